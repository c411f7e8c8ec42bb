"""Autocast's memory pass: what the backward pass keeps, and what it recomputes under
``recompute=True`` (private). The dtypes are the rules' (:mod:`._rules`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
from jax.ad_checkpoint import Offloadable
from jax.ad_checkpoint import Saveable
from jax.ad_checkpoint import checkpoint_name

from jaxamp._autocast import _ops
from jaxamp._autocast._rules import _pure_elementwise_like
from jaxamp._fp8 import OUTPUT_NAME
from jaxamp._fp8 import RESIDUAL_NAME
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import kind
from jaxamp._jaxpr import sub_jaxprs
from jaxamp._jaxpr import walk
from jaxamp._tree import is_floating_array

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context
    from jaxamp._autocast._context import _Facts


# Outputs kept for the backward pass under ``recompute=True``: the matmuls', and those of the
# few other ops that are costly to run twice (collectives, sorts, linear algebra, pooling
# windows). Everything else between them is recomputed from these. Not an FFT's: it runs in
# fp32 and its output is complex, which jax.checkpoint's saved values do not take on jax 0.10
# ("reduce_precision does not accept dtype complex64"); it runs again from its saved input.
_SAVED = frozenset((*MATMULS, "scaled_matmul_wrapper", "dot_product_attention_fwd",
                    "dot_product_attention_fwd_wrapper", "psum", "psum_invariant", "pmax",
                    "pmin", "all_gather", "all_gather_invariant", "all_to_all", "ppermute",
                    "reduce_scatter", "psum_scatter", "sort", "top_k", "cholesky", "lu",
                    "qr", "eigh", "svd", "triangular_solve", "reduce_window_sum",
                    "reduce_window_max", "reduce_window_min", "reduce_window", "cumsum",
                    "cumlogsumexp", "cumprod", "cummax", "cummin"))


# Debug callbacks that the policy "saves": JAX then runs them once, in the forward pass
# (``jax.debug.print`` under a checkpoint that recomputes would print twice).
_DEBUG_CALLBACKS = ("debug_callback", "debug_print")


_OPERAND = "jaxamp_matmul_operand"


_KEPT = "jaxamp_kept"


_OFFLOADED = "jaxamp_offloaded"


_VIEWS = ("convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
          "expand_dims", "copy")


def _saveable(prim: Any, *avals: Any, **params: Any) -> bool:
    """The ``jax.checkpoint`` policy of ``recompute=True``: the outputs of ``_SAVED`` ops and
    the matmuls' operands (named ``_OPERAND``), which their transposes read. The matmuls'
    outputs are named (``_KEPT``) where autocast binds them outside a model's own remat, and
    inside one where the model's policy saves them, so that the model's remat is kept: JAX
    applies the outermost policy inside a nested ``jax.checkpoint``. An FP8 matmul keeps its
    8-bit operands and its output (named), not its fp32 accumulator;
    ``jaxamp.ops.linear_softmax_cross_entropy`` its gradients (named ``ops.SAVED_NAME``), not
    its chunk loop to run again."""
    del avals
    if prim.name == "name":
        return params.get("name") in (_KEPT, _OPERAND, RESIDUAL_NAME, OUTPUT_NAME,
                                      _ops.SAVED_NAME)
    return prim.name in _SAVED and prim.name not in MATMULS or prim.name in _DEBUG_CALLBACKS


def _nothing_saveable(*_: Any, **__: Any) -> bool:
    """A model remat's policy ``None``: it saves nothing but its inputs."""
    return False



class _Memory:
    """The memory pass of ``recompute=False`` (and of an fp32 compute dtype): JAX's default,
    every intermediate the derivative reads is kept; nothing is named or recomputed but the
    fp32 regions (:mod:`._regions`). The interpreter asks it at each equation, after the rules
    (the dtype pass) have cast the inputs: it decides what the backward pass keeps and
    nothing of the dtypes."""

    def around(self, evaluate: Callable) -> Callable:
        """The whole evaluation, under the pass's ``jax.checkpoint`` policy."""
        return evaluate

    def arguments(self, facts: _Facts, arrays: Sequence[Any]) -> None:
        """Records ``fn``'s arguments."""
        del facts, arrays

    def operands(self, ctx: _Context, eqn: Any, invals: list) -> list:
        """A matmul's operands, as cast, named for what the backward pass keeps."""
        del ctx, eqn
        return invals

    def outputs(self, ctx: _Context, eqn: Any, invals: list, outs: list) -> list:
        """An equation's outputs as bound (from ``invals``, as cast), named for what the
        backward pass keeps."""
        del ctx, eqn, invals
        return outs

    def computed(self, ctx: _Context, eqn: Any, invals: list, outs: list, outer: str,
                 const_in: Sequence[bool]) -> None:
        """Records what ``outs`` are, from the equation's inputs as read (before the cast)."""
        del ctx, eqn, invals, outs, outer, const_in

    def region(self, ctx: _Context, invals: list, const_in: Sequence[bool],
               outs: list) -> None:
        """Records the outputs of an fp32 region, computed from ``invals``."""
        del ctx, invals, const_in, outs

    def entering_remat(self, ctx: _Context, eqn: Any,
                       invals: list) -> tuple[list, _Context]:
        """A model's own ``jax.checkpoint``: its inputs, and the context of its body."""
        del eqn
        return invals, ctx

    def scan_body(self, ctx: _Context, eqn: Any, run: Callable) -> Callable:
        """A ``scan``'s body as evaluated under the rules (``run``), as it runs each step."""
        del ctx, eqn
        return run

    def each_step(self, ctx: _Context) -> Callable[[list, list], None] | None:
        """What a scan tells of each step's slices of its stacked inputs, or ``None``."""
        del ctx
        return None


class _Recomputing(_Memory):
    """The memory pass of ``recompute=True`` under a half compute dtype: the whole evaluation
    under :func:`_saveable`'s policy, which keeps the matmuls' outputs and the operands that
    are not :attr:`_Fact.cheap` (an argument, a cast or view of one) nor :attr:`_Fact.near`
    the kept outputs (a softmax's probabilities, a GELU), and recomputes the rest. One per
    call: it collects the offloads of a model's remat policy as the call evaluates."""

    def __init__(self):
        # The names of the values a model's remat policy offloads, to its ``Offloadable``s.
        self.offloads: dict[str, Offloadable] = {}

    def _policy(self, prim: Any, *avals: Any, **params: Any) -> Any:
        """:func:`_saveable`, and for the values a model's remat policy offloads (named by
        :meth:`_kept_name`), that policy's own ``Offloadable``: JAX applies the outermost
        policy inside a nested ``jax.checkpoint``, so autocast's hands on the model's
        offloads."""
        if prim.name == "name" and params.get("name") in self.offloads:
            return self.offloads[params["name"]]
        return _saveable(prim, *avals, **params)

    def around(self, evaluate):
        return jax.checkpoint(evaluate, policy=self._policy)

    def arguments(self, facts, arrays):
        for a in arrays:
            facts.set_cheap(a)

    def operands(self, ctx, eqn, invals):
        facts = ctx.call.facts
        if ctx.model_remat is not None or eqn.primitive.name not in MATMULS:
            return invals
        return [checkpoint_name(x, _OPERAND) if is_floating_array(x) and not facts.cheap(x)
                and facts.near(x) is None else x for x in invals]

    def outputs(self, ctx, eqn, invals, outs):
        kept = self._kept_name(ctx, eqn, invals)
        if kept is not None:
            outs = [checkpoint_name(x, kept) if is_floating_array(x) else x for x in outs]
        if eqn.primitive.name in MATMULS or (kept == _KEPT and kind(eqn) is not None):
            ctx.call.facts.set_near_all(outs, 0)  # saved
        return outs

    def _kept_name(self, ctx: _Context, eqn: Any, invals: list) -> str | None:
        """The name under which the outputs of ``eqn`` are kept for the backward pass, or
        ``None``: ``_KEPT`` for a matmul's and a loop's outside a model's remat, and inside one
        for whatever the model's policy saves; what it offloads
        (``save_and_offload_only_these_names``, ``offload_dot_with_no_batch_dims``) is named
        for its memory kinds and offloaded so (:meth:`_policy`). The outputs of a loop and of
        a model's remat (as the interpreter asks) are kept as a matmul's are: recomputing one
        runs the loop or the remat'd block again (the final carry of a scan of layers, read by
        the loss after it, is every layer run twice)."""
        prim = eqn.primitive
        if ctx.model_remat is None:
            return _KEPT if prim.name in MATMULS or kind(eqn) in ("loop", "remat") else None
        try:
            decision = ctx.model_remat(prim, *[jax.typeof(x) for x in invals], **eqn.params)
        except Exception:  # noqa: BLE001 - a policy that cannot judge saves nothing extra
            return None
        if decision is True or decision is Saveable:
            return _KEPT
        if isinstance(decision, Offloadable):
            name = f"{_OFFLOADED}:{decision.src}:{decision.dst}"
            self.offloads[name] = decision
            return name
        return None

    def computed(self, ctx, eqn, invals, outs, outer, const_in):
        """A view of a cheap value is cheap (:meth:`_Facts.view`); the outputs of an
        elementwise op on near values are near, one op further."""
        if eqn.primitive.name in MATMULS or (eqn.primitive.name not in _VIEWS
                                             and not _pure_elementwise_like(ctx, eqn, outer)):
            return
        depth = _near_depth(ctx, invals, const_in)
        if depth is not None:
            ctx.call.facts.set_near_all(outs, depth + (0 if eqn.primitive.name in _VIEWS
                                                       else 1))

    def region(self, ctx, invals, const_in, outs):
        """Recomputed from its inputs: near when they are."""
        depth = _near_depth(ctx, invals, const_in)
        if depth is not None:
            ctx.call.facts.set_near_all(outs, depth + 1)

    def entering_remat(self, ctx, eqn, invals):
        """Its inputs are kept (named ``_KEPT``: what the model's remat saves, where
        autocast's policy would recompute them from further back), the arguments and their
        casts aside; inside, its policy alone decides (the outermost's, as JAX applies it)."""
        if ctx.model_remat is not None:
            return invals, ctx
        policy = eqn.params.get("policy") or _nothing_saveable
        return _kept(ctx, invals), dataclasses.replace(ctx, model_remat=policy)

    def scan_body(self, ctx, eqn, run):
        """Outside a model's remat, each step under ``jax.checkpoint`` with this policy, so
        that the backward pass recomputes each step's values in that step, from the step's
        inputs (kept, stacked by the scan). Without it, the checkpoint around the whole
        function runs the forward scan again before the backward one, and stacks every
        step's recomputed values (a layer-scanned transformer's attention probabilities, of
        all its layers at once). A scan of a model's remat'd blocks is left to the model's
        remat. The arguments keep inside the checkpoint's trace what the evaluation knows of
        them (cheap, or near kept values)."""
        if ctx.model_remat is not None or _holds_remat(eqn):
            return run

        def step(*args):
            args = _kept(ctx, args)

            def body(*traced):
                for outer, x in zip(args, traced, strict=True):
                    ctx.call.facts.inherit(x, outer)
                return run(*traced)
            # Inside a scan, no CSE can merge the recomputation with the forward pass (JAX's
            # advice for remat in scan), and barriers would only hinder XLA.
            return jax.checkpoint(body, policy=self._policy, prevent_cse=False)(*args)
        return step

    def each_step(self, ctx):
        """A slice of a cheap stacked array is cheap too."""
        facts = ctx.call.facts

        def each_step(slices: list, stacked: list) -> None:
            for x, whole in zip(slices, stacked, strict=True):
                if facts.cheap(whole):
                    facts.set_cheap(x)
        return each_step


def _holds_no_remat(closed: Any) -> bool:
    """Whether no equation of a traced function, at any depth, is a model's own remat."""
    return not any(kind(e) == "remat" for e, _ in walk(closed.jaxpr))


def _holds_remat(eqn: Any) -> bool:
    """Whether a higher-order equation's bodies hold a model's own remat."""
    return any(kind(e) == "remat" for body, _ in sub_jaxprs(eqn) for e, _ in walk(body))


def _kept(ctx: _Context, values: Sequence[Any]) -> list:
    """``values`` named ``_KEPT`` for the backward pass, the arguments and their casts aside
    (cheap: recomputed)."""
    facts = ctx.call.facts
    return [checkpoint_name(x, _KEPT) if is_floating_array(x) and not facts.cheap(x) else x
            for x in values]


def _near_depth(ctx: _Context, values: Sequence[Any], const_in: Sequence[bool]) -> int | None:
    """How many elementwise ops ``values`` are from saved matmul outputs and cheap values
    (the deepest of them); ``None`` where one of them is not near."""
    facts = ctx.call.facts
    depth = 0
    for x, c in zip(values, const_in, strict=True):
        if c or not is_floating_array(x) or facts.cheap(x):
            continue
        near = facts.near(x)
        if near is None:
            return None
        depth = max(depth, near)
    return depth
