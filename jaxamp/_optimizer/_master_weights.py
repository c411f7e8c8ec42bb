"""FP32 master weights in the optax state: :func:`mixed_precision` and its state.

``mixed_precision(inner, policy, loss_scale=...)`` wraps any optax transform. Its state holds
the master params (in ``policy.param_dtype``), the inner optimizer's state, the loss-scale
state, counters and the policy itself (static data, so that any optax wrapper keeps it).
``update(scaled_grads, state, params)``:

1. casts the grads to fp32 and unscales them with the scale used for this step;
2. checks that they are all finite (and the loss, when ``update`` is given ``value=loss``);
3. runs ``inner`` on the fp32 value of each param, so clipping, weight decay and schedules see
   true fp32 gradients;
4. adjusts the loss scale;
5. returns updates such that ``optax.apply_updates(params, updates)`` gives each param's new
   value in its working dtype.

Where each param's fp32 value lives is ``master=``. ``"float32"`` (the default) keeps an fp32
master copy of every half-precision param; ``"kahan"`` keeps only a 16-bit compensation
(the value is ``param + compensation``, exact for bf16); ``"stochastic"`` and ``"none"`` keep
nothing and round the new fp32 value to the param's dtype, stochastically or to the
nearest. A param that works in ``param_dtype`` (every param under a ``float32`` policy) is its
own master under every option. ``moments_dtype=`` stores the inner optimizer's moments in
bf16 (rounded stochastically) or in block-wise 8-bit codes, and computes with them in fp32.

A non-finite step returns zero updates (``-0.0``, so that even signed zeros are kept) and leaves
the master params, the compensation, the inner state (its step count included) and the rounding
key bit-identical. How the step is skipped is ``skip=``: ``"cond"`` branches with ``lax.cond``
(the optimizer does not run on a skipped step), ``"select"`` runs it on every step and keeps the
old value of each leaf with ``jnp.where``. Given the same gradients, both skip the same steps,
with the same bits on a skipped step and the same loss scale and counters on every step. An
applied step is the same math in two different XLA programs, which may fuse and round it
differently: equal to within rounding (a float32 ulp here and there), not bit for bit.

A non-finite update is never applied, however many come in a row. When ``stall_after``
consecutive steps are non-finite at the minimum loss scale (where backing off cannot help), the
state reports ``stalled``, so that a training loop can stop and say why.

The transform must see the gradients first and give the final updates:
:func:`jaxamp.state.find_state` refuses a state where another transform wraps it (``optax.chain``
with other members, ``optax.MultiSteps``, ...) and says what to write instead.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from typing import Any
from typing import cast

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import DTypeLike

from jaxamp._optimizer._gradients import GradStats
from jaxamp._optimizer._gradients import grad_stats
from jaxamp._optimizer._moments import Moments
from jaxamp._optimizer._moments import parse_moments
from jaxamp._optimizer._moments import stored_moments
from jaxamp._optimizer._moments import warn_half_second_moments
from jaxamp._optimizer._state import Health
from jaxamp._optimizer._state import Master
from jaxamp._optimizer._state import MixedPrecisionState
from jaxamp._optimizer._state import as_transformation
from jaxamp._optimizer._state import carried_storage
from jaxamp._optimizer._state import check_same_structure
from jaxamp._optimizer._state import find_state
from jaxamp._optimizer._storage import MASTERS
from jaxamp._optimizer._storage import Storage
from jaxamp._precision._loss_scale import DynamicLossScale
from jaxamp._precision._loss_scale import LossScale
from jaxamp._precision._loss_scale import NoOpLossScale
from jaxamp._precision._loss_scale import StaticLossScale
from jaxamp._precision._policy import Policy
from jaxamp._precision._policy import get_policy
from jaxamp._tree import INT32_MAX
from jaxamp._tree import select
from jaxamp._tree import tree_path_str

__all__ = ["MASTERS", "apply_updates", "mixed_precision", "skip_or_apply", "wrap_plain"]


def _saturating_increment(count: jax.Array, when: jax.Array) -> jax.Array:
    return (count + (when & (count < INT32_MAX)).astype(jnp.int32)).astype(jnp.int32)


def _step_key(state: MixedPrecisionState) -> Any:
    """This step's rounding key: the state's key folded with the count of applied steps (so a
    skipped step leaves the key, and the next applied step draws what it would have)."""
    if state.master.rounding_key is None:
        return None
    key = jax.random.wrap_key_data(state.master.rounding_key)
    return jax.random.fold_in(key, state.health.applied_steps)


# --------------------------------------------------------------------------------------------
# The update, in pieces
# --------------------------------------------------------------------------------------------

def _check_working_dtypes(params: list, paths: list, work_dtypes: tuple, policy: Policy) -> None:
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


def _apply(inner, extra_args, storage: Storage, scale, master, comp, inner_state, params,
           grads, key):
    """The finite branch: unscale, run ``inner`` on each param's fp32 value, store the new
    values (master, compensation or rounded param); with ``storage.rounds_moments``, ``inner``
    is :func:`stored_moments` in bf16, which takes its key as an extra argument."""
    grads = scale.unscale(grads)  # fp32, with the scale used for this step (pre-adjust)
    view = storage.view(params, master, comp)
    # In each value's dtype: fp32, but for a param that is its own master in a half
    # param_dtype (a pure half policy), whose optimizer state is in that dtype too.
    grads = jax.tree.map(lambda g, v: g.astype(v.dtype), grads, view)
    param_key = moment_key = None
    if key is not None:
        param_key, moment_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    if storage.rounds_moments:
        extra_args = {**extra_args, "rounding_key": moment_key}
    inner_updates, new_inner = inner.update(grads, inner_state, view, **extra_args)
    new_view = optax.apply_updates(view, inner_updates)
    # The leaves without a master return their new param; the update handed out is the exact
    # difference to it (the inner update itself is not enough: XLA may fuse the optimizer's
    # last multiply into p + u as an FMA).
    master, comp, targets = storage.split(new_view, params, param_key)
    return master, comp, new_inner, targets


def _skip(storage: Storage, master, comp, inner_state, params, grads, key):
    """The non-finite branch: everything stays."""
    del grads, key
    master, comp, targets = storage.skip(params, master, comp)
    return master, comp, inner_state, targets


_SKIPS = ("auto", "cond", "select")


def _resolve_skip(skip: str) -> str:
    """``"auto"`` is ``"cond"`` on every backend. On XLA:GPU a ``lax.cond`` may cost a sync of
    the predicate to the host on every step; ``python -m benchmarks gpu`` times both, and its
    first run on a GPU is what will decide whether ``auto`` becomes ``"select"`` there."""
    return "cond" if skip == "auto" else skip


def skip_or_apply(skip: str, finite: jax.Array, apply, skip_fn, *operands):
    """``(master, compensation, inner_state, targets)`` of the applied step if ``finite``, else
    of the skip."""
    if skip == "cond":
        return lax.cond(finite, apply, skip_fn, *operands)
    return select(finite, apply(*operands), skip_fn(*operands))


def _stall_state(state: MixedPrecisionState, finite: jax.Array, stall_after: int | None):
    """A skip at the minimum scale (the scale used for this step could not back off) extends
    the run that ``stalled`` watches; any other step ends it."""
    at_min = ~finite & state.loss_scale.at_min_scale()
    skips = jnp.where(at_min, _saturating_increment(state.health.skips_at_min_scale, at_min),
                      0).astype(jnp.int32)
    stalled = jnp.array(False) if stall_after is None else skips >= stall_after
    return skips, stalled


def _new_state(state: MixedPrecisionState, master, comp, inner_state, stats: GradStats,
               stall_after: int | None) -> MixedPrecisionState:
    finite = stats.finite
    skips_at_min, stalled = _stall_state(state, finite, stall_after)
    health = Health(
        applied_steps=_saturating_increment(state.health.applied_steps, finite),
        skipped_steps=_saturating_increment(state.health.skipped_steps, ~finite),
        grads_finite=finite,
        grad_norm=stats.norm.astype(jnp.float32),
        nonfinite_leaves=stats.nonfinite_leaves,
        first_nonfinite_leaf=stats.first_nonfinite_leaf,
        skips_at_min_scale=skips_at_min,
        stalled=stalled,
    )
    return state._replace(master=state.master._replace(params=master, compensation=comp),
                          inner_state=inner_state, loss_scale=state.loss_scale.adjust(finite),
                          health=health)


def _check_state_matches(storage: Storage, state: MixedPrecisionState, params: Any) -> None:
    """The state must hold what this transform's storage reads: the state of another
    ``master=`` option (or of other params) would be read wrongly."""
    paths = [tree_path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    mismatch = storage.mismatch(paths, state.master.params, state.master.compensation)
    if mismatch is not None:
        raise ValueError(
            f"the optimizer state {mismatch}, which mixed_precision(..., master="
            f"{storage.option!r}) under policy {state.policy} does not expect: the state was "
            "built by another master= option or for other params. Build the state with the "
            "same transform that updates it (tx.init).")
    if storage.needs_key and state.master.rounding_key is None:
        raise ValueError(
            f"mixed_precision(..., master={storage.option!r}, moments_dtype={storage.moments})"
            " rounds stochastically but the optimizer state holds no rounding key: it was "
            "built by another transform. Build the state with the same transform (tx.init).")
    if state.storage is not None and state.storage != storage:
        raise ValueError(
            f"the optimizer state was built by mixed_precision(..., master="
            f"{state.storage.option!r}) for params with other working dtypes or another "
            f"master= option than this transform's (master={storage.option!r}, policy "
            f"{state.policy}). Build the state with the same transform that updates it "
            "(tx.init).")


def _storage_for(state: MixedPrecisionState, policy: Policy, params: Any, option: str,
                 moments: Moments | None) -> Storage:
    """The storage the state carries (static: fixed by ``tx.init``), once this transform's
    options are the ones it was built with. It is built afresh only for a state that carries
    none, or to say what differs (the state of another transform would be read wrongly)."""
    carried = state.storage
    if (carried is not None and carried.option == option and carried.moments == moments
            and state.policy == policy):
        return carried
    storage = Storage.build(policy, params, option, moments)
    _check_state_matches(storage, state, params)
    return storage


@dataclasses.dataclass(frozen=True, eq=False)
class _MixedPrecision:
    """The transform :func:`mixed_precision` builds: its options, and the optax protocol's
    ``init`` and ``update`` as methods (the optax object holds the two bound methods).
    :meth:`apply` is the train step's way: the new working params themselves, not updates."""

    inner: Any
    policy: Policy
    loss_scale: LossScale
    stall_after: int | None
    skip: str
    master: str
    moments: Moments | None
    seed: Any
    wraps_plain: bool = False
    """A plain optax transform that :meth:`jaxamp.TrainState.create` wrapped: its moments are
    the caller's choice, so ``init`` does not warn about them."""

    def init(self, params: Any) -> MixedPrecisionState:
        storage = Storage.build(self.policy, params, self.master, self.moments)
        # Fresh buffers: the state must never share one with the working params, or donating
        # the train state would donate it twice (an inner state may keep the params it was
        # built on).
        values = jax.tree.map(lambda x: jnp.array(x, copy=True) if hasattr(x, "dtype") else x,
                              self.policy.cast_to_param(params))
        master, comp = storage.init(values)
        inner_state = self.inner.init(values)
        # stored_moments warns about the moments it leaves; a wrapped plain transform's
        # moments are the caller's choice.
        if self.moments is None and not self.wraps_plain:
            warn_half_second_moments(inner_state)
        return MixedPrecisionState(
            master=Master(master, comp,
                          _rounding_key(self.seed) if storage.needs_key else None),
            inner_state=inner_state,
            # Fresh buffers too: every init must survive another state's donation.
            loss_scale=jax.tree.map(lambda x: jnp.array(x, copy=True), self.loss_scale),
            health=Health.create(),
            policy=self.policy,
            storage=storage,
        )

    def _step(self, updates: Any, state: MixedPrecisionState, params: Any, extra_args: dict):
        """``(storage, master, targets, new state)``: the step's new values, before they are
        turned into updates (:meth:`update`) or into the new params (:meth:`apply`)."""
        if params is None:
            raise ValueError("mixed_precision.update needs params (the working params) to "
                             "compute updates; call tx.update(grads, state, params)")
        check_same_structure(updates, params, what="gradient tree",
                              against="params tree passed to update")
        check_same_structure(params, state.master.params, what="params passed to update")
        paths_and_params = jax.tree_util.tree_flatten_with_path(params)[0]
        storage = _storage_for(state, self.policy, params, self.master, self.moments)
        _check_working_dtypes([p for _, p in paths_and_params],
                              [k for k, _ in paths_and_params], storage.work_dtypes, self.policy)
        # One reduction over the still-scaled grads gives the finite check, the norm and the
        # count of non-finite leaves. It reads each gradient once, in its own dtype.
        stats = grad_stats(updates, state.loss_scale.loss_scale)
        # The loss (optax's ``value``), when given, counts too: a step whose loss is inf or nan
        # is skipped as a non-finite gradient is, though its gradients may be finite (an fp16
        # sum that overflowed where nothing depends on it, a masked row).
        value = extra_args.get("value")
        if value is not None:
            stats = stats._replace(finite=stats.finite & jnp.all(jnp.isfinite(value)))
        # A skip leaves master, compensation and inner state untouched. lax.cond
        # (skip="cond") lets XLA update donated buffers in place and never runs the optimizer
        # on a skipped step; a select per leaf (skip="select") runs it always and keeps the
        # old bits where the grads are not finite.
        master, comp, inner_state, targets = skip_or_apply(
            _resolve_skip(self.skip), stats.finite,
            functools.partial(_apply, self.inner, extra_args, storage, state.loss_scale),
            functools.partial(_skip, storage),
            state.master.params, state.master.compensation, state.inner_state, params, updates,
            _step_key(state))
        return storage, master, targets, _new_state(state, master, comp, inner_state, stats,
                                                    self.stall_after)

    def update(self, updates: Any, state: MixedPrecisionState, params: Any = None,
               **extra_args) -> tuple[Any, MixedPrecisionState]:
        storage, master, targets, new_state = self._step(updates, state, params, extra_args)
        return storage.updates(params, master, targets), new_state

    def apply(self, grads: Any, state: MixedPrecisionState, params: Any,
              **extra_args) -> tuple[Any, MixedPrecisionState]:
        """``(new working params, new state)``: what ``update`` and
        :func:`jaxamp.state.next_working_params` give, taken from the step's new values directly.
        The old params are not read after the skip's branch, so that a skipped step passes them
        through in place (``update``'s exact differences need them, and XLA then copies every param
        a ``lax.cond`` passes through: 2 bytes a bf16 param of ``master="kahan"``)."""
        storage, master, targets, new_state = self._step(grads, state, params, extra_args)
        return storage.next_params(params, master, targets), new_state


def apply_updates(tx: Any, grads: Any, opt_state: Any, params: Any,
                  **extra_args) -> tuple[Any, Any, MixedPrecisionState]:
    """``(new working params, new optimizer state, its mixed-precision state)`` of a step:
    ``tx``'s own :meth:`_MixedPrecision.apply` where ``tx`` is :func:`mixed_precision`
    itself, else its updates applied by :func:`jaxamp.state.next_working_params`
    (``mixed_precision`` inside a chain)."""
    own = getattr(tx.update, "__self__", None)
    if isinstance(own, _MixedPrecision):
        params, state = own.apply(grads, opt_state, params, **extra_args)
        return params, state, state
    updates, opt_state = optax.with_extra_args_support(tx).update(grads, opt_state, params,
                                                                   **extra_args)
    state = find_state(opt_state)
    return (carried_storage(state).next_working(params, updates, state.master.params), opt_state,
            state)


def _rounding_key(seed: Any) -> jax.Array:
    """The raw uint32 data of the rounding key (raw, so that any checkpointer stores it)."""
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return jnp.array(jax.random.key_data(key), copy=True)


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


def _check_storage(master: Any, moments_dtype: Any, seed: Any) -> Moments | None:
    """Checks ``master``, ``moments_dtype`` and ``seed``; returns how the moments are stored
    (None: as the inner optimizer builds them)."""
    if not isinstance(master, str) or master not in MASTERS:
        raise ValueError(
            f"master must be one of {', '.join(map(repr, MASTERS))}, got {master!r}: "
            "'float32' keeps an fp32 master copy (default), 'kahan' a half-precision "
            "compensation buffer, 'stochastic' rounds the params stochastically, 'none' rounds "
            "them to the nearest (a baseline that loses small updates)")
    moments = parse_moments(moments_dtype)
    is_int = isinstance(seed, int) and not isinstance(seed, bool)
    seed_dtype = getattr(seed, "dtype", None)
    is_key = seed_dtype is not None and (jnp.issubdtype(seed_dtype, jax.dtypes.prng_key)
                                         or seed_dtype == jnp.uint32)
    if not (is_int or is_key):
        raise TypeError(f"seed must be an int or a PRNG key, got {type(seed).__name__} "
                        f"{seed!r}; e.g. seed=0 or seed=jax.random.key(0)")
    return moments


_WARNED_PURE_HALF: set[str] = set()


def _warn_pure_half(policy: Policy) -> None:
    """Warns once per policy that ``"fp16"``, ``"bf16"`` and their like keep the params
    themselves in half precision, with no fp32 master: what a PyTorch user means by "fp16" is
    AMP, ``"mixed_float16"``."""
    half = jnp.dtype(policy.param_dtype)
    if jnp.dtype(half).itemsize >= 4 or str(policy) in _WARNED_PURE_HALF:
        return
    _WARNED_PURE_HALF.add(str(policy))
    mixed = "mixed_float16" if half == jnp.dtype(jnp.float16) else "mixed_bfloat16"
    warnings.warn(
        f"policy {policy.name or policy} ({policy}) keeps the params in {half.name} with no "
        f"fp32 master: updates smaller than half a {half.name} ulp of a weight are lost. "
        f"Mixed precision with an fp32 master, as PyTorch's AMP, is {mixed!r}",
        UserWarning, stacklevel=3)


def mixed_precision(
    inner: optax.GradientTransformation,
    policy: Any = "mixed_bfloat16",
    *,
    loss_scale: LossScale | None = None,
    stall_after: int | None = 10,
    skip: str = "auto",
    master: str = "float32",
    moments_dtype: DTypeLike | str | Mapping[str, DTypeLike | str] | None = None,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with fp32 master weights, loss scaling and skipping of non-finite steps.

    It must be the outermost transform: clipping, schedules, ``MultiSteps`` and the like go
    inside it (``mixed_precision(optax.chain(clip, adam), policy)``), where they see the true
    fp32 gradients. :func:`jaxamp.state.find_state` raises on a state where another transform wraps
    it.

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
      skip: how a non-finite step is skipped. ``"cond"``: a ``lax.cond`` around the optimizer,
        which does not run on a skipped step and lets XLA update donated buffers in place;
        ``"select"``: the optimizer runs on every step and ``jnp.where`` keeps each leaf's
        old value on a skipped one (no branch, so no predicate to bring to the host). Given
        the same gradients, both skip the same steps, leave the master, the inner state and
        the working params bit-identical on a skip, and keep the same loss scale and
        counters. On an applied step they compute the same update, but XLA compiles each
        into its own program and may fuse (and so round) it differently: the results agree
        to within rounding, not bit for bit (on XLA:CPU, a float32 ulp here and there from
        jax 0.12; an ill-conditioned update, such as Adam's for a near-zero second moment,
        magnifies that), and such differences accumulate over the steps of a run.
        ``"auto"`` (default) is ``"cond"`` on every backend for now; the GPU suite of
        ``python -m benchmarks gpu`` times both on a GPU, which will decide.
      master: where the fp32 value of each half-precision param lives between steps.

        - ``"float32"`` (default): an fp32 master copy in the state (4 bytes per param on top
          of the 2 of the bf16 working param).
        - ``"kahan"``: no master. The state holds a 2-byte compensation per param; the
          optimizer works on ``param + compensation`` in fp32, and the new value is split
          back into the param, rounded to the nearest, and what the rounding dropped
          (:func:`jaxamp.rounding.kahan_split`). For bf16 params that is exactly the fp32 word's
          lower 16 bits (``uint16``), so the fp32 value is kept bit for bit and training follows
          ``"float32"``'s. The one difference: a value exactly halfway between two bf16
          values (one in 2**16) moves by one fp32 ulp toward the one the cast picks, so that
          the compensation alone tells which way it was rounded. For fp16 params, the
          compensation is the fp16-rounded remainder (about 22 bits).
        - ``"stochastic"``: no master and no buffer. The new fp32 value is rounded to the
          param's dtype stochastically (:func:`jaxamp.rounding.stochastic_round`), exact in
          expectation, with the state's ``rounding_key`` folded with the step and the leaf
          (the same bits on every device, reproducible on resume).
        - ``"none"``: no master; the new value is rounded to the nearest. An update below half
          an ulp of the param (``2**-9`` of it in bf16) is lost: a baseline, not a choice.

        A param that works in ``param_dtype`` (all of them under a ``float32`` policy) is its
        own master under every option: no copy is kept.
      moments_dtype: how the inner state's moments (its floating arrays of rank >= 1: Adam's
        ``mu`` and ``nu``, any per-parameter buffer) are stored between steps; ``inner``
        always computes on fp32 copies, so ``beta2 = 0.999``, ``1 - beta2`` and the bias
        corrections run in fp32. Scalars (an injected learning rate) keep their dtype.

        - ``None`` (default): the dtypes ``inner`` builds.
        - ``"float32"``: fp32 (an ``mu_dtype`` of bf16 is undone).
        - ``"bfloat16"``: bf16, rounded stochastically (2 bytes each). Rounding the second
          moment to the nearest would ratchet it: at ``beta2 = 0.999`` its per-step decay
          (0.1%) is below half a bf16 ulp, so ``nu`` could only grow.
        - ``"8bit"``: block-wise 8-bit codes, as :func:`jaxamp.quantized_moments` (1 + 4/256
          bytes each; moments of fewer than 4096 values stay fp32).
        - a mapping from the inner state's fields to those formats, the others kept as
          ``inner`` builds them: ``{"mu": "bfloat16"}`` stores Adam's first moment in bf16
          and its second in fp32 (optax's ``mu_dtype`` pattern, 6 bytes for both).
      seed: the seed (an int) or PRNG key of stochastic rounding; used by
        ``master="stochastic"`` and bf16 moments.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``init(params)`` copies the params into the
      master (in ``param_dtype``), or into the compensation (``"kahan"``: the fp32 params'
      remainder after rounding to the working dtype). ``update(scaled_grads, state, params,
      **extra)`` expects the gradient of ``scale_loss(loss, state)`` with respect to the
      working params (each in its working dtype: a ``ValueError`` otherwise), and forwards
      ``extra`` to ``inner``. ``value=loss`` (optax's name for the objective's value, which
      :func:`jaxamp.make_train_step` passes) makes a step whose loss is inf or nan a skipped,
      non-finite step even where its gradients are finite. The updates of half-precision
      params are fp32 (the exact difference to the new value), so ``optax.apply_updates``
      promotes bf16 + fp32; under ``jax.numpy_dtype_promotion("strict")`` take
      :func:`jaxamp.state.next_working_params` instead, as :func:`jaxamp.make_train_step` does.

    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxamp.state import get_master_params, scale_loss
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
    _warn_pure_half(policy)
    return _transform(inner, policy, loss_scale, stall_after, skip, master, moments_dtype, seed)


def wrap_plain(inner: optax.GradientTransformation, policy: Policy):
    """``mixed_precision(inner, policy)`` with its defaults, for a plain optax transform that
    :meth:`jaxamp.TrainState.create` wraps (the policy and the moments were the caller's
    choice: no warning about them)."""
    return _transform(inner, policy, None, 10, "auto", "float32", None, 0, wraps_plain=True)


def _transform(inner, policy: Policy, loss_scale, stall_after, skip, master, moments_dtype,
               seed, *, wraps_plain: bool = False) -> optax.GradientTransformationExtraArgs:
    if loss_scale is None:
        loss_scale = DynamicLossScale() if policy.needs_loss_scaling else NoOpLossScale()
    inner = as_transformation(inner)
    _check_arguments(inner, loss_scale, stall_after, skip)
    moments = _check_storage(master, moments_dtype, seed)
    inner = optax.with_extra_args_support(inner)
    if moments is not None:
        inner = stored_moments(inner, moments)
    # optax types a state as an ``ArrayTree`` (arrays, and iterables and mappings of them),
    # which leaves no room for a pytree node such as the loss scale or the static policy, and
    # its protocols are not generic in the state's type. These two implement the protocols
    # (they take and return a pytree state), so they are cast to them.
    transform = _MixedPrecision(inner, policy, loss_scale, stall_after, skip, master, moments,
                                seed, wraps_plain)
    init = cast(optax.TransformInitFn, transform.init)
    update = cast(optax.TransformUpdateExtraArgsFn, transform.update)
    return optax.GradientTransformationExtraArgs(init, update)


