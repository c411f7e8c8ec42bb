"""The ``gpu`` preset: ResNet-50 on synthetic ImageNet-size images, for throughput."""

from __future__ import annotations

import dataclasses

from train.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(default.get_config(), task="synthetic_images", model="resnet50",
                               batch_size=256, image_size=224, num_classes=1000, steps=200,
                               lr=1e-3, checkpoint_every=1000, log_every=20, model_overrides={})
