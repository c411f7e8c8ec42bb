"""FP8 matmuls: current scaling for any model, delayed scaling for Flax NNX.

An FP8 matmul quantizes each operand to an 8-bit float after multiplying it by a per-tensor
``scale``, multiplies the 8-bit values with an fp32 accumulator, and multiplies the result by
``1 / (scale_lhs * scale_rhs)``. The forward pass quantizes the operands to ``e4m3`` (max 448,
3 mantissa bits) and the backward pass the incoming gradient to ``e5m2`` (max 57344, 2 bits):
the ``"hybrid"`` format of Transformer Engine. A scale is ``fp8_max / amax / 2**margin``, with
``amax`` the largest magnitude of the tensor; a zero, infinite or NaN ``amax`` (or a scale that
overflows fp32, from a tiny ``amax``) keeps the previous scale.

Two recipes:

* :class:`CurrentScaling` (stateless): each tensor's ``amax`` is computed on the fly.
  :func:`fp8_dot_general` is a drop-in ``lax.dot_general``; ``jaxamp.autocast`` under the
  ``mixed_fp8`` policy runs every ``dot_general`` of any model through it.
* :class:`DelayedScaling`: the scales come from a history of the ``amax`` of past steps, kept in
  an :class:`Fp8State` (the NNX variable kind :class:`Fp8Meta`). :class:`DotGeneral`,
  :class:`EinsumOp`, :class:`Linear` and :class:`Einsum` are the NNX layers that hold one.
  The step updates it, never the optimizer: :func:`jaxamp.make_train_step` differentiates with
  respect to each ``Fp8State`` in the model state (the cotangent of its ``scale`` is the
  ``amax`` this step saw), takes the maximum over micro-batches and devices, rolls the history
  and recomputes the scale, and keeps it bit-identical on a skipped step.

Loss scaling: the gradient's ``amax`` is kept in the units of the unscaled gradient. The step
hands the model a gradient scale divided by the loss scale and divides the ``amax`` it sees by
the loss scale, so the whole state is the same whatever the loss scale, and a change of loss
scale does not make the next steps' scales stale. The forward tensors' metadata never meets the
loss scale (keras#21706 divided it by the loss scale).

Non-finite values are never hidden by saturation: a matmul whose operand or incoming gradient
holds an inf or a NaN returns NaN, so an fp16 overflow still skips the step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

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

if TYPE_CHECKING:  # loaded lazily by __getattr__ (they import flax.nnx)
    from jaxamp._fp8_nnx import DotGeneral
    from jaxamp._fp8_nnx import Einsum
    from jaxamp._fp8_nnx import EinsumOp
    from jaxamp._fp8_nnx import Fp8Meta
    from jaxamp._fp8_nnx import Linear

__all__ = ["AMAX_ALGOS", "FORMATS", "CurrentScaling", "DelayedScaling", "DotGeneral",
           "Einsum", "EinsumOp", "Fp8Meta", "Fp8State", "Linear", "amax", "compute_scale",
           "delayed_dot_general", "dequantize", "find_fp8_states", "fp8_dot_general", "fp8_max",
           "quantize",
           "update_fp8_state"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FORMATS: dict[str, tuple[Any, Any]] = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3),
                                       "e5m2": (E5M2, E5M2)}
"""Format name -> (forward operands' dtype, gradient's dtype)."""
AMAX_ALGOS = ("max", "most_recent")
"""How a delayed scale reads the ``amax`` history: its maximum, or the latest entry."""
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


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Stateless FP8 scaling: each tensor is scaled by its own ``amax``, computed on the fly.

    Attributes:
      format: ``"hybrid"`` (e4m3 forward, e5m2 gradients; default), ``"e4m3"`` or ``"e5m2"``.
      margin: the scale is divided by ``2**margin`` (headroom against saturation).

    >>> CurrentScaling().dtypes
    (dtype(float8_e4m3fn), dtype(float8_e5m2))
    """

    format: str = "hybrid"
    """A key of :data:`FORMATS`: ``"hybrid"`` (e4m3 forward, e5m2 gradients; default),
    ``"e4m3"`` or ``"e5m2"``."""
    margin: int = 0
    """An int >= 0: every scale is divided by ``2**margin`` (headroom against saturation)."""

    def __post_init__(self):
        _check_format(self.format)
        _check_margin(self.margin)

    @property
    def dtypes(self) -> tuple[Any, Any]:
        """(forward dtype, gradient dtype)."""
        return FORMATS[self.format]


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """FP8 scaling from a history of past ``amax`` values (Transformer Engine's defaults).

    Attributes:
      history_length: the number of past steps' ``amax`` kept (default 1024).
      margin: the scale is divided by ``2**margin``.
      format: ``"hybrid"`` (default), ``"e4m3"`` or ``"e5m2"``.
      amax_algo: ``"max"`` (the history's maximum; default) or ``"most_recent"``.

    >>> DelayedScaling(history_length=16).amax_algo
    'max'
    >>> DelayedScaling(history_length=0)
    Traceback (most recent call last):
    ...
    ValueError: history_length must be an int >= 1, got 0; ...
    """

    history_length: int = 1024
    """The number of past steps' ``amax`` kept for each tensor (default 1024)."""
    margin: int = 0
    """An int >= 0: every scale is divided by ``2**margin`` (headroom against saturation)."""
    format: str = "hybrid"
    """A key of :data:`FORMATS`: ``"hybrid"`` (e4m3 forward, e5m2 gradients; default),
    ``"e4m3"`` or ``"e5m2"``."""
    amax_algo: str = "max"
    """How a scale reads the history (one of :data:`AMAX_ALGOS`): ``"max"``, its maximum
    (default), or ``"most_recent"``, the latest step's ``amax``."""

    def __post_init__(self):
        n = self.history_length
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"history_length must be an int >= 1, got {n!r}; it is the number "
                             "of past steps' amax the scale is computed from (1024 by default)")
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


def _transpose_lhs(g, y, x_ndim: int, dims, swap_ans: bool = False):
    """The cotangent of ``dot_general``'s lhs (JAX's own transpose rule) with fp8 operands and
    an fp32 result."""
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
    x_bar = lax.dot_general(g, y, new_dims, preferred_element_type=_F32)
    return lax.transpose(x_bar, tuple(int(a) for a in out_axes))


def _transpose_rhs(g, x, y_ndim: int, dims):
    (x_contract, y_contract), (x_batch, y_batch) = dims
    swapped = ((y_contract, x_contract), (y_batch, x_batch))
    return _transpose_lhs(g, x, y_ndim, swapped, swap_ans=True)


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


def _current_fwd(lhs, rhs, dims, out_dtype, recipe):
    fwd_dtype = recipe.dtypes[0]
    s_lhs = compute_scale(amax(lhs), fwd_dtype, recipe.margin)
    s_rhs = compute_scale(amax(rhs), fwd_dtype, recipe.margin)
    return _forward(lhs, rhs, dims, out_dtype, fwd_dtype, s_lhs, s_rhs)


def _current_bwd(dims, out_dtype, recipe, res, g):
    del out_dtype
    bwd_dtype = recipe.dtypes[1]
    s_grad = compute_scale(amax(g), bwd_dtype, recipe.margin)
    d_lhs, d_rhs, _ = _backward(dims, bwd_dtype, res, g, s_grad)
    return d_lhs, d_rhs


_current.defvjp(_current_fwd, _current_bwd)


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
    dtype. ``precision`` and ``out_sharding`` are accepted for the signature and ignored.

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
    return _current(lhs, rhs, _dims(dimension_numbers),
                    _output_dtype(lhs, rhs, preferred_element_type), recipe)


# --------------------------------------------------------------------------------------------
# Delayed scaling
# --------------------------------------------------------------------------------------------

class Fp8State(State):
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _delayed(lhs, rhs, state: Fp8State, dims, out_dtype):
    return _delayed_fwd(lhs, rhs, state, dims, out_dtype)[0]


def _delayed_scale(state: Fp8State, row: int, x, dtype):
    """The state's scale for ``row``; before the row's first amax (an empty history, which
    would leave the scale at 1), ``x``'s own, as in current scaling."""
    fresh = jnp.max(state.amax_history[row]) == 0
    return jnp.where(fresh, compute_scale(amax(x), dtype, state.recipe.margin), state.scale[row])


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
    the ``amax`` of the lhs, the rhs and the gradient: :func:`update_fp8_state` rolls them in.

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
    calls = _DELAYED_CALLS.get()
    if calls is not None:
        calls.append(state)
    return _delayed(lhs, rhs, state, _dims(dimension_numbers),
                    _output_dtype(lhs, rhs, preferred_element_type))


# Trace-time only: the delayed-scaling matmuls that ran while a train step traced its loss, so
# that a model whose FP8 metadata is not in the step's model state is an error, not a silent
# run with scales that never change.
_DELAYED_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxamp_fp8_delayed_calls", default=None)
UNTRACKED_MESSAGE = (
    "the loss ran delayed-scaling FP8 matmuls (jaxamp.fp8.DotGeneral, Linear, Einsum) whose "
    "Fp8State is not in the train state's model state, so their scales would never be "
    "updated. Split it out and keep it there: graphdef, params, fp8_meta = nnx.split(model, "
    "nnx.Param, jaxamp.fp8.Fp8Meta); TrainState.create(..., model_state=fp8_meta); "
    "make_train_step(loss_fn, has_model_state=True), with loss_fn returning "
    "nnx.state(model, jaxamp.fp8.Fp8Meta)")


@contextlib.contextmanager
def recording_delayed_calls():
    """Collects (at trace time) the :class:`Fp8State` of every delayed matmul run inside."""
    calls: list = []
    token = _DELAYED_CALLS.set(calls)
    try:
        yield calls
    finally:
        _DELAYED_CALLS.reset(token)


def update_fp8_state(state: Fp8State, seen: ArrayLike) -> Fp8State:
    """The state after a step that saw ``seen`` (``(..., 3)``: the lhs, rhs and unscaled
    gradient ``amax``): the history rolled by one with ``seen`` in column 0, and the scales
    recomputed from it (``amax_algo``, ``margin``, the format's maxima). A zero, inf or NaN
    ``amax`` keeps the row's previous scale. A matmul that saw nothing (all three zero: it did
    not run this step) is left as it was.

    >>> s = Fp8State.create(DelayedScaling(history_length=3))
    >>> s = update_fp8_state(s, jnp.array([2.0, 4.0, 0.5]))
    >>> s.amax_history[:, 0].tolist(), s.scale.tolist()
    ([2.0, 4.0, 0.5], [224.0, 112.0, 114688.0])
    """
    recipe = state.recipe
    seen = jnp.asarray(seen, _F32)
    rolled = jnp.roll(state.amax_history, 1, axis=-1).at[..., 0].set(seen)
    amaxes = rolled[..., 0] if recipe.amax_algo == "most_recent" else jnp.max(rolled, axis=-1)
    fwd, bwd = recipe.dtypes
    scale = jnp.stack([compute_scale(amaxes[..., i], fwd if i < 2 else bwd, recipe.margin,
                                     state.scale[..., i]) for i in range(len(_ROWS))], axis=-1)
    ran = jnp.any(seen != 0, axis=-1)
    return Fp8State(jnp.where(ran[..., None, None], rolled, state.amax_history),
                    jnp.where(ran[..., None], scale, state.scale), recipe)


def is_fp8_state(x: Any) -> bool:
    return isinstance(x, Fp8State)


def find_fp8_states(tree: Any) -> list[Fp8State]:
    """Every :class:`Fp8State` in ``tree``, in tree order.

    >>> states = {"b": Fp8State.create(DelayedScaling(history_length=2)), "a": [1.0]}
    >>> [s.amax_history.shape for s in find_fp8_states(states)]
    [(3, 2)]
    """
    return [x for x in jax.tree.leaves(tree, is_leaf=is_fp8_state) if is_fp8_state(x)]


def replace_fp8_states(tree: Any, states: Sequence[Fp8State]) -> Any:
    """``tree`` with its :class:`Fp8State` nodes replaced, in tree order, by ``states``."""
    it = iter(states)
    out = jax.tree.map(lambda x: next(it) if is_fp8_state(x) else x, tree, is_leaf=is_fp8_state)
    if next(it, None) is not None:
        raise ValueError("more Fp8States given than the tree holds")
    return out


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


# The train step differentiates and updates the Fp8States in its model state through this hook
# (it names nothing of FP8 itself). The functions are looked up at each call: a test may patch
# one of them.
_model_state.register(_model_state.Hook(
    is_node=lambda x: is_fp8_state(x),
    hand=lambda state, loss_scale: with_loss_scale(state, loss_scale),
    seen=lambda cotangent, loss_scale: seen_amax(cotangent, loss_scale),
    update=lambda state, seen: update_fp8_state(state, seen),
    nothing_seen=lambda state: jnp.zeros_like(state.scale),
    recording=lambda: recording_delayed_calls(),
    untracked=UNTRACKED_MESSAGE))


# The NNX layers load flax.nnx, which ``import jaxamp`` and ``autocast`` do not need: they live
# in a module of their own, imported on the first access to one of them.
_NNX_LAYERS = ("DotGeneral", "Einsum", "EinsumOp", "Fp8Meta", "Linear")


def __getattr__(name: str) -> Any:
    if name in _NNX_LAYERS:
        from jaxamp import _fp8_nnx
        return getattr(_fp8_nnx, name)
    raise AttributeError(f"module 'jaxamp.fp8' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_NNX_LAYERS})
