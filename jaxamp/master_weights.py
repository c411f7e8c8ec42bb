"""FP32 master weights in the optax state: :func:`mixed_precision` and its state.

``mixed_precision(inner, policy, loss_scale=...)`` wraps any optax transform. Its state holds
the master params (in ``policy.param_dtype``), the inner optimizer's state, the loss-scale
state, counters and the policy itself (static data, so that any optax wrapper keeps it).
``update(scaled_grads, state, params)``:

1. casts the grads to fp32 and unscales them with the scale used for this step;
2. checks that they are all finite;
3. runs ``inner`` on the fp32 master params, so clipping, weight decay and schedules see
   true fp32 gradients;
4. adjusts the loss scale;
5. returns updates such that ``optax.apply_updates(params, updates)`` gives the new master
   cast to each param's working dtype.

A non-finite step returns zero updates (``-0.0``, so that even signed zeros are kept) and leaves
the master params and the inner state, including its step count, bit-identical. How the step is
skipped is ``skip=``: ``"cond"`` branches with ``lax.cond`` (the optimizer does not run on a
skipped step), ``"select"`` runs it on every step and keeps the old value of each leaf with
``jnp.where``; both give the same bits.

A non-finite update is never applied, however many come in a row. When ``stall_after``
consecutive steps are non-finite at the minimum loss scale (where backing off cannot help), the
state reports ``stalled``, so that a training loop can stop and say why.

The transform must see the gradients first and give the final updates: :func:`find_state`
refuses a state where another transform wraps it (``optax.chain`` with other members,
``optax.MultiSteps``, ...) and says what to write instead.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.experimental.layout import Layout
from jax.experimental.layout import with_layout_constraint

from jaxamp._loss import check_loss
from jaxamp._tree import cast_like
from jaxamp._tree import find_with_path
from jaxamp._tree import is_floating_array
from jaxamp._tree import parents_along
from jaxamp._tree import select
from jaxamp._tree import tree_path_str
from jaxamp.gradients import GradStats
from jaxamp.gradients import grad_stats
from jaxamp.loss_scale import DynamicLossScale
from jaxamp.loss_scale import LossScale
from jaxamp.loss_scale import NoOpLossScale
from jaxamp.loss_scale import StaticLossScale
from jaxamp.policy import Policy
from jaxamp.policy import get_policy

__all__ = [
    "MixedPrecisionState",
    "find_state",
    "get_loss_scale",
    "get_master_params",
    "mixed_precision",
    "policy_of",
    "scale_loss",
    "working_params",
]

_INT32_MAX = 2**31 - 1


class MixedPrecisionState(NamedTuple):
    """The state of :func:`mixed_precision`. Every leaf is an array.

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.adam(1e-3), "mixed_bfloat16").init({"w": jnp.ones(2)})
    >>> int(state.applied_steps), int(state.skipped_steps), state.master_params["w"].dtype
    (0, 0, dtype('float32'))
    >>> str(state.policy)
    'p=f32,c=bf16,o=f32'

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
        -1; :func:`jaxamp.nonfinite_leaf_path` gives its path.
      skips_at_min_scale: int32 count of consecutive non-finite steps taken at the minimum loss
        scale (see ``LossScale.at_min_scale``); 0 after a finite step (saturates).
      stalled: bool, ``skips_at_min_scale >= stall_after``: the gradients keep overflowing
        where the loss scale cannot back off any further, so loss scaling cannot fix them.
      policy: the :class:`~jaxamp.Policy` the transform was built with. Static: a pytree node
        without leaves, part of the treedef, so it survives jit, pmap and every optax wrapper.
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
    policy: Policy = Policy()


def _saturating_increment(count: jax.Array, when: jax.Array) -> jax.Array:
    return (count + (when & (count < _INT32_MAX)).astype(jnp.int32)).astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# The gradient layout on XLA:CPU
# --------------------------------------------------------------------------------------------

def _pins_layout(pin_grad_layout: bool | None) -> bool:
    if pin_grad_layout is not None:
        return bool(pin_grad_layout)
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def _row_major_grads(grads: Any) -> Any:
    """Pins traced gradients of rank >= 2 to the default row-major layout.

    XLA:CPU emits a weight gradient ``x.T @ dy`` as the product ``dy.T @ x`` read through a
    column-major bitcast. Elementwise fusions read that layout for free, but the finite check
    (a reduction) and the ``lax.cond`` boundary of the skip each insert a transposing copy of
    every such gradient: two extra passes over the grads. Pinning the layout here moves the
    transpose into the fusion that produces the gradient (its cast to the param dtype), so the
    step reads the grads once. On the encoder of ``python -m benchmarks overhead`` this takes
    the bytes accessed from 1.022x to 1.012x the bare bf16 step. The constraint changes no
    update; only the reported grad norm, an fp32 sum whose order follows the layout, may
    differ in its last bit. XLA's partitioner all-gathers a gradient sharded over a mesh to
    pin it, so by default (``pin_grad_layout=None``) it is applied only on a single CPU device;
    on other backends (TPU's tiled layouts in particular) the grads pass through untouched.
    """
    def pin(g):
        if isinstance(g, jax.core.Tracer) and getattr(g, "ndim", 0) >= 2:
            return with_layout_constraint(g, Layout(tuple(range(g.ndim))))
        return g
    return jax.tree.map(pin, grads)


# --------------------------------------------------------------------------------------------
# The update, in pieces
# --------------------------------------------------------------------------------------------

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


def _same_dtype(params: list, masters: list, work_dtypes: list) -> list[bool]:
    """Per leaf: does it work in its master dtype? Such leaves get their update from the branch
    (and the master is stored as ``m + update``); the others get the difference to the cast
    master. Known at trace time, so the branches return only the updates they must."""
    return [d is not None and p.dtype == d == m.dtype
            for p, m, d in zip(params, masters, work_dtypes, strict=True)]


def _check_working_dtypes(params: list, paths: list, work_dtypes: list, policy: Policy) -> None:
    """The params handed to ``update`` must be the working params: a float32 param under a
    bf16 policy would land on the rounded master and keep computing in float32."""
    for p, path, d in zip(params, paths, work_dtypes, strict=True):
        if d is not None and hasattr(p, "dtype") and jnp.dtype(p.dtype) != d:
            raise ValueError(
                f"param {tree_path_str(path)!r} is {jnp.dtype(p.dtype).name} but policy "
                f"{policy} works in {jnp.dtype(d).name}: the model would keep computing in "
                f"{jnp.dtype(p.dtype).name}. Pass the working params to tx.update: "
                "jaxamp.TrainState.create(params=..., tx=tx) casts them, or cast them "
                "yourself with jaxamp.get_policy(policy).cast_params_to_compute(params) "
                "(for an NNX model, after building nnx.Optimizer, so that the master starts "
                "from the fp32 values: nnx.update(model, policy.cast_params_to_compute("
                "nnx.state(model, nnx.Param))))")


def _apply(inner, extra_args, same, scale, master, inner_state, grads):
    """The finite branch: unscale, run ``inner`` on the master, keep dtypes."""
    grads = scale.unscale(grads)  # fp32, with the scale used for this step (pre-adjust)
    inner_updates, new_inner = inner.update(grads, inner_state, master, **extra_args)
    new_master = optax.apply_updates(master, inner_updates)
    # Same-dtype leaves: return the exact difference d and store m + d, the very add the
    # caller's apply_updates runs. (Returning the inner update itself is not enough: XLA may
    # fuse the optimizer's last multiply into m + u as an FMA.)
    new_leaves, treedef = jax.tree.flatten(new_master)
    old_leaves = jax.tree.leaves(master)
    kept = [_working_update(n, m) for n, m, k in zip(new_leaves, old_leaves, same, strict=True)
            if k]
    kept_iter = iter(kept)
    new_leaves = [m + next(kept_iter) if k else n for n, m, k in
                  zip(new_leaves, old_leaves, same, strict=True)]
    return jax.tree.unflatten(treedef, new_leaves), cast_like(new_inner, inner_state), kept


def _skip(same, master, inner_state, grads):
    """The non-finite branch: everything stays; -0.0 is the additive identity, so
    ``p + (-0.0) == p`` bit for bit, signed zeros too."""
    del grads
    kept = [jnp.full_like(m, -0.0) for m, k in zip(jax.tree.leaves(master), same, strict=True)
            if k]
    return master, inner_state, kept


_SKIPS = ("auto", "cond", "select")


def _resolve_skip(skip: str) -> str:
    """``"auto"`` is ``"cond"`` on every backend. On XLA:GPU a ``lax.cond`` may cost a sync of
    the predicate to the host on every step; ``python -m benchmarks gpu`` times both, and its
    first run on a GPU is what will decide whether ``auto`` becomes ``"select"`` there."""
    return "cond" if skip == "auto" else skip


def _skip_or_apply(skip: str, finite: jax.Array, apply, skip_fn, master, inner_state, grads):
    """``(master, inner_state, kept)`` of the applied step if ``finite``, else of the skip."""
    if skip == "cond":
        return lax.cond(finite, apply, skip_fn, master, inner_state, grads)
    return select(finite, apply(master, inner_state, grads), skip_fn(master, inner_state, grads))


def _stall_state(state: MixedPrecisionState, finite: jax.Array, stall_after: int | None):
    """A skip at the minimum scale (the scale used for this step could not back off) extends
    the run that ``stalled`` watches; any other step ends it."""
    at_min = ~finite & state.loss_scale.at_min_scale()
    skips = jnp.where(at_min, _saturating_increment(state.skips_at_min_scale, at_min),
                      0).astype(jnp.int32)
    stalled = jnp.array(False) if stall_after is None else skips >= stall_after
    return skips, stalled


def _working_updates(policy: Policy, master: Any, params: Any, same: list[bool],
                     kept: list) -> Any:
    """Updates that land the working params on ``cast(master)``: the exact difference for
    leaves that work in another dtype, the branch's update for the others."""
    param_leaves, treedef = jax.tree.flatten(params)
    targets = jax.tree.leaves(policy.cast_params_to_compute(master))
    kept_iter = iter(kept)
    updates = []
    for t, p, k in zip(targets, param_leaves, same, strict=True):
        if k:
            updates.append(next(kept_iter))
        elif is_floating_array(p):
            updates.append(_working_update(t, p))
        else:
            updates.append(jnp.zeros_like(p))
    return jax.tree.unflatten(treedef, updates)


def _new_state(state: MixedPrecisionState, master, inner_state, stats: GradStats,
               stall_after: int | None) -> MixedPrecisionState:
    finite = stats.finite
    skips_at_min, stalled = _stall_state(state, finite, stall_after)
    return state._replace(
        master_params=master,
        inner_state=inner_state,
        loss_scale=state.loss_scale.adjust(finite),
        applied_steps=_saturating_increment(state.applied_steps, finite),
        skipped_steps=_saturating_increment(state.skipped_steps, ~finite),
        grads_finite=finite,
        grad_norm=stats.norm.astype(jnp.float32),
        nonfinite_leaves=stats.nonfinite_leaves,
        first_nonfinite_leaf=stats.first_nonfinite_leaf,
        skips_at_min_scale=skips_at_min,
        stalled=stalled,
    )


def _update(inner, policy: Policy, stall_after: int | None, pin_grad_layout: bool | None,
            skip: str, updates, state: MixedPrecisionState, params=None, **extra_args):
    if params is None:
        raise ValueError("mixed_precision.update needs params (the working params) to "
                         "compute updates; call tx.update(grads, state, params)")
    _check_same_structure(updates, state.master_params)
    _check_same_structure(params, state.master_params, what="params passed to update")
    paths_and_params = jax.tree_util.tree_flatten_with_path(params)[0]
    param_leaves = [p for _, p in paths_and_params]
    work_dtypes = policy.working_dtypes(params)
    _check_working_dtypes(param_leaves, [k for k, _ in paths_and_params], work_dtypes, policy)
    if _pins_layout(pin_grad_layout):
        updates = _row_major_grads(updates)
    # One reduction over the still-scaled grads gives the finite check, the norm and the count
    # of non-finite leaves. It reads each gradient once, in its own dtype.
    stats = grad_stats(updates, state.loss_scale.loss_scale)
    same = _same_dtype(param_leaves, jax.tree.leaves(state.master_params), work_dtypes)
    # A skip leaves master and inner state untouched. lax.cond (skip="cond") lets XLA update
    # donated buffers in place and never runs the optimizer on a skipped step; a select per leaf
    # (skip="select") runs it always and keeps the old bits where the grads are not finite.
    master, inner_state, kept = _skip_or_apply(
        _resolve_skip(skip), stats.finite,
        functools.partial(_apply, inner, extra_args, same, state.loss_scale),
        functools.partial(_skip, same),
        state.master_params, state.inner_state, updates)
    new_updates = _working_updates(policy, master, params, same, kept)
    return new_updates, _new_state(state, master, inner_state, stats, stall_after)


def _init(inner, policy: Policy, loss_scale: LossScale, params) -> MixedPrecisionState:
    # A copy even where the dtype already matches: the master must never share a buffer with
    # the working params, or donating the train state would donate it twice.
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
        policy=policy,
    )


def _as_transformation(tx: Any) -> Any:
    """``optax.MultiSteps`` is a class whose transform is ``.gradient_transformation()``."""
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    return tx


def _check_arguments(inner: Any, loss_scale: Any, stall_after: Any, skip: Any) -> None:
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"inner must be an optax.GradientTransformation, got "
                        f"{type(inner).__name__} {inner!r}; pass e.g. optax.adamw(1e-3)")
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
    if not isinstance(skip, str) or skip not in _SKIPS:
        raise ValueError(f"skip must be one of {', '.join(map(repr, _SKIPS))}, got {skip!r}: "
                         "'cond' skips a non-finite step with lax.cond, 'select' runs the "
                         "optimizer and keeps the old values with jnp.where, 'auto' (the "
                         "default) is 'cond' for now")


def mixed_precision(
    inner: optax.GradientTransformation,
    policy: Any = "mixed_bfloat16",
    *,
    loss_scale: LossScale | None = None,
    stall_after: int | None = 10,
    pin_grad_layout: bool | None = None,
    skip: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with fp32 master weights, loss scaling and skipping of non-finite steps.

    It must be the outermost transform: clipping, schedules, ``MultiSteps`` and the like go
    inside it (``mixed_precision(optax.chain(clip, adam), policy)``), where they see the true
    fp32 gradients. :func:`find_state` raises on a state where another transform wraps it.

    Args:
      inner: any optax transform. It runs on the fp32 master params and fp32 unscaled grads.
      policy: anything :func:`jaxamp.get_policy` accepts. The state carries it.
      loss_scale: the initial loss-scale state. Default: ``DynamicLossScale()`` when the
        compute dtype is float16 (:attr:`jaxamp.Policy.needs_loss_scaling`), else
        ``NoOpLossScale()``.
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
      skip: how a non-finite step is skipped. ``"cond"``: a ``lax.cond`` around the optimizer,
        which does not run on a skipped step and lets XLA update donated buffers in place;
        ``"select"``: the optimizer runs on every step and ``jnp.where`` keeps each leaf's
        old value on a skipped one (no branch, so no predicate to bring to the host). Both
        leave the master, the inner state and the working params bit-identical on a skip.
        ``"auto"`` (default) is ``"cond"`` on every backend for now; the GPU suite of
        ``python -m benchmarks gpu`` times both on a GPU, which will decide.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``init(params)`` copies the params into the
      master (in ``param_dtype``). ``update(scaled_grads, state, params, **extra)`` expects the
      gradient of ``scale_loss(loss, state)`` with respect to the working params (each in its
      working dtype: a ``ValueError`` otherwise), and forwards ``extra`` to ``inner``. The
      updates of half-precision params are fp32 (the exact difference to the cast master), so
      ``optax.apply_updates`` promotes bf16 + fp32; under
      ``jax.numpy_dtype_promotion("strict")`` take :func:`working_params` instead, as
      :func:`jaxamp.make_train_step` does.

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
    if loss_scale is None:
        loss_scale = DynamicLossScale() if policy.needs_loss_scaling else NoOpLossScale()
    inner = _as_transformation(inner)
    _check_arguments(inner, loss_scale, stall_after, skip)
    inner = optax.with_extra_args_support(inner)
    return optax.GradientTransformationExtraArgs(
        functools.partial(_init, inner, policy, loss_scale),
        functools.partial(_update, inner, policy, stall_after, pin_grad_layout, skip))


def _check_same_structure(tree: Any, master: Any, what: str = "gradient tree") -> None:
    g, m = jax.tree.structure(tree), jax.tree.structure(master)
    if g != m:  # type: ignore[operator]
        raise ValueError(
            f"the {what} does not match the params tree given to init: it has structure "
            f"{g}, the params have {m}. Differentiate the loss with respect to the same "
            "params the optimizer was initialised with.")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                            jax.tree.leaves(master), strict=True):
        if hasattr(x, "shape") and hasattr(y, "shape") and tuple(x.shape) != tuple(y.shape):
            noun = "gradient" if what == "gradient tree" else "value"
            raise ValueError(
                f"the {noun} of {tree_path_str(path)!r} has shape {tuple(x.shape)} but the "
                f"param given to init has shape {tuple(y.shape)}; differentiate the loss with "
                "respect to the same params the optimizer was initialised with.")


# --------------------------------------------------------------------------------------------
# Finding the state, wherever a harmless wrapper put it
# --------------------------------------------------------------------------------------------

_INSIDE = ("put it inside jaxamp.mixed_precision, where it sees the true fp32 gradients: "
           "mixed_precision(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "
           "policy)")


def _passes_through(node: Any) -> bool:
    """A container that hands the grads to its one member and returns its updates unchanged:
    ``optax.chain`` or ``optax.named_chain`` of the mixed-precision transform alone."""
    return (type(node) in (tuple, list) or isinstance(node, dict)) and len(node) == 1


def _wrapping_error(node: Any) -> ValueError:
    name = type(node).__name__
    if name == "MultiStepsState":
        return ValueError(
            "optax.MultiSteps wraps jaxamp.mixed_precision: it would accumulate half-precision "
            "gradients computed under changing loss scales, and apply them behind the "
            "skip of non-finite steps. Use jaxamp.make_train_step(loss_fn, accum_steps=k), "
            "which sums the micro-batch gradients in fp32 under one scale, or put it inside: "
            "mixed_precision(optax.MultiSteps(optax.adam(1e-3), k), policy)")
    if name == "InjectHyperparamsState" or name == "InjectStatefulHyperparamsState":
        return ValueError(
            "optax.inject_hyperparams wraps jaxamp.mixed_precision; inject the inner "
            "optimizer's hyperparameters instead: mixed_precision(optax.inject_hyperparams("
            "optax.adam)(learning_rate=1e-3), policy)")
    if type(node) in (tuple, list) or isinstance(node, dict):
        chain = "optax.named_chain" if isinstance(node, dict) else "optax.chain"
        return ValueError(
            f"{chain} puts other transforms beside jaxamp.mixed_precision: one before it "
            "sees loss-scaled, half-precision gradients (a clip would clip the scaled norm), "
            f"one after it changes the updates that land the working params on the master; "
            f"{_INSIDE}")
    return ValueError(
        f"a transform whose state is {name} wraps jaxamp.mixed_precision: it would see "
        f"loss-scaled, half-precision gradients or change the updates; {_INSIDE}")


def _locate(opt_state: Any) -> MixedPrecisionState | None:
    found = find_with_path(opt_state, MixedPrecisionState)
    if not found:
        return None
    nested = sum(len(find_with_path(s.inner_state, MixedPrecisionState)) for _, s in found)
    if len(found) + nested > 1:
        raise ValueError(f"expected exactly one MixedPrecisionState in the optimizer state, "
                         f"found {len(found) + nested}; wrap the whole optimizer once: "
                         "jaxamp.mixed_precision(inner, policy)")
    path, state = found[0]
    for node in parents_along(opt_state, path):
        if not _passes_through(node):
            raise _wrapping_error(node)
    return state


def maybe_find_state(opt_state: Any) -> MixedPrecisionState | None:
    """Like :func:`find_state`, but ``None`` for the state of a plain optax transform."""
    return _locate(opt_state)


def find_state(opt_state: Any) -> MixedPrecisionState:
    """Returns the :class:`MixedPrecisionState` inside ``opt_state``.

    ``opt_state`` may be the state itself or the state of a wrapper that passes gradients
    and updates through untouched (an ``optax.chain`` or ``named_chain`` of the transform
    alone, an ``nnx.Optimizer``'s ``opt_state``). Raises ``ValueError`` when there is none,
    more than one, or when another transform wraps it (a clip before it, ``MultiSteps``
    around it): the message says what to write instead.

    >>> import jax.numpy as jnp, optax
    >>> tx = optax.chain(mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))
    >>> int(find_state(tx.init({"w": jnp.ones(2)})).skipped_steps)
    0
    >>> tx = optax.chain(optax.clip(1.0), mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))
    >>> find_state(tx.init({"w": jnp.ones(2)}))
    Traceback (most recent call last):
    ...
    ValueError: optax.chain puts other transforms beside jaxamp.mixed_precision: ...
    """
    state = _locate(opt_state)
    if state is None:
        raise ValueError("expected exactly one MixedPrecisionState in the optimizer state, "
                         "found 0; build the optimizer with jaxamp.mixed_precision(inner, "
                         "policy)")
    return state


def policy_of(tx_or_state: Any, params: Any = None) -> Policy | None:
    """The policy a :func:`mixed_precision` transform carries, else ``None``.

    Takes an optimizer state or a transform, whose ``init`` is traced abstractly (nothing is
    allocated) on ``params``, or on an empty tree by default; pass the params for a transform
    whose init needs them (``optax.masked`` with a mask tree). A wrapping that cannot be
    correct raises, as in :func:`find_state`.

    >>> import optax
    >>> str(policy_of(mixed_precision(optax.sgd(0.1), "mixed_float16")))
    'p=f32,c=f16,o=f32'
    >>> str(policy_of(optax.chain(mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))))
    'p=f32,c=bf16,o=f32'
    >>> policy_of(optax.sgd(0.1)) is None
    True
    """
    tx_or_state = _as_transformation(tx_or_state)
    if isinstance(tx_or_state, optax.GradientTransformation):
        tx_or_state = jax.eval_shape(tx_or_state.init, {} if params is None else params)
    state = _locate(tx_or_state)
    return None if state is None else state.policy


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


def working_params(opt_state: Any, policy: Any = None) -> Any:
    """The working params implied by ``opt_state``: the master cast to each working dtype.

    ``policy`` defaults to the one the state carries.

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> working_params(state)["w"].dtype
    dtype('float16')
    """
    state = find_state(opt_state)
    policy = state.policy if policy is None else get_policy(policy)
    return policy.cast_params_to_compute(state.master_params)


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Returns ``loss`` in fp32 multiplied by the current loss scale held in ``opt_state``.

    Differentiate this (not the raw loss) and hand the gradients to ``tx.update``.
    ``opt_state`` may be the :class:`MixedPrecisionState` itself or any state that
    :func:`find_state` accepts, such as flax's ``TrainState.opt_state``.

    >>> import jax.numpy as jnp, optax
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> float(scale_loss(jnp.float16(0.5), state))
    32768.0
    """
    loss = check_loss(loss, scalar="the loss must be a scalar",
                      floating="the loss must be floating")
    return get_loss_scale(opt_state).scale(loss)
