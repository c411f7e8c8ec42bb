"""The objective: the user's loss and how to call it, one description for the step and every
diagnosis of it.

:func:`jaxamp.make_train_step` trains an :class:`Objective`, and
:func:`jaxamp.explain_overflow` re-runs the one a step holds (``step.objective``): the calling
convention (``model_state=``, ``rng=``, the outputs), autocast under the state's policy and the
FP8 metadata that the step hands the loss are written here once.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import jax

from jaxamp import _model_state
from jaxamp._autocast import autocast as _autocast
from jaxamp._loss import check_loss
from jaxamp._loss import split_outputs
from jaxamp._precision._policy import Policy

__all__ = ["Objective", "Scaled", "objective_of"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss a train step minimises and how it is called.

    ``loss_fn`` is called as ``loss_fn(params, batch)``, plus ``model_state=`` when
    ``has_model_state`` and ``rng=`` when ``has_rng``. It returns the loss, or a tuple:
    ``(loss, aux)`` with ``has_aux``, ``(loss, new_model_state)`` with ``has_model_state``, and
    ``(loss, new_model_state, aux)`` with both. The loss must be a floating scalar; it is
    reduced in fp32 whatever the compute dtype. With ``autocast``, ``loss_fn`` runs under
    :func:`jaxamp.autocast` with the state's policy (the ``mixed_fp8`` policy's FP8 matmuls
    included).

    Build it once and hand it to :func:`jaxamp.make_train_step`; the step keeps it as
    ``step.objective``, and :func:`jaxamp.explain_overflow` takes the step, so a diagnosis
    runs the program that trained.

    >>> import jax.numpy as jnp, jaxamp
    >>> objective = jaxamp.Objective(lambda p, b: jnp.mean((b @ p) ** 2), autocast=True)
    >>> step = jaxamp.make_train_step(objective)
    >>> step.objective is objective
    True
    """

    loss_fn: Callable[..., Any]
    """The loss, in terms of the working params and a (cast) batch."""
    has_aux: bool = False
    """``loss_fn`` also returns auxiliary outputs (the step's ``metrics["aux"]``)."""
    has_model_state: bool = False
    """``loss_fn`` takes ``model_state=`` and returns the new one."""
    has_rng: bool = False
    """``loss_fn`` takes ``rng=``."""
    autocast: bool | Mapping[str, Any] = dataclasses.field(default=False, hash=False)
    """Run ``loss_fn`` under :func:`jaxamp.autocast` with the state's policy: ``True``, or a
    dict of autocast's other options (``{"recompute": False}``, ``{"rules": ...,
    "fp32_scopes": ...}``), checked when the objective is built."""

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(self.loss_fn).__name__} "
                            f"{self.loss_fn!r}; pass a function loss_fn(params, batch) -> loss")
        for name in ("has_aux", "has_model_state", "has_rng"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "autocast", _autocast_options(self.autocast))
        _check_signature(self.loss_fn, {"model_state": self.has_model_state,
                                        "rng": self.has_rng})

    def under(self, policy: Policy) -> Callable[..., Any]:
        """``loss_fn`` as the step calls it under ``policy``: wrapped by
        :func:`jaxamp.autocast` with ``autocast``'s options."""
        if not self.autocast:
            return self.loss_fn
        options = self.autocast if isinstance(self.autocast, Mapping) else {}
        return _autocast(self.loss_fn, policy, **options)

    def batch_under(self, policy: Policy, batch: Any) -> Any:
        """The batch as ``loss_fn`` gets it under ``policy``: its floating leaves cast to the
        compute dtype, or as given under ``autocast``, whose rules decide each op's dtype (as
        PyTorch's autocast never casts its inputs): Fourier features ``sin(2^k x)`` of fp32
        positions keep their fp32 inputs."""
        return batch if self.autocast else policy.cast_to_compute(batch)

    def scaled(self, policy: Policy, batch: Any, scale: jax.Array, model_state: Any = None,
               rng: Any = None) -> Scaled:
        """The scaled loss of one (cast) micro-batch, to differentiate: a function of the params
        and the handed model-state nodes (FP8 metadata), with what they saw."""
        model_state = model_state if self.has_model_state else None
        nodes = _model_state.find(model_state)
        return Scaled(self, self.under(policy), batch, scale, model_state, rng, nodes,
                      _model_state.hand(nodes, scale))


@dataclasses.dataclass(frozen=True, eq=False)
class Scaled:
    """``loss * scale`` of one micro-batch as a function of the params and the handed
    model-state nodes: ``fn(params, handed) -> (loss * scale, (loss, new_model_state, aux))``.

    Each node of the model state that the step updates (:mod:`jaxamp._model_state`: an
    :class:`~jaxamp.fp8.Fp8State`, :attr:`nodes`) is handed to ``loss_fn`` as it makes itself
    for this loss scale (:attr:`handed`), and is differentiated: its cotangent tells what it saw
    (:meth:`seen`). The new model state holds the nodes as they came in; the step updates them
    from what they saw."""

    objective: Objective
    loss_fn: Callable[..., Any]
    batch: Any
    scale: jax.Array
    model_state: Any
    rng: Any
    nodes: list
    """The model state's nodes the step updates, in tree order."""
    handed: list
    """The nodes as ``loss_fn`` receives them under this loss scale."""

    def seen(self, cotangents: list) -> list:
        """What each node saw, from the cotangents of :attr:`handed`."""
        return _model_state.seen(self.nodes, cotangents, self.scale)

    def __call__(self, params: Any, handed: list) -> tuple[jax.Array, tuple[Any, Any, Any]]:
        objective, nodes = self.objective, self.nodes
        kwargs: dict[str, Any] = {}
        if objective.has_model_state:
            kwargs["model_state"] = _model_state.replace(self.model_state, handed)
        if objective.has_rng:
            kwargs["rng"] = self.rng
        with _model_state.recording(tracked=bool(nodes)):
            out = self.loss_fn(params, self.batch, **kwargs)
        loss, new_model_state, aux = split_outputs(out, objective.has_aux,
                                                   objective.has_model_state)
        if nodes:
            new_model_state = _model_state.replace(new_model_state, nodes,
                                                   what="the model state loss_fn returned")
        loss = check_loss(loss)
        return loss * self.scale, (loss, new_model_state, aux)


_AUTOCAST_OPTIONS = ("rules", "fp32_scopes", "recompute")


def _check_signature(loss_fn: Callable[..., Any], flags: Mapping[str, bool]) -> None:
    """A keyword the flags hand ``loss_fn`` that it does not take, or one it requires that
    they do not hand it, named when the step is built (a ``TypeError`` from inside the traced
    step, nine frames deep, named neither the flag nor the fix)."""
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a builtin or a C callable: nothing to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name, given in flags.items():
        flag = f"has_{name}"
        p = params.get(name)
        takes = p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                              inspect.Parameter.KEYWORD_ONLY)
        if given and not takes:
            raise TypeError(f"{flag}=True hands loss_fn {name}=, but "
                            f"{getattr(loss_fn, '__name__', 'loss_fn')}{inspect.signature(loss_fn)}"
                            f" takes no {name} argument: add one, or leave {flag} out")
        if not given and p is not None and takes and p.default is inspect.Parameter.empty:
            raise TypeError(f"{getattr(loss_fn, '__name__', 'loss_fn')}"
                            f"{inspect.signature(loss_fn)} requires {name}=, which the step "
                            f"hands it only with {flag}=True: pass {flag}=True to "
                            "make_train_step (or jaxamp.Objective)")


def _autocast_options(autocast: Any) -> bool | Mapping[str, Any]:
    """``autocast`` as the objective keeps it: ``False``, ``True`` (autocast's defaults), or a
    dict of its options, checked by :func:`jaxamp.autocast` itself."""
    if not isinstance(autocast, Mapping):
        if autocast is None or isinstance(autocast, bool | int):
            return bool(autocast)
        raise TypeError(f"autocast must be True, False or a dict of jaxamp.autocast's options "
                        f"({', '.join(_AUTOCAST_OPTIONS)}), got {type(autocast).__name__} "
                        f"{autocast!r}")
    unknown = [k for k in autocast if k not in _AUTOCAST_OPTIONS]
    if unknown:
        hint = (" (the policy is the train state's)" if "policy" in unknown else "")
        raise TypeError(f"autocast={{...}} takes jaxamp.autocast's options "
                        f"{', '.join(_AUTOCAST_OPTIONS)}; got {', '.join(map(repr, unknown))}"
                        f"{hint}")
    options = dict(autocast)
    _autocast(lambda: None, **options)  # its checks, with the options named
    return options or True


def objective_of(loss_fn: Any, flags: Mapping[str, Any]) -> Objective:
    """``loss_fn`` with the flags given, or an :class:`Objective` (with no flags)."""
    if isinstance(loss_fn, Objective):
        given = {k: v for k, v in flags.items() if v}
        if given:
            named = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise TypeError(f"{named} is the objective's; an Objective already says how "
                            f"loss_fn is called: build it with jaxamp.Objective(loss_fn, "
                            f"{named})")
        return loss_fn
    return Objective(loss_fn, **flags)
