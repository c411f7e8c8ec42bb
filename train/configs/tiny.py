"""The ``tiny`` preset: three steps of the smallest models, in seconds, for tests."""

from __future__ import annotations

import dataclasses

from train.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(
        default.get_config(), batch_size=16, steps=3, lr=1e-3, checkpoint_every=2, log_every=1,
        eval_batches=1, model_overrides={"resnet": {"width": 8, "stage_sizes": (1, 1)},
                                         "bert": {"width": 32, "depth": 1, "mlp": 64},
                                         "gpt": {"width": 32, "depth": 1, "mlp": 64}})
