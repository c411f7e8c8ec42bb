"""Training an Equinox module: the module in, the module out (private; the face is
:mod:`jaxamp.equinox`).

An Equinox model is one pytree: its inexact arrays are the params, the rest (static fields,
integer arrays, PRNG keys, activation functions, ``eqx.nn.Dropout``'s flags) rides along
untouched. Each entry point splits the model with ``eqx.partition(model,
eqx.is_inexact_array)``, trains the params through the library's own pieces (the
:class:`~jaxamp.TrainState` and :func:`~jaxamp.make_train_step` of one step, or an
:class:`~jaxamp.Objective`'s scaled loss) and puts the model back together with
``eqx.combine``: the loss scale, the skip and the master live in one place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from jaxamp._loss import described
from jaxamp._optimizer._state import MixedPrecisionState
from jaxamp._optimizer._state import maybe_find_state
from jaxamp._optimizer._state import policy_of
from jaxamp._precision._policy import Policy
from jaxamp._step._objective import Objective
from jaxamp._step._train_step import TrainState
from jaxamp._step._train_step import make_train_step
from jaxamp._tree import tree_path_str

__all__ = ["filter_value_and_grad", "init", "make_step"]

_WRAP = 'wrap it: tx = jaxamp.mixed_precision(optax.adamw(1e-3), "mixed_bfloat16")'


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------

def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_model(model: Any) -> None:
    if not isinstance(model, eqx.Module):
        raise TypeError(
            f"model must be an equinox.Module, got {type(model).__name__} {_short(model)}; "
            "pass the module itself (an eqx.nn layer or your own eqx.Module). A params tree "
            "that is not a module trains with jaxamp.TrainState and jaxamp.make_train_step")


def _check_callable(loss_fn: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__} "
                        f"{_short(loss_fn)}; pass a function loss_fn(model, *args) -> loss")


def _check_tx(tx: Any, params: Any = None) -> None:
    """``tx`` is :func:`jaxamp.mixed_precision` (or a harmless wrapper of it). A transform whose
    init needs the params (``optax.masked`` with a mask tree) is checked once they are known."""
    if not isinstance(tx, optax.GradientTransformation | optax.MultiSteps):
        raise TypeError(f"tx must be an optax transform wrapped by jaxamp.mixed_precision, got "
                        f"{type(tx).__name__} {_short(tx)}; {_WRAP}")
    try:
        policy = policy_of(tx, params)
    except Exception as e:
        if params is not None or isinstance(e, ValueError):
            raise  # a wrapping that cannot be correct raises find_state's own ValueError
        return  # an init that needs the params: the step checks its opt_state at each call
    if policy is None:
        raise ValueError(f"tx is a plain optax transform, got {_short(tx)}: it keeps no fp32 "
                         f"master and no loss scale; {_WRAP} (policy \"float32\" trains in "
                         "fp32)")


def _mixed_state(opt_state: Any) -> MixedPrecisionState:
    if isinstance(opt_state, eqx.nn.State):
        raise TypeError("opt_state is an eqx.nn.State: the model state goes before the "
                        "optimizer state, step(model, state, opt_state, *args), with "
                        "make_step(..., has_state=True)")
    mp = maybe_find_state(opt_state)
    if mp is None:
        raise ValueError(f"opt_state holds no jaxamp.mixed_precision state, got "
                         f"{type(opt_state).__name__} {_short(opt_state)}; pass the opt_state "
                         "that jaxamp.equinox.init(model, tx) returns, with tx built by "
                         "jaxamp.mixed_precision")
    return mp


def _check_working(policy: Policy, params: Any) -> None:
    """The model must be the working model: each inexact array in its working dtype."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), dtype in zip(leaves, policy.working_dtypes(params), strict=True):
        if dtype is not None and jnp.dtype(x.dtype) != dtype:
            raise ValueError(
                f"model is not the working model: {tree_path_str(path)!r} is "
                f"{jnp.dtype(x.dtype).name} but policy {policy} works in "
                f"{jnp.dtype(dtype).name}; start from model, opt_state = "
                "jaxamp.equinox.init(model, tx) and pass on the model each step returns")


def _is_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def _check_no_state(args: Any) -> None:
    if any(_is_state(x) for x in jax.tree.leaves(args, is_leaf=_is_state)):
        raise ValueError("an eqx.nn.State is among the step's arguments but make_step was "
                         "built without has_state: build it with has_state=True and call "
                         "step(model, state, opt_state, *args), so that the state is never "
                         "cast and is kept as it was on a skipped step")


# --------------------------------------------------------------------------------------------
# The Equinox loss as an objective
# --------------------------------------------------------------------------------------------

def _split_outputs(out: Any, has_aux: bool, has_state: bool) -> Any:
    """Equinox's outputs (``loss``, ``(loss, aux)``, ``(loss, state)``, ``(loss, (state,
    aux))``) in the objective's order (``loss``, ``(loss, aux)``, ``(loss, state)``, ``(loss,
    state, aux)``)."""
    if not (has_aux or has_state):
        if isinstance(out, tuple):
            raise ValueError(f"loss_fn returned a tuple of {len(out)} where the loss alone is "
                             "expected: a (loss, aux) tuple needs has_aux=True, (loss, state) "
                             "has_state=True")
        return out
    shape = {(True, False): "(loss, aux)", (False, True): "(loss, state)",
             (True, True): "(loss, (state, aux))"}[(has_aux, has_state)]
    ok = isinstance(out, tuple) and len(out) == 2
    if ok and has_aux and has_state:
        ok = isinstance(out[1], tuple) and len(out[1]) == 2
    if not ok:
        raise ValueError(f"loss_fn must return {shape} with has_aux={has_aux} and "
                         f"has_state={has_state}, got {described(out)}; return that, or set "
                         "the flags to what loss_fn returns")
    if has_aux and has_state:
        return out[0], out[1][0], out[1][1]
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class _ModuleLoss:
    """``loss_fn(model, [state,] *args, **kwargs)`` as an :class:`~jaxamp.Objective` calls a
    loss: ``(params, batch, model_state=)``, the model and the arguments put back together from
    their arrays (``params``, ``batch``) and the rest (``static_model``, ``static_args``)."""

    loss_fn: Callable[..., Any]
    static_model: Any
    static_args: Any
    has_aux: bool
    has_state: bool

    def __call__(self, params: Any, batch: Any, model_state: Any = None) -> Any:
        model = eqx.combine(params, self.static_model)
        args, kwargs = eqx.combine(batch, self.static_args)
        if self.has_state:
            # A copy: eqx.nn.State.set invalidates the object it is called on, and the step
            # keeps the state it was handed for a skipped step.
            state = jax.tree.map(lambda x: x, model_state)
            out = self.loss_fn(model, state, *args, **kwargs)
        else:
            out = self.loss_fn(model, *args, **kwargs)
        return _split_outputs(out, self.has_aux, self.has_state)


def _objective(loss_fn: Callable[..., Any], static_model: Any, static_args: Any, *,
               has_aux: bool, has_state: bool, autocast: Any) -> Objective:
    return Objective(_ModuleLoss(loss_fn, static_model, static_args, has_aux, has_state),
                     has_aux=has_aux, has_model_state=has_state, autocast=autocast)


def _cast_args(policy: Policy, args: Any) -> Any:
    """The floating arrays of ``args`` in the compute dtype; an ``eqx.nn.State`` as it is."""
    return jax.tree.map(lambda x: x if _is_state(x) else policy.cast_to_compute(x), args,
                        is_leaf=_is_state)


# --------------------------------------------------------------------------------------------
# The three entry points
# --------------------------------------------------------------------------------------------

def init(model: Any, tx: optax.GradientTransformation) -> tuple[Any, Any]:
    """The working model and the optimizer state of ``tx`` (a :func:`jaxamp.mixed_precision`
    transform) for an Equinox ``model`` in any precision.

    The optimizer state is ``tx.init(eqx.filter(model, eqx.is_inexact_array))``: its fp32
    master holds the model's inexact arrays as given (an fp32 model is kept bit for bit). The
    working model is ``model`` with each inexact array cast to its working dtype (the policy's
    ``compute_dtype``, or an override's); every other leaf is ``model``'s own. This is what
    ``jaxamp.TrainState.create`` makes of ``eqx.partition(model, eqx.is_inexact_array)[0]``.

    Args:
      model: an ``equinox.Module``.
      tx: an optax transform wrapped by :func:`jaxamp.mixed_precision`, which carries the
        policy.

    Returns:
      ``(model, opt_state)``: the working model, and ``tx``'s state with the fp32 master and the
      loss scale.

    Raises:
      TypeError: ``model`` is not an ``equinox.Module``, or ``tx`` not an optax transform.
      ValueError: ``tx`` is a plain optax transform (no ``jaxamp.mixed_precision``).

    >>> import equinox as eqx, jax, optax, jaxamp
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    >>> model, opt_state = jaxamp.equinox.init(eqx.nn.Linear(2, 3, key=jax.random.key(0)), tx)
    >>> model.weight.dtype, jaxamp.state.get_master_params(opt_state).weight.dtype
    (dtype(bfloat16), dtype('float32'))
    """
    _check_model(model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    _check_tx(tx, params)
    state = TrainState.create(params=params, tx=tx)
    return eqx.combine(state.params, static), state.opt_state


@dataclasses.dataclass(frozen=True, eq=False)
class _ValueAndGrad:
    """What :func:`filter_value_and_grad` returns: ``(model, *args, **kwargs) -> (value,
    grads)``."""

    loss_fn: Callable[..., Any]
    state: MixedPrecisionState
    has_aux: bool
    autocast: bool | Mapping[str, Any]

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        _check_model(model)
        policy = self.state.policy
        params, static = eqx.partition(model, eqx.is_inexact_array)
        _check_working(policy, params)
        batch, static_args = eqx.partition((args, kwargs), eqx.is_array)
        if not self.autocast:
            batch = _cast_args(policy, batch)
        objective = _objective(self.loss_fn, static, static_args, has_aux=self.has_aux,
                               has_state=False, autocast=self.autocast)
        scaled = objective.scaled(policy, batch, self.state.loss_scale.loss_scale)
        (_, (loss, _, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(params,
                                                                              scaled.handed)
        return ((loss, aux) if self.has_aux else loss), grads


def filter_value_and_grad(loss_fn: Callable[..., Any], opt_state: Any, *,
                          has_aux: bool = False,
                          autocast: bool | Mapping[str, Any] = False
                          ) -> Callable[..., tuple[Any, Any]]:
    """``eqx.filter_value_and_grad(loss_fn)`` under the loss scale and policy that
    ``opt_state`` (the state of :func:`jaxamp.mixed_precision`) holds.

    The returned function takes what ``loss_fn`` takes, ``(model, *args, **kwargs)``, with
    ``model`` the working model (from :func:`init` or the last step). Its floating array
    arguments are cast to the compute dtype (under ``autocast`` they stay as given); an
    ``eqx.nn.State``, integer arrays, PRNG keys and non-array arguments are passed as they
    are. It differentiates ``loss * scale`` (the loss in fp32, the scale the state holds) with
    respect to the model's inexact arrays, and returns ``(loss, grads)``, or ``((loss, aux),
    grads)`` with ``has_aux``, as ``eqx.filter_value_and_grad`` does:

    * ``loss`` is the unscaled fp32 loss;
    * ``grads`` is a model-shaped tree of the *scaled* gradients in the working dtypes,
      ``None`` where the model holds no inexact array: what ``tx.update(grads, opt_state,
      eqx.filter(model, eqx.is_inexact_array))`` takes; it unscales them, checks them and skips
      a non-finite step. ``jaxamp.state.next_working_params`` then gives the new params in
      their working dtypes (``eqx.apply_updates`` would promote a bf16 param plus an fp32
      update to fp32).

    The loss scale is read from ``opt_state`` when the function is built: build it inside the
    step, from that step's ``opt_state`` (as MPX's ``filter_value_and_grad`` takes the step's
    scaling), not once for the whole run.

    A step written this way leaves the rest to its author: on a skipped step (``tx.update``
    returns zero updates), an ``eqx.nn.State`` returned in ``aux`` is the new one; keep the
    old where ``jaxamp.state.find_state(opt_state).health.grads_finite`` is False.
    :func:`make_step` does all of it.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs)``, returning a floating scalar loss (reduced
        in fp32 whatever its dtype), or ``(loss, aux)`` with ``has_aux``.
      opt_state: the optimizer state of a :func:`jaxamp.mixed_precision` transform, or of a
        harmless wrapper of it.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      autocast: run ``loss_fn`` under :func:`jaxamp.autocast` with the state's policy
        (``True``, or a dict of its options), for a model whose arrays meet fp32 inputs.

    Returns:
      A function ``(model, *args, **kwargs) -> (value, grads)``.

    Raises:
      TypeError: ``loss_fn`` is not callable, or the returned function is handed a model
        that is not an ``equinox.Module``.
      ValueError: ``opt_state`` holds no ``jaxamp.mixed_precision`` state, or the model is
        not the working model.

    >>> import equinox as eqx, jax, jax.numpy as jnp, optax, jaxamp
    >>> from jaxamp.state import get_loss_scale, next_working_params
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    >>> linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    >>> linear = eqx.tree_at(lambda m: (m.weight, m.bias), linear,
    ...                      (jnp.ones((1, 2)), jnp.zeros(1)))
    >>> model, opt_state = jaxamp.equinox.init(linear, tx)
    >>> def loss_fn(model, x):
    ...     return jnp.mean(jax.vmap(model)(x) ** 2)
    >>> loss, grads = jaxamp.equinox.filter_value_and_grad(loss_fn, opt_state)(
    ...     model, jnp.ones((4, 2)))
    >>> float(loss), grads.weight.dtype, float(get_loss_scale(opt_state).loss_scale)
    (4.0, dtype('float16'), 65536.0)
    >>> params = eqx.filter(model, eqx.is_inexact_array)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> model = eqx.combine(next_working_params(opt_state, params, updates), model)
    >>> # 4 * 2**16 overflows fp16: the step is skipped and the scale backs off
    >>> model.weight.tolist(), float(get_loss_scale(opt_state).loss_scale)
    ([[1.0, 1.0]], 32768.0)
    """
    _check_callable(loss_fn)
    state = _mixed_state(opt_state)
    # The autocast options, checked now rather than at the first call.
    autocast = _objective(loss_fn, None, None, has_aux=has_aux, has_state=False,
                          autocast=autocast).autocast
    return _ValueAndGrad(loss_fn, state, bool(has_aux), autocast)


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """What :func:`make_step` returns: ``(model, [state,] opt_state, *args, **kwargs) ->
    (model, [state,] opt_state, metrics)``."""

    loss_fn: Callable[..., Any]
    tx: optax.GradientTransformation
    has_aux: bool
    has_state: bool
    autocast: bool | Mapping[str, Any]

    @property
    def __name__(self) -> str:  # jax.jit, eqx.filter_jit and the audit name a function by it
        return "equinox_step"

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        positional = "(model, state, opt_state, *args)" if self.has_state else (
            "(model, opt_state, *args)")
        if len(args) < 1 + self.has_state:
            raise TypeError(f"step{positional} takes the model, "
                            f"{'the state, ' if self.has_state else ''}the optimizer state "
                            f"and loss_fn's other arguments; got {1 + len(args)} positional "
                            "argument(s)")
        state = args[0] if self.has_state else None
        opt_state, args = args[int(self.has_state)], args[1 + self.has_state:]
        _check_model(model)
        if self.has_state and maybe_find_state(state) is not None:
            raise TypeError(f"step{positional}: the optimizer state was passed where the "
                            "model state goes; pass the state first, then the opt_state")
        mp = _mixed_state(opt_state)
        if not self.has_state:
            _check_no_state((args, kwargs))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        _check_working(mp.policy, params)
        batch, static_args = eqx.partition((args, kwargs), eqx.is_array)
        objective = _objective(self.loss_fn, static, static_args, has_aux=self.has_aux,
                               has_state=self.has_state, autocast=self.autocast)
        train_state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=opt_state, model_state=state, tx=self.tx)
        new, metrics = make_train_step(objective)(train_state, batch)
        model = eqx.combine(new.params, static)
        if self.has_state:
            return model, new.model_state, new.opt_state, metrics
        return model, new.opt_state, metrics


def make_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, *,
              has_aux: bool = False, has_state: bool = False,
              autocast: bool | Mapping[str, Any] = False) -> Callable[..., tuple[Any, ...]]:
    """One training step of an Equinox model: ``step(model, opt_state, *args, **kwargs) ->
    (model, opt_state, metrics)``, or with ``has_state``, ``step(model, state, opt_state,
    *args, **kwargs) -> (model, state, opt_state, metrics)`` (the order of Equinox's own
    stateful examples). Pure: wrap it in ``eqx.filter_jit``.

    ``args`` and ``kwargs`` are ``loss_fn``'s, handed on after the model (and the state): the
    batch, a PRNG key for dropout, flags. The step is :func:`jaxamp.make_train_step`'s, on
    the model's inexact arrays (``eqx.partition(model, eqx.is_inexact_array)``) with the
    state as its model state, and returns the same metrics. Per step:

    1. the floating arrays among ``args`` and ``kwargs`` are cast to the compute dtype (under
       ``autocast`` they stay as given); integer arrays, PRNG keys and non-array arguments
       are handed on as they are;
    2. ``loss * scale`` is differentiated with respect to the model's inexact arrays, the loss
       in fp32, the scale the optimizer state holds;
    3. :func:`jaxamp.mixed_precision` unscales the gradients, checks them (and the loss), and
       updates the fp32 master, or skips the step and backs off the scale;
    4. the new model is the cast of the new master (its working dtypes), with every other leaf
       (static fields, integer arrays, PRNG keys, ``eqx.nn.Dropout``'s flags) as it was; on a
       skipped step the model, the inner optimizer state and the ``eqx.nn.State`` are
       bit-identical to those passed in.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs)``, or ``loss_fn(model, state, *args,
        **kwargs)`` with ``has_state``. It returns the loss (a floating scalar, reduced in
        fp32), ``(loss, aux)`` with ``has_aux``, ``(loss, state)`` with ``has_state`` and
        ``(loss, (state, aux))`` with both: the ``aux`` of ``eqx.filter_value_and_grad(loss_fn,
        has_aux=True)`` for a stateful model, so the same loss serves both.
      tx: an optax transform wrapped by :func:`jaxamp.mixed_precision`, the one
        :func:`init` was given.
      has_aux: ``loss_fn`` returns auxiliary outputs, returned as ``metrics["aux"]``.
      has_state: ``loss_fn`` takes an ``eqx.nn.State`` (``eqx.nn.make_with_state``:
        ``eqx.nn.BatchNorm``'s statistics) after the model and returns the new one. It is kept
        in its own dtypes, never cast; a skipped step returns the state it was handed.
      autocast: run ``loss_fn`` under :func:`jaxamp.autocast` with the policy of ``tx``:
        matmuls in the compute dtype, precision-sensitive ops in fp32, for a model whose
        arrays meet fp32 inputs. ``True``, or a dict of autocast's options.

    Returns:
      The step, a pure function. Its metrics are :func:`jaxamp.make_train_step`'s: ``loss``
      (fp32, unscaled), ``loss_scale`` (the one this step used), ``grads_finite``,
      ``skipped_steps``, ``grad_norm``, and the diagnostics.

    Raises:
      TypeError: ``loss_fn`` is not callable or ``tx`` not an optax transform; at a call, a
        model that is not an ``equinox.Module``, or the states in the wrong order.
      ValueError: ``tx`` is a plain optax transform; at a call, an ``opt_state`` with no
        ``jaxamp.mixed_precision`` state, a model that is not the working model, or an
        ``eqx.nn.State`` among the arguments without ``has_state``.

    >>> import equinox as eqx, jax, jax.numpy as jnp, optax, jaxamp
    >>> def loss_fn(model, x, y):
    ...     return jnp.mean((jax.vmap(model)(x) - y) ** 2)
    >>> tx = jaxamp.mixed_precision(optax.sgd(0.1), "mixed_float16")
    >>> linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    >>> linear = eqx.tree_at(lambda m: (m.weight, m.bias), linear,
    ...                      (jnp.zeros((1, 2)), jnp.zeros(1)))
    >>> model, opt_state = jaxamp.equinox.init(linear, tx)
    >>> step = eqx.filter_jit(jaxamp.equinox.make_step(loss_fn, tx))
    >>> x, y = jnp.ones((8, 2)), jnp.ones((8, 1))
    >>> for _ in range(3):  # fp16 gradients overflow at 2**16 and 2**15: two skipped steps
    ...     model, opt_state, metrics = step(model, opt_state, x, y)
    ...     print(float(metrics["loss"]), float(metrics["loss_scale"]),
    ...           bool(metrics["grads_finite"]), model.weight.tolist())
    1.0 65536.0 False [[0.0, 0.0]]
    1.0 32768.0 False [[0.0, 0.0]]
    1.0 16384.0 True [[0.199951171875, 0.199951171875]]
    """
    _check_callable(loss_fn)
    _check_tx(tx)
    # The autocast options, checked now rather than at the first call.
    autocast = _objective(loss_fn, None, None, has_aux=has_aux, has_state=has_state,
                          autocast=autocast).autocast
    return _Step(loss_fn, tx, bool(has_aux), bool(has_state), autocast)
