"""A ``jax.nn.dot_product_attention`` call found in the jaxpr, run as cuDNN's fused kernel
where it can be (private)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
from jax import lax

from jaxamp._autocast._casts import _cast
from jaxamp._autocast._rules import _RULES
from jaxamp._autocast._rules import rule_for
from jaxamp._jaxpr import nested_stack

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context


def _fused_attention(ctx: _Context, call: Any, read: Callable, outer: str,
                     constant: set, body: Callable[..., Callable]) -> list | None:
    """An attention call (``jax.nn.dot_product_attention``'s, or one found by its structure)
    under a half compute dtype: cuDNN's kernel where the program is lowered for CUDA, its own
    equations under the rules elsewhere. None where the fused kernel is not an option (a rule
    other than the default on its matmul: an fp32 scope, :func:`full_precision`, an fp32
    region; a shape or dtype cuDNN does not take): its equations then run one by one. ``body``
    is the interpreter's way to evaluate a jaxpr under the rules."""
    stack = nested_stack(call.scores, outer)
    if rule_for(ctx, call.scores, stack) is not _RULES["compute"]:
        return None
    options = dict(call.options)
    has_bias, has_mask = options.pop("bias"), options.pop("mask")
    arrange = call.arrange or (lambda q, k, v, *rest: (
        q, k, v, rest[0] if has_bias else None, rest[-1] if has_mask else None))
    restore = call.restore or (lambda out: out)
    values = [read(v) for v in call.inputs]
    reads = [read(v) for v in call.reads]
    n = len(values)
    # Elsewhere its own equations, as they were traced (in a shard_map too), under the rules.
    explicit_body = body(ctx, call.equations, outer, [v in constant for v in call.reads],
                         attention=False)

    def fused(*args):
        q, k, v, bias, mask = arrange(*args[:n])
        q, k, v = (_cast(x, ctx.compute) for x in (q, k, v))
        bias = None if bias is None else _cast(bias, ctx.compute)
        out = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="cudnn",
                                           **options)
        return [restore(out)]

    def explicit(*args):
        return [_cast(x, ctx.compute) for x in explicit_body(*args[n:])]
    try:  # JAX checks cuDNN, the dtypes, head size and masks when it traces the call
        jax.eval_shape(fused, *values)
    except Exception:  # noqa: BLE001 - any refusal means: not this kernel
        return None
    return lax.platform_dependent(*values, *reads, cuda=fused, default=explicit)[0]
