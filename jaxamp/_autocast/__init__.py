"""Op-level automatic mixed precision: :func:`autocast`, the counterpart of ``torch.autocast``.

``autocast(fn, policy)`` returns a function with ``fn``'s signature. Called, it traces ``fn`` to a
jaxpr and evaluates that jaxpr again, equation by equation, under per-primitive dtype rules, with
the rules' casts inserted. The result is an ordinary JAX function: it works under ``jax.grad``,
``jit``, ``vmap``, ``pmap`` and ``shard_map``, and costs nothing at run time beyond its casts.

The rules follow PyTorch's CUDA autocast lists (``aten/src/ATen/autocast_mode.cpp``):

==============  ==========================================================================
rule            primitives
==============  ==========================================================================
``compute``     ``dot_general``, ``conv_general_dilated``, ``ragged_dot``: operands cast to
                the compute dtype, and the output too (``preferred_element_type``), so that
                the backward pass's transposed matmuls meet a half-precision cotangent and
                run in half precision as well. Accumulation is fp32 inside the kernel where
                the backend does that (cuBLAS, cuDNN, XLA:CPU).
``float32``     exp, exp2, log, log1p, expm1, logistic, erf, erfc, erf_inv, pow, rsqrt,
                sqrt, cbrt, tan, lgamma, digamma, cumsum, cumprod, cumlogsumexp, fft, linear
                algebra (cholesky, lu, qr, svd, eigh, solves), complex, and the
                reductions ``reduce_sum`` and ``reduce_prod`` behind softmax, logsumexp,
                normalization statistics and losses: floating inputs cast to fp32. Also
                ``reduce_max``/``reduce_min`` (exact in any dtype), so that the sums in their
                derivatives run in fp32 too.
``promote``     everything else (add, mul, max, select_n, concatenate, reshapes, ...): the
                floating inputs are cast to the widest of them; a weakly typed constant
                (``x * 0.5``) adopts the others' dtype. A single-input op follows its input.
``fp8``         ``dot_general`` under a policy with ``fp8=True`` (``mixed_fp8``): the operands
                cast to the compute dtype, then quantized to e4m3 with current scaling, the
                gradient to e5m2 (:func:`jaxamp.fp8.fp8_dot_general`), or with the policy's
                ``fp8`` recipe (:class:`jaxamp.CurrentScaling`: rowwise or block
                scales); the output is in the compute dtype. Convolutions keep the
                ``compute`` rule: FP8 is for matmuls.
``original``    the dtypes of ``fn`` as written: inside :func:`full_precision`, and for
                ``custom_vjp`` functions, ``shard_map`` and ``pmap`` bodies and callbacks,
                whose rules were written for those dtypes. ``fn`` is traced with its bf16
                and fp16 arguments as fp32 (the train step hands it half-precision working
                params), so these run in fp32 for a model written in fp32.
==============  ==========================================================================

Integer, boolean and PRNG-key values are never touched. Casts that ``fn`` itself makes to a
dtype other than the one it is traced in (to half precision, JAX's own promotions) are kept, as
``torch.autocast`` keeps them; a cast to fp32 of a value ``fn`` computes in fp32 is no op in the
fp32 trace (mark such a region with ``fp32_scopes`` or :func:`full_precision`).
As in torch, an fp32 op returns fp32, which the next matmul casts back to the compute dtype;
what ``fn`` returns is cast to ``policy.output_dtype``.

Nested jaxprs are entered: ``jit``/``pjit`` and ``closed_call`` inline, ``remat``/``checkpoint``
(re-wrapped with its policy, which alone decides what is kept inside it, ``recompute=True``
keeping its inputs and nothing more), ``scan`` and ``while`` (the carry as wide as its initial
value or what the body computes, up to its traced dtype), ``cond``/``switch`` (the branches'
outputs promoted to one dtype), and ``custom_jvp`` functions (``jax.nn.relu``, a
straight-through estimator): their primal body and their JVP rule are each evaluated under the
rules, so that their own rule differentiates them. Ops whose params hold a function traced for
their operands' dtypes (scatters and reductions with a combiner, ``custom_linear_solve``)
take the ``original`` rule; an embedding lookup's gradient is summed in fp32.

No value computed in fp32 is rounded to half on its way to the next fp32 op: ``fn`` is
traced as written in fp32, so JAX's own casts back to a half dtype (``jnp.sum`` and
``jnp.mean`` of a half array round their fp32 sum) are not in the program; an fp32 region
(a norm's statistics, a softmax, a loss) keeps its statistics and sums in fp32, wherever they
go next (a ``custom_jvp`` such as ``jax.nn.relu`` included), and every value that another fp32
op reads next.

Memory: an fp32 region is computed under ``jax.checkpoint`` from its half-precision inputs
and hands its full-size results to the matmuls and elementwise ops that read them in the
compute dtype, so it keeps no fp32 tensor for the backward pass; torch keeps its fp32 ops'
fp32 results. With
``recompute=True`` (the default under a half compute dtype, for a function with no remat of its
own: where the model remats, its policy decides what is kept) the whole function also runs under a
``jax.checkpoint`` policy that keeps only the matmuls' outputs and operands (and those of
collectives, sorts, pools and cumulative ops): the elementwise chains between matmuls (a
tanh GELU, a residual add, a mask) are recomputed in the backward pass, as PyTorch's fused GELU,
softmax and norms keep only their inputs. A matmul's operand is not kept either where at most
16 elementwise ops (an fp32 region counting as one) compute it from kept matmul outputs and the
arguments: attention keeps its scores and recomputes the softmax from them, an MLP keeps its
first matmul's output and recomputes the GELU, so each keeps one tensor where it kept two (on an
H200 the user's NNX GPT of the benchmarks needs 15.7 GB instead of 20.5). Each step of a ``scan``
outside a model's remat runs under the same policy, its inputs kept: the backward scan
recomputes a step in that step, where the forward scan would otherwise run again first and stack
every step's recomputed values. The arguments and their casts are never saved under it.

Attention: a call of ``jax.nn.dot_product_attention`` that leaves ``implementation`` unset
(flax NNX's ``dot_product_attention`` and ``MultiHeadAttention`` make one), and any other
``softmax(q·kᵀ·scale [+ bias] [masked]) · v`` found by its structure
(:mod:`jaxamp._autocast._attention_structure`: Linen's, MaxText's, a hand-written one) runs, under a
half compute dtype, as cuDNN's fused flash attention where the step is compiled for an NVIDIA GPU
(``lax.platform_dependent``: the choice follows the platform the program is lowered for, a
deviceless compile for a GPU included), and as the XLA implementation under the rules above
elsewhere. Autocast traces ``fn`` in fp32, where JAX traces the XLA implementation inline; it
finds the call's equations in the jaxpr (:mod:`jaxamp._autocast._attention`: where they were traced,
confirmed by tracing JAX's function again) and makes the choice itself. Nothing of JAX's is
changed, so a function imported by name and a trace in another thread are the same. cuDNN's
kernel keeps the output and fp32 row statistics for the backward pass, not the probabilities.
Shapes and options the kernel does not take (JAX checks them when it traces the fused call),
a call made inside an fp32 region, scope or :func:`full_precision` or under an FP8 policy,
one that names its ``implementation``, and one that JAX's function traced again does not
confirm (a ``vmap`` of the call, sequence lengths, a local window, the residual) keep the
XLA implementation.

Overrides: ``rules={"exp": "compute"}`` per primitive, ``rules={"router": {"dot_general":
"float32"}}`` per primitive inside a name scope or module path (the innermost scope that names
the primitive decides), ``fp32_scopes=("head",)`` per name scope or module path (every op
inside, matmuls included, in fp32), and :func:`full_precision` for a region that runs exactly as
written (torch's ``autocast(enabled=False)``).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._autocast._casts import _as_written
from jaxamp._autocast._casts import _cast
from jaxamp._autocast._casts import _is_array
from jaxamp._autocast._context import _FULL_PRECISION
from jaxamp._autocast._context import _Call
from jaxamp._autocast._context import _Context
from jaxamp._autocast._context import _Facts
from jaxamp._autocast._interpreter import _evaluate
from jaxamp._autocast._recompute import _DEBUG_CALLBACKS
from jaxamp._autocast._recompute import _holds_no_remat
from jaxamp._autocast._recompute import _Memory
from jaxamp._autocast._recompute import _Recomputing
from jaxamp._autocast._rules import _RULES
from jaxamp._autocast._rules import DEFAULT_RULES
from jaxamp._autocast._rules import _in_scopes
from jaxamp._fp8 import CurrentScaling
from jaxamp._jaxpr import Literal
from jaxamp._jaxpr import sub_jaxprs as _sub_jaxprs
from jaxamp._jaxpr import walk
from jaxamp._precision._policy import get_policy
from jaxamp._tree import tree_path_str

__all__ = ["DEFAULT_RULES", "autocast", "full_precision"]


def full_precision(fn: Callable) -> Callable:
    """Marks ``fn`` as a region that :func:`autocast` leaves exactly as written.

    The counterpart of ``torch.autocast(enabled=False)``: every op inside runs in the dtypes
    ``fn`` was traced with. Outside autocast it is ``fn`` itself (under a name scope).

    >>> import jax.numpy as jnp
    >>> def f(x, w):
    ...     return full_precision(lambda a, b: a @ b)(x, w)
    >>> autocast(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype  # the matmul stays in fp32
    dtype('float32')
    """
    if not callable(fn):
        raise TypeError(f"full_precision needs a callable, got {type(fn).__name__} {fn!r}")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.named_scope(_FULL_PRECISION):
            return fn(*args, **kwargs)
    return wrapped


def autocast(fn: Callable, policy: Any = "mixed_bfloat16", *,
             rules: Mapping[str, str] | None = None,
             fp32_scopes: Sequence[str] = (), recompute: bool | None = None) -> Callable:
    """Runs ``fn`` under per-op dtype rules: matmuls in the compute dtype, precision-sensitive
    ops in fp32 (see the module docstring for the lists).

    Args:
      fn: any JAX-traceable function: a jnp function, an NNX module call, a Linen ``apply``,
        an Equinox model. Array arguments (anything with a shape and a dtype) are traced; the
        others (Python numbers, strings, flags) are passed through as static values.
      policy: anything :func:`jaxamp.get_policy` accepts; its ``compute_dtype`` is the matmul
        dtype and ``output_dtype`` the dtype of what ``fn`` returns.
      rules: per-primitive overrides, ``{"exp": "compute"}``; a rule is one of ``compute``,
        ``float32``, ``promote``, ``original`` or ``fp8`` (``dot_general`` only; the default
        under the ``mixed_fp8`` policy). A key whose value is such a dict is a name scope or
        module path, as in ``fp32_scopes``, and its rules hold for the ops inside it:
        ``{"router": {"dot_general": "float32"}}``; where scopes nest, the innermost scope
        that names the primitive decides. A scope that matches no op is warned about.
      fp32_scopes: name scopes or module paths (``"head"``, ``"Encoder/router"``) whose ops all
        run in fp32, matmuls included. Linen modules open a scope named after the module,
        Equinox's own layers one named after their class (``eqx.nn.Linear``); NNX modules and
        the Equinox modules you write open none (use ``jax.named_scope`` there). A scope that
        matches no op is warned about.
      recompute: keep only the matmuls' outputs for the backward pass (and those of the few
        other ops that are costly to run twice: collectives, sorts, pooling windows),
        and recompute the elementwise ops between them, as PyTorch's fused GELU, softmax and
        norms keep only their inputs. ``False`` keeps JAX's default: every intermediate the
        derivative reads (a tanh GELU alone saves six tensors of its input's size). Functions
        with other side effects than ``jax.debug.print`` and ``jax.debug.callback`` (which run
        once, in the forward pass) are not recomputed. ``None`` (default): ``True``, unless
        ``fn`` holds a remat of its own (``jax.checkpoint``, ``nnx.remat``, a scan of remat'd
        layers): the model's remat policy then decides what is kept, and what lies outside
        it keeps JAX's default (on MaxText's llama2 that is 5-7% less GPU memory than
        autocast's recompute around the model's remat, under each of its remat policies).

    Returns:
      A function with ``fn``'s signature.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> def loss(w, x):
    ...     return jnp.mean(jnp.exp(x @ w))
    >>> w, x = jnp.ones((4, 2)) * 0.1, jnp.ones((8, 4))
    >>> report = jaxamp.audit_grad(autocast(loss), w, x)  # the forward and the backward pass
    >>> report.share("bfloat16"), report.half_sensitive_ops  # every matmul bf16, exp in fp32
    (1.0, [])
    >>> round(float(autocast(loss)(w, x)), 2), autocast(loss)(w, x).dtype
    (1.49, dtype('float32'))
    """
    if not callable(fn):
        raise TypeError(f"autocast needs a callable fn, got {type(fn).__name__} {fn!r}; pass the "
                        "function to run in mixed precision, e.g. autocast(loss_fn, policy)")
    policy = get_policy(policy)
    if not jnp.issubdtype(policy.compute_dtype, jnp.floating):
        raise TypeError(f"autocast needs a floating compute dtype, got {policy.compute_dtype}")
    checked, scope_rules = _check_rules(rules)
    if policy.fp8 and (rules is None or "dot_general" not in rules):
        checked = {**checked, "dot_general": "fp8"}
    fp32_scopes = _check_scopes(fp32_scopes)
    regions = jnp.dtype(policy.compute_dtype) != jnp.float32
    context = functools.partial(_Context, policy.compute_dtype, checked, fp32_scopes,
                                scope_rules, regions=regions,
                                fp8_recipe=policy.fp8 if isinstance(policy.fp8, CurrentScaling)
                                else CurrentScaling())
    quantizes = "fp8" in checked.values() or any("fp8" in r.values() for _, r in scope_rules)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with_paths, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        leaves = [x for _, x in with_paths]
        traced = [i for i, x in enumerate(leaves) if _is_array(x)]

        def flat_fn(*arrays):
            full = list(leaves)
            for i, x in zip(traced, arrays, strict=True):
                full[i] = x
            a, k = jax.tree.unflatten(treedef, full)
            return fn(*a, **k)

        arrays = [leaves[i] for i in traced]
        # Only the FP8 rule asks which argument a matmul reads.
        paths = [tree_path_str(with_paths[i][0]) for i in traced]
        closed, out_shape = _trace(flat_fn, arrays)

        # Only under a half compute dtype; an effect would run again in the backward pass.
        recomputes = _holds_no_remat(closed) if recompute is None else recompute
        memory = (_Recomputing() if recomputes and regions
                  and _only_debug_effects(closed) else _Memory())
        scopes_seen: set[str] = set()

        def evaluate(*arrays):
            facts = _Facts()
            for a, path in zip(arrays, paths, strict=True):
                facts.set_path(a, path if quantizes else None)
                facts.set_argument(a)
            memory.arguments(facts, arrays)
            ctx = context(call=_Call(facts, memory, scopes_seen))
            outs = _evaluate(ctx, closed.jaxpr, list(closed.consts), list(arrays), "")
            outs = [_output(x, v) for x, v in zip(outs, closed.jaxpr.outvars, strict=True)]
            return [_cast(x, policy.output_dtype) for x in outs]
        outs = memory.around(evaluate)(*arrays)
        _warn_unmatched_scopes(fp32_scopes, scope_rules, scopes_seen)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return wrapped


def _output(x: Any, v: Any) -> Any:
    """The value of the outvar ``v``: a constant that fn returns (BatchNorm's first-call flag
    in its new state) is a literal of the jaxpr, and comes back an array, as fn returns it,
    never a Python scalar."""
    if not isinstance(v, Literal):
        return x
    aval: Any = v.aval  # a ShapedArray: the literal's dtype
    return jnp.array(x, aval.dtype)


def _trace(flat_fn: Callable, arrays: list) -> tuple[Any, Any]:
    """``fn`` traced with its half-precision arguments as fp32 (:func:`_as_written`), or, where
    ``fn`` cannot be traced so, as they are: a function that meets an argument with a value
    of the argument's own half dtype (``lax.reduce(x, np.float16(0), ...)``, a convolution's
    ``preferred_element_type=jnp.float16``) types only with the dtypes it was written for."""
    written = [_as_written(x) for x in arrays]
    if all(w is x for w, x in zip(written, arrays, strict=True)):
        return jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
    try:
        return jax.make_jaxpr(flat_fn, return_shape=True)(*written)
    except TypeError:
        return jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)


def _only_debug_effects(closed: Any) -> bool:
    """Whether ``fn``'s only side effects are debug callbacks (``jax.debug.print``,
    ``jax.debug.callback``), which ``recompute=True``'s policy runs once, in the forward
    pass; another effect (an ``io_callback``, a state) would run again in the backward pass."""
    return not closed.effects or all(
        eqn.primitive.name in _DEBUG_CALLBACKS for eqn, _ in walk(closed.jaxpr)
        if eqn.effects and next(_sub_jaxprs(eqn), None) is None)


def _check_rules(rules: Mapping[str, Any] | None) -> tuple[
        Mapping[str, str], tuple[tuple[str, Mapping[str, str]], ...]]:
    """The rules by primitive (``DEFAULT_RULES`` with the user's), and the user's rules by
    name scope: a key whose value is a dict is a scope (``{"router": {"dot_general":
    "float32"}}``)."""
    if rules is None:
        return DEFAULT_RULES, ()
    if not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a dict from primitive name to rule, got "
                        f"{type(rules).__name__} {rules!r}; for example {{'exp': 'compute'}}")
    by_primitive = {k: v for k, v in rules.items() if not isinstance(v, Mapping)}
    _check_primitive_rules(by_primitive, "")
    by_scope = []
    for scope, scoped in rules.items():
        if isinstance(scoped, Mapping):
            if not isinstance(scope, str) or not scope:
                raise TypeError(f"a scope of rules must be a non-empty name scope (a string), "
                                f"got {scope!r}; for example {{'router': {{'dot_general': "
                                "'float32'}}")
            _check_primitive_rules(scoped, f" in scope {scope!r}")
            by_scope.append((scope, dict(scoped)))
    return {**DEFAULT_RULES, **by_primitive}, tuple(by_scope)


def _check_primitive_rules(rules: Mapping[str, Any], where: str) -> None:
    for name, rule in rules.items():
        if not isinstance(rule, str) or rule not in _RULES:
            raise ValueError(f"unknown autocast rule {rule!r} for primitive {name!r}{where}; "
                             f"expected one of {', '.join(_RULES)}, or for a name scope a dict "
                             "of them, e.g. {'router': {'dot_general': 'float32'}}")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"rules keys are primitive names such as 'exp' or 'dot_general', "
                             f"or name scopes with a dict of them, got {name!r}{where}")
        if rule == "fp8" and name != "dot_general":
            raise ValueError(f"rule 'fp8' is for 'dot_general' only, got it for {name!r}{where}: "
                             "FP8 convolutions and other primitives are not supported; keep "
                             "them in the compute dtype ('compute')")


def _check_scopes(scopes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(scopes, str):
        scopes = (scopes,)
    out = tuple(scopes)
    for s in out:
        if not isinstance(s, str) or not s:
            raise TypeError(f"fp32_scopes must be non-empty name scopes (strings), got {s!r}; "
                            "for example fp32_scopes=('head',)")
    return out


def _warn_unmatched_scopes(fp32_scopes: tuple[str, ...],
                           scope_rules: tuple[tuple[str, Mapping[str, str]], ...],
                           scopes_seen: set[str]) -> None:
    """A warning for each scope of ``fp32_scopes`` and of ``rules`` that no op fell in."""
    missed = [f"fp32_scopes={fp32_scopes!r}"] if fp32_scopes and not any(
        _in_scopes(stack, fp32_scopes) for stack in scopes_seen) else []
    missed += [f"the scope {scope!r} of rules" for scope, _ in scope_rules
               if not any(_in_scopes(stack, (scope,)) for stack in scopes_seen)]
    if not missed:
        return
    seen = sorted(s for s in scopes_seen if s)
    shown = ", ".join(repr(s) for s in seen[:8]) + (", ..." if len(seen) > 8 else "")
    warnings.warn(
        f"autocast: {' and '.join(missed)} matched no op, so no rule changes because of "
        f"{'them' if len(missed) > 1 else 'it'}; the name scopes in this function are: "
        f"{shown or 'none'}. Flax Linen "
        "modules open a scope named after the module, Equinox's own layers one named "
        "after their class; NNX modules and the Equinox modules you write open none, so "
        "wrap the code in `with jax.named_scope('head'):` or use jaxamp.full_precision",
        UserWarning, stacklevel=3)
