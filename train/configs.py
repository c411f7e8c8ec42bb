"""Config presets: ``default`` (ResNet on digits), ``text`` (a character GPT on Python's docs),
``mlm`` (a tiny BERT on the same text), ``tiny`` (seconds, for tests), ``gpu`` (ResNet-50,
synthetic ImageNet-size images)."""

from __future__ import annotations

import dataclasses

from train.train import Config

PRESETS: dict[str, Config] = {
    "default": Config(task="digits", model="resnet18_small", batch_size=64, steps=300, lr=3e-3,
                      checkpoint_every=100, log_every=10,
                      model_overrides={"resnet": {"width": 16}}),
    "text": Config(task="text", model="gpt_tiny", batch_size=32, seq_len=64, steps=500,
                   lr=3e-3, checkpoint_every=250, log_every=10),
    "mlm": Config(task="mlm", model="bert_tiny", batch_size=32, seq_len=64, steps=500, lr=1e-3,
                  checkpoint_every=250, log_every=10),
    "tiny": Config(task="digits", model="resnet18_small", batch_size=16, steps=3, lr=1e-3,
                   checkpoint_every=2, log_every=1, eval_batches=1,
                   model_overrides={"resnet": {"width": 8, "stage_sizes": (1, 1)},
                                    "bert": {"width": 32, "depth": 1, "mlp": 64},
                                    "gpt": {"width": 32, "depth": 1, "mlp": 64}}),
    "gpu": Config(task="synthetic_images", model="resnet50", batch_size=256, image_size=224,
                  num_classes=1000, steps=200, lr=1e-3, checkpoint_every=1000, log_every=20),
}


def get_config(name: str, **overrides) -> Config:
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; expected one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
