"""Autocast's interpreter: a jaxpr evaluated again, equation by equation, under the rules
(private)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.extend import source_info_util

from jaxamp._autocast._attention import find_calls as attention_calls
from jaxamp._autocast._casts import _cast
from jaxamp._autocast._casts import _downcast_source
from jaxamp._autocast._context import _Context
from jaxamp._autocast._fused import _fused_attention
from jaxamp._autocast._recompute import _VIEWS
from jaxamp._autocast._regions import _feeds_only_matmuls
from jaxamp._autocast._regions import _is_seed
from jaxamp._autocast._regions import _run_region
from jaxamp._autocast._rules import _Compute
from jaxamp._autocast._rules import rule_for
from jaxamp._jaxpr import HIGHER_ORDER
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import Interpreter
from jaxamp._jaxpr import Level
from jaxamp._jaxpr import Literal
from jaxamp._jaxpr import evaluate
from jaxamp._jaxpr import nested_stack
from jaxamp._tree import is_floating_array


def _evaluate(ctx: _Context, jaxpr: Any, consts: list, args: list, outer: str,
              const_args: Sequence[bool] | None = None, attention: bool = True) -> list:
    """Evaluates ``jaxpr`` under the rules: the package's one loop
    (:func:`jaxamp._jaxpr.evaluate`), each equation by :func:`_run_equation`, an attention
    call taken whole (``attention``: but in the body of one), and an fp32 region taken whole
    where a seed opens one. ``const_args`` flags the arguments that are compile-time constants
    in the caller (a Python number passed to a jitted function)."""
    constant = _constants(jaxpr, const_args)
    level = Level(jaxpr) if ctx.regions else None  # the one index of this level
    calls = (attention_calls(level) if level is not None and attention
             and ctx.rules.get("dot_general") != "fp8" else {})

    return evaluate(jaxpr, consts, args, _Autocasting(ctx, constant, level, calls), outer)


class _Autocasting(Interpreter):
    """Each equation by :func:`_run_equation`; an attention call taken whole, and an fp32
    region where a seed opens one."""

    def __init__(self, ctx: _Context, constant: set, level: Level | None, calls: dict):
        self.ctx, self.constant, self.level, self.calls = ctx, constant, level, calls
        self.eqns = level.eqns if level is not None else []

    def equation(self, eqn: Any, read: Callable, outer: str) -> list:
        return _run_equation(self.ctx, eqn, read, outer, self.constant)

    def take(self, i: int, eqn: Any, env: dict, read: Callable, outer: str) -> set[int] | None:
        ctx = self.ctx
        if self.level is not None and eqn.primitive.name == "name":
            named = _named_in_compute_dtype(ctx, self.level, eqn, read, outer)
            if named is not None:
                env[eqn.outvars[0]] = named
                return {i}
        call = self.calls.get(i)
        if call is not None:
            for k in call.before:  # what the call reads, made inside its stretch
                made = self.eqns[k]
                env.update(zip(made.outvars, _run_equation(ctx, made, read, outer,
                                                           self.constant), strict=True))
            out = _fused_attention(ctx, call, read, outer, self.constant, _body)
            if out is not None:
                env[call.output] = out
                return set(call.indices) | set(call.before)
            if call.before:  # its equations one by one, the first now
                env.update(zip(eqn.outvars, _run_equation(ctx, eqn, read, outer,
                                                          self.constant), strict=True))
                return set(call.before) | {i}
        if (self.level is None or not _is_seed(ctx, eqn, [read(v) for v in eqn.invars], outer)
                or _feeds_only_matmuls(self.level, i)):
            return None
        done: set[int] = set()
        _run_region(ctx, self.level, i, env, read, done, outer, self.constant, _run_equation,
                    _body)
        return done | {i}


_PASSES_ON = (*_VIEWS, "sharding_constraint")


def _named_in_compute_dtype(ctx: _Context, level: Level, eqn: Any, read: Callable,
                            outer: str) -> Any:
    """A model's ``checkpoint_name`` of an fp32 value that every reader casts to the compute
    dtype (through views, into matmuls run in it) names that cast instead, or ``None``.

    The value is fp32 only because autocast traces the model in fp32: MaxText's RoPE casts its
    sin and cos to the query's dtype, bf16 in its own mixed precision and fp32 here, so the
    rotated query and key it names for its remat policy (``query_proj``, ``key_proj``) come out
    of a bf16 projection times an fp32 table. The matmuls round them to bf16 anyway; the name
    on the rounded value is the same computation, and what the policy saves for the backward
    pass is half the bytes."""
    x = read(eqn.invars[0])
    if (len(eqn.invars) != 1 or not is_floating_array(x) or ctx.compute == jnp.float32
            or jnp.dtype(x.dtype) != jnp.float32):
        return None
    frontier, readers = [eqn.outvars[0]], []
    while frontier:
        v = frontier.pop()
        if v in level.outvars:
            return None  # the caller may read it in fp32
        for j in level.consumers.get(v, ()):
            user = level.eqns[j]
            if user.primitive.name in _PASSES_ON:
                frontier.extend(user.outvars)
            elif user.primitive.name in MATMULS:
                readers.append(user)
            else:
                return None
    if not readers or any(type(rule_for(ctx, u, nested_stack(u, outer))) is not _Compute
                          for u in readers):
        return None
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        half = _cast(_downcast_source(ctx, x), ctx.compute)
        outs = ctx.call.memory.outputs(ctx, eqn, [half], [eqn.primitive.bind(half, **eqn.params)])
        ctx.call.memory.computed(ctx, eqn, [half], outs, outer, [False])
    return outs[0]


def _constants(jaxpr: Any, const_args: Sequence[bool] | None) -> set:
    """The variables that are compile-time constants: closed-over constants, constant
    arguments, and what is computed from them alone. A constant adopts the dtype of the
    traced values it meets, as a weakly typed Python number does."""
    constant = set(jaxpr.constvars)
    if const_args is not None:
        constant.update(v for v, c in zip(jaxpr.invars, const_args, strict=True) if c)
    for eqn in jaxpr.eqns:
        if not eqn.effects and all(isinstance(v, Literal) or v in constant
                                   for v in eqn.invars):
            constant.update(eqn.outvars)
    return constant


def _run_equation(ctx: _Context, eqn: Any, read: Callable, outer: str,
                  constant: set) -> list:
    # The new equations keep the user's source line and name scope, as eval_jaxpr does.
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        const_in = [isinstance(v, Literal) or v in constant for v in eqn.invars]
        invals = [read(v) for v in eqn.invars]
        outs = _equation(ctx, eqn, invals, outer, const_in)
        if (eqn.primitive.name == "convert_element_type" and is_floating_array(invals[0])
                and is_floating_array(outs[0]) and jnp.dtype(outs[0].dtype) == jnp.float32
                and jnp.dtype(invals[0].dtype) != jnp.float32):
            ctx.call.facts.set_upcast(outs[0], invals[0])
        if eqn.primitive.name in _VIEWS and invals:
            ctx.call.facts.view(outs[0], invals[0])
        ctx.call.memory.computed(ctx, eqn, invals, outs, outer, const_in)
    return outs


def _body(ctx: _Context, closed: Any, stack: str,
          const_args: Sequence[bool] | None = None, attention: bool = True) -> Callable:
    """A closed (or open) jaxpr as a function evaluated under the rules."""
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = list(getattr(closed, "consts", ()))
    return lambda *args: _evaluate(ctx, jaxpr, consts, list(args), stack, const_args,
                                   attention)


def _equation(ctx: _Context, eqn: Any, invals: list, outer: str,
              const_in: Sequence[bool]) -> list:
    """One equation: the rules' dtypes (the dtype pass: :func:`rule_for`, then the rule's
    ``cast`` and ``bind``), with what the backward pass keeps of it named around its bind
    (the memory pass, ``ctx.call.memory``), or its bodies entered under the rules."""
    name = eqn.primitive.name
    stack = nested_stack(eqn, outer)
    rule = rule_for(ctx, eqn, stack)
    memory = ctx.call.memory
    higher_order = HIGHER_ORDER.get(name) if rule.enters_bodies else None
    if higher_order is not None and higher_order.run is not None:
        is_remat, loops = higher_order.kind == "remat", higher_order.kind == "loop"
        in_loop = ctx.in_loop or loops
        inner = (ctx if (ctx.remat_body, ctx.in_loop) == (is_remat, in_loop) else
                 dataclasses.replace(ctx, remat_body=is_remat, in_loop=in_loop))
        if is_remat:
            invals, inner = memory.entering_remat(inner, eqn, invals)

        def enter(body, const_args=None):
            run = _body(inner, body, stack, const_args)
            return memory.scan_body(ctx, eqn, run) if name == "scan" else run
        outs = higher_order.run(eqn, invals, enter, const_in, each_step=memory.each_step(ctx))
        # What runs a loop or a model's remat again is kept; in a loop's body a remat's
        # outputs are the next step's inputs, kept as such.
        if loops or (is_remat and not ctx.in_loop):
            outs = memory.outputs(ctx, eqn, invals, outs)
        return outs
    rule = rule.for_inputs(ctx, eqn, invals)
    invals = rule.cast(ctx, eqn, invals, const_in)
    if not rule.memory_pass:
        return rule.bind(ctx, eqn, invals)
    return memory.outputs(ctx, eqn, invals,
                          rule.bind(ctx, eqn, memory.operands(ctx, eqn, invals)))
