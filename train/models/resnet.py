"""ResNets in Flax NNX (He et al., 2016), channels-last, built for mixed precision.

Convolutions and the classifier run in the compute dtype ``dtype`` with fp32 params. Batch norm
keeps fp32 params and running statistics, computes the batch statistics in fp32 and casts its
output back to ``dtype``, so the next convolution runs in half precision too. Global average
pooling sums in fp32 and the logits are returned in fp32.

Two stems: ``"imagenet"`` (7x7/2 convolution and 3x3/2 max pool, for 224x224 inputs) and
``"small"`` (3x3/1 convolution, no pool, for 8x8 digits or 32x32 CIFAR images). The stride of a
bottleneck block sits on its 3x3 convolution (ResNet v1.5, as in torchvision), and the last
batch norm of every block starts with a zero scale, so each block starts as the identity.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from train.models.layers import F32
from train.models.layers import BatchNorm
from train.models.layers import Dense

# He initialization over the fan-out, as torchvision.
_CONV_INIT = jax.nn.initializers.variance_scaling(2.0, "fan_out", "normal")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The shape of a ResNet.

    Attributes:
      stage_sizes: blocks per stage; every stage after the first halves the resolution.
      block: ``"basic"`` (two 3x3 convolutions: ResNet-18/34) or ``"bottleneck"``
        (1x1, 3x3, 1x1 with 4x expansion: ResNet-50/101/152).
      width: channels of the stem and of the first stage; stage ``i`` has ``width * 2**i``
        (times 4 at the output of a bottleneck block).
      num_classes: outputs of the classifier.
      stem: ``"imagenet"`` or ``"small"``.
      in_channels: channels of the input images.
    """

    stage_sizes: tuple[int, ...] = (2, 2, 2, 2)
    block: str = "basic"
    width: int = 64
    num_classes: int = 1000
    stem: str = "imagenet"
    in_channels: int = 3

    def __post_init__(self):
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"block must be 'basic' or 'bottleneck', got {self.block!r}")
        if self.stem not in ("imagenet", "small"):
            raise ValueError(f"stem must be 'imagenet' or 'small', got {self.stem!r}")
        if not self.stage_sizes or any(n < 1 for n in self.stage_sizes):
            raise ValueError(f"stage_sizes must be positive block counts, got "
                             f"{self.stage_sizes!r}")


CONFIGS = {
    "resnet18": ResNetConfig(stage_sizes=(2, 2, 2, 2), block="basic"),
    "resnet50": ResNetConfig(stage_sizes=(3, 4, 6, 3), block="bottleneck"),
}


def _conv(in_features: int, out_features: int, size: int, stride: int = 1, *, dtype: Any,
          rngs: nnx.Rngs) -> nnx.Conv:
    pad = (size - 1) // 2
    return nnx.Conv(in_features, out_features, (size, size), strides=stride,
                    padding=((pad, pad), (pad, pad)), use_bias=False, dtype=dtype,
                    param_dtype=F32, kernel_init=_CONV_INIT, rngs=rngs)


class Downsample(nnx.Module):
    """The projection shortcut: a strided 1x1 convolution and a batch norm."""

    def __init__(self, in_features: int, out_features: int, stride: int, *, dtype: Any,
                 rngs: nnx.Rngs):
        self.conv = _conv(in_features, out_features, 1, stride, dtype=dtype, rngs=rngs)
        self.norm = BatchNorm(out_features, dtype=dtype)

    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        return self.norm(self.conv(x), train=train)


class BasicBlock(nnx.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_features: int, features: int, stride: int, *, dtype: Any,
                 rngs: nnx.Rngs):
        self.conv1 = _conv(in_features, features, 3, stride, dtype=dtype, rngs=rngs)
        self.norm1 = BatchNorm(features, dtype=dtype)
        self.conv2 = _conv(features, features, 3, dtype=dtype, rngs=rngs)
        self.norm2 = BatchNorm(features, dtype=dtype, zero_scale=True)
        self.downsample = (Downsample(in_features, features, stride, dtype=dtype, rngs=rngs)
                           if stride != 1 or in_features != features else None)

    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool) -> jax.Array:
        h = self.norm1(self.conv1(x_BxHxWxC), train=train, relu=True)
        shortcut = x_BxHxWxC if self.downsample is None else self.downsample(x_BxHxWxC,
                                                                             train=train)
        return self.norm2(self.conv2(h), train=train, residual=shortcut, relu=True)


class Bottleneck(nnx.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a shortcut (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, in_features: int, features: int, stride: int, *, dtype: Any,
                 rngs: nnx.Rngs):
        out_features = features * self.expansion
        self.conv1 = _conv(in_features, features, 1, dtype=dtype, rngs=rngs)
        self.norm1 = BatchNorm(features, dtype=dtype)
        self.conv2 = _conv(features, features, 3, stride, dtype=dtype, rngs=rngs)
        self.norm2 = BatchNorm(features, dtype=dtype)
        self.conv3 = _conv(features, out_features, 1, dtype=dtype, rngs=rngs)
        self.norm3 = BatchNorm(out_features, dtype=dtype, zero_scale=True)
        self.downsample = (Downsample(in_features, out_features, stride, dtype=dtype, rngs=rngs)
                           if stride != 1 or in_features != out_features else None)

    def __call__(self, x_BxHxWxC: jax.Array, *, train: bool) -> jax.Array:
        h = self.norm1(self.conv1(x_BxHxWxC), train=train, relu=True)
        h = self.norm2(self.conv2(h), train=train, relu=True)
        shortcut = x_BxHxWxC if self.downsample is None else self.downsample(x_BxHxWxC,
                                                                             train=train)
        return self.norm3(self.conv3(h), train=train, residual=shortcut, relu=True)


class ResNet(nnx.Module):
    """``ResNet(config, dtype=policy.compute_dtype, rngs=nnx.Rngs(0))``.

    ``model(images_BxHxWxC, train=...)`` returns fp32 logits ``(B, num_classes)``. With
    ``train=True`` batch norm uses (and updates) batch statistics; with ``train=False`` it uses
    the running averages.
    """

    def __init__(self, config: ResNetConfig, *, dtype: Any = F32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        block_cls = BasicBlock if config.block == "basic" else Bottleneck
        if config.stem == "imagenet":
            self.stem = nnx.Conv(config.in_channels, config.width, (7, 7), strides=2,
                                 padding=((3, 3), (3, 3)), use_bias=False, dtype=dtype,
                                 param_dtype=F32, kernel_init=_CONV_INIT, rngs=rngs)
        else:
            self.stem = _conv(config.in_channels, config.width, 3, dtype=dtype, rngs=rngs)
        self.stem_norm = BatchNorm(config.width, dtype=dtype)
        blocks = []
        in_features = config.width
        for i, size in enumerate(config.stage_sizes):
            for j in range(size):
                stride = 2 if i > 0 and j == 0 else 1
                features = config.width * 2 ** i
                blocks.append(block_cls(in_features, features, stride, dtype=dtype, rngs=rngs))
                in_features = features * block_cls.expansion
        self.blocks = nnx.List(blocks)
        self.head = Dense(in_features, config.num_classes, dtype=dtype, rngs=rngs)

    def __call__(self, images_BxHxWxC: jax.Array, *, train: bool = False) -> jax.Array:
        x = images_BxHxWxC.astype(self.dtype)
        x = self.stem_norm(self.stem(x), train=train, relu=True)
        if self.config.stem == "imagenet":
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for block in self.blocks:
            x = block(x, train=train)
        # Average in fp32, then back to the compute dtype so the classifier runs in it.
        pooled_BxC = x.astype(F32).mean(axis=(1, 2)).astype(self.dtype)
        return self.head(pooled_BxC).astype(F32)
