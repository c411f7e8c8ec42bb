"""The train state and :func:`make_train_step`.

``make_train_step(loss_fn, ...)`` returns a pure ``step(state, batch) -> (state, metrics)``
that the caller wraps in ``jax.jit`` or ``jax.pmap``. Per step:

1. cast the floating leaves of the batch to the compute dtype (under ``autocast``, the batch
   stays as given: the rules decide each op's dtype);
2. take the gradient of ``loss * scale`` with respect to the working params;
3. with ``accum_steps=k``, split the batch into k micro-batches and sum their gradients in fp32
   under ``lax.scan``, all with the same scale;
4. average the gradients over the devices in ``reduce_dtype`` (fp32 by default): with
   ``axis_name``, a ``pmean`` over the ``pmap``/``shard_map`` axis; under ``jax.jit`` with the
   batch on a mesh, each device's gradient is computed inside ``shard_map`` over the data axis
   and reduced with an explicit ``pmean`` (replicated optimizer state) or ``psum_scatter``
   (sharded optimizer state, :func:`jaxamp.parallel.state_sharding`), never by XLA in bf16;
5. let :func:`jaxamp.mixed_precision` unscale, check finiteness (after the reduction, so every
   device decides the same), update the master and adjust the scale;
6. set the working params to their new values (the cast of the new master, or the rounded
   new value without one); on a skipped step, keep the old mutable model state (BatchNorm
   statistics) too;
7. return metrics computed in-graph.

The policy comes from the optimizer state (the :class:`~jaxamp.state.MixedPrecisionState` carries
it), never from an attribute of a function, so any harmless optax wrapper keeps it and a
harmful one is a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from jaxamp import _model_state
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import Interpreter
from jaxamp._jaxpr import is_backward
from jaxamp._jaxpr import run_traced
from jaxamp._jaxpr import walk_levels
from jaxamp._jaxpr import where
from jaxamp._optimizer._gradients import all_finite
from jaxamp._optimizer._master_weights import apply_updates
from jaxamp._optimizer._master_weights import wrap_plain
from jaxamp._optimizer._state import MixedPrecisionState
from jaxamp._optimizer._state import get_master_params
from jaxamp._optimizer._state import maybe_find_state
from jaxamp._optimizer._state import storage_of
from jaxamp._precision._policy import Policy
from jaxamp._precision._policy import get_policy
from jaxamp._step import _data_parallel
from jaxamp._step._objective import Objective
from jaxamp._step._objective import objective_of
from jaxamp._tree import State
from jaxamp._tree import in_made_order
from jaxamp._tree import is_inexact_array
from jaxamp._tree import row_major_grads
from jaxamp._tree import select
from jaxamp._tree import static_field

__all__ = ["TrainState", "TrainStep", "device_gradients", "make_train_step",
           "split_micro_batches", "step_rng"]


def _checked_policy(policy: Any, mp: MixedPrecisionState | None) -> Policy:
    """The policy of a state built on ``mp`` (``None``: a plain optax transform, which
    :meth:`TrainState.create` wraps at ``policy``), checked against an explicit ``policy``."""
    if mp is None:
        policy = get_policy("float32" if policy is None else policy)
        if policy.is_mixed:
            raise ValueError(f"policy {policy} keeps a master copy in {policy.param_dtype} but "
                             "tx is a plain optax transform; wrap it: "
                             "jaxamp.mixed_precision(tx, policy)")
        return policy
    if policy is not None and get_policy(policy) != mp.policy:
        raise ValueError(f"policy {get_policy(policy)} differs from the policy {mp.policy} "
                         "that tx was built with; pass the same policy to both, or omit it here")
    return mp.policy


class TrainState(State, kw_only=True):
    """Everything a step reads and writes, as one pytree (checkpoint it whole).

    Attributes:
      step: int32 count of steps taken (applied and skipped).
      params: the working params, in their compute dtypes.
      opt_state: the optimizer state; with :func:`jaxamp.mixed_precision` it holds the fp32
        master, the inner state, the loss scale, the counters and the policy.
      model_state: mutable model state such as BatchNorm statistics, or ``None``.
      rng: a base PRNG key (folded with ``step`` each step), or ``None``.
      tx: the optimizer (static).

    Its :attr:`policy` is the one its optimizer state carries (stored there only).

    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    >>> state = TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
    >>> int(state.step), float(state.loss_scale), state.master_params["w"].dtype
    (0, 65536.0, dtype('float32'))
    """

    step: jax.Array
    """An int32 scalar: the number of steps taken, applied and skipped."""
    params: Any
    """The working params, each in its working dtype (``compute_dtype`` or an override's)."""
    opt_state: Any
    """The optimizer state; with :func:`jaxamp.mixed_precision` it holds the fp32 master, the
    inner state, the loss scale, the counters and the policy."""
    model_state: Any = None
    """Mutable model state such as BatchNorm statistics or FP8 metadata, or ``None``."""
    rng: Any = None
    """A base PRNG key, folded with ``step`` at each step, or ``None``."""
    tx: optax.GradientTransformation = static_field()
    """The optimizer (static: part of the treedef, not a leaf)."""

    @classmethod
    def create(cls, *, params: Any, tx: optax.GradientTransformation, policy: Any = None,
               model_state: Any = None, rng: Any = None) -> TrainState:
        """Builds the state from params in any precision (the master copy is made by ``tx``).

        The policy is the one the :class:`~jaxamp.state.MixedPrecisionState` in ``tx``'s state
        carries, wherever a harmless wrapper (``optax.chain`` of it alone, a ``named_chain``)
        put it. A plain optax transform is wrapped: ``tx`` becomes
        ``jaxamp.mixed_precision(tx, policy)`` with ``policy`` ``float32`` unless given (a
        policy without a master: ``float32``, ``bfloat16``, ``float16``), so that every step
        takes one path, with its finite check, skip and counters. ``policy``, when given, must
        agree. A wrapping that cannot be correct (a clip outside it, ``optax.MultiSteps``
        around it) raises a ``ValueError`` that says what to write instead.

        >>> import jax.numpy as jnp, optax, jaxamp
        >>> tx = optax.chain(jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))
        >>> s = TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
        >>> s.params["w"].dtype, jaxamp.state.get_master_params(s.opt_state)["w"].dtype
        (dtype(bfloat16), dtype('float32'))
        """
        # Abstractly first: where is the state, and which policy does it carry?
        mp = maybe_find_state(jax.eval_shape(tx.init, params))
        policy = _checked_policy(policy, mp)
        if mp is None:  # one path: a plain optax transform is mixed_precision's, at its policy
            tx = wrap_plain(tx, policy)
        opt_state = tx.init(policy.cast_to_param(params))
        return cls(step=jnp.zeros((), jnp.int32), params=policy.cast_params_to_compute(params),
                   opt_state=opt_state, model_state=model_state, rng=rng, tx=tx)

    @property
    def policy(self) -> Policy:
        """The precision policy: the one the optimizer state carries."""
        return _checked_optimizer_state(self).policy

    @property
    def master_params(self) -> Any:
        """Every param's value in ``param_dtype`` (fp32): the master copy, or ``param +
        compensation`` (``master="kahan"``), or the param itself (a param that is its own
        master, ``"stochastic"``, ``"none"``, a plain optax transform)."""
        return get_master_params(_checked_optimizer_state(self), self.params)

    @property
    def loss_scale(self) -> jax.Array:
        """The current fp32 loss scale (1 under a policy without fp16)."""
        return _checked_optimizer_state(self).loss_scale.loss_scale


def _pins_layout(pin_grad_layout: bool | None, local: bool, state: TrainState) -> bool:
    if pin_grad_layout is not None:
        return bool(pin_grad_layout)
    # XLA:CPU alone, for a step on one device: XLA's partitioner all-gathers a gradient
    # sharded over a mesh to pin its layout. The params' types say whether they lie on a mesh,
    # so a step on one device of a process that sees several (a test's virtual devices) pins.
    return (local and jax.default_backend() == "cpu"
            and _data_parallel.on_one_device(state.params))


def _check_step_arguments(accum_steps: Any, reduce_dtype: Any, axis_name: Any, mesh: Any,
                          data_axis: Any, pin_grad_layout: Any) -> None:
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}; 1 (the "
                         "default) takes one micro-batch per step")
    if not jnp.issubdtype(reduce_dtype, jnp.floating):
        raise TypeError(f"reduce_dtype must be floating, got {reduce_dtype}; use float32 "
                        "(default) or bfloat16")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a string or None, got {axis_name!r}; pass the "
                        "axis_name given to jax.pmap or shard_map, or None under jax.jit")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__} "
                        f"{mesh!r}; e.g. jax.make_mesh((jax.device_count(),), ('batch',))")
    if data_axis not in (None, _data_parallel.AUTO):
        if mesh is not None:
            _data_parallel.check_mesh_axis(mesh, data_axis, "data_axis")
        elif not (isinstance(data_axis, str) or (
                isinstance(data_axis, tuple) and data_axis
                and all(isinstance(a, str) for a in data_axis))):
            raise TypeError(f"data_axis must be 'auto', None, a mesh axis name or a tuple of "
                            f"names, got {data_axis!r}")
    if pin_grad_layout is not None and not isinstance(pin_grad_layout, bool):
        raise TypeError(f"pin_grad_layout must be True, False or None, got {pin_grad_layout!r}; "
                        "None (the default) pins only on a single XLA:CPU device")


def make_train_step(
    loss_fn: Callable[..., Any] | Objective,
    *,
    has_aux: bool = False,
    has_model_state: bool = False,
    has_rng: bool = False,
    autocast: bool | Mapping[str, Any] = False,
    accum_steps: int = 1,
    axis_name: str | None = None,
    reduce_dtype: DTypeLike = jnp.float32,
    warn_fp32_matmuls: bool = True,
    sync_model_state: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str | tuple[str, ...] | None = "auto",
    pin_grad_layout: bool | None = None,
    retry_on_overflow: bool | int = False,
) -> TrainStep:
    """Builds ``step(state, batch) -> (state, metrics)``, pure and compiled once.

    ``loss_fn`` is a :class:`jaxamp.Objective`, or the loss function with the flags that build
    one (``has_aux``, ``has_model_state``, ``has_rng``, ``autocast``). It is called as
    ``loss_fn(params, batch)``, plus ``model_state=`` when ``has_model_state`` and ``rng=`` when
    ``has_rng``. It returns the loss, or a tuple: ``(loss, aux)`` with ``has_aux``, ``(loss,
    new_model_state)`` with ``has_model_state`` and ``(loss, new_model_state, aux)`` with both.
    The loss must be a floating scalar; it is reduced in fp32 whatever the compute dtype. The
    step keeps the objective as ``step.objective``: :func:`jaxamp.explain_overflow` takes the
    step and re-runs what it trains.

    Args:
      loss_fn: the loss, in terms of the working params and a (cast) batch, or an
        :class:`~jaxamp.Objective`.
      has_aux: ``loss_fn`` also returns auxiliary outputs, returned as ``metrics["aux"]``
        (stacked over micro-batches when ``accum_steps > 1``).
      has_model_state: ``loss_fn`` takes ``model_state=`` and returns the new one. On a
        skipped step the new model state is discarded.
      has_rng: ``loss_fn`` takes ``rng=``, the state's key folded with the step, the
        micro-batch index and, under ``axis_name``, the device index.
      autocast: run ``loss_fn`` under :func:`jaxamp.autocast` with the state's policy:
        matmuls in the compute dtype and precision-sensitive ops in fp32, for a model written
        in fp32 with no ``dtype=`` anywhere. ``True``, or a dict of autocast's other options:
        ``{"recompute": False}`` (a model whose own remat decides what is kept),
        ``{"rules": {...}, "fp32_scopes": (...)}``.
      accum_steps: micro-batches per step. The batch's leading axis is split into this many;
        the gradients are summed in fp32 and the optimizer runs once.
      axis_name: the pmap/shard_map axis to average gradients, loss and metrics over, when
        the step runs under the caller's ``jax.pmap`` or ``shard_map``.
      reduce_dtype: dtype of the cross-device gradient mean (fp32, or bf16 to halve traffic),
        under ``axis_name`` and under a data-parallel ``jit`` alike.
      sync_model_state: with ``axis_name`` and ``has_model_state``, average the floating
        leaves of the new model state (BatchNorm running statistics) over the axis, so that
        replicas stay identical. Integer leaves are kept per device. (Under a data-parallel
        ``jit`` the state is one array for all devices: always averaged, integer leaves
        taking the maximum.)
      mesh: the device mesh of a data-parallel step under ``jax.jit``. Default: the mesh set
        with ``jax.set_mesh``, else the one the batch (or the state) lives on. No mesh: one
        device.
      data_axis: the mesh axis (or tuple of axes) the batch is split over. Each device's
        gradient is computed inside ``jax.shard_map`` over it and averaged with an explicit
        collective in ``reduce_dtype``: a ``pmean``, or a ``psum_scatter`` onto the master's
        shard under :func:`jaxamp.parallel.state_sharding`. The loss is averaged too, the model
        state synchronised, the rng folded with the device index (as under ``pmap``), and each aux
        output gains a leading axis with one entry per device (per micro-batch with
        ``accum_steps``). ``"auto"`` (default): the axis the batch's type says it is split
        over (``Explicit`` mesh axes), else the axis named ``"batch"``; else the batch is
        taken as not split (tensor parallelism), with a warning when it lies on an ``Auto``
        mesh under a half-precision policy. ``None``: no ``shard_map``; under a sharded
        batch XLA then reduces the gradients itself, in their dtype (bf16 for bf16 params).
      warn_fp32_matmuls: warn at trace time when a half-precision policy still runs matmuls
        in fp32 (a promotion by an fp32 param or activation). The check never raises.
      pin_grad_layout: pin the traced gradients of rank >= 2 to row-major before the update of
        :func:`jaxamp.mixed_precision` (its finite check and skip). ``None`` (default): on
        XLA:CPU for a step on one device (no ``axis_name``, no mesh, and params whose types
        name no mesh at trace time), where it was measured to save passes over the
        gradients; ``True``/``False`` force it on or off. It changes no update, but XLA's
        partitioner all-gathers a gradient sharded over a device mesh to pin it, which is why
        the default leaves params on a mesh alone.
      retry_on_overflow: a step whose gradients (or loss) overflow backs the loss scale off,
        as a skipped step does, and computes them again at the lower scale within the same
        call, at most this many times (``True``: 4, a factor of 16 at the default backoff);
        the update then applies the first finite gradients, so an fp16 overflow costs no
        update. A step that still overflows after the retries is skipped as without them
        (the state bit for bit, the scale backed off once more). A retry runs only where the
        overflow lowers the scale (not at ``min_scale``, nor while a ``hysteresis`` budget is
        left), and needs :func:`jaxamp.mixed_precision`'s loss scale. On a step that does not
        overflow it is a loop whose body does not run. ``False`` (default): none.

    Metrics (all computed in-graph): ``loss`` (fp32, unscaled, averaged), ``loss_scale`` (the
    scale used for this step), ``grads_finite`` (False on a skipped step: a gradient or the
    loss held an inf or nan; a non-finite loss never trains), ``skipped_steps`` (cumulative),
    ``grad_norm`` (of the unscaled, averaged gradients), ``nonfinite_leaves`` and
    ``first_nonfinite_leaf`` (-1, or the index that :func:`jaxamp.gradients.nonfinite_leaf_path`
    maps to the offending param's path), ``skips_at_min_scale`` (consecutive non-finite steps at
    the minimum loss scale) and ``stalled`` (True once those reach the ``stall_after`` of
    :func:`jaxamp.mixed_precision`: loss scaling cannot fix this overflow, so stop and look at
    the data or the model), and ``retries`` (the gradients computed again this step at a
    backed-off scale; 0 without ``retry_on_overflow``).

    >>> import jax, jax.numpy as jnp, optax, jaxamp
    >>> def loss_fn(params, batch):
    ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    >>> state = TrainState.create(params={"w": jnp.zeros((3,))}, tx=tx)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8,))}
    >>> step = jax.jit(make_train_step(loss_fn))
    >>> for _ in range(3):  # fp16 gradients overflow at 2**16 and 2**15: two skipped steps
    ...     state, m = step(state, batch)
    ...     print(float(m["loss"]), float(m["loss_scale"]), bool(m["grads_finite"]))
    1.0 65536.0 False
    1.0 32768.0 False
    1.0 16384.0 True
    >>> state = TrainState.create(params={"w": jnp.zeros((3,))}, tx=tx)
    >>> retrying = jax.jit(make_train_step(loss_fn, retry_on_overflow=True))
    >>> state, m = retrying(state, batch)  # both overflows retried within the first step
    >>> float(m["loss_scale"]), bool(m["grads_finite"]), int(m["retries"])
    (16384.0, True, 2)
    """
    objective = objective_of(loss_fn, {"has_aux": has_aux, "has_model_state": has_model_state,
                                        "has_rng": has_rng, "autocast": autocast})
    reduce_dtype = jnp.dtype(reduce_dtype)
    _check_step_arguments(accum_steps, reduce_dtype, axis_name, mesh, data_axis,
                          pin_grad_layout)
    return TrainStep(objective, accum_steps, reduce_dtype, warn_fp32_matmuls, sync_model_state,
                     pin_grad_layout, _Axis(axis_name) if axis_name is not None else
                     _Jit(mesh, data_axis), _retries(retry_on_overflow))


_DEFAULT_RETRIES = 4


def _retries(retry_on_overflow: Any) -> int:
    if retry_on_overflow is True or retry_on_overflow is False:
        return _DEFAULT_RETRIES if retry_on_overflow else 0
    if not isinstance(retry_on_overflow, int) or retry_on_overflow < 0:
        raise ValueError(f"retry_on_overflow must be True, False or an int >= 0 (the most "
                         f"retries in one step), got {retry_on_overflow!r}; True retries up "
                         f"to {_DEFAULT_RETRIES} times")
    return retry_on_overflow


@dataclasses.dataclass(frozen=True, eq=False)
class TrainStep:
    """The step :func:`make_train_step` builds: ``step(state, batch) -> (state, metrics)``,
    pure, for ``jax.jit`` or ``jax.pmap``. It holds what it was built with: its
    :attr:`objective` and the options that say how the objective's gradients are taken,
    reduced and applied. Each build is its own function (equal to itself only), as a closure
    would be: ``jax.jit`` traces two builds apart, even of the same loss."""

    objective: Objective
    """The loss and how it is called (see :class:`~jaxamp.Objective`)."""
    accum_steps: int
    """Micro-batches per step."""
    reduce_dtype: Any
    warn_fp32_matmuls: bool
    sync_model_state: bool
    pin_grad_layout: bool | None
    distribution: _Distribution
    """Where the step's gradients come from and how they are reduced: one device, the caller's
    ``pmap``/``shard_map`` axis, or the devices of a sharded ``jit``."""
    retries: int = 0
    """The most times an overflowed step's gradients are computed again at a backed-off
    scale (``retry_on_overflow``)."""

    @property
    def __name__(self) -> str:  # jax.jit and the audit name a function by it
        return "train_step"

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        mp = _checked_optimizer_state(state)
        if self.objective.autocast and not _has_half_compute(mp.policy):
            warnings.warn(
                "make_train_step(autocast=True) with an optimizer that jaxamp.mixed_precision "
                "does not wrap: the state's policy is float32, so autocast changes nothing and "
                "the step trains in fp32; wrap it: tx = jaxamp.mixed_precision(tx, "
                '"mixed_bfloat16") (or "mixed_float16")', UserWarning, stacklevel=2)
        placed = self.distribution.place(self, state, mp, batch)
        scale = mp.loss_scale.loss_scale
        batch = self.objective.batch_under(mp.policy, batch)
        # 1. The scaled gradients of each micro-batch, accumulated and reduced over the devices;
        #    with retry_on_overflow, again at a backed-off scale while they overflow.
        rng = step_rng(self.objective, state)
        out = placed.gradients(self, state, mp, scale, batch, rng)
        retries = jnp.zeros((), jnp.int32)
        if self.retries:
            loss_scale, out, retries = _retry(self, placed, state, mp, batch, rng, out)
            state = state.replace(opt_state=_with_loss_scale(state.opt_state, loss_scale))
            mp, scale = mp._replace(loss_scale=loss_scale), loss_scale.loss_scale
        loss, grads, new_model_state, aux, seen = out
        # 2. The model state's nodes (FP8 metadata) updated from what the step saw; an
        #    applied step keeps them, a skipped one drops them with the rest of the model state.
        if seen:
            nodes = _model_state.find(state.model_state)
            new_model_state = _model_state.replace(new_model_state,
                                                   _model_state.update(nodes, seen))
        # 3. The update.
        new_state, metrics = placed.update(self, state, mp, grads, new_model_state, loss)
        metrics = {"loss": loss, "loss_scale": scale, **metrics, "retries": retries}
        if self.objective.has_aux:
            metrics["aux"] = aux
        return new_state, metrics


def _retry(step: TrainStep, placed: _Distribution, state: TrainState,
           mp: MixedPrecisionState, batch: Any, rng: Any, out: tuple):
    """``(loss scale, gradients, retries)``: ``out`` (the gradients at the state's scale), or
    while they overflow and a backoff lowers the scale, at most ``step.retries`` times, the
    gradients at the backed-off scale. Every device of a step sees the same reduced gradients,
    so all run the loop as often."""
    def lowers(loss_scale):
        return loss_scale.adjust(False).loss_scale < loss_scale.loss_scale

    def again(carry):
        loss_scale, out, n = carry
        return ~all_finite((out[0], out[1])) & (n < step.retries) & lowers(loss_scale)

    def retry(carry):
        loss_scale, _, n = carry
        loss_scale = loss_scale.adjust(False)
        out = placed.gradients(step, state, mp, loss_scale.loss_scale, batch, rng)
        return loss_scale, out, n + 1

    return lax.while_loop(again, retry, (mp.loss_scale, out, jnp.zeros((), jnp.int32)))


def _with_loss_scale(opt_state: Any, loss_scale: Any) -> Any:
    """``opt_state`` with its :class:`~jaxamp.state.MixedPrecisionState`'s loss scale replaced."""
    return jax.tree.map(
        lambda x: x._replace(loss_scale=loss_scale) if isinstance(x, MixedPrecisionState) else x,
        opt_state, is_leaf=lambda x: isinstance(x, MixedPrecisionState))


# --------------------------------------------------------------------------------------------
# Where the gradients come from: the step's distribution
# --------------------------------------------------------------------------------------------

class _Distribution:
    """One device: the gradients of the whole batch, updated in place."""

    def place(self, step: TrainStep, state: TrainState, mp: MixedPrecisionState,
              batch: Any) -> _Distribution:
        """The distribution of this trace (a ``jit`` step finds its mesh on the arrays)."""
        del step, state, mp, batch
        return self

    def gradients(self, step: TrainStep, state: TrainState, mp: MixedPrecisionState,
                  scale, batch, rng):
        """``(loss, reduced gradients of loss * scale, new model state, aux, seen)``."""
        return device_gradients(step, mp.policy, state.params, scale, state.model_state,
                                batch, rng)

    def update(self, step: TrainStep, state: TrainState, mp: MixedPrecisionState,
               grads, new_model_state, loss):
        return _update(step, self is _LOCAL, state, grads, new_model_state, loss)


_LOCAL = _Distribution()


@dataclasses.dataclass(frozen=True)
class _Axis(_Distribution):
    """The caller's ``pmap``/``shard_map`` axis: each device's gradients, ``pmean``-ed."""

    axis_name: str

    def place(self, step, state, mp, batch):
        del step, state, mp, batch
        _check_axis_bound(self.axis_name)
        return self

    def gradients(self, step, state, mp, scale, batch, rng):
        if rng is not None:
            rng = jax.random.fold_in(rng, lax.axis_index(self.axis_name))
        loss, grads, new_model_state, aux, seen = super().gradients(step, state, mp, scale,
                                                                    batch, rng)
        loss, grads, new_model_state = _reduce_across_devices(step, self.axis_name, loss, grads,
                                                              new_model_state)
        return loss, grads, new_model_state, aux, [lax.pmax(a, self.axis_name) for a in seen]


@dataclasses.dataclass(frozen=True)
class _Jit(_Distribution):
    """Under ``jax.jit``: the mesh and data axis are found on the arrays at trace time
    (:mod:`jaxamp._step._data_parallel`); none is one device."""

    mesh: Any
    data_axis: Any

    def place(self, step, state, mp, batch):
        del step
        dp = _data_parallel.find(self.mesh, self.data_axis, state, batch,
                                 warn_implicit=_has_half_params(mp.policy, state.params))
        return _LOCAL if dp is None else _Mesh(dp)


@dataclasses.dataclass(frozen=True)
class _Mesh(_Distribution):
    """A data-parallel ``jit``: each device's shard of the batch under ``shard_map``."""

    dp: _data_parallel.DataParallel

    def gradients(self, step, state, mp, scale, batch, rng):
        _data_parallel.check_batch(self.dp, batch, step.accum_steps)
        return _sharded_gradients(step, self.dp, state, mp, scale, batch, rng)

    def update(self, step, state, mp, grads, new_model_state, loss):
        if not self.dp.explicit:
            return super().update(step, state, mp, grads, new_model_state, loss)
        return _update_on_explicit_mesh(step, self.dp, state, mp, grads, new_model_state, loss)


# --------------------------------------------------------------------------------------------
# The step, in pieces
# --------------------------------------------------------------------------------------------

def _update(step: TrainStep, local: bool, state: TrainState, grads,
            new_model_state, loss, cast_sharding: Any = None):
    """The optimizer's update (by :func:`jaxamp.mixed_precision`), skipped where a gradient
    or the loss is not finite; the new model state, kept only on an applied step.
    ``local``: the step runs on one device (no axis, no mesh)."""
    if _pins_layout(step.pin_grad_layout, local, state):
        grads = row_major_grads(grads)
    new_state, metrics = _apply_update(state, grads, loss, cast_sharding)
    if step.objective.has_model_state:
        model_state = select(metrics["grads_finite"], new_model_state, state.model_state)
        new_state = new_state.replace(model_state=model_state)
    return new_state, metrics


def _update_on_explicit_mesh(step: TrainStep, dp: _data_parallel.DataParallel,
                             state: TrainState, mp: MixedPrecisionState, grads,
                             new_model_state, loss):
    """:func:`_update` where the arrays' types carry their shardings. The optimizer's own code
    (norms, masks, any optax transform) runs with the mesh axes Auto, as under any ``jit``,
    and hands back the state's own shardings; the working params are cast on the master's
    shards and then gathered in their (compute) dtype."""
    cast_sharding = jax.tree.map(lambda x: dp.sharding_of(x).spec,
                                 storage_of(mp, state.params))
    replicated = NamedSharding(dp.abstract_mesh, PartitionSpec())
    # Declared: auto_axes is unannotated, and its inferred type includes the decorator
    # factory that ``auto_axes(out_sharding=...)`` (no function) returns.
    update: Callable[..., Any] = jax.sharding.auto_axes(
        functools.partial(_update, step, False, cast_sharding=cast_sharding),
        out_sharding=(jax.tree.map(dp.sharding_of, state), replicated))
    return update(state, grads, new_model_state, loss)


def _has_half_compute(policy: Policy) -> bool:
    return jnp.dtype(policy.compute_dtype).itemsize < 4


def _has_half_params(policy: Policy, params: Any) -> bool:
    return any(d is not None and jnp.dtype(d).itemsize < 4 for d in policy.working_dtypes(params))


def device_gradients(step: TrainStep, policy: Policy, params, scale, model_state, batch,
                     rng, interpreter: Callable[[], Interpreter] | None = None):
    """``(loss, gradients of loss * scale, new model state, aux, seen)`` of one device's batch,
    ``seen`` what each node of the model state saw (an :class:`~jaxamp.fp8.Fp8State`'s
    amax). ``interpreter``: a fresh :class:`~jaxamp._jaxpr.Interpreter` for each micro-batch,
    which evaluates its program eagerly (the overflow diagnosis), the micro-batches in a
    python loop; else the step's traced program, the micro-batches under ``lax.scan``."""
    if step.accum_steps == 1:
        return _micro_batch(step, policy, params, scale, model_state, batch, rng, interpreter)
    return _accumulate(step, policy, params, scale, model_state, batch, rng, interpreter)


def _sharded_gradients(step: TrainStep, dp: _data_parallel.DataParallel,
                       state: TrainState, mp: MixedPrecisionState, scale, batch, rng):
    """:func:`device_gradients` of each device's shard of the batch under ``shard_map`` over
    the data axis, averaged in ``reduce_dtype``: ``psum_scatter`` onto the master's shards when the
    optimizer state is sharded, else ``pmean``. ZeRO-3 params are all-gathered inside, in the
    compute dtype, and never differentiated through the gather (whose transpose would
    reduce-scatter in bf16)."""
    storage = storage_of(mp, state.params)
    param_specs = jax.tree.map(dp.spec_of, state.params)
    grad_specs = jax.tree.map(dp.spec_of, storage)
    has_model_state = step.objective.has_model_state

    def local(params, model_state, batch, scale, rng):
        params = _data_parallel.to_varying(_data_parallel.gather(dp, params, param_specs),
                                           dp.names)
        if has_model_state:  # a scan over micro-batches carries it with the batch's type
            model_state = _data_parallel.to_varying(model_state, dp.names)
        if rng is not None:
            rng = jax.random.fold_in(rng, lax.axis_index(dp.names))
        loss, grads, new_model_state, aux, seen = device_gradients(
            step, mp.policy, params, scale, model_state, batch, rng)
        grads = _data_parallel.reduce(dp, grads, grad_specs, step.reduce_dtype)
        seen = [lax.pmax(a, dp.names) for a in seen]
        new_model_state = _data_parallel.sync(dp, new_model_state) if has_model_state else None
        aux = _data_parallel.stack(dp, aux, stacked=step.accum_steps > 1)
        return lax.pmean(loss, dp.names), grads, new_model_state, aux, seen

    replicated, split = PartitionSpec(), PartitionSpec(_data_parallel.spec_entry(dp.names))
    return jax.shard_map(
        local, mesh=dp.mesh, axis_names=frozenset(dp.names),
        in_specs=(param_specs, replicated, split, replicated, replicated),
        out_specs=(replicated, grad_specs, replicated, split, replicated),
    )(state.params, dp.place(state.model_state, replicated), dp.place(batch, split),
      scale, rng)


def _checked_optimizer_state(state: TrainState) -> MixedPrecisionState:
    if not isinstance(state, TrainState):
        raise TypeError(f"step expects a jaxamp.TrainState, got {type(state).__name__}; "
                        "build it with jaxamp.TrainState.create(params=..., tx=...)")
    mp = maybe_find_state(state.opt_state)
    if mp is None:
        raise ValueError("the state's optimizer state holds no jaxamp.mixed_precision state: "
                         "build the state with jaxamp.TrainState.create(params=..., tx=...), "
                         "which wraps a plain optax transform")
    return mp


def step_rng(objective: Objective, state: TrainState):
    """The state's key folded with the step, for an objective that takes ``rng=`` (the
    distribution folds in the device, accumulation the micro-batch); else ``None``."""
    if not objective.has_rng:
        return None
    if state.rng is None:
        raise ValueError("has_rng=True but state.rng is None; pass rng=jax.random.key(0) "
                         "to TrainState.create")
    return jax.random.fold_in(state.rng, state.step)


def _micro_batch(step: TrainStep, policy: Policy, params, scale, model_state, batch, rng,
                 interpreter: Callable[[], Interpreter] | None = None):
    """``(loss, grads of loss * scale, new model state, aux, seen)`` of one micro-batch (see
    :class:`~jaxamp._step._objective.Scaled`: the FP8 metadata handed, differentiated, and what it
    saw)."""
    scaled = step.objective.scaled(policy, batch, scale, model_state, rng)
    warn = None
    if step.warn_fp32_matmuls and policy.compute_dtype != jnp.float32:
        warn = functools.partial(_warn_fp32_matmuls, policy=policy)
    # Traced once and run: the jaxpr tells the order in which the backward pass makes each
    # gradient, and the gradients are handed on in that order (see in_made_order); the
    # fp32-matmul warning reads the same jaxpr.
    ((_, (loss, new_model_state, aux)), (grads, cotangents)), made = run_traced(
        jax.value_and_grad(scaled, argnums=(0, 1), has_aux=True), params, scaled.handed,
        inspect=warn, interpreter=None if interpreter is None else interpreter())
    grads = in_made_order(grads, made[1][0])
    return loss, grads, new_model_state, aux, scaled.seen(cotangents)


def split_micro_batches(batch: Any, k: int) -> Any:
    def split(x):
        if not hasattr(x, "shape") or x.ndim == 0:
            raise ValueError(f"accum_steps={k} needs every batch leaf to have a leading batch "
                             f"axis, got {type(x).__name__} {getattr(x, 'shape', '')}")
        if x.shape[0] % k:
            raise ValueError(f"accum_steps={k} does not divide the batch size {x.shape[0]} "
                             f"(leaf shape {x.shape}); use a batch size that is a multiple of "
                             f"{k} or another accum_steps")
        return x.reshape((k, x.shape[0] // k) + x.shape[1:])
    return jax.tree.map(split, batch)


def _accumulate(step: TrainStep, policy: Policy, params, scale, model_state, batch, rng,
                interpreter: Callable[[], Interpreter] | None = None):
    """The mean of the micro-batches' gradients, summed in fp32 under ``lax.scan`` (in a
    python loop with an ``interpreter``), all with the same scale; the model state threads
    through the micro-batches."""
    k, has_model_state = step.accum_steps, step.objective.has_model_state

    def body(carry, xs):
        acc, seen, model_state = carry
        micro_batch, index = xs
        micro_rng = None if rng is None else jax.random.fold_in(rng, index)
        loss, grads, new_ms, aux, micro_seen = _micro_batch(
            step, policy, params, scale, model_state, micro_batch, micro_rng, interpreter)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        seen = [jnp.maximum(a, b) for a, b in zip(seen, micro_seen, strict=True)]  # never a sum
        return (acc, seen, new_ms if has_model_state else model_state), (loss, aux)

    # zeros_like keeps a param's type: varying over the data axis inside shard_map.
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params)
    nothing_seen = _model_state.nothing_seen(
        _model_state.find(model_state) if has_model_state else [])
    scan = lax.scan if interpreter is None else _python_scan
    (acc, seen, new_model_state), (losses, aux) = scan(
        body, (zeros, nothing_seen, model_state), (split_micro_batches(batch, k), jnp.arange(k)))
    inv_k = jnp.float32(1.0 / k)
    return (jnp.mean(losses), jax.tree.map(lambda a: a * inv_k, acc), new_model_state, aux,
            seen)


def _python_scan(body: Callable, init: Any, xs: Any) -> tuple[Any, Any]:
    """``lax.scan(body, init, xs)`` as a python loop, each iteration run eagerly."""
    carry, ys = init, []
    for i in range(len(jax.tree.leaves(xs)[0])):
        carry, y = body(carry, jax.tree.map(lambda x, i=i: x[i], xs))
        ys.append(y)
    return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)


def _reduce_across_devices(step: TrainStep, axis: str, loss, grads, new_model_state):
    """``pmean`` over ``axis_name``: the gradients in ``reduce_dtype``, the loss, and the
    floating model state when ``sync_model_state``."""
    grads = jax.tree.map(lambda g: lax.pmean(g.astype(step.reduce_dtype), axis), grads)
    loss = lax.pmean(loss, axis)
    if step.objective.has_model_state and step.sync_model_state:
        new_model_state = jax.tree.map(
            lambda x: lax.pmean(x, axis) if is_inexact_array(jnp.asarray(x)) else x,
            new_model_state)
    return loss, grads, new_model_state


def _apply_update(state: TrainState, grads: Any, loss: jax.Array, cast_sharding: Any = None):
    """The optimizer's update and the metrics it reports, read from the new state's health in
    one place. :func:`jaxamp.mixed_precision` decides the skip (it is handed the loss as
    optax's ``value``: a non-finite loss skips the step too). ``cast_sharding``: where the
    cast of the master to the working params runs (the master's shards)."""
    # mixed_precision, alone or in an optax.chain (find_state refuses other wrappers), takes
    # extra arguments; the declared type of tx does not say so.
    params, opt_state, mp = apply_updates(state.tx, grads, state.opt_state, state.params,
                                          value=loss)
    if cast_sharding is not None:
        params = lax.with_sharding_constraint(params, cast_sharding)
    health = mp.health
    metrics = {"grads_finite": health.grads_finite, "skipped_steps": health.skipped_steps,
               "grad_norm": health.grad_norm, "nonfinite_leaves": health.nonfinite_leaves,
               "first_nonfinite_leaf": health.first_nonfinite_leaf,
               "skips_at_min_scale": health.skips_at_min_scale, "stalled": health.stalled}
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def _check_axis_bound(axis_name: str) -> None:
    try:
        lax.axis_index(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: run the step under "
            f"jax.pmap(step, axis_name={axis_name!r}) or shard_map, or build it without "
            "axis_name for jax.jit (with a sharded batch the reduction is implicit)") from e


def _fp32_matmul_sites(jaxpr: Any) -> tuple[int, list[str]]:
    """The forward pass's matmuls in a value-and-gradient jaxpr, and those with an fp32
    operand."""
    matmuls = [eqn for eqn, _, _, outer in walk_levels(jaxpr)
               if eqn.primitive.name in MATMULS and not is_backward(eqn, outer)]
    sites = [f"{eqn.primitive.name} at {where(eqn)}" for eqn in matmuls
             if any(getattr(v.aval, "dtype", None) == jnp.float32 for v in eqn.invars)]
    return len(matmuls), sites


def _warn_fp32_matmuls(jaxpr: Any, policy: Policy) -> None:
    """A trace-time warning, never an error: a failure of the diagnostic itself is ignored."""
    try:
        total, sites = _fp32_matmul_sites(jaxpr)
    except Exception:  # noqa: BLE001 - a diagnostic must never break a training step
        return
    if sites:
        shown = "; ".join(sites[:5]) + (" ..." if len(sites) > 5 else "")
        warnings.warn(
            f"{len(sites)} of {total} matmuls/convs run in float32 under policy {policy}: "
            f"{shown}. An fp32 param or activation (often a LayerNorm with dtype=float32) "
            "promotes the next matmul back to fp32. Build layers with the compute dtype, or "
            "pass warn_fp32_matmuls=False if this is intended.", stacklevel=4)
