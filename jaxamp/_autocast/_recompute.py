"""What autocast keeps for the backward pass under ``recompute=True``, and what it recomputes
(private)."""

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

from jaxamp import ops
from jaxamp._fp8 import OUTPUT_NAME
from jaxamp._fp8 import RESIDUAL_NAME
from jaxamp._jaxpr import MATMULS
from jaxamp._tree import is_floating_array

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context


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


def _policy(offloads: dict) -> Callable[..., Any]:
    """:func:`_saveable`, and for the values a model's remat policy offloads (named by
    :func:`_kept_name`), that policy's own ``Offloadable``: JAX applies the outermost policy
    inside a nested ``jax.checkpoint``, so autocast's hands on the model's offloads.
    ``offloads`` is the call's (:class:`_Call`), filled as it evaluates."""
    def policy(prim: Any, *avals: Any, **params: Any) -> Any:
        if prim.name == "name" and params.get("name") in offloads:
            return offloads[params["name"]]
        return _saveable(prim, *avals, **params)
    return policy


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
                                      ops.SAVED_NAME)
    return prim.name in _SAVED and prim.name not in MATMULS or prim.name in _DEBUG_CALLBACKS


def _nothing_saveable(*_: Any, **__: Any) -> bool:
    """A model remat's policy ``None``: it saves nothing but its inputs."""
    return False


def _kept_name(ctx: _Context, prim: Any, invals: list, params: Any) -> str | None:
    """The name under which the outputs of ``prim`` are kept for the backward pass, or
    ``None``: ``_KEPT`` for a matmul's outside a model's remat, and inside one for whatever the
    model's policy saves; what it offloads (``save_and_offload_only_these_names``,
    ``offload_dot_with_no_batch_dims``) is named for its memory kinds and offloaded so
    (:func:`_policy`)."""
    if not ctx.call.facts.recompute:
        return None
    if ctx.model_remat is None:
        return _KEPT if prim.name in MATMULS else None
    try:
        decision = ctx.model_remat(prim, *[jax.typeof(x) for x in invals], **params)
    except Exception:  # noqa: BLE001 - a policy that cannot judge saves nothing extra
        return None
    if decision is True or decision is Saveable:
        return _KEPT
    if isinstance(decision, Offloadable):
        name = f"{_OFFLOADED}:{decision.src}:{decision.dst}"
        ctx.call.offloads[name] = decision
        return name
    return None


def _recomputed_in_its_step(ctx: _Context, run: Callable) -> Callable:
    """A scan's body under ``recompute=True``, outside a model's remat: under
    ``jax.checkpoint`` with autocast's policy, so that the backward pass recomputes each step's
    values in that step, from the step's inputs (kept, stacked by the scan). Without it, the
    checkpoint around the whole function runs the forward scan again before the backward one,
    and stacks every step's recomputed values (a layer-scanned transformer's attention
    probabilities, of all its layers at once). The arguments keep inside the checkpoint's
    trace what the evaluation knows of them (cheap, or near kept values)."""
    def step(*args):
        args = _kept(ctx, args)

        def body(*traced):
            for outer, x in zip(args, traced, strict=True):
                ctx.call.facts.inherit(x, outer)
            return run(*traced)
        # Inside a scan, no CSE can merge the recomputation with the forward pass (JAX's
        # advice for remat in scan), and barriers would only hinder XLA.
        return jax.checkpoint(body, policy=_policy(ctx.call.offloads),
                              prevent_cse=False)(*args)
    return step


def _entering_model_remat(ctx: _Context, eqn: Any, invals: list) -> tuple[list, _Context]:
    """A model's own ``jax.checkpoint`` under ``recompute=True``: its inputs are kept (named
    ``_KEPT``: what the model's remat saves, where autocast's policy would recompute them from
    further back), the arguments and their casts aside; inside, its policy alone decides."""
    if ctx.model_remat is not None:  # nested: the outermost model remat's policy rules
        return invals, ctx
    policy = eqn.params.get("policy") or _nothing_saveable
    return _kept(ctx, invals), dataclasses.replace(ctx, model_remat=policy)


def _kept(ctx: _Context, values: Sequence[Any]) -> list:
    """``values`` named ``_KEPT`` for the backward pass, the arguments and their casts aside
    (cheap: recomputed)."""
    facts = ctx.call.facts
    return [checkpoint_name(x, _KEPT) if is_floating_array(x) and not facts.cheap(x) else x
            for x in values]


def _each_scan_step(ctx: _Context) -> Callable[[list, list], None] | None:
    """Under ``recompute=True``, a slice of a cheap stacked array is cheap too."""
    facts = ctx.call.facts
    if not facts.recompute:
        return None

    def each_step(slices: list, stacked: list) -> None:
        for x, whole in zip(slices, stacked, strict=True):
            if facts.cheap(whole):
                facts.set_cheap(x)
    return each_step
