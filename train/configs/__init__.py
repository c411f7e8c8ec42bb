"""Config presets, one module each, every one overriding ``default``:

- ``default``: a small-image ResNet-18 on scikit-learn's digits;
- ``text``: a character GPT on Python's docs;
- ``mlm``: a tiny BERT on the same text;
- ``tiny``: seconds, for tests;
- ``gpu``: ResNet-50 on synthetic ImageNet-size images.

>>> get_config("tiny", steps=5).steps
5
"""

from __future__ import annotations

import dataclasses

from train.configs import default
from train.configs import gpu
from train.configs import mlm
from train.configs import text
from train.configs import tiny
from train.configs.default import Config

_MODULES = {"default": default, "text": text, "mlm": mlm, "tiny": tiny, "gpu": gpu}

PRESETS: dict[str, Config] = {name: module.get_config() for name, module in _MODULES.items()}


def get_config(name: str, **overrides) -> Config:
    """The preset ``name`` with ``overrides`` (``Config`` fields) replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; expected one of {', '.join(PRESETS)}")
    return dataclasses.replace(_MODULES[name].get_config(), **overrides)
