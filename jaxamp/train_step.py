"""The train state and :func:`make_train_step`.

``make_train_step(loss_fn, ...)`` returns a pure ``step(state, batch) -> (state, metrics)``
that the caller wraps in ``jax.jit`` or ``jax.pmap``. Per step:

1. cast the floating leaves of the batch to the compute dtype;
2. take the gradient of ``loss * scale`` with respect to the working params;
3. with ``accum_steps=k``, split the batch into k micro-batches and sum their gradients in fp32
   under ``lax.scan``, all with the same scale;
4. with ``axis_name``, ``pmean`` the gradients in ``reduce_dtype`` (fp32 by default);
5. let :func:`jaxamp.mixed_precision` unscale, check finiteness (after the reduction, so every
   device decides the same), update the master and adjust the scale;
6. set the working params to the cast of the new master; on a skipped step, keep the old
   mutable model state (BatchNorm statistics) too;
7. return metrics computed in-graph.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax import lax
from jax.typing import DTypeLike

from jaxamp import auditing as _audit
from jaxamp.master import MixedPrecisionState
from jaxamp.master import _select
from jaxamp.master import find_state
from jaxamp.master import grad_stats
from jaxamp.policy import Policy
from jaxamp.policy import get_policy

__all__ = ["TrainState", "make_train_step", "policy_of"]


def policy_of(tx: optax.GradientTransformation) -> Policy | None:
    """The policy a :func:`jaxamp.mixed_precision` transform was built with, else ``None``.

    >>> import optax, jaxamp
    >>> str(policy_of(jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")))
    'p=f32,c=f16,o=f32'
    >>> policy_of(optax.sgd(0.1)) is None
    True
    """
    return getattr(tx.update, "jaxamp_policy", None)


@struct.dataclass(kw_only=True)
class TrainState:
    """Everything a step reads and writes, as one pytree (checkpoint it whole).

    Attributes:
      step: int32 count of steps taken (applied and skipped).
      params: the working params, in their compute dtypes.
      opt_state: the optimizer state; with :func:`jaxamp.mixed_precision` it holds the fp32
        master, the inner state, the loss scale and the counters.
      model_state: mutable model state such as BatchNorm statistics, or ``None``.
      rng: a base PRNG key (folded with ``step`` each step), or ``None``.
      tx: the optimizer (static).
      policy: the precision policy (static).

    >>> import jax.numpy as jnp, optax, jaxamp
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    >>> state = TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
    >>> int(state.step), float(state.loss_scale), state.master_params["w"].dtype
    (0, 65536.0, dtype('float32'))
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None
    rng: Any = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    policy: Policy = struct.field(pytree_node=False)

    @classmethod
    def create(cls, *, params: Any, tx: optax.GradientTransformation, policy: Any = None,
               model_state: Any = None, rng: Any = None) -> TrainState:
        """Builds the state from params in any precision (the master copy is made by ``tx``).

        ``policy`` defaults to the one ``tx`` was built with (``float32`` for a plain optax
        transform).

        >>> import jax.numpy as jnp, optax, jaxamp
        >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
        >>> s = TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
        >>> s.params["w"].dtype, jaxamp.get_master_params(s.opt_state)["w"].dtype
        (dtype(bfloat16), dtype('float32'))
        """
        tx_policy = policy_of(tx)
        if policy is None:
            policy = tx_policy if tx_policy is not None else get_policy("float32")
        policy = get_policy(policy)
        if tx_policy is not None and (tx_policy.param_dtype, tx_policy.compute_dtype,
                                      tx_policy.overrides) != (policy.param_dtype,
                                                               policy.compute_dtype,
                                                               policy.overrides):
            raise ValueError(f"policy {policy} differs from the policy {tx_policy} that tx was "
                             "built with; pass the same policy to both, or omit it here")
        if tx_policy is None and policy.is_mixed:
            raise ValueError(f"policy {policy} keeps a master copy in {policy.param_dtype} but tx "
                             "is a plain optax transform; wrap it: "
                             "jaxamp.mixed_precision(tx, policy)")
        opt_state = tx.init(policy.cast_to_param(params))
        return cls(step=jnp.zeros((), jnp.int32), params=policy.cast_params_to_compute(params),
                   opt_state=opt_state, model_state=model_state, rng=rng, tx=tx, policy=policy)

    @property
    def master_params(self) -> Any:
        """The fp32 master params (the params themselves for a plain optax transform)."""
        mp = _maybe_state(self.opt_state)
        return self.params if mp is None else mp.master_params

    @property
    def loss_scale(self) -> jax.Array:
        """The current fp32 loss scale (1 for a plain optax transform)."""
        mp = _maybe_state(self.opt_state)
        return jnp.ones((), jnp.float32) if mp is None else mp.loss_scale.loss_scale


def _maybe_state(opt_state: Any) -> MixedPrecisionState | None:
    try:
        return find_state(opt_state)
    except ValueError:
        return None


def _split_outputs(out: Any, has_aux: bool, has_model_state: bool):
    """Unpacks ``loss``, ``(loss, aux)``, ``(loss, model_state)`` or ``(loss, state, aux)``."""
    expected = 1 + has_aux + has_model_state
    if expected == 1:
        return out, None, None
    if not isinstance(out, tuple) or len(out) != expected:
        shape = {(True, False): "(loss, aux)", (False, True): "(loss, new_model_state)",
                 (True, True): "(loss, new_model_state, aux)"}[(has_aux, has_model_state)]
        if isinstance(out, tuple):
            got = f"a tuple of {len(out)}"
        elif hasattr(out, "shape") and hasattr(out, "dtype"):
            got = f"a single {jnp.dtype(out.dtype).name}{list(out.shape)} array"
        else:
            got = type(out).__name__
        raise ValueError(f"loss_fn must return {shape} with has_aux={has_aux} and "
                         f"has_model_state={has_model_state}; got {got}. Return that tuple, "
                         "or set the flags to what loss_fn returns")
    loss = out[0]
    model_state = out[1] if has_model_state else None
    aux = out[-1] if has_aux else None
    return loss, model_state, aux


def _check_loss(loss: Any) -> jax.Array:
    loss = jnp.asarray(loss)
    if loss.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar loss, got shape {loss.shape}; reduce "
                         "it with jnp.mean (per-example losses are averaged by you)")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss_fn must return a floating loss, got dtype {loss.dtype}: an "
                        "integer or bool loss has no gradient; compute it from the model's "
                        "floating outputs, in float32")
    return loss.astype(jnp.float32)


def _split_microbatches(batch: Any, k: int) -> Any:
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


def make_train_step(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    has_model_state: bool = False,
    has_rng: bool = False,
    accum_steps: int = 1,
    axis_name: str | None = None,
    reduce_dtype: DTypeLike = jnp.float32,
    warn_fp32_matmuls: bool = True,
    sync_model_state: bool = True,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """Builds ``step(state, batch) -> (state, metrics)``, pure and compiled once.

    ``loss_fn`` is called as ``loss_fn(params, batch)``, plus ``model_state=`` when
    ``has_model_state`` and ``rng=`` when ``has_rng``. It returns the loss, or a tuple:
    ``(loss, aux)`` with ``has_aux``, ``(loss, new_model_state)`` with ``has_model_state`` and
    ``(loss, new_model_state, aux)`` with both. The loss must be a floating scalar; it is
    reduced in fp32 whatever the compute dtype.

    Args:
      loss_fn: the loss, in terms of the working params and a (cast) batch.
      has_aux: ``loss_fn`` also returns auxiliary outputs, returned as ``metrics["aux"]``
        (stacked over micro-batches when ``accum_steps > 1``).
      has_model_state: ``loss_fn`` takes ``model_state=`` and returns the new one. On a
        skipped step the new model state is discarded.
      has_rng: ``loss_fn`` takes ``rng=``, the state's key folded with the step, the
        micro-batch index and, under ``axis_name``, the device index.
      accum_steps: micro-batches per step. The batch's leading axis is split into this many;
        the gradients are summed in fp32 and the optimizer runs once.
      axis_name: the pmap/shard_map axis to average gradients, loss and metrics over.
      reduce_dtype: dtype of the cross-device gradient mean (fp32, or bf16 to halve traffic).
      sync_model_state: with ``axis_name`` and ``has_model_state``, average the floating
        leaves of the new model state (BatchNorm running statistics) over the axis, so that
        replicas stay identical. Integer leaves are kept per device.
      warn_fp32_matmuls: warn at trace time when a half-precision policy still runs matmuls
        in fp32 (a promotion by an fp32 param or activation).

    Metrics (all computed in-graph): ``loss`` (fp32, unscaled, averaged), ``loss_scale`` (the
    scale used for this step), ``grads_finite``, ``skipped_steps`` (cumulative),
    ``grad_norm`` (of the unscaled, averaged gradients), ``nonfinite_leaves`` and
    ``first_nonfinite_leaf`` (-1, or the index that :func:`jaxamp.nonfinite_leaf_path` maps to
    the offending param's path), ``skips_at_min_scale`` (consecutive non-finite steps at the
    minimum loss scale) and ``stalled`` (True once those reach the ``stall_after`` of
    :func:`jaxamp.mixed_precision`: loss scaling cannot fix this overflow, so stop and look at
    the data or the model).

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
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__} "
                        f"{loss_fn!r}; pass a function loss_fn(params, batch) -> loss")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"accum_steps must be an int >= 1, got {accum_steps!r}; 1 (the "
                         "default) takes one micro-batch per step")
    reduce_dtype = jnp.dtype(reduce_dtype)
    if not jnp.issubdtype(reduce_dtype, jnp.floating):
        raise TypeError(f"reduce_dtype must be floating, got {reduce_dtype}; use float32 "
                        "(default) or bfloat16")
    if axis_name is not None and not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a string or None, got {axis_name!r}; pass the "
                        "axis_name given to jax.pmap or shard_map, or None under jax.jit")

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if not isinstance(state, TrainState):
            raise TypeError(f"step expects a jaxamp.TrainState, got {type(state).__name__}; "
                            "build it with jaxamp.TrainState.create(params=..., tx=...)")
        if axis_name is not None:
            _check_axis_bound(axis_name)
        policy = state.policy
        mp = _maybe_state(state.opt_state)
        scale = jnp.ones((), jnp.float32) if mp is None else mp.loss_scale.loss_scale
        batch = policy.cast_to_compute(batch)
        rng = None
        if has_rng:
            if state.rng is None:
                raise ValueError("has_rng=True but state.rng is None; pass rng=jax.random.key(0) "
                                 "to TrainState.create")
            rng = jax.random.fold_in(state.rng, state.step)
            if axis_name is not None:
                rng = jax.random.fold_in(rng, lax.axis_index(axis_name))

        def grads_of(model_state, micro_batch, micro_rng):
            def scaled(params):
                kwargs = {}
                if has_model_state:
                    kwargs["model_state"] = model_state
                if has_rng:
                    kwargs["rng"] = micro_rng
                loss, new_model_state, aux = _split_outputs(
                    loss_fn(params, micro_batch, **kwargs), has_aux, has_model_state)
                loss = _check_loss(loss)
                return loss * scale, (loss, new_model_state, aux)
            if warn_fp32_matmuls and policy.compute_dtype != jnp.float32:
                _warn_fp32_matmuls(scaled, state.params, policy)
            (_, (loss, new_ms, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(
                state.params)
            return loss, grads, new_ms, aux

        if accum_steps == 1:
            loss, grads, new_model_state, aux = grads_of(state.model_state, batch, rng)
        else:
            micro = _split_microbatches(batch, accum_steps)

            def body(carry, xs):
                acc, model_state = carry
                micro_batch, index = xs
                micro_rng = None if rng is None else jax.random.fold_in(rng, index)
                loss, grads, new_ms, aux = grads_of(model_state, micro_batch, micro_rng)
                acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
                return (acc, new_ms if has_model_state else model_state), (loss, aux)

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            (acc, new_model_state), (losses, aux) = lax.scan(
                body, (zeros, state.model_state), (micro, jnp.arange(accum_steps)))
            inv_k = jnp.float32(1.0 / accum_steps)
            grads = jax.tree.map(lambda a: a * inv_k, acc)
            loss = jnp.mean(losses)

        if axis_name is not None:
            grads = jax.tree.map(lambda g: lax.pmean(g.astype(reduce_dtype), axis_name), grads)
            loss = lax.pmean(loss, axis_name)
            if has_model_state and sync_model_state:
                new_model_state = jax.tree.map(
                    lambda x: lax.pmean(x, axis_name)
                    if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x,
                    new_model_state)

        if mp is not None:
            _, opt_state = state.tx.update(grads, state.opt_state, state.params)
            new_mp = find_state(opt_state)
            finite, norm, nonfinite, first_bad = (
                new_mp.grads_finite, new_mp.grad_norm, new_mp.nonfinite_leaves,
                new_mp.first_nonfinite_leaf)
            skipped = new_mp.skipped_steps
            skips_at_min, stalled = new_mp.skips_at_min_scale, new_mp.stalled
            params = policy.cast_params_to_compute(new_mp.master_params)
        else:
            finite, norm, nonfinite, first_bad = grad_stats(jax.tree.map(
                lambda g: g.astype(jnp.float32), grads))
            updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
            params = _select(finite, optax.apply_updates(state.params, updates), state.params)
            opt_state = _select(finite, opt_state, state.opt_state)
            skipped = jnp.zeros((), jnp.int32)
            skips_at_min, stalled = jnp.zeros((), jnp.int32), jnp.array(False)
        model_state = state.model_state
        if has_model_state:
            model_state = _select(finite, new_model_state, state.model_state)

        metrics = {
            "loss": loss,
            "loss_scale": scale,
            "grads_finite": finite,
            "skipped_steps": skipped,
            "grad_norm": norm,
            "nonfinite_leaves": nonfinite,
            "first_nonfinite_leaf": first_bad,
            "skips_at_min_scale": skips_at_min,
            "stalled": stalled,
        }
        if has_aux:
            metrics["aux"] = aux
        new_state = dataclasses.replace(state, step=state.step + 1, params=params,
                                        opt_state=opt_state, model_state=model_state)
        return new_state, metrics

    return step


def _check_axis_bound(axis_name: str) -> None:
    try:
        lax.axis_index(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound: run the step under "
            f"jax.pmap(step, axis_name={axis_name!r}) or shard_map, or build it without "
            "axis_name for jax.jit (with a sharded batch the reduction is implicit)") from e


def _warn_fp32_matmuls(scaled_loss: Callable, params: Any, policy: Policy) -> None:
    jaxpr = jax.make_jaxpr(lambda p: scaled_loss(p)[0])(params)
    matmuls = [(eqn, where) for eqn, _ in _audit.walk(jaxpr)
               if eqn.primitive.name in ("dot_general", "conv_general_dilated")
               for where in [_audit.where(eqn)]]
    total = len(matmuls)
    sites = [f"{eqn.primitive.name} at {where}" for eqn, where in matmuls
             if any(getattr(v.aval, "dtype", None) == jnp.float32 for v in eqn.invars)]
    if sites:
        shown = "; ".join(sites[:5]) + (" ..." if len(sites) > 5 else "")
        warnings.warn(
            f"{len(sites)} of {total} matmuls/convs run in float32 under policy {policy}: "
            f"{shown}. An fp32 param or activation (often a LayerNorm with dtype=float32) "
            "promotes the next matmul back to fp32. Build layers with the compute dtype, or "
            "pass warn_fp32_matmuls=False if this is intended.", stacklevel=3)
