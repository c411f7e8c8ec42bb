"""The ``text`` preset: a character GPT on Python's own docs (``pydoc_data``)."""

from __future__ import annotations

import dataclasses

from train.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(default.get_config(), task="text", model="gpt_tiny", batch_size=32,
                               seq_len=64, steps=500, lr=3e-3, checkpoint_every=250,
                               model_overrides={})
