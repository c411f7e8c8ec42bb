"""Autocast's rules, as objects: how each kind of primitive casts its inputs and binds (private)."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._autocast._casts import _ELEMENTWISE
from jaxamp._autocast._casts import _HALF
from jaxamp._autocast._casts import _broadcast
from jaxamp._autocast._casts import _broadcast_operands
from jaxamp._autocast._casts import _cast
from jaxamp._autocast._casts import _cast_constant
from jaxamp._autocast._casts import _downcast_source
from jaxamp._autocast._casts import _is_half_broadcast
from jaxamp._autocast._context import _FULL_PRECISION
from jaxamp._fp8 import _errors as _fp8_errors
from jaxamp._fp8 import fp8_dot_general
from jaxamp._jaxpr import HIGHER_ORDER
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import body as _jaxpr_body
from jaxamp._jaxpr import jaxprs_in
from jaxamp._jaxpr import nested_stack
from jaxamp._jaxpr import sub_jaxprs
from jaxamp._jaxpr import where
from jaxamp._tree import is_floating_array
from jaxamp._tree import wider_float

if TYPE_CHECKING:
    from jaxamp._autocast._context import _Context


_FLOAT32 = ("exp", "exp2", "log", "log1p", "expm1", "logistic", "erf", "erfc", "erf_inv", "pow",
            "rsqrt", "sqrt", "cbrt", "tan", "lgamma", "digamma", "cumsum", "cumprod",
            "cumlogsumexp", "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "fft",
            # Linear algebra: LAPACK and cuSOLVER take no half precision, and torch's autocast
            # runs it in fp32 too. ``complex`` takes fp32 or fp64 parts only.
            "cholesky", "lu", "qr", "svd", "eigh", "eig", "schur", "hessenberg",
            "householder_product", "tridiagonal", "tridiagonal_solve", "triangular_solve",
            "lu_pivots_to_permutation", "complex",
            # A rejection sampler: in half precision another sample, not a rounded one.
            "random_gamma")


# Primitives whose rules were written for the dtypes they were traced with.
_ORIGINAL = ("custom_vjp_call", "custom_vjp_call_jaxpr", "shard_map", "xla_pmap", "pmap",
             "debug_callback", "pure_callback", "io_callback", "custom_transpose_call",
             "custom_lin",
             # Their params hold the dtypes they were traced with (a bit width, a conj's
             # input dtype).
             "bitcast_convert_type", "conj")


DEFAULT_RULES: Mapping[str, str] = {
    **{name: "compute" for name in MATMULS},
    **{name: "float32" for name in _FLOAT32},
    **{name: "original" for name in _ORIGINAL},
}


class _Rule:
    """``"promote"``: the widest floating input, weakly typed constants aside (the rule of
    every primitive not in ``DEFAULT_RULES``). The other rules change what differs."""

    enters_bodies = True  # a jit, remat, scan, while or cond is evaluated under the rules
    rewrites = True  # a half-precision broadcast's gradient is summed in fp32
    opens_region = False  # on a half-precision input, it starts an fp32 region
    joins_region = True  # an fp32 region grows over it
    # The memory pass names what the backward pass keeps of it; an FP8 matmul names its own
    # (its 8-bit operands and its output, not its accumulator).
    memory_pass = True

    def for_inputs(self, ctx: _Context, eqn: Any, invals: list) -> _Rule:
        """The rule these inputs get (an FP8 matmul of integers is a plain one)."""
        del ctx, eqn, invals
        return self

    def cast(self, ctx: _Context, eqn: Any, invals: list, const_in: Sequence[bool]) -> list:
        del ctx
        strong = [jnp.dtype(x.dtype) for x, v, c in zip(invals, eqn.invars, const_in,
                                                        strict=True)
                  if is_floating_array(x) and not c and not getattr(v.aval, "weak_type", False)]
        floats = strong or [jnp.dtype(x.dtype) for x in invals if is_floating_array(x)]
        if not floats:
            return invals
        target = functools.reduce(wider_float, floats)
        # A no-op for inputs already in target.
        return [_cast_constant(x, target) if c else _cast(x, target)
                for x, c in zip(invals, const_in, strict=True)]

    def preferred(self, ctx: _Context, invals: list, current: Any) -> Any:
        """A matmul's ``preferred_element_type`` (its accumulation and output dtype)."""
        del ctx
        if current is None or any(_is_complex(x) for x in invals):
            return current
        return functools.reduce(wider_float, [jnp.dtype(x.dtype) for x in invals
                                         if is_floating_array(x)])

    def bind(self, ctx: _Context, eqn: Any, invals: list) -> list:
        if self.rewrites and eqn.primitive.name in _ELEMENTWISE:
            invals = _broadcast_operands(eqn, invals)
        if self.rewrites and _is_half_broadcast(eqn, invals):
            x = invals[0]
            return [_broadcast(x, tuple(eqn.outvars[0].aval.shape),
                               tuple(eqn.params["broadcast_dimensions"]),
                               eqn.params.get("sharding"))]
        params = dict(eqn.params)
        if "preferred_element_type" in params and any(is_floating_array(x) for x in invals):
            params["preferred_element_type"] = self.preferred(ctx, invals,
                                                              params["preferred_element_type"])
        summed = _sums_in_its_transpose(ctx, eqn, invals) if self.rewrites else None
        bind_params = eqn.primitive.get_bind_params(params)
        if summed is not None and eqn.primitive.name == "gather":
            outs = [_gather_summed_in_fp32(eqn.primitive, bind_params, *invals)]
        elif summed is not None:  # taken from fp32, rounded back: summed in fp32 backward
            invals = [_cast(x, jnp.float32) for x in invals]
            outs = [_cast(eqn.primitive.bind(*invals, **bind_params), summed)]
        else:
            out = eqn.primitive.bind(*invals, **bind_params)
            outs = out if eqn.primitive.multiple_results else [out]
        return outs


def _sums_in_its_transpose(ctx: _Context, eqn: Any, invals: list) -> Any:
    """The half dtype of a ``gather``'s operand when it is an argument of ``fn`` (a param:
    an embedding lookup), or of a ``pad``'s, else ``None``: their transposes sum in fp32.
    A gather's transpose is a scatter-add of the cotangents into the table, which sums a
    token's every occurrence in the batch: in bf16 a token that makes up most of a batch gets
    its row's gradient off by a third (:func:`_gather_summed_in_fp32`). A pad's transpose sums
    the cotangents of the padded places into the padding value's gradient: the pad is taken
    from its operands in fp32 and rounded back (exact), so that the backward pass sums in
    fp32 and rounds once, as a half-precision broadcast's gradient (:func:`_broadcast`)."""
    if eqn.primitive.name not in ("gather", "pad") or not is_floating_array(invals[0]):
        return None
    if eqn.primitive.name == "gather" and not ctx.call.facts.argument(invals[0]):
        return None  # an activation's (take_along_axis of logits): one cotangent a place
    dtype = jnp.dtype(invals[0].dtype)
    return dtype if dtype in _HALF else None


def _is_complex(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.complexfloating)


def _gather_summed_in_fp32(prim: Any, params: dict, operand: Any, indices: Any) -> Any:
    """A gather from a half-precision table whose transpose, a scatter-add of the cotangents
    into the table, sums in an fp32 table and rounds once. The forward gather reads the half
    table as it is: no fp32 copy of it (a gather from its fp32 cast cost the NNX GPT of the
    benchmarks 0.31 GB on an H200, its vocabulary's table twice in fp32)."""
    @jax.custom_vjp
    def gather(operand, indices):
        return prim.bind(operand, indices, **params)

    def forward(operand, indices):
        return gather(operand, indices), (operand, indices)

    def backward(residuals, cotangent):
        operand, indices = residuals
        _, transpose = jax.vjp(lambda table: prim.bind(table, indices, **params),
                               jnp.zeros_like(operand, dtype=jnp.float32))
        (summed,) = transpose(cotangent.astype(jnp.float32))
        return summed.astype(operand.dtype), None
    gather.defvjp(forward, backward)
    return gather(operand, indices)


class _Compute(_Rule):
    """``"compute"``: every floating input in the compute dtype (matmuls); a matmul of a
    complex operand takes ``"promote"`` (no half-precision complex dtype)."""

    joins_region = False

    def for_inputs(self, ctx, eqn, invals):
        del ctx, eqn
        return _RULES["promote"] if any(_is_complex(x) for x in invals) else self

    def cast(self, ctx, eqn, invals, const_in):
        del eqn, const_in
        outs = []
        for x in invals:
            source = _downcast_source(ctx, x)
            out = _cast(source, ctx.compute)
            ctx.call.facts.inherit(out, x, source)  # the cast of an argument: recomputed, not saved
            outs.append(out)
        return outs

    def preferred(self, ctx, invals, current):
        del invals, current
        return jnp.dtype(ctx.compute)


class _Float32(_Rule):
    """``"float32"``: every input in fp32 (precision-sensitive ops)."""

    opens_region = True

    def cast(self, ctx, eqn, invals, const_in):
        del ctx, eqn, const_in
        return [_cast(x, jnp.float32) for x in invals]

    def preferred(self, ctx, invals, current):
        del ctx, invals
        return current


class _EverythingFloat32(_Float32):
    """An op in one of ``fp32_scopes``: fp32 in and out, matmuls included (no region: it is
    all fp32 already)."""

    opens_region = joins_region = False

    def preferred(self, ctx, invals, current):
        del ctx, invals, current
        return jnp.dtype(jnp.float32)


class _Original(_Rule):
    """``"original"``: the dtypes it was traced with (rules written for them)."""

    enters_bodies = False
    rewrites = False
    joins_region = False

    def cast(self, ctx, eqn, invals, const_in):
        del ctx, const_in
        return [_cast(x, v.aval.dtype) if is_floating_array(x) else x
                for x, v in zip(invals, eqn.invars, strict=True)]

    def preferred(self, ctx, invals, current):
        del ctx, invals
        return current


class _Fp8(_Compute):
    """``"fp8"``: a ``dot_general`` in FP8 with current scaling, from compute-dtype inputs."""

    memory_pass = False

    def for_inputs(self, ctx, eqn, invals):
        """The compute rule for integers, for an operand read from an argument the recipe
        keeps (the head), and for a batched matmul of two computed values (attention) unless
        the recipe quantizes those."""
        if not all(is_floating_array(x) for x in invals):
            return _RULES["compute"].for_inputs(ctx, eqn, invals)
        recipe = ctx.fp8_recipe
        paths = [ctx.call.facts.path(x) for x in invals]
        if recipe.keep and any(p is not None and re.search(recipe.keep, p) for p in paths):
            return _RULES["compute"]
        batch_dims = eqn.params["dimension_numbers"][1][0]
        if batch_dims and not recipe.batched and all(p is None for p in paths):
            return _RULES["compute"]
        return self

    def bind(self, ctx, eqn, invals):
        lhs, rhs = invals
        dims = eqn.params["dimension_numbers"]
        probe = _fp8_errors.active_probe()
        if probe is not None:  # jaxamp.fp8.error_report: each GEMM against its fp32 twin
            # Named by the argument it reads, the rhs's first (``x @ w``: the weight).
            paths = [ctx.call.facts.path(x) for x in reversed(invals)]
            site = probe.site(_fp8_errors.argument_name(next((p for p in paths if p), None))
                              or where(eqn), lhs, rhs)
            return [_fp8_errors.probed_dot(probe, site, lhs, rhs, dims, ctx.compute,
                                           ctx.fp8_recipe)]
        return [fp8_dot_general(lhs, rhs, dims, preferred_element_type=ctx.compute,
                                recipe=ctx.fp8_recipe)]


_RULES: dict[str, _Rule] = {"compute": _Compute(), "float32": _Float32(), "promote": _Rule(),
                            "original": _Original(), "fp8": _Fp8()}


_ORIGINAL_RULE = _RULES["original"]


_FLOAT32_RULE = _RULES["float32"]


_EVERYTHING_FLOAT32_RULE = _EverythingFloat32()


def rule_for(ctx: _Context, eqn: Any, stack: str) -> _Rule:
    """The one place an equation's rule is decided, in this order: :func:`full_precision`
    (``original``), inside an fp32 region (``float32``), ``fp32_scopes`` (everything fp32),
    the user's rules for the primitive in the innermost name scope that names it, the rules
    by primitive (``DEFAULT_RULES`` and the user's), and for a primitive they do not name, its
    structure: params that hold a traced function (``original``, :func:`_holds_jaxpr`),
    ``integer_pow`` with a negative exponent (``float32``), else ``promote``."""
    if _FULL_PRECISION in stack:
        return _ORIGINAL_RULE
    if ctx.all_float32:
        return _FLOAT32_RULE
    if ctx.fp32_scopes or ctx.scope_rules:
        ctx.call.scopes_seen.add(stack)
    if ctx.fp32_scopes and _in_scopes(stack, ctx.fp32_scopes):
        return _EVERYTHING_FLOAT32_RULE  # every op, matmuls included
    name = eqn.primitive.name
    scoped = _scope_rule(stack, name, ctx.scope_rules) if ctx.scope_rules else None
    if scoped is not None:
        return _RULES[scoped]
    if name not in ctx.rules:
        if _holds_jaxpr(eqn):
            return _ORIGINAL_RULE
        if name == "integer_pow" and eqn.params.get("y", 0) < 0:
            return _FLOAT32_RULE  # x ** -3 of a small half value overflows
    return _RULES[ctx.rules.get(name, "promote")]


def _holds_jaxpr(eqn: Any) -> bool:
    """A primitive that is no higher-order primitive autocast enters but whose params hold a
    jaxpr: a scatter's or a reduction's combiner (``segment_sum``, ``x.at[i].max``,
    ``lax.reduce`` with a body), a linear solve's functions, a kernel. The jaxpr was traced
    for the dtypes of the operands, which it must keep: such an op takes the ``original``
    rule (an fp32 accumulator for a model written in fp32)."""
    return eqn.primitive.name not in HIGHER_ORDER and any(
        next(jaxprs_in(v), None) is not None for v in eqn.params.values())


def _in_scopes(stack: str, scopes: Sequence[str]) -> bool:
    """Whether the name stack ``stack`` is inside one of ``scopes``."""
    parts = _parts(stack)
    return any(_depth(parts, s) is not None for s in scopes)


def _parts(stack: str) -> list[str]:
    """A name stack's scopes, outermost first (``jit(f)/head/dot_general``: ``f``, ``head``,
    ``dot_general``)."""
    return [p for p in re.split(r"[()/]", stack) if p]


def _depth(parts: list[str], scope: str) -> int | None:
    """How deep in ``parts`` the innermost match of ``scope`` ends (a name scope or a module
    path, ``"Encoder/router"``), or ``None``."""
    wanted = scope.split("/")
    n = len(wanted)
    ends = [i + n for i in range(len(parts) - n + 1) if parts[i:i + n] == wanted]
    return ends[-1] if ends else None


def _scope_rule(stack: str, name: str,
                scope_rules: Sequence[tuple[str, Mapping[str, str]]]) -> str | None:
    """The rule for primitive ``name`` of the innermost scope of ``scope_rules`` that holds
    ``stack`` and names ``name`` (of two as deep, the later), or ``None``."""
    parts = _parts(stack)
    best, rule = -1, None
    for scope, rules in scope_rules:
        if name in rules:
            depth = _depth(parts, scope)
            if depth is not None and depth >= best:
                best, rule = depth, rules[name]
    return rule


def _pure_elementwise_like(ctx: _Context, eqn: Any, outer: str) -> bool:
    """An equation a region may hold: no effect, no matmul, no key, and no nested jaxpr but
    a jitted function (``jnp.take_along_axis``, ``jnp.where``) whose body is such equations."""
    if eqn.effects:
        return False
    # A jitted function, and a custom_jvp (``jax.nn.softmax``, ``relu``) whose primal is such
    # equations: in a region it is bound as it is, in fp32, its rule kept.
    body = _jaxpr_body(eqn, ("call", "custom") if eqn.primitive.name == "custom_jvp_call"
                       else ("call",))
    if body is not None:
        stack = nested_stack(eqn, outer)
        return all(_pure_elementwise_like(ctx, e, stack)
                   for e in getattr(body, "jaxpr", body).eqns)
    if next(sub_jaxprs(eqn), None) is not None or eqn.primitive.name in MATMULS:
        return False
    dtypes = (getattr(v.aval, "dtype", None) for v in (*eqn.invars, *eqn.outvars))
    if any(d is not None and jnp.issubdtype(d, jax.dtypes.prng_key) for d in dtypes):
        return False
    return rule_for(ctx, eqn, nested_stack(eqn, outer)).joins_region
