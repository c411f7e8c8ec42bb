"""The ``mlm`` preset: a tiny BERT with a masked-language-model head on the ``text`` data."""

from __future__ import annotations

import dataclasses

from train.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(default.get_config(), task="mlm", model="bert_tiny", batch_size=32,
                               seq_len=64, steps=500, lr=1e-3, checkpoint_every=250,
                               model_overrides={})
