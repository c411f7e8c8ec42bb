"""The code of :mod:`jaxamp.rounding`: rounding fp32 values into half precision without
losing small updates."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from jaxamp._tree import HALF_DTYPES

__all__ = ["Blockwise8bit", "dequantize_blockwise", "dynamic_map", "kahan_join", "kahan_split",
           "quantize_blockwise", "rounding_noise", "stochastic_round"]



def _check_half(dtype: DTypeLike, what: str) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in HALF_DTYPES:
        raise ValueError(f"{what} rounds to bfloat16 or float16, got {dtype.name}")
    return dtype


def stochastic_round(x: jax.Array, dtype: DTypeLike, key: jax.Array) -> jax.Array:
    """Rounds fp32 ``x`` to ``dtype`` (bfloat16 or float16), up or down at random, so that the
    expected result is ``x``.

    Each element goes to one of the two ``dtype`` values that enclose it, the farther one with
    probability proportional to the distance to the nearer: ``E[result] == x`` up to the
    resolution of the random bits (``2**-16`` of an ulp for bfloat16, ``2**-24`` for float16).
    Values already representable, infinities and nans are returned as they are.

    The random bits are a counter-based hash of each element's index (murmur3's 32-bit
    finalizer over a Weyl sequence), seeded by 32 bits drawn from ``key``: a few integer
    operations per element, fused into the update, where ``jax.random.bits`` would run
    Threefry's 20 rounds per pair of elements. The same key gives the same bits on any device,
    under any sharding and after a resume.

    Args:
      x: a float32 array (other floating dtypes are converted to float32 first).
      dtype: ``bfloat16`` or ``float16``.
      key: a PRNG key (typed, ``jax.random.key``, or raw, ``jax.random.PRNGKey``).

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.full((100_000,), 1.0 + 2.0**-10)  # a quarter of a bf16 ulp above 1.0
    >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0)).astype(jnp.float32)
    >>> sorted(set(y.tolist())), abs(float(y.mean()) - float(x[0])) < 1e-4
    ([1.0, 1.0078125], True)
    >>> float(x.astype(jnp.bfloat16)[0])  # round to nearest loses the quarter ulp
    1.0
    """
    dtype = _check_half(dtype, "stochastic_round")
    x = jnp.asarray(x).astype(jnp.float32)
    bits = hashed_bits(key, x.shape)
    if dtype == jnp.bfloat16:
        # bf16 is fp32's upper 16 bits: add 16 random bits below them and truncate. On the
        # magnitude (sign and magnitude form) this rounds away from zero with probability
        # (dropped bits) / 2**16 and toward zero otherwise. Infinities stay: their low 16 bits
        # are zero and the carry never reaches the exponent. A nan stays a nan.
        raw = lax.bitcast_convert_type(x, jnp.uint32)
        rounded = (raw + (bits >> 16)) & jnp.uint32(0xFFFF0000)
        out = lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
        return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), out)
    # float16 (its own exponent range and subnormals): pick between the nearest value and its
    # neighbour on the far side of x, with the probability that makes the mean exact.
    near = x.astype(dtype)
    near32 = near.astype(jnp.float32)
    toward = jnp.where(near32 < x, jnp.inf, -jnp.inf).astype(dtype)
    other = jnp.nextafter(near, toward)
    gap = jnp.abs(other.astype(jnp.float32) - near32)
    p = jnp.where(gap > 0, jnp.abs(x - near32) / gap, 0.0)  # in [0, 1/2]
    u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # uniform in [0, 1)
    finite = jnp.isfinite(x) & jnp.isfinite(other)
    return jnp.where(finite & (u < p), other, near)


def rounding_noise(params: Any, learning_rates: ArrayLike,
                   dtype: DTypeLike = jnp.bfloat16) -> float:
    """The noise :func:`stochastic_round` is predicted to add to the params over a run, as a
    fraction of how far the run moves them: the median over the params' elements.

    The prediction reads only the learning rate of each step and the params' magnitudes. An
    Adam-family update moves a param by about the learning rate ``lr_t`` per step. Where that
    is a fraction ``f`` of ``dtype``'s spacing ``s`` at the param, rounding it stochastically
    adds a variance of ``s**2 * frac(f) * (1 - frac(f))``; over the run the noise is the square
    root of the summed variances, and the movement the summed learning rates. A param's
    magnitude is taken as at least the peak learning rate (a param that starts at zero does
    not stay there). ``master="stochastic"`` under the training CLI warns above
    ``train.train.STOCHASTIC_NOISE_WARNING``.

    Args:
      params: the params (or their fp32 values), any tree of arrays.
      learning_rates: the learning rate of every step of the run (a schedule's values).
      dtype: the half-precision dtype the params are rounded to.

    >>> import numpy as np
    >>> params = {"w": np.full((4,), 0.5, np.float32)}  # bf16's spacing at 0.5: 2**-8
    >>> round(rounding_noise(params, [2.0**-10] * 100), 4)  # a quarter of it, 100 steps
    0.1732
    """
    dtype = _check_half(dtype, "rounding_noise")
    lrs = np.asarray(learning_rates, np.float64).ravel()
    if lrs.size == 0 or not np.all(np.isfinite(lrs)) or np.any(lrs < 0) or lrs.sum() <= 0:
        raise ValueError(f"learning_rates must hold each step's learning rate (finite, >= 0, "
                         f"not all 0), got {lrs.size} values summing to {lrs.sum():g}")
    bits = jnp.finfo(dtype).nmant
    ratios, counts = [], []
    for leaf in jax.tree.leaves(params):
        values = np.abs(np.asarray(leaf, np.float32)).ravel()
        if values.size == 0:
            continue
        magnitude = np.maximum(values, lrs.max())
        # Elements of one binade share a spacing: one prediction per binade.
        spacing, count = np.unique(np.exp2(np.floor(np.log2(magnitude)) - bits),
                                   return_counts=True)
        fraction = np.modf(lrs[None, :] / spacing[:, None])[0]
        noise = np.sqrt((spacing[:, None] ** 2 * fraction * (1 - fraction)).sum(axis=1))
        ratios.append(noise / lrs.sum())
        counts.append(count)
    if not ratios:
        raise ValueError("params holds no array to predict the rounding noise of")
    ratio, count = np.concatenate(ratios), np.concatenate(counts)
    order = np.argsort(ratio)
    median = np.searchsorted(np.cumsum(count[order]), count.sum() / 2)
    return float(ratio[order][median])


def hashed_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits for each element of ``shape``: murmur3's finalizer of ``index * golden +
    seed``, with the seed drawn from ``key``. Consecutive seeds give sequences shifted by a
    random offset, so an element's bits at two steps are those of two distant indices."""
    if jnp.issubdtype(jnp.asarray(key).dtype, jnp.uint32):
        key = jax.random.wrap_key_data(key)
    seed = jax.random.bits(key, (), jnp.uint32)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):  # the flat index, without a reshape
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
        stride *= shape[dim]
    z = index * jnp.uint32(0x9E3779B9) + seed
    z = z ^ (z >> 16)
    z = z * jnp.uint32(0x85EBCA6B)
    z = z ^ (z >> 13)
    z = z * jnp.uint32(0xC2B2AE35)
    return z ^ (z >> 16)


def kahan_split(x: jax.Array, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
    """Splits fp32 ``x`` into ``(high, low)``: ``high`` is ``x`` rounded to the nearest
    ``dtype`` value, ``low`` the part rounding dropped; :func:`kahan_join` puts them back.

    - bfloat16: bf16 is the upper half of an fp32 word, so what rounding drops is exactly the
      lower 16 bits. ``low`` holds them as ``uint16`` and ``kahan_join(high, low) == x`` bit
      for bit: a bf16 param with this compensation carries its fp32 value losslessly in 4
      bytes. ``high`` rounds ties away from zero (so that ``low`` alone tells whether rounding
      went up); everywhere else it equals ``x.astype(bfloat16)``.
    - float16: ``low`` is the remainder ``x - high`` rounded to float16 (Kahan's compensation):
      about 22 significant bits together; a remainder below float16's range is lost.

    >>> import jax.numpy as jnp
    >>> x = jnp.float32(1.0 + 2.0**-10 + 2.0**-20)
    >>> hi, lo = kahan_split(x, jnp.bfloat16)
    >>> float(hi), lo.dtype.name, float(kahan_join(hi, lo)) == float(x)
    (1.0, 'uint16', True)
    """
    dtype = _check_half(dtype, "kahan_split")
    x = jnp.asarray(x).astype(jnp.float32)
    if dtype == jnp.bfloat16:
        raw = lax.bitcast_convert_type(x, jnp.uint32)
        low = raw & jnp.uint32(0xFFFF)
        up = (low >= 0x8000).astype(jnp.uint32)  # on the magnitude: ties away from zero
        high = ((raw >> 16) + up).astype(jnp.uint16)
        return lax.bitcast_convert_type(high, jnp.bfloat16), low.astype(jnp.uint16)
    high = x.astype(dtype)
    rest = jnp.where(jnp.isfinite(x), x - high.astype(jnp.float32), 0.0)
    return high, rest.astype(dtype)


def kahan_join(high: jax.Array, low: jax.Array) -> jax.Array:
    """The fp32 value that :func:`kahan_split` split into ``high`` and ``low``."""
    if low.dtype == jnp.uint16:
        bits = lax.bitcast_convert_type(high.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
        # high was rounded up (away from zero) iff the dropped half is >= 0x8000; a zero high
        # (one set from outside) takes the low bits as they are.
        up = ((low >= 0x8000) & ((bits & 0x7FFF) != 0)).astype(jnp.uint32)
        raw = ((bits - up) << 16) | low.astype(jnp.uint32)
        return lax.bitcast_convert_type(raw, jnp.float32)
    return high.astype(jnp.float32) + low.astype(jnp.float32)


# --------------------------------------------------------------------------------------------
# Block-wise 8-bit quantization
# --------------------------------------------------------------------------------------------

@functools.cache
def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 values (float32, ascending) an 8-bit code stands for, relative to its block's
    absmax: a dynamic map (Dettmers, 2016), finest near the block's largest value.

    Its magnitudes fill seven decades, ``1e-6`` to ``1``, each with a linear grid twice as
    fine as the decade below it (so the relative step is about the same in each): the top
    decade ``(0.1, 1]`` holds 64 values (128 unsigned), ending at exactly 1.

    - ``signed=True`` (first moments): 0, and 127 magnitudes with either sign (255 values),
      symmetric, so that a block's most negative value is kept exactly too.
    - ``signed=False`` (second moments): 254 magnitudes and ``1e-7``, **no zero**: a second
      moment is a denominator, and a small one in a block with a large one becomes
      ``1e-7`` of the block's max rather than 0.

    The one code left over repeats the largest value.

    >>> m = dynamic_map(signed=True)
    >>> m.shape, float(m[0]), float(m[127]), float(m[-2]), float(m[-1])
    ((256,), -1.0, 0.0, 1.0, 1.0)
    >>> u = dynamic_map(signed=False)
    >>> round(float(u[0]), 12), bool((u > 0).all()), float(u[-1])
    (1e-07, True, 1.0)
    """
    per_decade = 1 if signed else 2
    magnitudes: list[float] = []
    for i in range(7):  # decades 1e-6 .. 1
        n = per_decade * 2**i
        if i == 6:  # the top decade ends at 1: the block's absmax is kept exactly
            grid = np.linspace(0.1, 1.0, n + 1)[1:]
        else:
            edges = np.linspace(0.1, 1.0, n + 1)
            grid = (edges[:-1] + edges[1:]) / 2
        magnitudes += (grid * 10.0 ** (i - 6)).tolist()
    if signed:
        values = [-v for v in magnitudes] + [0.0] + magnitudes
    else:
        values = [1e-7] + magnitudes
    values += [1.0] * (256 - len(values))
    out = np.array(sorted(values), np.float32)
    out.flags.writeable = False
    return out


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "absmax"],
                   meta_fields=["shape", "signed"])
@dataclasses.dataclass(frozen=True)
class Blockwise8bit:
    """An fp32 array kept in 8-bit codes: :func:`quantize_blockwise`'s result, a pytree of
    two arrays (``codes`` and ``absmax``; ``shape`` and ``signed`` are static)."""

    codes: jax.Array
    """uint8 ``(blocks, block_size)``: the flattened array, zero-padded to whole blocks, each
    value's index into :func:`dynamic_map` (``signed``)."""
    absmax: jax.Array
    """float32 ``(blocks,)``: each block's largest magnitude (nan for a block holding an inf or
    a nan)."""
    shape: tuple[int, ...]
    """The array's shape (static)."""
    signed: bool
    """Which map the codes index (static)."""


def quantize_blockwise(x: jax.Array, *, signed: bool = True,
                       block_size: int = 256) -> Blockwise8bit:
    """``x`` in 8-bit codes, block by block: each block of ``block_size`` consecutive values of
    the flattened array (the last one zero-padded) keeps its absmax in fp32 and each value as
    the nearest entry of ``dynamic_map(signed)`` to ``value / absmax`` (ties to the larger).

    Exact where it matters: a block's largest magnitude comes back exactly, an all-zero block
    is all zeros, a block holding an inf or a nan comes back all nan (never a finite value
    that looks right). With ``signed=False`` a value is read as its magnitude, and a zero in a
    block with a nonzero max comes back as ``1e-7`` of that max.

    >>> import jax.numpy as jnp
    >>> q = quantize_blockwise(jnp.array([0.5, -2.0, 0.0, 1.0]), block_size=3)
    >>> q.codes.shape, q.absmax.tolist()
    ((2, 3), [2.0, 1.0])
    >>> [round(v, 4) for v in dequantize_blockwise(q).tolist()]  # 0.25 of the max: 1.9% off
    [0.5094, -2.0, 0.0, 1.0]
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    x = jnp.asarray(x).astype(jnp.float32)
    shape = tuple(x.shape)
    size = math.prod(shape)
    blocks = max(1, -(-size // block_size))
    flat = jnp.pad(x.reshape(-1), (0, blocks * block_size - size)).reshape(blocks, block_size)
    if not signed:
        flat = jnp.abs(flat)
    finite = jnp.all(jnp.isfinite(flat), axis=1)
    absmax = jnp.where(finite, jnp.max(jnp.abs(flat), axis=1), jnp.nan)
    scaled = flat / jnp.where(finite & (absmax > 0), absmax, 1.0)[:, None]
    table = dynamic_map(signed)
    midpoints = jnp.asarray((table[:-1] + table[1:]) / 2)  # value i rounds to code #(mid <= x)
    codes = jnp.searchsorted(midpoints, jnp.where(finite[:, None], scaled, 0.0), side="right")
    # One code per value: the spare code 255 (the max again) is never written.
    codes = jnp.minimum(codes, 254)
    return Blockwise8bit(codes.astype(jnp.uint8), absmax, shape, bool(signed))


def dequantize_blockwise(q: Blockwise8bit) -> jax.Array:
    """The fp32 array :func:`quantize_blockwise` encoded (to its map's precision)."""
    values = jnp.asarray(dynamic_map(q.signed))[q.codes.astype(jnp.int32)]
    flat = (values * q.absmax[:, None]).reshape(-1)
    return flat[:math.prod(q.shape)].reshape(q.shape)

