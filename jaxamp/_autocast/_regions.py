"""fp32 regions: computed in fp32 from their half-precision inputs, recomputed for the backward
pass (private)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import source_info_util

from jaxamp._autocast._casts import _cast
from jaxamp._autocast._rules import _FLOAT32_RULE
from jaxamp._autocast._rules import _pure_elementwise_like
from jaxamp._autocast._rules import rule_for
from jaxamp._jaxpr import CALLS
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import Level
from jaxamp._jaxpr import Literal
from jaxamp._jaxpr import body as _jaxpr_body
from jaxamp._jaxpr import kind
from jaxamp._jaxpr import nested_stack
from jaxamp._tree import is_floating_array

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context


_REGION_WINDOW = 48  # equations scanned past the last one that joined a region


def _look_behind(ctx: _Context, level: Level, members: list[int], region_vars: set,
                 env: dict, outer: str) -> list[int]:
    """Pulls into the region the elementwise ops before it whose only use is the region (the
    ``x * x`` of a variance, computed in the compute dtype from a half input): recomputed in
    fp32 inside the region, their half-precision results are no longer saved."""
    member_set = set(members)
    for _ in range(4):
        added = False
        for j in sorted(member_set):
            for v in level.eqns[j].invars:
                if isinstance(v, Literal) or v in region_vars or v in level.outvars:
                    continue
                i = level.producer.get(v)
                if i is None or i in member_set:
                    continue
                eqn = level.eqns[i]
                if (eqn.primitive.name in CALLS or not _pure_elementwise_like(ctx, eqn, outer)
                        or not all(c in member_set for c in level.consumers.get(v, ()))
                        or len(eqn.outvars) != 1
                        or not all(isinstance(u, Literal) or u in env or u in region_vars
                                   for u in eqn.invars)):
                    continue
                member_set.add(i)
                region_vars.update(eqn.outvars)
                added = True
        if not added:
            break
    return sorted(member_set)


def _feeds_only_matmuls(level: Level, i: int) -> bool:
    """An upcast whose only consumers are matmuls (flax's ``promote_dtype`` of a kernel) is no
    region: the matmul takes the half-precision value it came from (``_downcast_source``)."""
    eqn = level.eqns[i]
    if eqn.primitive.name != "convert_element_type":
        return False
    users = [level.eqns[j] for v in eqn.outvars for j in level.consumers.get(v, ())]
    return bool(users) and all(u.primitive.name in MATMULS for u in users) and not any(
        v in level.outvars for v in eqn.outvars)


def _is_seed(ctx: _Context, eqn: Any, invals: list, outer: str) -> bool:
    """A precision-sensitive op on a half-precision input opens an fp32 region, and so does an
    explicit upcast of one (flax's norms cast their input to fp32 for the statistics)."""
    half_in = any(is_floating_array(x) and jnp.dtype(x.dtype) != jnp.float32 for x in invals)
    if not half_in or not _pure_elementwise_like(ctx, eqn, outer):
        return False
    if eqn.primitive.name == "convert_element_type":
        return jnp.dtype(eqn.outvars[0].aval.dtype) == jnp.float32
    return rule_for(ctx, eqn, nested_stack(eqn, outer)).opens_region


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def _rounded_on_the_way(ctx: _Context, level: Level, v: Any, members: set[int],
                        inputs: list, outer: str) -> bool:
    """Whether the region hands ``v`` on in the compute dtype: a full-size value read outside
    the region by the ops between the matmuls (the activations' elementwise ops, a nested
    function such as a model's remat'd block), or returned by a remat's body to its caller's
    ops (a remat'd block's output; what a called or custom function returns stays as it is,
    and what ``fn`` returns is cast to ``output_dtype``). A statistic or a
    sum (smaller than the region's largest floating input), which any op may read at fp32 for
    almost no memory, a value read by a loop or a branch (:func:`_loops`) and a value read by
    another fp32 op stay fp32: no statistic computed in
    fp32 is rounded on its way to the next fp32 op."""
    outside = [level.eqns[c] for c in level.consumers.get(v, ()) if c not in members]
    leaves = ctx.remat_body and v in level.outvars  # read by the caller's ops
    if not (outside or leaves) or not is_floating_array(v.aval):
        return False
    largest = max((_size(u) for u in inputs if is_floating_array(u.aval)), default=0)
    if _size(v) < largest or any(_loops(e) for e in outside):
        return False
    return not any(rule_for(ctx, e, nested_stack(e, outer)).opens_region for e in outside)


def _loops(eqn: Any) -> bool:
    """A loop or a branch, whose body may carry the value from step to step: a decay
    ``exp(-exp(nu))`` near 1 rounded to bf16 is 1, and a recurrence compounds it."""
    return kind(eqn) in ("loop", "branch")


def _run_region(ctx: _Context, level: Level, seed: int, env: dict, read: Callable,
                done: set[int], outer: str, constant: set, run_equation: Callable[..., list],
                body: Callable[..., Callable]) -> None:
    """Grows the region from ``seed`` over the equations that consume its values, evaluates it
    in fp32 under ``jax.checkpoint`` (so that only its inputs are kept for the backward pass,
    and its fp32 intermediates are recomputed), and casts the values it hands on to the
    compute dtype. Equations that do not depend on the region are evaluated first
    (``run_equation`` and ``body``: the interpreter's way to evaluate an equation, and a
    jaxpr, under the rules)."""
    members, region_vars = [seed], set(level.eqns[seed].outvars)
    blocked: set[Any] = set()
    last = seed
    for j in range(seed + 1, len(level.eqns)):
        if j - last > _REGION_WINDOW:
            break
        if j in done:
            continue
        eqn = level.eqns[j]
        ins = {v for v in eqn.invars if not isinstance(v, Literal)}
        if ins & blocked:
            blocked.update(eqn.outvars)
        elif ins & region_vars:
            if _pure_elementwise_like(ctx, eqn, outer):
                members.append(j)
                region_vars.update(eqn.outvars)
                last = j
            else:
                blocked.update(eqn.outvars)
        elif all(v in env for v in ins) and not _feeds_only_matmuls(level, j) and _is_seed(
                ctx, eqn, [read(v) for v in eqn.invars],
                outer):  # another upcast or fp32 op of the region's inputs: it belongs here
            members.append(j)
            region_vars.update(eqn.outvars)
            last = j
        elif all(v in env for v in ins):  # independent of the region: run it now
            outs = run_equation(ctx, eqn, read, outer, constant)
            env.update(zip(eqn.outvars, outs, strict=True))
            done.add(j)
        else:
            blocked.update(eqn.outvars)
    members = _look_behind(ctx, level, members, region_vars, env, outer)
    member_set = set(members)
    eqns = [level.eqns[j] for j in members]
    inputs = list(dict.fromkeys(v for e in eqns for v in e.invars
                                if not isinstance(v, Literal) and v not in region_vars))
    exports = [v for v in dict.fromkeys(v for e in eqns for v in e.outvars)
               if v in level.outvars or any(c not in member_set
                                            for c in level.consumers.get(v, ()))]
    handed_on = [_rounded_on_the_way(ctx, level, v, member_set, inputs, outer)
                 for v in exports]

    inside = dataclasses.replace(ctx, regions=False, all_float32=True)

    def region(*values):
        local = dict(zip(inputs, values, strict=True))
        wide: dict = {}  # each value cast to fp32 once, however many ops read it

        def read(v):
            if isinstance(v, Literal):
                return _cast(v.val, jnp.float32)
            if v not in wide:
                wide[v] = _cast(local[v], jnp.float32)
            return wide[v]
        for eqn in eqns:
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (source_info_util.user_context(eqn.source_info.traceback,
                                                name_stack=name_stack), eqn.ctx.manager):
                ins = [read(v) for v in eqn.invars]
                call = _jaxpr_body(eqn, ("call",))
                if call is not None:  # a jitted function: all of it in fp32
                    outs = body(inside, call, nested_stack(eqn, outer))(*ins)
                else:
                    outs = ctx.call.memory.outputs(ctx, eqn, ins,
                                                   _FLOAT32_RULE.bind(ctx, eqn, ins))
            for v, x in zip(eqn.outvars, outs, strict=True):
                local[v] = x
        out = []
        for v, on in zip(exports, handed_on, strict=True):
            eqn = level.producing(v)  # the cast is the user's op's: its source line and scope
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
                out.append(_cast(local[v], ctx.compute) if on else local[v])
        return out

    invals = [env[v] for v in inputs]
    # Inside a model's remat the region is recomputed with the rest of it: its own checkpoint
    # would only keep its inputs for the backward pass (JAX keeps a nested remat's inputs).
    outs = (region if ctx.model_remat is not None else jax.checkpoint(region))(*invals)
    for v, x in zip(exports, outs, strict=True):
        env[v] = x
    ctx.call.memory.region(ctx, invals, [v in constant for v in inputs], outs)
    done.update(members)
