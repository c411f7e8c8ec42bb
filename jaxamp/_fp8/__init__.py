"""The core of FP8 matmuls: the formats, the quantizers, the two recipes, the scaled
``dot_general`` functions and the delayed-scaling state (private; :mod:`jaxamp.fp8` is the
public module, which adds the error report and the NNX layers). The recipes carry the options
they accept (``CurrentScaling.GRANULARITIES``, ...); the quantizers are the library's own."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Sequence
from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.typing import ArrayLike
from jax.typing import DTypeLike

from jaxamp import _model_state
from jaxamp._tree import State
from jaxamp._tree import static_field

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
# The options of the recipes, public as their class attributes (CurrentScaling.FORMATS, ...).
FORMATS: dict[str, tuple[Any, Any]] = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3),
                                       "e5m2": (E5M2, E5M2)}
AMAX_ALGOS = ("max", "most_recent")
_F32 = jnp.float32
_ROWS = ("lhs", "rhs", "grad")
RESIDUAL_NAME = "jaxamp_fp8_residual"  # jax.checkpoint names of what an FP8 matmul keeps
OUTPUT_NAME = "jaxamp_fp8_output"  # the three tensors of an FP8 matmul, in an Fp8State's rows


def _check_format(fmt: Any) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {', '.join(FORMATS)} "
                         "('hybrid': e4m3 forward, e5m2 gradients)")


def _check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be an int >= 0 (the scale is divided by 2**margin), got "
                         f"{margin!r}")


GRANULARITIES = ("tensor", "rowwise", "blocks", "mxfp8")
_BLOCK_SIZES = {"blocks": 128, "mxfp8": 32}
WEIGHT_GRADS = ("fp8", "high")
KEEP = r"(?i)embed|(^|/)(lm_)?head(/|$)|unembed|logits|(^|/)wte(/|$)"


def _check_power_of_two(p: Any) -> None:
    if not isinstance(p, bool):
        raise ValueError(f"power_of_two must be True or False, got {p!r}")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Stateless FP8 scaling: each tensor, row or block is scaled by its own ``amax``, computed
    on the fly.

    Attributes:
      format: ``"hybrid"`` (e4m3 forward, e5m2 gradients), ``"e4m3"`` or ``"e5m2"``. Default:
        ``"hybrid"`` for per-tensor scales, ``"e4m3"`` (every tensor, gradients too) for the
        fine granularities, as the recipes that use them do.
      margin: the scale is divided by ``2**margin`` (headroom against saturation).
      granularity: one of :attr:`GRANULARITIES`. ``"tensor"`` (default): one scale per
        operand. ``"rowwise"``: one per row of each operand along its contraction axes, in each
        of the three GEMMs (the backward pass quantizes the saved operands again along its own
        contraction axes). ``"blocks"``: one per ``1 x block_size`` tile of the last contraction
        axis, and one per ``block_size x block_size`` block (the last contraction axis by the
        last free axis) of the forward's rhs, the weight under ``x @ w``. ``"mxfp8"``: one
        power-of-two scale per ``1 x block_size`` tile, every operand.
      block_size: the tile length of ``"blocks"`` (default 128) and ``"mxfp8"`` (default 32);
        ``None`` for the others.
      power_of_two: round each scale down to a power of two (exact to apply and to undo, never
        saturating). Default: ``True`` for ``"mxfp8"`` (its E8M0 scales), else ``False``.
      weight_grad: ``"fp8"`` (default) or ``"high"``: the weight-gradient GEMM (of the
        forward's rhs) in the operands' own dtype (bf16 under ``mixed_fp8``).
      keep: under :func:`jaxamp.autocast`, a regex (``re.search``) of the argument paths
        (``tree_path_str``: ``0/0/head/kernel``) whose matmuls stay in the compute dtype: a
        matmul with an operand read from a matching argument (through casts, reshapes and
        transposes) is not quantized. Default :attr:`KEEP`: the embeddings and the output
        head, as the anchors' recipes keep them. ``""``: none.
      batched: under :func:`jaxamp.autocast`, whether a matmul with batch dimensions between
        two computed values (the attention's ``q k^T`` and ``p v``) runs in FP8. Default
        ``False``: they stay in the compute dtype, as the anchors' recipes keep them.

    ``"tensor"`` and ``"rowwise"`` multiply 8-bit operands (an FP8 GEMM, the scales applied to
    its fp32 output). ``"blocks"`` and ``"mxfp8"`` have scales that vary along the contraction:
    they are emulated, each operand quantized and dequantized to fp32 and the matmul run in
    fp32 (``Precision.HIGHEST``), which computes what a block-scaled kernel computes (exact
    products, an fp32 accumulator), not at its speed.

    >>> CurrentScaling().dtypes
    (dtype(float8_e4m3fn), dtype(float8_e5m2))
    >>> r = CurrentScaling(granularity="mxfp8")
    >>> r.format, r.block_size, r.power_of_two
    ('e4m3', 32, True)
    >>> CurrentScaling.GRANULARITIES
    ('tensor', 'rowwise', 'blocks', 'mxfp8')
    """

    FORMATS: ClassVar[dict[str, tuple[Any, Any]]] = FORMATS
    """Format name -> (forward operands' dtype, gradient's dtype): ``"hybrid"`` (e4m3, e5m2),
    ``"e4m3"`` and ``"e5m2"``."""
    GRANULARITIES: ClassVar[tuple[str, ...]] = GRANULARITIES
    """The ``granularity`` options: one scale per tensor; one per row along the contraction
    (``rowwise``); one per ``1 x 128`` tile of the contraction axis, ``128 x 128`` for the
    forward's rhs (``blocks``, DeepSeek-V3's recipe); one power-of-two scale per ``1 x 32`` tile
    (``mxfp8``)."""
    WEIGHT_GRADS: ClassVar[tuple[str, ...]] = WEIGHT_GRADS
    """The ``weight_grad`` options: the weight-gradient GEMM (the forward rhs's gradient) in FP8,
    or in the operands' own dtype (``"high"``: torchao's ``rowwise_with_gw_hp``)."""
    KEEP: ClassVar[str] = KEEP
    """The default ``keep``: the argument paths whose matmuls :func:`jaxamp.autocast` keeps in
    the compute dtype under an FP8 policy, embedding tables (an ``attend``/tied output
    projection reads one) and output heads (``head``, ``lm_head``, ``unembed``, ``logits``,
    GPT-2's ``wte``)."""

    format: str = None  # type: ignore[assignment]  # resolved in __post_init__
    """A key of :attr:`FORMATS`: ``"hybrid"`` (e4m3 forward, e5m2 gradients), ``"e4m3"`` or
    ``"e5m2"``; by default ``"hybrid"`` for ``granularity="tensor"``, else ``"e4m3"``."""
    margin: int = 0
    """An int >= 0: every scale is divided by ``2**margin`` (headroom against saturation)."""
    granularity: str = "tensor"
    """One of :attr:`GRANULARITIES`: how many scales each operand gets."""
    block_size: int | None = None
    """The tile length of ``"blocks"`` (128 by default) and ``"mxfp8"`` (32); ``None`` else."""
    power_of_two: bool = None  # type: ignore[assignment]  # resolved in __post_init__
    """Whether scales are rounded down to a power of two (default: only for ``"mxfp8"``)."""
    weight_grad: str = "fp8"
    """``"fp8"`` or ``"high"``: the forward rhs's gradient GEMM in FP8 or in the operands'
    dtype (one of :attr:`WEIGHT_GRADS`)."""
    keep: str | None = None  # type: ignore[assignment]  # resolved in __post_init__
    """Under autocast: a regex of the argument paths whose matmuls stay in the compute dtype
    (default :attr:`KEEP`, the embeddings and the head; ``""``: none)."""
    batched: bool = False
    """Under autocast: whether batched matmuls of two computed values (attention) run in FP8."""

    def __post_init__(self):
        g = self.granularity
        if g not in GRANULARITIES:
            raise ValueError(f"unknown FP8 granularity {g!r}; expected one of "
                             f"{', '.join(GRANULARITIES)}")
        if self.format is None:
            object.__setattr__(self, "format", "hybrid" if g == "tensor" else "e4m3")
        _check_format(self.format)
        _check_margin(self.margin)
        b = self.block_size
        if g in _BLOCK_SIZES:
            if b is None:
                object.__setattr__(self, "block_size", _BLOCK_SIZES[g])
            elif isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"block_size must be an int >= 1, got {b!r}")
        elif b is not None:
            raise ValueError(f"block_size is for granularity 'blocks' or 'mxfp8', not {g!r}")
        if self.power_of_two is None:
            object.__setattr__(self, "power_of_two", g == "mxfp8")
        _check_power_of_two(self.power_of_two)
        if g == "mxfp8" and not self.power_of_two:
            raise ValueError("mxfp8's scales are powers of two (E8M0); for arbitrary scales per "
                             "tile use granularity='blocks'")
        keep = KEEP if self.keep is None else self.keep
        if not isinstance(keep, str):
            raise ValueError(f"keep must be a regex string ('' for none), got {keep!r}")
        try:
            re.compile(keep)
        except re.error as e:
            raise ValueError(f"keep {keep!r} is not a valid regex: {e}") from e
        object.__setattr__(self, "keep", keep)
        if not isinstance(self.batched, bool):
            raise ValueError(f"batched must be True or False, got {self.batched!r}")
        if self.weight_grad not in WEIGHT_GRADS:
            raise ValueError(f"unknown weight_grad {self.weight_grad!r}; expected one of "
                             f"{', '.join(WEIGHT_GRADS)}")

    @property
    def dtypes(self) -> tuple[Any, Any]:
        """(forward dtype, gradient dtype)."""
        return FORMATS[self.format]

    @property
    def per_tensor(self) -> bool:
        """True for the default path: one scale per tensor, the weight gradient in FP8."""
        return self.granularity == "tensor" and self.weight_grad == "fp8"


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """FP8 scaling from a history of past ``amax`` values (Transformer Engine's defaults).

    Attributes:
      history_length: the number of past steps' ``amax`` kept (default 16, as Transformer
        Engine's JAX tutorial; its own default is 1024).
      margin: the scale is divided by ``2**margin``.
      format: ``"hybrid"`` (default), ``"e4m3"`` or ``"e5m2"``.
      amax_algo: ``"max"`` (the history's maximum; default) or ``"most_recent"``.
      power_of_two: round each scale down to a power of two (default ``False``).

    >>> DelayedScaling(history_length=16).amax_algo, DelayedScaling.AMAX_ALGOS
    ('max', ('max', 'most_recent'))
    >>> DelayedScaling(history_length=0)
    Traceback (most recent call last):
    ...
    ValueError: history_length must be an int >= 1, got 0; ...
    """

    FORMATS: ClassVar[dict[str, tuple[Any, Any]]] = FORMATS
    """Format name -> (forward operands' dtype, gradient's dtype): ``"hybrid"`` (e4m3, e5m2),
    ``"e4m3"`` and ``"e5m2"``."""
    AMAX_ALGOS: ClassVar[tuple[str, ...]] = AMAX_ALGOS
    """The ``amax_algo`` options: how a delayed scale reads the ``amax`` history, its maximum
    or the latest entry."""

    history_length: int = 16
    """The number of past steps' ``amax`` kept for each tensor (default 16)."""
    margin: int = 0
    """An int >= 0: every scale is divided by ``2**margin`` (headroom against saturation)."""
    format: str = "hybrid"
    """A key of :attr:`FORMATS`: ``"hybrid"`` (e4m3 forward, e5m2 gradients; default),
    ``"e4m3"`` or ``"e5m2"``."""
    amax_algo: str = "max"
    """How a scale reads the history (one of :attr:`AMAX_ALGOS`): ``"max"``, its maximum
    (default), or ``"most_recent"``, the latest step's ``amax``."""
    power_of_two: bool = False
    """Whether scales are rounded down to a power of two."""

    def __post_init__(self):
        n = self.history_length
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"history_length must be an int >= 1, got {n!r}; it is the number "
                             "of past steps' amax the scale is computed from (16 by default)")
        _check_power_of_two(self.power_of_two)
        _check_margin(self.margin)
        _check_format(self.format)
        if self.amax_algo not in AMAX_ALGOS:
            raise ValueError(f"unknown amax_algo {self.amax_algo!r}; expected one of "
                             f"{', '.join(AMAX_ALGOS)}")

    @property
    def dtypes(self) -> tuple[Any, Any]:
        """(forward dtype, gradient dtype)."""
        return FORMATS[self.format]


# --------------------------------------------------------------------------------------------
# Scales and quantization
# --------------------------------------------------------------------------------------------

def fp8_max(dtype: DTypeLike) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2).

    >>> fp8_max(jnp.float8_e4m3fn), fp8_max(jnp.float8_e5m2)
    (448.0, 57344.0)
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (E4M3, E5M2):
        raise ValueError(f"expected an FP8 dtype (float8_e4m3fn or float8_e5m2), got {dtype}")
    return float(jnp.finfo(dtype).max)


def amax(x: ArrayLike) -> jax.Array:
    """The largest magnitude of ``x``, in fp32 (NaN if ``x`` holds one)."""
    return jnp.max(jnp.abs(jnp.asarray(x).astype(_F32)))


def compute_scale(amax: ArrayLike, dtype: DTypeLike, margin: int = 0,
                  previous: ArrayLike = 1.0) -> jax.Array:
    """``fp8_max(dtype) / amax / 2**margin`` in fp32; ``previous`` where ``amax`` is zero, inf
    or NaN or the scale overflows (a subnormal ``amax``). Elementwise.

    >>> [float(s) for s in compute_scale(jnp.array([2.0, 0.0, jnp.inf, 1e-45]), jnp.float8_e4m3fn,
    ...                                  previous=jnp.array([1.0, 3.0, 5.0, 7.0]))]
    [224.0, 3.0, 5.0, 7.0]
    """
    a = jnp.asarray(amax, _F32)
    scale = (jnp.float32(fp8_max(dtype)) / a) / jnp.float32(2.0 ** margin)
    ok = (a > 0) & jnp.isfinite(a) & jnp.isfinite(scale)
    return jnp.where(ok, scale, jnp.asarray(previous, _F32))


def round_to_power_of_two(scale: ArrayLike) -> jax.Array:
    """Each positive finite ``scale`` rounded down to a power of two, exactly (by its binary
    exponent, not a floating-point log).

    >>> round_to_power_of_two(jnp.array([1.0, 3.0, 448.0, 0.7])).tolist()
    [1.0, 2.0, 256.0, 0.5]
    """
    mantissa, exponent = jnp.frexp(jnp.asarray(scale, _F32))  # scale = mantissa * 2**exponent
    del mantissa
    return jnp.ldexp(jnp.float32(1.0), exponent - 1)


def quantize(x: ArrayLike, dtype: DTypeLike, scale: ArrayLike) -> jax.Array:
    """``x * scale`` in fp32, saturated to ``±fp8_max(dtype)`` and rounded to ``dtype`` (to
    nearest, ties to even; subnormals kept). NaN stays NaN.

    >>> quantize(jnp.array([1.0, 1000.0, -0.3]), jnp.float8_e4m3fn, 1.0)
    Array([1, 448, -0.3125], dtype=float8_e4m3fn)
    """
    m = fp8_max(dtype)
    y = jnp.asarray(x).astype(_F32) * jnp.asarray(scale, _F32)
    return jnp.clip(y, -m, m).astype(dtype)


def dequantize(q: ArrayLike, scale: ArrayLike, dtype: DTypeLike = _F32) -> jax.Array:
    """``q / scale`` in fp32, cast to ``dtype``."""
    return (jnp.asarray(q).astype(_F32) / jnp.asarray(scale, _F32)).astype(dtype)


def _blocked(shape: Sequence[int], block_shape: Sequence[int | None]) -> tuple[list, list]:
    """Per axis, the block length (``None``: the whole axis) and the number of blocks."""
    if len(block_shape) != len(shape):
        raise ValueError(f"block_shape {tuple(block_shape)} needs one entry per axis of an "
                         f"array of shape {tuple(shape)}")
    blocks = []
    for n, b in zip(shape, block_shape, strict=True):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"block lengths must be ints >= 1 or None, got {tuple(block_shape)}")
        blocks.append(max(n, 1) if b is None else min(b, max(n, 1)))
    counts = [-(-n // b) for n, b in zip(shape, blocks, strict=True)]
    return blocks, counts


def _split_blocks(x: jax.Array, blocks: list, counts: list) -> jax.Array:
    """``x`` zero-padded to whole blocks and reshaped to ``(count0, block0, count1, ...)``."""
    pad = [(0, c * b - n) for n, b, c in zip(x.shape, blocks, counts, strict=True)]
    x = jnp.pad(x, pad) if any(p for _, p in pad) else x
    return x.reshape([d for c, b in zip(counts, blocks, strict=True) for d in (c, b)])


def block_scales(x: ArrayLike, dtype: DTypeLike, block_shape: Sequence[int | None], *,
                 margin: int = 0, power_of_two: bool = False) -> jax.Array:
    """One scale per block of ``x`` (:func:`compute_scale` of the block's ``amax``, 1 for a
    block of zeros, infs or NaNs), shaped ``ceil(x.shape / block)``. ``block_shape`` has one
    entry per axis: a block length, or ``None`` for the whole axis. A last block that ``x``
    does not fill is scaled by the values it holds.

    >>> x = jnp.array([[1.0, 2.0, 4.0], [0.5, 0.0, 8.0]])
    >>> block_scales(x, jnp.float8_e4m3fn, (1, 2)).tolist()  # tiles [1 2][4] and [.5 0][8]
    [[224.0, 112.0], [896.0, 56.0]]
    >>> block_scales(x, jnp.float8_e4m3fn, (None, 2), power_of_two=True).tolist()
    [[128.0, 32.0]]
    """
    x = jnp.asarray(x).astype(_F32)
    blocks, counts = _blocked(x.shape, block_shape)
    amaxes = jnp.max(jnp.abs(_split_blocks(x, blocks, counts)),
                     axis=tuple(range(1, 2 * x.ndim, 2)))
    scale = compute_scale(amaxes, dtype, margin)
    return round_to_power_of_two(scale) if power_of_two else scale


def _expand(scale: jax.Array, blocks: list, shape: Sequence[int]) -> jax.Array:
    """A per-block ``scale`` repeated over each block, cut to ``shape``."""
    for axis, b in enumerate(blocks):
        if b > 1:
            scale = jnp.repeat(scale, b, axis=axis)
    return scale[tuple(slice(0, n) for n in shape)]


def quantize_blocks(x: ArrayLike, dtype: DTypeLike, block_shape: Sequence[int | None], *,
                    margin: int = 0, power_of_two: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
    """``x`` quantized to ``dtype`` with one scale per block: ``(q, scales)``, ``q`` of
    ``x``'s shape and ``scales`` of :func:`block_scales`'s;
    ``dequantize_blocks(q, scales, block_shape)`` undoes it. A block holding an inf saturates
    and one holding a NaN keeps it (a matmul must check its operands' ``amax``:
    :func:`fp8_dot_general` returns NaN then).

    >>> q, s = quantize_blocks(jnp.array([[1.0, 2.0, 4.0]]), jnp.float8_e4m3fn, (1, 2))
    >>> q, s
    (Array([[224, 448, 448]], dtype=float8_e4m3fn), Array([[224., 112.]], dtype=float32))
    >>> dequantize_blocks(q, s, (1, 2)).tolist()
    [[1.0, 2.0, 4.0]]
    """
    x = jnp.asarray(x)
    scales = block_scales(x, dtype, block_shape, margin=margin, power_of_two=power_of_two)
    blocks, _ = _blocked(x.shape, block_shape)
    return quantize(x, dtype, _expand(scales, blocks, x.shape)), scales


def dequantize_blocks(q: ArrayLike, scales: ArrayLike, block_shape: Sequence[int | None],
                      dtype: DTypeLike = _F32) -> jax.Array:
    """``q`` divided by the scale of its block, in fp32, cast to ``dtype``: the inverse of
    :func:`quantize_blocks` with the same ``block_shape``."""
    q, scales = jnp.asarray(q), jnp.asarray(scales, _F32)
    blocks, counts = _blocked(q.shape, block_shape)
    if tuple(counts) != scales.shape:
        raise ValueError(f"scales of shape {scales.shape} do not match blocks {tuple(blocks)} "
                         f"of an array of shape {q.shape} (expected {tuple(counts)})")
    return dequantize(q, _expand(scales, blocks, q.shape), dtype)


# --------------------------------------------------------------------------------------------
# The matmul and its transposes
# --------------------------------------------------------------------------------------------

def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = set(itertools.chain(*removed))
    return [i for i in range(n) if i not in gone]


def _ranges_like(*xs: Sequence[int]):
    start = 0
    for x in xs:
        yield tuple(range(start, start + len(x)))
        start += len(x)


def _f32_dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=_F32)


def _transpose_lhs(g, y, x_ndim: int, dims, swap_ans: bool = False, dot=_f32_dot):
    """The cotangent of ``dot_general``'s lhs (JAX's own transpose rule) with an fp32 result,
    its matmul ``dot(g, y, dims)``."""
    (x_contract, y_contract), (x_batch, y_batch) = dims
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y.ndim, y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    new_dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    x_contract_sorted_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_sorted_by_y)
    x_bar = dot(g, y, new_dims)
    return lax.transpose(x_bar, tuple(int(a) for a in out_axes))


def _transpose_rhs(g, x, y_ndim: int, dims, dot=_f32_dot):
    (x_contract, y_contract), (x_batch, y_batch) = dims
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, x, y_ndim, swapped, swap_ans=True, dot=dot)


def _poison(*amaxes) -> jax.Array:
    """1, or NaN when an ``amax`` is not finite: saturation must not hide an overflow."""
    finite = functools.reduce(jnp.logical_and, [jnp.isfinite(a) for a in amaxes])
    return jnp.where(finite, jnp.float32(1.0), jnp.float32(jnp.nan))


def _scaled_dot(qx, qw, dims, s_x, s_w, poison, out_dtype):
    # One division per scale: their product may overflow fp32 (a gradient's scale is large).
    out = lax.dot_general(qx, qw, dims, preferred_element_type=_F32)
    return (out / s_x / s_w * poison).astype(out_dtype)


def _forward(lhs, rhs, dims, out_dtype, fwd_dtype, s_lhs, s_rhs):
    a_lhs, a_rhs = amax(lhs), amax(rhs)
    q_lhs, q_rhs = quantize(lhs, fwd_dtype, s_lhs), quantize(rhs, fwd_dtype, s_rhs)
    out = _scaled_dot(q_lhs, q_rhs, dims, s_lhs, s_rhs, _poison(a_lhs, a_rhs), out_dtype)
    # Named for a jax.checkpoint policy (autocast's recompute=True): keep the 8-bit operands
    # and the output in its own dtype, never the fp32 accumulator.
    res = checkpoint_name((q_lhs, q_rhs, s_lhs, s_rhs, a_lhs, a_rhs), RESIDUAL_NAME)
    # Zero-size arrays carry the operands' dtypes to the backward pass.
    tags = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return checkpoint_name(out, OUTPUT_NAME), (*res, tags)


def _backward(dims, bwd_dtype, res, g, s_grad):
    q_lhs, q_rhs, s_lhs, s_rhs, _, _, (lhs_tag, rhs_tag) = res
    a_grad = amax(g)
    q_g = quantize(g, bwd_dtype, s_grad)
    poison = _poison(a_grad)
    d_lhs = _transpose_lhs(q_g, q_rhs, q_lhs.ndim, dims) / s_grad / s_rhs * poison
    d_rhs = _transpose_rhs(q_g, q_lhs, q_rhs.ndim, dims) / s_grad / s_lhs * poison
    return d_lhs.astype(lhs_tag.dtype), d_rhs.astype(rhs_tag.dtype), a_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _current(lhs, rhs, dims, out_dtype, recipe: CurrentScaling):
    return _current_fwd(lhs, rhs, dims, out_dtype, recipe)[0]


def _recipe_scale(a, dtype, recipe, previous: ArrayLike = 1.0) -> jax.Array:
    scale = compute_scale(a, dtype, recipe.margin, previous)
    return round_to_power_of_two(scale) if recipe.power_of_two else scale


def _current_fwd(lhs, rhs, dims, out_dtype, recipe):
    fwd_dtype = recipe.dtypes[0]
    s_lhs = _recipe_scale(amax(lhs), fwd_dtype, recipe)
    s_rhs = _recipe_scale(amax(rhs), fwd_dtype, recipe)
    return _forward(lhs, rhs, dims, out_dtype, fwd_dtype, s_lhs, s_rhs)


def _current_bwd(dims, out_dtype, recipe, res, g):
    del out_dtype
    bwd_dtype = recipe.dtypes[1]
    s_grad = _recipe_scale(amax(g), bwd_dtype, recipe)
    d_lhs, d_rhs, _ = _backward(dims, bwd_dtype, res, g, s_grad)
    return d_lhs, d_rhs


_current.defvjp(_current_fwd, _current_bwd)


# Fine granularities (and a weight gradient in high precision): the operands are saved as they
# came, and each of the three GEMMs quantizes its own operands along its own contraction axes.

def _operand_blocks(ndim: int, contract: Sequence[int], batch: Sequence[int],
                    recipe: CurrentScaling, weight: bool) -> list[int | None]:
    """The block shape of a GEMM operand (see :class:`CurrentScaling`'s ``granularity``)."""
    g = recipe.granularity
    if g == "tensor":
        return [None] * ndim
    shape: list[int | None] = [1] * ndim
    if g == "rowwise":
        for axis in contract:
            shape[axis] = None
        return shape
    if contract:
        shape[max(contract)] = recipe.block_size
    free = _remaining(ndim, contract, batch)
    if weight and g == "blocks" and free:
        shape[max(free)] = recipe.block_size
    return shape


def _row_scales_in_output(scale, contract, batch, other_free: int, side: str):
    """A rowwise operand's scales (1 along its contraction axes) laid out as ``dot_general``'s
    output: the batch axes, the lhs's free axes, then the rhs's."""
    kept = _remaining(scale.ndim, contract)
    scale = scale.reshape([scale.shape[a] for a in kept])
    free = [a for a in kept if a not in batch]
    order = [kept.index(a) for a in (*batch, *free)]
    scale = lax.transpose(scale, tuple(order))
    n_batch = len(batch)
    if side == "lhs":
        return scale.reshape(scale.shape + (1,) * other_free)
    return scale.reshape(scale.shape[:n_batch] + (1,) * other_free + scale.shape[n_batch:])


def _scaled_gemm(a, b, dims, dtype_a, dtype_b, recipe: CurrentScaling, weight_b: bool):
    """``dot_general(a, b)`` in FP8 with the recipe's granularity, in fp32 (NaN where an operand
    holds an inf or a NaN)."""
    (a_contract, b_contract), (a_batch, b_batch) = dims
    blocks_a = _operand_blocks(a.ndim, a_contract, a_batch, recipe, False)
    blocks_b = _operand_blocks(b.ndim, b_contract, b_batch, recipe, weight_b)
    q_a, s_a = quantize_blocks(a, dtype_a, blocks_a, margin=recipe.margin,
                               power_of_two=recipe.power_of_two)
    q_b, s_b = quantize_blocks(b, dtype_b, blocks_b, margin=recipe.margin,
                               power_of_two=recipe.power_of_two)
    poison = _poison(amax(a), amax(b))
    if recipe.granularity in ("tensor", "rowwise"):
        # The scales are constant along the contraction: an FP8 GEMM, scaled after.
        a_free = len(_remaining(a.ndim, a_contract, a_batch))
        b_free = len(_remaining(b.ndim, b_contract, b_batch))
        out = lax.dot_general(q_a, q_b, dims, preferred_element_type=_F32)
        out = out / _row_scales_in_output(s_a, a_contract, a_batch, b_free, "lhs")
        return out / _row_scales_in_output(s_b, b_contract, b_batch, a_free, "rhs") * poison
    # Scales that vary along the contraction: the block-scaled kernel's products and fp32 sum.
    return lax.dot_general(dequantize_blocks(q_a, s_a, blocks_a),
                           dequantize_blocks(q_b, s_b, blocks_b), dims,
                           precision=lax.Precision.HIGHEST, preferred_element_type=_F32) * poison


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fine(lhs, rhs, dims, out_dtype, recipe: CurrentScaling):
    return _fine_fwd(lhs, rhs, dims, out_dtype, recipe)[0]


def _fine_fwd(lhs, rhs, dims, out_dtype, recipe):
    fwd_dtype = recipe.dtypes[0]
    out = _scaled_gemm(lhs, rhs, dims, fwd_dtype, fwd_dtype, recipe, True).astype(out_dtype)
    # The backward GEMMs quantize the operands along other axes: they are kept as they came.
    return checkpoint_name(out, OUTPUT_NAME), checkpoint_name((lhs, rhs), RESIDUAL_NAME)


def _high_dot(a, b, dims):
    """The GEMM in the operands' own (widest) dtype, as autocast's ``compute`` rule runs it
    (XLA:CPU has no bf16 x bf16 -> fp32 dot; GPUs accumulate a bf16 GEMM in fp32)."""
    dtype = jnp.result_type(a.dtype, b.dtype)
    return lax.dot_general(a.astype(dtype), b.astype(dtype), dims,
                           preferred_element_type=dtype).astype(_F32)


def _fine_bwd(dims, out_dtype, recipe, res, g):
    del out_dtype
    lhs, rhs = res
    fwd_dtype, bwd_dtype = recipe.dtypes

    def gemm(weight_b):
        return lambda a, b, d: _scaled_gemm(a, b, d, bwd_dtype, fwd_dtype, recipe, weight_b)
    d_lhs = _transpose_lhs(g, rhs, lhs.ndim, dims, dot=gemm(True))
    d_rhs = _transpose_rhs(g, lhs, rhs.ndim, dims,
                           dot=_high_dot if recipe.weight_grad == "high" else gemm(False))
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_fine.defvjp(_fine_fwd, _fine_bwd)


def _output_dtype(lhs, rhs, preferred_element_type) -> Any:
    if preferred_element_type is not None:
        return jnp.dtype(preferred_element_type)
    return jnp.result_type(lhs.dtype, rhs.dtype)


def _check_operands(lhs, rhs, where: str) -> tuple[jax.Array, jax.Array]:
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype in (E4M3, E5M2):
            raise TypeError(f"{where}: the {name} must be a float16/bfloat16/float32 array to "
                            f"quantize, got {x.dtype}")
    return lhs, rhs


def _dims(dimension_numbers) -> tuple:
    (lc, rc), (lb, rb) = dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def fp8_dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: Any,
                    precision: Any = None, preferred_element_type: DTypeLike | None = None,
                    out_sharding: Any = None, *,
                    recipe: CurrentScaling = CurrentScaling()) -> jax.Array:
    """``lax.dot_general`` in FP8 with current scaling: a drop-in ``dot_general`` (for
    ``nnx.Linear(..., dot_general=fp8_dot_general)``, or the one ``jaxamp.autocast`` uses under
    the ``mixed_fp8`` policy).

    The operands are quantized to the recipe's forward dtype (e4m3) with their own ``amax``;
    the backward pass quantizes the incoming gradient to e5m2 the same way and runs both
    transposed matmuls in FP8. Products accumulate in fp32; the result is in
    ``preferred_element_type`` (default: the operands' dtype), each gradient in its operand's
    dtype. ``precision`` and ``out_sharding`` are accepted for the signature and ignored. A
    recipe with a finer ``granularity`` (rows, tiles, blocks) or ``weight_grad="high"`` keeps
    the operands for the backward pass and quantizes them again along each GEMM's own
    contraction axes (see :class:`CurrentScaling`).

    >>> x, w = jnp.full((2, 3), 3.5), jnp.full((3, 4), 7.0)  # scales 128 and 64: exact
    >>> fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
    Array([[73.5, 73.5, 73.5, 73.5],
           [73.5, 73.5, 73.5, 73.5]], dtype=float32)
    """
    del precision, out_sharding
    if not isinstance(recipe, CurrentScaling):
        raise TypeError(f"fp8_dot_general takes recipe=CurrentScaling(...), got {recipe!r}; "
                        "delayed scaling keeps state: use jaxamp.fp8.DotGeneral")
    lhs, rhs = _check_operands(lhs, rhs, "fp8_dot_general")
    matmul = _current if recipe.per_tensor else _fine
    return matmul(lhs, rhs, _dims(dimension_numbers),
                  _output_dtype(lhs, rhs, preferred_element_type), recipe)


# --------------------------------------------------------------------------------------------
# Delayed scaling
# --------------------------------------------------------------------------------------------

class Fp8State(State, _model_state.Node):
    """The FP8 metadata of one delayed-scaling matmul.

    Rows 0, 1 and 2 are the lhs (the input), the rhs (the kernel) and the incoming gradient.

    Attributes:
      amax_history: ``(..., 3, history_length)`` fp32, the latest step's ``amax`` in column 0
        (the gradient's in the units of the unscaled gradient); zeros before the first step.
      scale: ``(..., 3)`` fp32, the scales the next step quantizes with. Ones at first, unused:
        while a row's history is empty (before its first step) the tensor is scaled by its
        own amax, as in current scaling, not by 1.
      recipe: the :class:`DelayedScaling` (static).

    >>> s = Fp8State.create(DelayedScaling(history_length=4))
    >>> s.amax_history.shape, s.scale.tolist()
    ((3, 4), [1.0, 1.0, 1.0])

    A model's states are found, and put back, in tree order by :meth:`find_all` and
    :meth:`replace_all`; the train step rolls each one with :meth:`update`.
    """

    amax_history: jax.Array
    """``(..., 3, history_length)`` fp32: the past steps' ``amax`` of the lhs, the rhs and the
    unscaled gradient, the latest in column 0; zeros before the first step."""
    scale: jax.Array
    """``(..., 3)`` fp32: the scales the next step quantizes the lhs, the rhs and the gradient
    with (a row whose history is still empty uses its tensor's own ``amax`` instead)."""
    recipe: DelayedScaling = static_field(default=DelayedScaling())
    """The :class:`DelayedScaling` recipe (static: part of the treedef, not a leaf)."""

    @classmethod
    def create(cls, recipe: DelayedScaling = DelayedScaling()) -> Fp8State:
        """The state of one matmul before its first step: a ``(3, history_length)`` history of
        zeros and scales of 1. Raises ``TypeError`` unless ``recipe`` is a
        :class:`DelayedScaling`."""
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"Fp8State needs a DelayedScaling recipe, got {recipe!r}")
        return cls(jnp.zeros((len(_ROWS), recipe.history_length), _F32),
                   jnp.ones((len(_ROWS),), _F32), recipe)

    # The train step differentiates and updates the Fp8States in its model state through
    # these (jaxamp._model_state.Node; the step names nothing of FP8). Each looks up the
    # module's function at its call: a test may patch one.
    untracked: ClassVar[str] = (
        "the loss ran delayed-scaling FP8 matmuls (jaxamp.fp8.DotGeneral, Linear, Einsum) whose "
        "Fp8State is not in the train state's model state, so their scales would never be "
        "updated. Split it out and keep it there: graphdef, params, fp8_meta = nnx.split(model, "
        "nnx.Param, jaxamp.fp8.Fp8Meta); TrainState.create(..., model_state=fp8_meta); "
        "make_train_step(loss_fn, has_model_state=True), with loss_fn returning "
        "nnx.state(model, jaxamp.fp8.Fp8Meta)")
    """The train step's error when a delayed matmul ran whose state is not in the model state."""

    def hand(self, scale: jax.Array) -> Fp8State:
        """The state the step hands the loss under the loss scale ``scale``: the gradient's
        scale divided by it."""
        return with_loss_scale(self, scale)

    def seen(self, scale: jax.Array) -> jax.Array:
        """The ``(..., 3)`` amax a step saw, read from this cotangent (the gradient's
        unscaled)."""
        return seen_amax(self, scale)

    def update(self, seen: ArrayLike) -> Fp8State:
        """The state after a step that saw ``seen`` (``(..., 3)``: the lhs, rhs and unscaled
        gradient ``amax``): the history rolled by one with ``seen`` in column 0, and the scales
        recomputed from it (``amax_algo``, ``margin``, the format's maxima). A zero, inf or NaN
        ``amax`` keeps the row's previous scale. A matmul that saw nothing (all three zero: it
        did not run this step) is left as it was.

        >>> s = Fp8State.create(DelayedScaling(history_length=3))
        >>> s = s.update(jnp.array([2.0, 4.0, 0.5]))
        >>> s.amax_history[:, 0].tolist(), s.scale.tolist()
        ([2.0, 4.0, 0.5], [224.0, 112.0, 114688.0])
        """
        return update_fp8_state(self, seen)

    def nothing_seen(self) -> jax.Array:
        """The amax of a step where this matmul did not run: zeros."""
        return jnp.zeros_like(self.scale)

    @classmethod
    def find_all(cls, tree: Any) -> list[Fp8State]:
        """Every :class:`Fp8State` in ``tree`` (a model state, ``nnx.state(model,
        jaxamp.fp8.Fp8Meta)``), in tree order.

        >>> states = {"b": Fp8State.create(DelayedScaling(history_length=2)), "a": [1.0]}
        >>> [s.amax_history.shape for s in Fp8State.find_all(states)]
        [(3, 2)]
        """
        return find_fp8_states(tree)

    @classmethod
    def replace_all(cls, tree: Any, states: Sequence[Fp8State]) -> Any:
        """``tree`` with its :class:`Fp8State` nodes replaced, in tree order, by ``states`` (as
        many as it holds: :meth:`find_all`'s list, changed).

        >>> tree = {"a": Fp8State.create(DelayedScaling(history_length=2))}
        >>> new = [s.update(jnp.array([1.0, 1.0, 1.0])) for s in Fp8State.find_all(tree)]
        >>> Fp8State.replace_all(tree, new)["a"].scale.tolist()
        [448.0, 448.0, 57344.0]
        """
        return replace_fp8_states(tree, states)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _delayed(lhs, rhs, state: Fp8State, dims, out_dtype):
    return _delayed_fwd(lhs, rhs, state, dims, out_dtype)[0]


def _delayed_scale(state: Fp8State, row: int, x, dtype):
    """The state's scale for ``row``; before the row's first amax (an empty history, which
    would leave the scale at 1), ``x``'s own, as in current scaling."""
    fresh = jnp.max(state.amax_history[row]) == 0
    return jnp.where(fresh, _recipe_scale(amax(x), dtype, state.recipe), state.scale[row])


def _delayed_fwd(lhs, rhs, state, dims, out_dtype):
    fwd_dtype = state.recipe.dtypes[0]
    out, res = _forward(lhs, rhs, dims, out_dtype, fwd_dtype,
                        _delayed_scale(state, 0, lhs, fwd_dtype),
                        _delayed_scale(state, 1, rhs, fwd_dtype))
    return out, (res, state)


def _delayed_bwd(dims, out_dtype, res, g):
    del out_dtype
    res, state = res
    bwd_dtype = state.recipe.dtypes[1]
    d_lhs, d_rhs, a_grad = _backward(dims, bwd_dtype, res, g,
                                     _delayed_scale(state, 2, g, bwd_dtype))
    a_lhs, a_rhs = res[4], res[5]
    # The cotangent of the state: the amax this step saw at the scale's place (the step merges
    # these by max and rolls them into the history), nothing at the history's.
    seen = Fp8State(jnp.zeros_like(state.amax_history), jnp.stack([a_lhs, a_rhs, a_grad]),
                    state.recipe)
    return d_lhs, d_rhs, seen


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def delayed_dot_general(lhs: ArrayLike, rhs: ArrayLike, dimension_numbers: Any,
                        state: Fp8State, preferred_element_type: DTypeLike | None = None
                        ) -> jax.Array:
    """``lax.dot_general`` in FP8 with the scales of ``state`` (the functional core of
    :class:`DotGeneral`). Differentiating with respect to ``state`` gives, at its ``scale``,
    the ``amax`` of the lhs, the rhs and the gradient: :meth:`Fp8State.update` rolls them in.

    >>> s = Fp8State.create(DelayedScaling(history_length=4))
    >>> x, w, dims = jnp.full((2, 3), 2.0), jnp.full((3, 4), 0.5), (((1,), (0,)), ((), ()))
    >>> round(float(delayed_dot_general(x, w, dims, s)[0, 0]), 4)
    3.0
    >>> seen = jax.grad(lambda s: delayed_dot_general(x, w, dims, s).sum())(s)
    >>> seen.scale.tolist()  # the amax of the lhs, the rhs and the gradient
    [2.0, 0.5, 1.0]
    """
    if not isinstance(state, Fp8State):
        raise TypeError(f"state must be a jaxamp.fp8.Fp8State, got {type(state).__name__}")
    if state.scale.ndim != 1:
        raise ValueError(f"state.scale has shape {state.scale.shape}; a stacked Fp8State (from "
                         "nnx.vmap or nnx.scan) must be sliced to one layer's before the call")
    lhs, rhs = _check_operands(lhs, rhs, "delayed FP8 dot_general")
    _model_state.ran(state)
    return _delayed(lhs, rhs, state, _dims(dimension_numbers),
                    _output_dtype(lhs, rhs, preferred_element_type))


def update_fp8_state(state: Fp8State, seen: ArrayLike) -> Fp8State:
    """:meth:`Fp8State.update`: the state after a step that saw ``seen``."""
    recipe = state.recipe
    seen = jnp.asarray(seen, _F32)
    rolled = jnp.roll(state.amax_history, 1, axis=-1).at[..., 0].set(seen)
    amaxes = rolled[..., 0] if recipe.amax_algo == "most_recent" else jnp.max(rolled, axis=-1)
    fwd, bwd = recipe.dtypes
    scale = jnp.stack([_recipe_scale(amaxes[..., i], fwd if i < 2 else bwd, recipe,
                                     state.scale[..., i]) for i in range(len(_ROWS))], axis=-1)
    ran = jnp.any(seen != 0, axis=-1)
    return Fp8State(jnp.where(ran[..., None, None], rolled, state.amax_history),
                    jnp.where(ran[..., None], scale, state.scale), recipe)


def find_fp8_states(tree: Any) -> list[Fp8State]:
    """:meth:`Fp8State.find_all`: every :class:`Fp8State` in ``tree``, in tree order."""
    return _model_state.find(tree, Fp8State)


def replace_fp8_states(tree: Any, states: Sequence[Fp8State]) -> Any:
    """:meth:`Fp8State.replace_all`: ``tree`` with its :class:`Fp8State` nodes replaced, in
    tree order, by ``states``."""
    states = list(states)
    held = len(find_fp8_states(tree))
    if held != len(states):
        raise ValueError(f"the tree holds {held} Fp8State(s) but {len(states)} were given; "
                         "pass one state for each, in tree order")
    return _model_state.replace(tree, states, kind=Fp8State)


def with_loss_scale(state: Fp8State, loss_scale: ArrayLike) -> Fp8State:
    """The state a scaled loss's backward pass quantizes with: the gradient's scale divided by
    the loss scale (its ``amax`` is kept unscaled)."""
    s = jnp.asarray(loss_scale, _F32)
    return Fp8State(state.amax_history, state.scale.at[..., 2].divide(s), state.recipe)


def seen_amax(cotangent: Fp8State, loss_scale: ArrayLike) -> jax.Array:
    """The ``(..., 3)`` amax of a step from the cotangent of its :class:`Fp8State`, the
    gradient's in unscaled units."""
    s = jnp.asarray(loss_scale, _F32)
    return cotangent.scale.at[..., 2].divide(s)
