"""FP32 master weights in the optax state: :func:`mixed_precision`.

``mixed_precision(inner, policy, loss_scale=...)`` wraps any optax transform. Its state holds
the master params (in ``policy.param_dtype``), the inner optimizer's state, the loss-scale
state and counters. ``update(scaled_grads, state, params)``:

1. casts the grads to fp32 and unscales them with the scale used for this step;
2. checks that they are all finite;
3. runs ``inner`` on the fp32 master params, so clipping, weight decay and schedules see
   true fp32 gradients;
4. adjusts the loss scale;
5. returns updates such that ``optax.apply_updates(params, updates)`` gives the new master
   cast to each param's working dtype.

A non-finite step returns zero updates (``-0.0``, so that even signed zeros are kept) and leaves
the master params and the inner state, including its step count, bit-identical.

A non-finite update is never applied, however many come in a row. When ``stall_after``
consecutive steps are non-finite at the minimum loss scale (where backing off cannot help), the
state reports ``stalled``, so that a training loop can stop and say why.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental.layout import Layout
from jax.experimental.layout import with_layout_constraint

from jaxamp.loss_scale import DynamicLossScale
from jaxamp.loss_scale import LossScale
from jaxamp.loss_scale import NoOpLossScale
from jaxamp.loss_scale import StaticLossScale
from jaxamp.policy import get_policy
from jaxamp.policy import tree_path_str

__all__ = [
    "MixedPrecisionState",
    "mixed_precision",
    "find_state",
    "get_loss_scale",
    "get_master_params",
    "scale_loss",
    "GradStats",
    "grad_stats",
    "nonfinite_leaf_path",
    "working_params",
]

_INT32_MAX = 2**31 - 1


class MixedPrecisionState(NamedTuple):
    """The state of :func:`mixed_precision`. Every leaf is an array.

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.adam(1e-3), "mixed_bfloat16").init({"w": jnp.ones(2)})
    >>> int(state.applied_steps), int(state.skipped_steps), state.master_params["w"].dtype
    (0, 0, dtype('float32'))

    Attributes:
      master_params: the params in ``policy.param_dtype`` (fp32 for the mixed presets).
      inner_state: the wrapped optimizer's state, built on the master params.
      loss_scale: a :class:`~jaxamp.NoOpLossScale`, ``StaticLossScale`` or
        ``DynamicLossScale`` holding the scale for the next step.
      applied_steps: int32 count of applied updates (saturates at 2**31 - 1).
      skipped_steps: int32 count of skipped, non-finite updates (saturates).
      grads_finite: bool, whether the last update's gradients were all finite.
      grad_norm: fp32 global L2 norm of the last update's unscaled gradients.
      nonfinite_leaves: int32 number of gradient leaves holding an inf or nan at the last update.
      first_nonfinite_leaf: int32 index (tree order, floating leaves) of the first of them, or
        -1; :func:`nonfinite_leaf_path` gives its path.
      skips_at_min_scale: int32 count of consecutive non-finite steps taken at the minimum loss
        scale (see ``LossScale.at_min_scale``); 0 after a finite step (saturates).
      stalled: bool, ``skips_at_min_scale >= stall_after``: the gradients keep overflowing
        where the loss scale cannot back off any further, so loss scaling cannot fix them.
    """

    master_params: Any
    inner_state: Any
    loss_scale: LossScale
    applied_steps: jax.Array
    skipped_steps: jax.Array
    grads_finite: jax.Array
    grad_norm: jax.Array
    nonfinite_leaves: jax.Array
    first_nonfinite_leaf: jax.Array
    skips_at_min_scale: jax.Array
    stalled: jax.Array


def _saturating_increment(count: jax.Array, when: jax.Array) -> jax.Array:
    return (count + (when & (count < _INT32_MAX)).astype(jnp.int32)).astype(jnp.int32)


class GradStats(NamedTuple):
    """What one pass over the gradients tells: see :func:`grad_stats`.

    >>> import jax.numpy as jnp
    >>> grad_stats({"w": jnp.array([3.0, 4.0])})._fields
    ('finite', 'norm', 'nonfinite_leaves', 'first_nonfinite_leaf')
    """

    finite: jax.Array
    norm: jax.Array
    nonfinite_leaves: jax.Array
    first_nonfinite_leaf: jax.Array


def _floating_leaves_with_path(tree: Any) -> list[tuple[Any, Any]]:
    return [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]


def _sum_of_squares(x: jax.Array) -> jax.Array:
    """``sum(x**2)`` accumulated in fp32, as one dot that contracts every axis.

    No reshape: flattening a gradient sharded along a minor axis would all-gather it first,
    while a contraction over a sharded axis leaves a partial sum per device and one scalar
    all-reduce.
    """
    axes = tuple(range(x.ndim))
    return lax.dot_general(x, x, ((axes, axes), ((), ())), preferred_element_type=jnp.float32)


def grad_stats(grads: Any, scale: Any = None) -> GradStats:
    """``(finite, norm, nonfinite_leaves, first_nonfinite_leaf)`` from one pass over ``grads``.

    ``grads`` may be in any floating dtype and may still be multiplied by a loss ``scale``: the
    sums of squares are accumulated in fp32 and the norm is divided by ``scale``. A leaf is
    non-finite when its sum of squares is inf or nan: exactly when it holds an inf or nan, or
    when its (scaled) norm exceeds ~1.8e19, which is treated as an overflow too. One reduction
    that reads each gradient once serves the check, the norm and the per-leaf diagnosis.
    ``first_nonfinite_leaf`` is the index of the first non-finite floating leaf in tree order
    (-1 when all are finite); :func:`nonfinite_leaf_path` maps it back to its path.

    >>> import jax.numpy as jnp
    >>> ok, norm, bad, first = grad_stats({"a": jnp.array([3.0, 4.0]), "b": jnp.array([jnp.nan])})
    >>> bool(ok), int(bad), int(first)
    (False, 1, 1)
    >>> float(grad_stats({"a": jnp.array([30.0, 40.0])}, scale=10.0).norm)
    5.0
    """
    leaves = [x for _, x in _floating_leaves_with_path(grads)]
    if not leaves:
        return GradStats(jnp.array(True), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                         jnp.full((), -1, jnp.int32))
    # A dot with fp32 accumulation reads each leaf once in its own dtype; on XLA:CPU a
    # convert-square-sum materialises an fp32 copy of the gradients first. fp16 inputs are
    # multiplied in fp32, so squares of large scaled fp16 gradients do not overflow.
    sumsq = jnp.stack([_sum_of_squares(x) for x in leaves])
    total = jnp.sum(sumsq)
    bad = ~jnp.isfinite(sumsq)
    norm = jnp.sqrt(total)
    if scale is not None:
        norm = norm / jnp.asarray(scale, jnp.float32)
    first = jnp.where(bad.any(), jnp.argmax(bad), -1).astype(jnp.int32)
    return GradStats(jnp.isfinite(total), norm.astype(jnp.float32),
                     jnp.sum(bad).astype(jnp.int32), first)


def nonfinite_leaf_path(tree: Any, index: Any) -> str | None:
    """Maps ``first_nonfinite_leaf`` (from metrics or the optimizer state) to a tree path.

    ``tree`` is anything with the params' structure (the params, the master, the grads).
    Returns ``None`` for -1 (all finite). Host-side: call it on a fetched value.

    >>> nonfinite_leaf_path({"dense": {"bias": 0.0, "kernel": 0.0}}, 1)
    'dense/kernel'
    >>> nonfinite_leaf_path({"w": 0.0}, -1) is None
    True
    """
    index = int(np.asarray(index).reshape(-1)[0])
    if index < 0:
        return None
    leaves = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if not hasattr(x, "dtype") or jnp.issubdtype(x.dtype, jnp.floating)]
    if index >= len(leaves):
        raise ValueError(f"leaf index {index} is out of range for a tree with {len(leaves)} "
                         "floating leaves; pass the params the step was run with")
    return tree_path_str(leaves[index][0])


def _pins_layout(pin_grad_layout: bool | None) -> bool:
    if pin_grad_layout is not None:
        return bool(pin_grad_layout)
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def _row_major_grads(grads: Any) -> Any:
    """Pins traced gradients of rank >= 2 to the default row-major layout, on XLA:CPU.

    XLA:CPU emits a weight gradient ``x.T @ dy`` as the product ``dy.T @ x`` read through a
    column-major bitcast. Elementwise fusions read that layout for free, but the finite check
    (a reduction) and the ``lax.cond`` boundary of the skip each insert a transposing copy of
    every such gradient: two extra passes over the grads. Pinning the layout here moves the
    transpose into the fusion that produces the gradient (its cast to the param dtype), so the
    step reads the grads once. On the encoder of ``python -m train.bench overhead`` this takes
    the bytes accessed from 1.022x to 1.012x the bare bf16 step. The constraint changes no
    update; only the reported grad norm, an fp32 sum whose order follows the layout, may
    differ in its last bit. (Flattening the grads would also pin the layout, but resharding a
    tensor-parallel gradient would cost more than it saves; the constraint itself makes XLA's
    partitioner all-gather a sharded gradient, so by default it is applied only on a single
    CPU device.) Only where measured: on other backends (TPU's tiled layouts in particular)
    the grads pass through untouched.
    """
    def pin(g):
        if isinstance(g, jax.core.Tracer) and getattr(g, "ndim", 0) >= 2:
            return with_layout_constraint(g, Layout(tuple(range(g.ndim))))
        return g
    return jax.tree.map(pin, grads)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Per-leaf ``where`` for arrays; identical non-array leaves pass through."""
    def sel(a, b):
        if isinstance(a, jax.Array | jnp.ndarray) or hasattr(a, "dtype"):
            return jnp.where(pred, a, b)
        return a
    return jax.tree.map(sel, on_true, on_false)


def _like(new: Any, old: Any) -> Any:
    """Casts ``new``'s array leaves to ``old``'s dtypes (state dtypes are invariant)."""
    return jax.tree.map(lambda n, o: n.astype(o.dtype) if hasattr(o, "dtype") else n, new, old)


def _working_update(target: jax.Array, param: jax.Array) -> jax.Array:
    """An fp32 update ``u`` with ``(param + u).astype(param.dtype) == target``.

    ``target - param`` is exact in fp32 whenever a half-precision param does not shrink by more
    than ~2**15x in one step, so the sum reproduces ``target`` bit for bit. A zero difference
    becomes ``-0.0``, the additive identity that also keeps the sign of a zero param.
    """
    t32, p32 = target.astype(jnp.float32), param.astype(jnp.float32)
    diff = t32 - p32
    plus_zero = jnp.signbit(p32) & ~jnp.signbit(t32)  # -0 -> +0 needs +0.
    zero = jnp.where(plus_zero, jnp.float32(0.0), jnp.float32(-0.0))
    return jnp.where(diff == 0, zero, diff)


def mixed_precision(
    inner: optax.GradientTransformation,
    policy: Any = "mixed_bfloat16",
    *,
    loss_scale: LossScale | None = None,
    stall_after: int | None = 10,
    pin_grad_layout: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with fp32 master weights, loss scaling and skipping of non-finite steps.

    Args:
      inner: any optax transform. It runs on the fp32 master params and fp32 unscaled grads.
      policy: anything :func:`jaxamp.get_policy` accepts.
      loss_scale: the initial loss-scale state. Default: ``DynamicLossScale()`` when the
        compute dtype is float16, else ``NoOpLossScale()``.
      stall_after: the number of consecutive non-finite steps at the minimum loss scale after
        which the state reports ``stalled`` (``None``: never). The updates are skipped either
        way; ``stalled`` tells a training loop that loss scaling cannot fix the overflow (a
        nan in the data, a diverged model) and that it should stop. A fixed scale (static or
        none) is always at its minimum; a dynamic one once it has backed off to ``min_scale``.
      pin_grad_layout: pin traced gradients of rank >= 2 to row-major before the finite
        check and the skip. ``None`` (default): only on XLA:CPU with a single device, where it
        was measured to save two passes over the gradients; ``True``/``False`` force it on or
        off. It changes no update, but XLA's partitioner all-gathers a gradient sharded over
        a device mesh to pin it, which is why the default leaves several devices alone.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``init(params)`` copies the params into the
      master (in ``param_dtype``). ``update(scaled_grads, state, params, **extra)`` expects the
      gradient of ``scale_loss(loss, state)`` with respect to the working params, and forwards
      ``extra`` to ``inner``.

    >>> import jax, jax.numpy as jnp, optax
    >>> tx = mixed_precision(optax.sgd(0.25), "mixed_bfloat16")
    >>> master = {"w": jnp.array([1.0, 2.0])}
    >>> state = tx.init(master)
    >>> params = get_policy("mixed_bfloat16").cast_params_to_compute(master)
    >>> grads = jax.grad(lambda p: scale_loss(jnp.sum(p["w"] ** 2), state))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["w"].dtype, params["w"].tolist(), get_master_params(state)["w"].tolist()
    (dtype(bfloat16), [0.5, 1.0], [0.5, 1.0])
    """
    policy = get_policy(policy)
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"inner must be an optax.GradientTransformation, got "
                        f"{type(inner).__name__} {inner!r}; pass e.g. optax.adamw(1e-3)")
    if loss_scale is None:
        loss_scale = DynamicLossScale() if policy.compute_dtype == jnp.float16 \
            else NoOpLossScale()
    if not isinstance(loss_scale, NoOpLossScale | StaticLossScale | DynamicLossScale):
        raise TypeError(f"loss_scale must be a NoOpLossScale, StaticLossScale or "
                        f"DynamicLossScale, got {type(loss_scale).__name__} {loss_scale!r}; "
                        "wrap a number: jaxamp.StaticLossScale(2.0**15), or use "
                        "jaxamp.DynamicLossScale()")
    if stall_after is not None and (isinstance(stall_after, bool)
                                    or not isinstance(stall_after, int) or stall_after < 1):
        raise ValueError(f"stall_after must be an int >= 1 or None, got {stall_after!r}; it "
                         "counts consecutive non-finite steps at the minimum loss scale "
                         "(default 10, None never reports a stall)")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # A copy even where the dtype already matches: the master must never share a buffer
        # with the working params, or donating the train state would donate it twice.
        master = jax.tree.map(lambda x: jnp.array(x, copy=True) if hasattr(x, "dtype") else x,
                              policy.cast_to_param(params))
        return MixedPrecisionState(
            master_params=master,
            inner_state=inner.init(master),
            # Fresh buffers too: every init must survive another state's donation.
            loss_scale=jax.tree.map(lambda x: jnp.array(x, copy=True), loss_scale),
            applied_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            grads_finite=jnp.array(True),
            grad_norm=jnp.zeros((), jnp.float32),
            nonfinite_leaves=jnp.zeros((), jnp.int32),
            first_nonfinite_leaf=jnp.full((), -1, jnp.int32),
            skips_at_min_scale=jnp.zeros((), jnp.int32),
            stalled=jnp.array(False),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("mixed_precision.update needs params (the working params) to "
                             "compute updates; call tx.update(grads, state, params)")
        _check_same_structure(updates, state.master_params)
        scale = state.loss_scale
        if _pins_layout(pin_grad_layout):
            updates = _row_major_grads(updates)
        # 3 first: one reduction over the still-scaled grads gives the finite check, the norm
        # and the count of non-finite leaves. It reads each gradient once, in its own dtype.
        finite, norm, nonfinite, first_bad = grad_stats(updates, scale.loss_scale)

        # Leaves whose working dtype is the master dtype get their update from inside the cond
        # (and the master is stored as m + update); the others get the difference to the cast
        # master. Known at trace time, so the cond returns only the updates it must.
        work_dtypes = policy.param_compute_dtypes(state.master_params)
        same = jax.tree.map(lambda p, d, m: p.dtype == d == m.dtype,
                            params, work_dtypes, state.master_params)

        def apply(master, inner_state, grads):
            # 1-2. fp32, unscaled with the scale used for this step (pre-adjust).
            grads = scale.unscale(grads)
            # 4. The inner transform on the fp32 master.
            inner_updates, new_inner = inner.update(grads, inner_state, master, **extra_args)
            new_master = optax.apply_updates(master, inner_updates)
            # Same-dtype leaves: return the exact difference d and store m + d, the very add
            # the caller's apply_updates runs. (Returning the inner update itself is not
            # enough: XLA may fuse the optimizer's last multiply into m + u as an FMA.)
            kept = jax.tree.map(lambda n, m, k: _working_update(n, m) if k else None,
                                new_master, master, same)
            new_master = jax.tree.map(lambda n, m, d: n if d is None else m + d,
                                      new_master, master, kept, is_leaf=lambda x: x is None)
            return new_master, _like(new_inner, inner_state), kept

        def skip(master, inner_state, grads):
            del grads
            # -0.0 is the additive identity: p + (-0.0) == p bit for bit, signed zeros too.
            kept = jax.tree.map(lambda m, k: jnp.full_like(m, -0.0) if k else None,
                                master, same)
            return master, inner_state, kept

        # A skip leaves master and inner state untouched. lax.cond (rather than a select per
        # leaf) lets XLA update donated buffers in place and never runs the optimizer on a
        # skipped step.
        master, inner_state, kept = lax.cond(
            finite, apply, skip, state.master_params, state.inner_state, updates)
        # 5. The loss scale. A skip at the minimum scale (the scale used for this step could
        # not back off) extends the run that `stalled` watches; any other step ends it.
        new_scale = scale.adjust(finite)
        at_min = ~finite & scale.at_min_scale()
        skips_at_min = jnp.where(at_min, _saturating_increment(state.skips_at_min_scale, at_min),
                                 0).astype(jnp.int32)
        stalled = jnp.array(False) if stall_after is None else skips_at_min >= stall_after
        # 6. Updates that land the working params on cast(master).
        targets = policy.cast_params_to_compute(master)
        new_updates = jax.tree.map(
            lambda k, t, p: _working_update(t, p) if k is None else k,
            kept, targets, params, is_leaf=lambda x: x is None)
        new_state = MixedPrecisionState(
            master_params=master,
            inner_state=inner_state,
            loss_scale=new_scale,
            applied_steps=_saturating_increment(state.applied_steps, finite),
            skipped_steps=_saturating_increment(state.skipped_steps, ~finite),
            grads_finite=finite,
            grad_norm=norm.astype(jnp.float32),
            nonfinite_leaves=nonfinite,
            first_nonfinite_leaf=first_bad,
            skips_at_min_scale=skips_at_min,
            stalled=stalled,
        )
        return new_updates, new_state

    update_fn.jaxamp_policy = policy  # type: ignore[attr-defined]  # read by TrainState.create
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_same_structure(grads: Any, master: Any) -> None:
    g, m = jax.tree.structure(grads), jax.tree.structure(master)
    if g != m:  # type: ignore[operator]
        raise ValueError(
            "the gradient tree does not match the params tree given to init: grads have "
            f"structure {g}, params have {m}. Differentiate the loss with respect to the same "
            "params the optimizer was initialised with.")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(master), strict=True):
        if hasattr(x, "shape") and hasattr(y, "shape") and tuple(x.shape) != tuple(y.shape):
            raise ValueError(
                f"the gradient of {tree_path_str(path)!r} has shape {tuple(x.shape)} but the "
                f"param given to init has shape {tuple(y.shape)}; differentiate the loss with "
                "respect to the same params the optimizer was initialised with.")


def find_state(opt_state: Any) -> MixedPrecisionState:
    """Returns the :class:`MixedPrecisionState` inside ``opt_state`` (at any depth).

    Raises ``ValueError`` when there is none, or more than one.

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(optax.identity(), mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))
    >>> int(find_state(tx.init({"w": jnp.ones(2)})).skipped_steps)
    0
    """
    found = [s for s in jax.tree.leaves(opt_state,
                                        is_leaf=lambda x: isinstance(x, MixedPrecisionState))
             if isinstance(s, MixedPrecisionState)]
    if len(found) != 1:
        raise ValueError(f"expected exactly one MixedPrecisionState in the optimizer state, "
                         f"found {len(found)}; build the optimizer with "
                         "jaxamp.mixed_precision(inner, policy)")
    return found[0]


def get_loss_scale(opt_state: Any) -> LossScale:
    """The loss-scale state held in ``opt_state`` (``.loss_scale`` is the fp32 scale).

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> float(get_loss_scale(state).loss_scale)
    65536.0
    """
    return find_state(opt_state).loss_scale


def get_master_params(opt_state: Any) -> Any:
    """The fp32 master params held in ``opt_state``.

    >>> import jax.numpy as jnp, optax
    >>> tx = mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    >>> get_master_params(tx.init({"w": jnp.ones(2, jnp.bfloat16)}))["w"].dtype
    dtype('float32')
    """
    return find_state(opt_state).master_params


def working_params(opt_state: Any, policy: Any) -> Any:
    """The working params implied by ``opt_state``: the master cast to each working dtype.

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> working_params(state, "mixed_float16")["w"].dtype
    dtype('float16')
    """
    return get_policy(policy).cast_params_to_compute(get_master_params(opt_state))


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Returns ``loss`` in fp32 multiplied by the current loss scale held in ``opt_state``.

    Differentiate this (not the raw loss) and hand the gradients to ``tx.update``.
    ``opt_state`` may be the :class:`MixedPrecisionState` itself or any tree containing it,
    such as flax's ``TrainState.opt_state``.

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> float(scale_loss(jnp.float16(0.5), state))
    32768.0
    """
    loss = jnp.asarray(loss)
    if loss.ndim != 0:
        raise ValueError(f"the loss must be a scalar, got shape {loss.shape}; reduce it "
                         "(for example jnp.mean) before scaling")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"the loss must be floating, got dtype {loss.dtype}: an integer or "
                        "bool loss has no gradient; compute it from the model's floating "
                        "outputs, in float32")
    return get_loss_scale(opt_state).scale(loss.astype(jnp.float32))
