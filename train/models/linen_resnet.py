"""A standard Flax Linen ResNet, written like flax's ImageNet example, for peer comparisons.

``ResNet(stage_sizes, dtype=..., norm_dtype=...)``: the convolutions compute in ``dtype`` and the
BatchNorms in ``norm_dtype``; the params are fp32. This is how the peers' recipes are usually
applied to a convolutional network:

* flax's own: every layer built with ``dtype=bfloat16`` (BatchNorm included);
* jmp's: an fp32 model whose params are cast by ``cast_to_compute``, BatchNorm kept in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

RESNET50_STAGES = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    filters: int
    strides: tuple[int, int]
    conv: Any
    norm: Any

    @nn.compact
    def __call__(self, x):
        residual = x
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.norm(scale_init=nn.initializers.zeros)(self.conv(4 * self.filters, (1, 1))(y))
        if residual.shape != y.shape:
            residual = self.norm(name="norm_proj")(
                self.conv(4 * self.filters, (1, 1), self.strides, name="conv_proj")(residual))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int] = RESNET50_STAGES
    num_classes: int = 1000
    width: int = 64
    dtype: Any = None
    norm_dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, dtype=self.norm_dtype)
        x = conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = Bottleneck(self.width * 2 ** i, strides, conv, norm)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)
