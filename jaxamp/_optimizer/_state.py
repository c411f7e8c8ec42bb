"""The state of :func:`jaxamp.mixed_precision` and its readers: the state's fields (the master,
the inner optimizer's state, the loss scale, the health counters, the static policy and
storage), where it is in an optimizer state (wherever a harmless wrapper put it; a wrapping that
cannot be correct is refused with what to write instead), and what a step reads from it (the
fp32 value of every param, the loss scale, the working params, the new params after an
update)."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxamp._loss import check_loss
from jaxamp._optimizer._storage import Storage
from jaxamp._optimizer._storage import is_absent
from jaxamp._precision._loss_scale import LossScale
from jaxamp._precision._policy import Policy
from jaxamp._precision._policy import get_policy
from jaxamp._tree import find_with_path
from jaxamp._tree import parents_along
from jaxamp._tree import tree_path_str

__all__ = [
    "Health",
    "Master",
    "MixedPrecisionState",
    "as_transformation",
    "carried_storage",
    "check_same_structure",
    "find_state",
    "get_loss_scale",
    "get_master_params",
    "maybe_find_state",
    "next_working_params",
    "policy_of",
    "scale_loss",
    "storage_of",
    "working_params",
]


class Master(NamedTuple):
    """Where :func:`jaxamp.mixed_precision` keeps each param's fp32 value, as its ``master=`` option
    (:attr:`MixedPrecisionState.storage`) lays it out."""

    params: Any
    """A tree like the params: the fp32 master copy of each param that works in another dtype
    (``master="float32"``), ``optax.MaskedNode()`` for every other param."""
    compensation: Any = None
    """``master="kahan"``: a tree like the params holding each half-precision param's
    compensation (``uint16`` for bf16, float16 for fp16; ``MaskedNode`` elsewhere); else
    ``None``."""
    rounding_key: Any = None
    """The uint32 data of the PRNG key of stochastic rounding (``master="stochastic"`` or
    ``moments_dtype="bfloat16"``), else ``None``; it never changes: each applied step folds in
    ``applied_steps``, then the leaf's index."""


class Health(NamedTuple):
    """The counters of :func:`jaxamp.mixed_precision` and what its last update found."""

    applied_steps: jax.Array
    """An int32 scalar: the number of applied updates (saturates at 2**31 - 1)."""
    skipped_steps: jax.Array
    """An int32 scalar: the number of skipped, non-finite updates (saturates at 2**31 - 1)."""
    grads_finite: jax.Array
    """A bool scalar: whether the last update's gradients were all finite."""
    grad_norm: jax.Array
    """An fp32 scalar: the global L2 norm of the last update's unscaled gradients."""
    nonfinite_leaves: jax.Array
    """An int32 scalar: the number of gradient leaves holding an inf or nan at the last
    update."""
    first_nonfinite_leaf: jax.Array
    """An int32 scalar: the index (tree order, floating leaves) of the first of them, or -1;
    :func:`jaxamp.gradients.nonfinite_leaf_path` gives its path."""
    skips_at_min_scale: jax.Array
    """An int32 scalar: consecutive non-finite steps taken at the minimum loss scale (see
    ``LossScale.at_min_scale``); 0 after a finite step (saturates)."""
    stalled: jax.Array
    """A bool scalar, ``skips_at_min_scale >= stall_after``: the gradients keep overflowing
    where the loss scale cannot back off any further, so loss scaling cannot fix them."""

    @classmethod
    def create(cls) -> Health:
        """Before the first update: no step, finite, no bad leaf. Each field is a buffer of
        its own, so that the state can be donated."""
        def zero():
            return jnp.zeros((), jnp.int32)
        return cls(zero(), zero(), jnp.array(True), jnp.zeros((), jnp.float32), zero(),
                   jnp.full((), -1, jnp.int32), zero(), jnp.array(False))


class MixedPrecisionState(NamedTuple):
    """The state of :func:`jaxamp.mixed_precision`, nested by concern (optax's way): the master
    storage, the inner optimizer's state, the loss scale, the health counters, and the static
    policy and storage layout. Every leaf is an array.

    >>> import jax.numpy as jnp, optax

    >>> from jaxamp import mixed_precision
    >>> state = mixed_precision(optax.adam(1e-3), "mixed_bfloat16").init({"w": jnp.ones(2)})
    >>> int(state.health.applied_steps), state.master.params["w"].dtype, str(state.policy)
    (0, dtype('float32'), 'p=f32,c=bf16,o=f32')
    """

    master: Master
    """The fp32 values: ``params`` (the master copies), ``compensation`` (the Kahan
    compensation) and ``rounding_key``."""
    inner_state: Any
    """The wrapped optimizer's state, built on the fp32 params (its moments in
    ``moments_dtype`` when one is given)."""
    loss_scale: LossScale
    """The loss-scale state (:class:`~jaxamp.NoOpLossScale`, ``StaticLossScale`` or
    ``DynamicLossScale``) holding the scale for the next step."""
    health: Health
    """The counters and what the last update found: ``applied_steps``, ``skipped_steps``,
    ``grads_finite``, ``grad_norm``, ``nonfinite_leaves``, ``first_nonfinite_leaf``,
    ``skips_at_min_scale``, ``stalled``."""
    policy: Policy = Policy()
    """The :class:`~jaxamp.Policy` the transform was built with; static (part of the
    treedef, not a leaf), so it survives jit, pmap and every optax wrapper."""
    storage: Storage | None = None
    """How each param leaf's fp32 value is kept: the ``master=`` option and each leaf's working
    dtype; static like the policy. Every reader of the state (:func:`get_master_params`,
    :func:`next_working_params`) asks it."""


def as_transformation(tx: Any) -> Any:
    """``optax.MultiSteps`` is a class whose transform is ``.gradient_transformation()``."""
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    return tx


def check_same_structure(tree: Any, reference: Any, what: str = "gradient tree",
                          against: str = "params tree given to init") -> None:
    """``tree`` must be laid out like ``reference`` (a ``MaskedNode`` there stands for any
    leaf), with the same shapes where ``reference`` holds an array."""
    g = jax.tree.structure(tree)
    m = jax.tree.structure(reference, is_leaf=is_absent)
    if g != m:  # type: ignore[operator]
        raise ValueError(
            f"the {what} does not match the {against}: it has structure {g}, the params have "
            f"{m}. Differentiate the loss with respect to the same params the optimizer was "
            "initialised with.")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(tree)[0],
                            jax.tree.leaves(reference, is_leaf=is_absent), strict=True):
        if hasattr(x, "shape") and hasattr(y, "shape") and tuple(x.shape) != tuple(y.shape):
            noun = "gradient" if what == "gradient tree" else "value"
            raise ValueError(
                f"the {noun} of {tree_path_str(path)!r} has shape {tuple(x.shape)} but the "
                f"param given to init has shape {tuple(y.shape)}; differentiate the loss with "
                "respect to the same params the optimizer was initialised with.")


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

    >>> from jaxamp import mixed_precision
    >>> tx = optax.chain(mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))
    >>> int(find_state(tx.init({"w": jnp.ones(2)})).health.skipped_steps)
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
    """The policy a :func:`jaxamp.mixed_precision` transform carries, else ``None``.

    Takes an optimizer state or a transform, whose ``init`` is traced abstractly (nothing is
    allocated) on ``params``, or on an empty tree by default; pass the params for a transform
    whose init needs them (``optax.masked`` with a mask tree). A wrapping that cannot be
    correct raises, as in :func:`find_state`.

    >>> import optax

    >>> from jaxamp import mixed_precision
    >>> str(policy_of(mixed_precision(optax.sgd(0.1), "mixed_float16")))
    'p=f32,c=f16,o=f32'
    >>> str(policy_of(optax.chain(mixed_precision(optax.sgd(0.1), "mixed_bfloat16"))))
    'p=f32,c=bf16,o=f32'
    >>> policy_of(optax.sgd(0.1)) is None
    True
    """
    tx_or_state = as_transformation(tx_or_state)
    if isinstance(tx_or_state, optax.GradientTransformation):
        tx_or_state = jax.eval_shape(tx_or_state.init, {} if params is None else params)
    state = _locate(tx_or_state)
    return None if state is None else state.policy


def get_loss_scale(opt_state: Any) -> LossScale:
    """The loss-scale state held in ``opt_state`` (``.loss_scale`` is the fp32 scale).

    >>> import jax.numpy as jnp, optax

    >>> from jaxamp import mixed_precision
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> float(get_loss_scale(state).loss_scale)
    65536.0
    """
    return find_state(opt_state).loss_scale


def get_master_params(opt_state: Any, params: Any = None) -> Any:
    """The fp32 value of every param: the master params held in ``opt_state``.

    Without ``params``, the master copies in the state (``master="float32"``, where every
    param works in another dtype than ``param_dtype``). With the working ``params``, every
    param's value in ``param_dtype`` under any ``master=`` option: the master copy, ``param +
    compensation`` (``"kahan"``), or the param itself (a param that is its own master, and
    ``"stochastic"``/``"none"``). :attr:`jaxamp.TrainState.master_params` passes them.

    >>> import jax.numpy as jnp, optax

    >>> from jaxamp import mixed_precision
    >>> tx = mixed_precision(optax.sgd(0.1), "mixed_bfloat16")
    >>> get_master_params(tx.init({"w": jnp.ones(2, jnp.bfloat16)}))["w"].dtype
    dtype('float32')
    >>> tx = mixed_precision(optax.sgd(0.1), "mixed_bfloat16", master="kahan")
    >>> w = jnp.float32(1.0 + 2.0**-10)  # between two bf16 values
    >>> state = tx.init({"w": w})
    >>> float(get_master_params(state, {"w": w.astype(jnp.bfloat16)})["w"])
    1.0009765625
    """
    state = find_state(opt_state)
    if params is None:
        masters = jax.tree.leaves(state.master.params, is_leaf=is_absent)
        if any(is_absent(m) for m in masters):
            raise ValueError(
                "this optimizer state keeps no separate master copy of some params (a param "
                "that works in param_dtype is its own master; master='kahan', 'stochastic' and "
                "'none' keep none): pass the working params, get_master_params(opt_state, "
                "params), or read jaxamp.TrainState.master_params")
        return state.master.params
    check_same_structure(params, state.master.params, what="params")
    return carried_storage(state).view(params, state.master.params, state.master.compensation)


def carried_storage(state: MixedPrecisionState) -> Storage:
    if state.storage is None:
        raise ValueError("this MixedPrecisionState carries no storage: it was built by hand, "
                         "not by tx.init. Build it with jaxamp.mixed_precision(...).init(params)")
    return state.storage


def next_working_params(opt_state: Any, params: Any, updates: Any) -> Any:
    """The working params after ``updates`` (from this transform's ``update``): what
    ``optax.apply_updates(params, updates)`` gives, without its promotion of bf16 + fp32 (so
    it runs under ``jax.numpy_dtype_promotion("strict")``), and read at the source where
    there is a master: its cast.

    >>> import jax, jax.numpy as jnp, optax

    >>> from jaxamp import mixed_precision
    >>> tx = mixed_precision(optax.sgd(0.25), "mixed_bfloat16", master="kahan")
    >>> state, params = tx.init({"w": jnp.ones(2)}), {"w": jnp.ones(2, jnp.bfloat16)}
    >>> updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    >>> with jax.numpy_dtype_promotion("strict"):
    ...     new = next_working_params(state, params, updates)
    >>> new["w"].dtype, new["w"].tolist()
    (dtype(bfloat16), [0.75, 0.75])
    """
    state = find_state(opt_state)
    return carried_storage(state).next_working(params, updates, state.master.params)


def storage_of(state: MixedPrecisionState, params: Any) -> Any:
    """A tree like the params holding, per param, the array its fp32 value is updated on: the
    master copy, else the compensation, else the param itself. Its shardings are where the
    data-parallel step reduces the gradients to and where it computes the new params."""
    return carried_storage(state).holders(params, state.master.params, state.master.compensation)


def working_params(opt_state: Any, policy: Any = None) -> Any:
    """The working params implied by ``opt_state``: the master cast to each working dtype.

    ``policy`` defaults to the one the state carries. Needs a master copy of every param
    (``master="float32"`` under a mixed policy); the other states hold the working params
    nowhere but in the params themselves.

    >>> import jax.numpy as jnp, optax

    >>> from jaxamp import mixed_precision
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> working_params(state)["w"].dtype
    dtype('float16')
    """
    state = find_state(opt_state)
    policy = state.policy if policy is None else get_policy(policy)
    return policy.cast_params_to_compute(get_master_params(state))


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Returns ``loss`` in fp32 multiplied by the current loss scale held in ``opt_state``.

    Differentiate this (not the raw loss) and hand the gradients to ``tx.update``.
    ``opt_state`` may be the :class:`MixedPrecisionState` itself or any state that
    :func:`find_state` accepts, such as flax's ``TrainState.opt_state``.

    >>> import jax.numpy as jnp, optax

    >>> from jaxamp import mixed_precision
    >>> state = mixed_precision(optax.sgd(0.1), "mixed_float16").init({"w": jnp.ones(2)})
    >>> float(scale_loss(jnp.float16(0.5), state))
    32768.0
    """
    loss = check_loss(loss, scalar="the loss must be a scalar",
                      floating="the loss must be floating")
    return get_loss_scale(opt_state).scale(loss)
