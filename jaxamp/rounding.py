"""Rounding fp32 values into half precision without losing small updates.

An fp32 value rounded to the nearest bf16 loses every change smaller than half a bf16 ulp
(``2**-9`` of its magnitude): an update of ``1e-4 * |param|`` vanishes, every step. Two remedies,
after "Revisiting BFloat16 Training" (Zamirai et al., 2020):

- :func:`stochastic_round` rounds up or down with probabilities that make the result exact in
  expectation, so small updates survive on average;
- :func:`kahan_split` splits the fp32 value into a half-precision high part and a 16-bit low
  part (the compensation): for bfloat16, exactly the 16 bits that rounding drops, so the pair
  holds the fp32 value without loss.

:func:`jaxamp.mixed_precision` uses both to keep bf16 params and moments without an fp32 copy
(``master="kahan"``, ``master="stochastic"``, ``moments_dtype="bfloat16"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from jaxamp._tree import HALF_DTYPES

__all__ = ["kahan_join", "kahan_split", "stochastic_round"]



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
