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
                sqrt, cbrt, tan, lgamma, digamma, cumsum, cumprod, cumlogsumexp, fft, and the
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
                ``fp8`` recipe (:class:`jaxamp.fp8.CurrentScaling`: rowwise or block
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
keeping its inputs and nothing more), ``scan`` and ``while`` (the carry keeps the dtype of its
initial value; jax#27144), ``cond``/``switch`` (the branches' outputs promoted to one dtype), and
``custom_jvp`` functions (``jax.nn.relu``, ``softplus``, ``softmax``): their primal body is
evaluated under the rules and differentiated as it is, since a JVP rule written for fp32 cannot
be kept for a bf16 body.

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
``recompute=True`` (the default under a half compute dtype) the whole function also runs under a
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
(flax NNX's ``dot_product_attention`` and ``MultiHeadAttention`` make one) runs, under a half
compute dtype, as cuDNN's fused flash attention where the step is compiled for an NVIDIA GPU
(``lax.platform_dependent``: the choice follows the platform the program is lowered for, a
deviceless compile for a GPU included), and as the XLA implementation under the rules above
elsewhere. Autocast traces ``fn`` in fp32, where JAX traces the XLA implementation inline; it
finds the call's equations in the jaxpr (:mod:`jaxamp._attention`: where they were traced,
confirmed by tracing JAX's function again) and makes the choice itself. Nothing of JAX's is
changed, so a function imported by name and a trace in another thread are the same. cuDNN's
kernel keeps the output and fp32 row statistics for the backward pass, not the probabilities.
Shapes and options the kernel does not take (JAX checks them when it traces the fused call),
a call made inside an fp32 region, scope or :func:`full_precision` or under an FP8 policy,
one that names its ``implementation``, and one that JAX's function traced again does not
confirm (a ``vmap`` of the call, sequence lengths, a local window, the residual) keep the
XLA implementation.

Overrides: ``rules={"exp": "compute"}`` per primitive, ``fp32_scopes=("head",)`` per name scope
or module path (every op inside, matmuls included, in fp32), and :func:`full_precision` for a
region that runs exactly as written (torch's ``autocast(enabled=False)``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import source_info_util

from jaxamp import _fp8_errors
from jaxamp import fp8
from jaxamp import ops
from jaxamp._attention import find_calls as attention_calls
from jaxamp._jaxpr import CALLS
from jaxamp._jaxpr import HIGHER_ORDER
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import Literal
from jaxamp._jaxpr import body as _jaxpr_body
from jaxamp._jaxpr import evaluate
from jaxamp._jaxpr import nested_stack
from jaxamp._jaxpr import sub_jaxprs
from jaxamp._jaxpr import where
from jaxamp._policy import get_policy
from jaxamp._tree import convert_floating
from jaxamp._tree import is_floating_array
from jaxamp._tree import tree_path_str
from jaxamp._tree import wider_float
from jaxamp.fp8 import fp8_dot_general

__all__ = ["DEFAULT_RULES", "autocast", "full_precision"]

_FLOAT32 = ("exp", "exp2", "log", "log1p", "expm1", "logistic", "erf", "erfc", "erf_inv", "pow",
            "rsqrt", "sqrt", "cbrt", "tan", "lgamma", "digamma", "cumsum", "cumprod",
            "cumlogsumexp", "reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "fft")
# Primitives whose rules were written for the dtypes they were traced with.
_ORIGINAL = ("custom_vjp_call", "custom_vjp_call_jaxpr", "shard_map", "xla_pmap", "pmap",
             "debug_callback", "pure_callback", "io_callback", "custom_transpose_call",
             "custom_lin")

DEFAULT_RULES: Mapping[str, str] = {
    **{name: "compute" for name in MATMULS},
    **{name: "float32" for name in _FLOAT32},
    **{name: "original" for name in _ORIGINAL},
}
"""The rule of every primitive that does not ``promote``: see the module docstring."""

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


_OPERAND = "jaxamp_matmul_operand"
_KEPT = "jaxamp_kept"
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
        return params.get("name") in (_KEPT, _OPERAND, fp8.RESIDUAL_NAME, fp8.OUTPUT_NAME,
                                      ops.SAVED_NAME)
    return prim.name in _SAVED and prim.name not in MATMULS


def _nothing_saveable(*_: Any, **__: Any) -> bool:
    """A model remat's policy ``None``: it saves nothing but its inputs."""
    return False


def _keeps(ctx: _Context, prim: Any, invals: list, params: Any) -> bool:
    """Whether the outputs of ``prim`` are kept for the backward pass (named ``_KEPT``): a
    matmul's outside a model's remat, and inside one whatever the model's policy saves."""
    if ctx.call.cheap is None:
        return False
    if ctx.model_remat is None:
        return prim.name in MATMULS
    try:
        return ctx.model_remat(prim, *[jax.typeof(x) for x in invals], **params) is True
    except Exception:  # noqa: BLE001 - a policy that cannot judge saves nothing extra
        return False


_FULL_PRECISION = "jaxamp_full_precision"


# --------------------------------------------------------------------------------------------
# The public functions
# --------------------------------------------------------------------------------------------

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
             fp32_scopes: Sequence[str] = (), recompute: bool = True) -> Callable:
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
        under the ``mixed_fp8`` policy).
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
        with side effects (``jax.debug.print``, callbacks) are never recomputed.

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
    checked = _check_rules(rules)
    if policy.fp8 and (rules is None or "dot_general" not in rules):
        checked = {**checked, "dot_general": "fp8"}
    context = _Context(policy.compute_dtype, checked, _check_scopes(fp32_scopes),
                       regions=jnp.dtype(policy.compute_dtype) != jnp.float32,
                       fp8_recipe=policy.fp8 if isinstance(policy.fp8, fp8.CurrentScaling)
                       else fp8.CurrentScaling())
    quantizes = "fp8" in checked.values()

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
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
            *[_as_written(x) for x in arrays])

        recomputed = recompute and context.regions and not closed.effects

        scopes_seen: dict = {}

        def evaluate(*arrays):
            ctx = dataclasses.replace(context, call=_Call(
                scopes_seen=scopes_seen,
                arguments={id(a): (a, path) for a, path in zip(arrays, paths, strict=True)}
                if quantizes else {},
                cheap={id(a): a for a in arrays} if recomputed else None,
                near={} if recomputed else None))
            outs = _evaluate(ctx, closed.jaxpr, list(closed.consts), list(arrays), "")
            return [_cast(x, policy.output_dtype) for x in outs]
        # Only under a half compute dtype; an effect would run again in the backward pass.
        if recomputed:
            evaluate = jax.checkpoint(evaluate, policy=_saveable)
        outs = evaluate(*arrays)
        _warn_unmatched_scopes(context.fp32_scopes, scopes_seen)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return wrapped


def _check_rules(rules: Mapping[str, str] | None) -> Mapping[str, str]:
    if rules is None:
        return DEFAULT_RULES
    if not isinstance(rules, Mapping):
        raise TypeError(f"rules must be a dict from primitive name to rule, got "
                        f"{type(rules).__name__} {rules!r}; for example {{'exp': 'compute'}}")
    for name, rule in rules.items():
        if rule not in _RULES:
            raise ValueError(f"unknown autocast rule {rule!r} for primitive {name!r}; expected "
                             f"one of {', '.join(_RULES)}")
        if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"rules keys are primitive names such as 'exp' or 'dot_general', "
                             f"got {name!r}")
        if rule == "fp8" and name != "dot_general":
            raise ValueError(f"rule 'fp8' is for 'dot_general' only, got it for {name!r}: FP8 "
                             "convolutions and other primitives are not supported; keep them "
                             "in the compute dtype ('compute')")
    return {**DEFAULT_RULES, **rules}


def _check_scopes(scopes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(scopes, str):
        scopes = (scopes,)
    out = tuple(scopes)
    for s in out:
        if not isinstance(s, str) or not s:
            raise TypeError(f"fp32_scopes must be non-empty name scopes (strings), got {s!r}; "
                            "for example fp32_scopes=('head',)")
    return out


# --------------------------------------------------------------------------------------------
# The interpreter
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Call:
    """What one call of the autocast function learns as it evaluates: its own, never shared
    with another call."""

    # id(fp32 value) -> (that value, the half-precision value it was upcast from).
    upcasts: dict = dataclasses.field(default_factory=dict)
    # The name scopes seen, and whether any op fell in ``fp32_scopes`` (shared by the calls of
    # one trace, for the warning about scopes that matched nothing).
    scopes_seen: dict = dataclasses.field(default_factory=dict)
    # recompute=True: id -> value of the arguments and their casts and views. A matmul operand
    # among them is not saved for backward: it is there already, or cheap.
    cheap: dict | None = None
    # recompute=True: id -> (value, depth) of the matmuls' outputs (depth 0) and of the values
    # an elementwise chain of at most ``_NEAR_DEPTH`` ops computes from them (and from cheap
    # values). A matmul operand among them is recomputed in the backward pass from the saved
    # matmul outputs rather than saved beside them: a softmax's probabilities from the
    # scores, a GELU from its matmul's output.
    near: dict | None = None
    # id -> (value, path) of the arguments and their views (casts, reshapes, transposes):
    # which matmul reads which argument (an FP8 policy keeps the head's in the compute dtype).
    arguments: dict = dataclasses.field(default_factory=dict)

    def argument_path(self, x: Any) -> str | None:
        """The path of the argument ``x`` is (or is a view of), or ``None``."""
        entry = self.arguments.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    def inherit(self, new: Any, old: Any, source: Any = None) -> None:
        """Records ``new`` (a cast or a new trace's value of ``old``) as what ``old`` is: cheap
        (as ``source`` may be, the value ``old`` was upcast from), or near kept values."""
        path = self.argument_path(old)
        if path is not None:
            self.arguments[id(new)] = (new, path)
        if self.cheap is not None and (id(old) in self.cheap or id(source) in self.cheap):
            self.cheap[id(new)] = new
        elif self.near is not None:
            entry = self.near.get(id(old))
            if entry is not None and entry[0] is old:
                self.near[id(new)] = (new, entry[1])


@dataclasses.dataclass(frozen=True)
class _Context:
    """The rules of an autocast function (fixed when it is built), the level being evaluated
    (inside an fp32 region or not), and the state of the call it serves (:class:`_Call`)."""

    compute: Any
    rules: Mapping[str, str]
    fp32_scopes: tuple[str, ...]
    regions: bool = True
    all_float32: bool = False  # inside an fp32 region
    fp8_recipe: Any = None  # the jaxamp.fp8.CurrentScaling of the "fp8" rule
    # Inside a model's own remat (under recompute=True): its policy (the outermost's, as JAX
    # applies it), which alone decides what is kept there.
    model_remat: Callable[..., Any] | None = None
    # A remat's body (a model's block), whose full-size outputs go on to the caller's ops.
    remat_body: bool = False
    call: _Call = dataclasses.field(default_factory=_Call, compare=False)

    def rule(self, eqn: Any, stack: str) -> _Rule:
        if _FULL_PRECISION in stack:
            return _ORIGINAL_RULE
        if self.all_float32:
            return _FLOAT32_RULE
        if self.fp32_scopes:
            matched = _in_scopes(stack, self.fp32_scopes)
            seen = self.call.scopes_seen
            seen[stack] = seen.get(stack, False) or matched
            if matched:
                return _EVERYTHING_FLOAT32_RULE  # every op, matmuls included
        return _RULES[self.rules.get(eqn.primitive.name, "promote")]


def _warn_unmatched_scopes(fp32_scopes: tuple[str, ...], scopes_seen: dict) -> None:
    if not fp32_scopes or any(scopes_seen.values()):
        return
    seen = sorted({s for s in scopes_seen if s})
    shown = ", ".join(repr(s) for s in seen[:8]) + (", ..." if len(seen) > 8 else "")
    warnings.warn(
        f"autocast: fp32_scopes={fp32_scopes!r} matched no op, so nothing runs in fp32 "
        f"because of them; the name scopes in this function are: {shown or 'none'}. Flax Linen "
        "modules open a scope named after the module, Equinox's own layers one named "
        "after their class; NNX modules and the Equinox modules you write open none, so "
        "wrap the code in `with jax.named_scope('head'):` or use jaxamp.full_precision",
        UserWarning, stacklevel=3)


def _in_scopes(stack: str, scopes: tuple[str, ...]) -> bool:
    parts = [p for p in re.split(r"[()/]", stack) if p]
    joined = "/".join(parts)
    return any(s in parts or f"/{s}/" in f"/{joined}/" for s in scopes)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _as_written(x: Any) -> Any:
    """What ``fn`` is traced with for the argument ``x``: a bf16 or fp16 array as fp32, the
    model as written (the train step hands it half-precision working params). Traced with
    half-precision arguments, JAX's own casts (``jnp.sum`` and ``jnp.mean`` of a half array
    sum in fp32 and round the sum back to half) and the dtypes of custom derivatives and of
    :func:`full_precision` regions would be the half ones. It is ``x``'s type with the dtype
    changed (its sharding and varying axes kept), not a cast: ``fn`` is evaluated on ``x``
    itself, and a cast would be differentiated for nothing (0.4 s of the NNX GPT's trace)."""
    if not (is_floating_array(x) and x.dtype in _HALF):
        return x
    return jax.typeof(x).update(dtype=jnp.dtype(jnp.float32), weak_type=False)


_cast = convert_floating


def _cast_constant(x: Any, dtype: Any) -> Any:
    """A compile-time constant in ``dtype``: a finite value past ``dtype``'s range becomes its
    finite extreme, as a mask constant is meant (Gemma masks logits with ``-2.3819763e38``,
    which fp16 would turn into ``-inf``, and a fully masked row into nan); an infinity stays
    one. A concrete value is clipped in numpy, at trace time, with no warning."""
    if not is_floating_array(x) or jnp.dtype(x.dtype) == jnp.dtype(dtype):
        return x
    big = float(jnp.finfo(dtype).max)
    if float(jnp.finfo(x.dtype).max) <= big:
        return _cast(x, dtype)
    if isinstance(x, np.ndarray | np.generic):
        x = np.where(np.isfinite(x), np.clip(x, -big, big), x)
        return np.asarray(x).astype(dtype)
    return _cast(jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x), dtype)


def _evaluate(ctx: _Context, jaxpr: Any, consts: list, args: list, outer: str,
              const_args: Sequence[bool] | None = None, attention: bool = True) -> list:
    """Evaluates ``jaxpr`` under the rules: the package's one loop
    (:func:`jaxamp._jaxpr.evaluate`), each equation by :func:`_run_equation`, an attention
    call taken whole (``attention``: but in the body of one), and an fp32 region taken whole
    where a seed opens one. ``const_args`` flags the arguments that are compile-time constants
    in the caller (a Python number passed to a jitted function)."""
    constant = _constants(jaxpr, const_args)
    level = _Level(jaxpr) if ctx.regions else None
    calls = (attention_calls(jaxpr) if attention and ctx.regions
             and ctx.rules.get("dot_general") != "fp8" else {})

    def take(i: int, eqn: Any, env: dict, read: Callable) -> set[int] | None:
        call = calls.get(i)
        if call is not None:
            out = _fused_attention(ctx, call, read, outer, constant)
            if out is not None:
                env[call.output] = out
                return set(call.indices)
        if (level is None or not _is_seed(ctx, eqn, [read(v) for v in eqn.invars], outer)
                or _feeds_only_matmuls(level, i)):
            return None
        done: set[int] = set()
        _run_region(ctx, level, i, env, read, done, outer, constant)
        return done | {i}

    return evaluate(jaxpr, consts, args, equation=lambda eqn, read: _run_equation(
        ctx, eqn, read, outer, constant), take=take)


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
            ctx.call.upcasts[id(outs[0])] = (outs[0], invals[0])
        if (ctx.call.cheap is not None and eqn.primitive.name in _VIEWS and invals
                and id(invals[0]) in ctx.call.cheap):
            ctx.call.cheap[id(outs[0])] = outs[0]
        if eqn.primitive.name in _VIEWS and invals:
            path = ctx.call.argument_path(invals[0])
            if path is not None:
                ctx.call.arguments[id(outs[0])] = (outs[0], path)
        if ctx.call.near is not None and eqn.primitive.name not in MATMULS:
            _mark_near(ctx, eqn, invals, outs, outer,
                       [isinstance(v, Literal) or v in constant for v in eqn.invars])
    return outs


# --------------------------------------------------------------------------------------------
# fp32 regions: computed in fp32 from their half-precision inputs, recomputed for backward
# --------------------------------------------------------------------------------------------

_REGION_WINDOW = 48  # equations scanned past the last one that joined a region


class _Level:
    """One jaxpr's equations, with each variable's consumers."""

    def __init__(self, jaxpr: Any):
        self.eqns = list(jaxpr.eqns)
        self.outvars = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
        self.consumers: dict[Any, list[int]] = {}
        self.producer: dict[Any, int] = {}
        for i, eqn in enumerate(self.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            for v in eqn.invars:
                if not isinstance(v, Literal):
                    self.consumers.setdefault(v, []).append(i)


def _look_behind(ctx: _Context, level: _Level, members: list[int], region_vars: set,
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


_NEAR_DEPTH = 16


def _near_depth(ctx: _Context, values: Sequence[Any], const_in: Sequence[bool]) -> int | None:
    """How many elementwise ops ``values`` are from saved matmul outputs and cheap values
    (the deepest of them); ``None`` where one of them is not near."""
    near, cheap = ctx.call.near or {}, ctx.call.cheap or {}
    depth = 0
    for x, c in zip(values, const_in, strict=True):
        if c or not is_floating_array(x) or id(x) in cheap:
            continue
        entry = near.get(id(x))
        if entry is None or entry[0] is not x:
            return None
        depth = max(depth, entry[1])
    return depth


def _mark_near(ctx: _Context, eqn: Any, invals: list, outs: list, outer: str,
               const_in: Sequence[bool]) -> None:
    """Records the outputs of an elementwise op on near values as near."""
    if ctx.call.near is None or (eqn.primitive.name not in _VIEWS
                            and not _pure_elementwise_like(ctx, eqn, outer)):
        return
    depth = _near_depth(ctx, invals, const_in)
    if depth is None:
        return
    _set_near(ctx, outs, depth + (0 if eqn.primitive.name in _VIEWS else 1))


def _set_near(ctx: _Context, outs: Sequence[Any], depth: int) -> None:
    """Records the floating ``outs`` as ``depth`` elementwise ops from kept values, within
    ``_NEAR_DEPTH``."""
    if ctx.call.near is not None and depth <= _NEAR_DEPTH:
        for x in outs:
            if is_floating_array(x):
                ctx.call.near[id(x)] = (x, depth)


def _feeds_only_matmuls(level: _Level, i: int) -> bool:
    """An upcast whose only consumers are matmuls (flax's ``promote_dtype`` of a kernel) is no
    region: the matmul takes the half-precision value it came from (``_downcast_source``)."""
    eqn = level.eqns[i]
    if eqn.primitive.name != "convert_element_type":
        return False
    users = [level.eqns[j] for v in eqn.outvars for j in level.consumers.get(v, ())]
    return bool(users) and all(u.primitive.name in MATMULS for u in users) and not any(
        v in level.outvars for v in eqn.outvars)


def _pure_elementwise_like(ctx: _Context, eqn: Any, outer: str) -> bool:
    """An equation a region may hold: no effect, no matmul, no key, and no nested jaxpr but
    a jitted function (``jnp.take_along_axis``, ``jnp.where``) whose body is such equations."""
    if eqn.effects:
        return False
    body = _jaxpr_body(eqn, ("call",))
    if body is not None:
        stack = nested_stack(eqn, outer)
        return all(_pure_elementwise_like(ctx, e, stack)
                   for e in getattr(body, "jaxpr", body).eqns)
    if next(sub_jaxprs(eqn), None) is not None or eqn.primitive.name in MATMULS:
        return False
    dtypes = (getattr(v.aval, "dtype", None) for v in (*eqn.invars, *eqn.outvars))
    if any(d is not None and jnp.issubdtype(d, jax.dtypes.prng_key) for d in dtypes):
        return False
    return ctx.rule(eqn, nested_stack(eqn, outer)).joins_region


def _is_seed(ctx: _Context, eqn: Any, invals: list, outer: str) -> bool:
    """A precision-sensitive op on a half-precision input opens an fp32 region, and so does an
    explicit upcast of one (flax's norms cast their input to fp32 for the statistics)."""
    half_in = any(is_floating_array(x) and jnp.dtype(x.dtype) != jnp.float32 for x in invals)
    if not half_in or not _pure_elementwise_like(ctx, eqn, outer):
        return False
    if eqn.primitive.name == "convert_element_type":
        return jnp.dtype(eqn.outvars[0].aval.dtype) == jnp.float32
    return ctx.rule(eqn, nested_stack(eqn, outer)).opens_region


def _size(v: Any) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def _rounded_on_the_way(ctx: _Context, level: _Level, v: Any, members: set[int],
                        inputs: list, outer: str) -> bool:
    """Whether the region hands ``v`` on in the compute dtype: a full-size value read outside
    the region by the ops between the matmuls (the activations' elementwise ops, a nested
    function such as a model's remat'd block), or returned by a remat's body to its caller's
    ops (a remat'd block's output; what a called or custom function returns stays as it is,
    and what ``fn`` returns is cast to ``output_dtype``). A statistic or a
    sum (smaller than the region's largest floating input), which any op may read at fp32 for
    almost no memory, and a value read by another fp32 op stay fp32: no statistic computed in
    fp32 is rounded on its way to the next fp32 op."""
    outside = [level.eqns[c] for c in level.consumers.get(v, ()) if c not in members]
    leaves = ctx.remat_body and v in level.outvars  # read by the caller's ops
    if not (outside or leaves) or not is_floating_array(v.aval):
        return False
    largest = max((_size(u) for u in inputs if is_floating_array(u.aval)), default=0)
    if _size(v) < largest:
        return False
    return not any(ctx.rule(e, nested_stack(e, outer)).opens_region for e in outside)


def _run_region(ctx: _Context, level: _Level, seed: int, env: dict, read: Callable,
                done: set[int],
                outer: str, constant: set) -> None:
    """Grows the region from ``seed`` over the equations that consume its values, evaluates it
    in fp32 under ``jax.checkpoint`` (so that only its inputs are kept for the backward pass,
    and its fp32 intermediates are recomputed), and casts the values it hands on to the
    compute dtype. Equations that do not depend on the region are evaluated first."""
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
            outs = _run_equation(ctx, eqn, read, outer, constant)
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
    producer = {v: eqn for eqn in eqns for v in eqn.outvars}

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
                    outs = _body(inside, call, nested_stack(eqn, outer))(*ins)
                else:
                    outs = _FLOAT32_RULE.bind(ctx, eqn, ins)
            for v, x in zip(eqn.outvars, outs, strict=True):
                local[v] = x
        out = []
        for v, on in zip(exports, handed_on, strict=True):
            eqn = producer[v]  # the cast is the user's op's: its source line and scope
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
    if ctx.call.near is not None:  # recomputed from its inputs: near when they are
        depth = _near_depth(ctx, invals, [v in constant for v in inputs])
        if depth is not None:
            _set_near(ctx, outs, depth + 1)
    done.update(members)


def _body(ctx: _Context, closed: Any, stack: str,
          const_args: Sequence[bool] | None = None, attention: bool = True) -> Callable:
    """A closed (or open) jaxpr as a function evaluated under the rules."""
    jaxpr = getattr(closed, "jaxpr", closed)
    consts = list(getattr(closed, "consts", ()))
    return lambda *args: _evaluate(ctx, jaxpr, consts, list(args), stack, const_args,
                                   attention)


def _equation(ctx: _Context, eqn: Any, invals: list, outer: str,
              const_in: Sequence[bool]) -> list:
    name = eqn.primitive.name
    stack = nested_stack(eqn, outer)
    rule = ctx.rule(eqn, stack)
    higher_order = HIGHER_ORDER.get(name) if rule.enters_bodies else None
    if higher_order is not None and higher_order.run is not None:
        is_remat = higher_order.kind == "remat"
        inner = ctx if ctx.remat_body == is_remat else dataclasses.replace(ctx,
                                                                         remat_body=is_remat)
        if is_remat and ctx.call.cheap is not None:
            invals, inner = _entering_model_remat(inner, eqn, invals)
        each_step_recomputed = (name == "scan" and ctx.call.cheap is not None
                                and ctx.model_remat is None)

        def enter(body, const_args=None):
            run = _body(inner, body, stack, const_args)
            return _recomputed_in_its_step(ctx, run) if each_step_recomputed else run
        return higher_order.run(eqn, invals, enter, const_in, each_step=_each_scan_step(ctx))
    rule = rule.for_inputs(ctx, eqn, invals)
    return rule.bind(ctx, eqn, rule.cast(ctx, eqn, invals, const_in))


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
                ctx.call.inherit(x, outer)
            return run(*traced)
        # Inside a scan, no CSE can merge the recomputation with the forward pass (JAX's
        # advice for remat in scan), and barriers would only hinder XLA.
        return jax.checkpoint(body, policy=_saveable, prevent_cse=False)(*args)
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
    cheap = ctx.call.cheap or {}
    return [checkpoint_name(x, _KEPT) if is_floating_array(x) and id(x) not in cheap else x
            for x in values]


# --------------------------------------------------------------------------------------------
# Fused attention
# --------------------------------------------------------------------------------------------

def _fused_attention(ctx: _Context, call: Any, read: Callable, outer: str,
                     constant: set) -> list | None:
    """A ``jax.nn.dot_product_attention`` call under a half compute dtype: cuDNN's kernel
    where the program is lowered for CUDA, JAX's XLA implementation under the rules
    elsewhere. None where the fused kernel is not an option (a rule other than the default
    on its matmul: an fp32 scope, :func:`full_precision`, an fp32 region; a shape or dtype
    cuDNN does not take): its equations then run one by one."""
    stack = nested_stack(call.scores, outer)
    if ctx.rule(call.scores, stack) is not _RULES["compute"]:
        return None
    options = dict(call.options)
    has_bias, has_mask = options.pop("bias"), options.pop("mask")
    it = iter([read(v) for v in call.inputs])
    q, k, v = (_cast(next(it), ctx.compute) for _ in range(3))
    bias = _cast(next(it), ctx.compute) if has_bias else None
    mask = next(it) if has_mask else None
    # Elsewhere its own equations, as they were traced (in a shard_map too), under the rules.
    explicit_body = _body(ctx, call.equations, outer, [v in constant for v in call.reads],
                          attention=False)

    def fused(q, k, v, bias, mask, *_):
        out = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="cudnn",
                                           **options)
        return [out]

    def explicit(q, k, v, bias, mask, *reads):
        return [_cast(x, ctx.compute) for x in explicit_body(*reads)]
    try:  # JAX checks cuDNN, the dtypes, head size and masks when it traces the call
        jax.eval_shape(fused, q, k, v, bias, mask)
    except Exception:  # noqa: BLE001 - any refusal means: not this kernel
        return None
    return lax.platform_dependent(q, k, v, bias, mask, *[read(v) for v in call.reads],
                                  cuda=fused, default=explicit)[0]


def _downcast_source(ctx: _Context, x: Any) -> Any:
    """An fp32 value that ``fn`` upcast from the compute dtype goes back to that value rather
    than through a second cast: exact, and the matmul then saves the original (often a param,
    an argument) instead of a new copy for the backward pass."""
    entry = ctx.call.upcasts.get(id(x))
    if entry is not None and entry[0] is x and jnp.dtype(entry[1].dtype) == ctx.compute:
        return entry[1]
    return x


def _broadcast(x: jax.Array, shape: tuple, dims: tuple, sharding: Any = None) -> jax.Array:
    """``broadcast_in_dim`` whose gradient, a sum over the broadcast axes, runs in fp32: the
    gradient of a bias sums a whole batch of half-precision cotangents. The broadcast is of
    ``x`` in fp32, rounded back: exact, and XLA drops the pair of casts; the transpose casts
    the cotangent to fp32, sums it there, and rounds the sum once."""
    wide = lax.broadcast_in_dim(x.astype(jnp.float32), shape, dims, out_sharding=sharding)
    return wide.astype(x.dtype)


def _is_half_broadcast(eqn: Any, invals: list) -> bool:
    if eqn.primitive.name != "broadcast_in_dim" or len(invals) != 1:
        return False
    x = invals[0]
    return (is_floating_array(x) and jnp.dtype(x.dtype) != jnp.float32
            and math.prod(eqn.outvars[0].aval.shape) > math.prod(x.shape))


_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem",
                          "nextafter", "select_n", "clamp"})


def _broadcast_operands(eqn: Any, invals: list) -> list:
    """An elementwise op broadcasts size-1 axes implicitly, and its gradient sums them in the
    cotangent's dtype: broadcast half-precision operands first, through ``_broadcast``."""
    shape = tuple(eqn.outvars[0].aval.shape)
    out = []
    for x in invals:
        if (is_floating_array(x) and jnp.dtype(x.dtype) != jnp.float32 and x.ndim == len(shape)
                and tuple(x.shape) != shape):
            x = _broadcast(x, shape, tuple(range(len(shape))))
        out.append(x)
    return out


# --------------------------------------------------------------------------------------------
# The rules: how an op's inputs are cast, and how it is bound
# --------------------------------------------------------------------------------------------

class _Rule:
    """``"promote"``: the widest floating input, weakly typed constants aside (the rule of
    every primitive not in ``DEFAULT_RULES``). The other rules change what differs."""

    enters_bodies = True  # a jit, remat, scan, while or cond is evaluated under the rules
    rewrites = True  # a half-precision broadcast's gradient is summed in fp32
    opens_region = False  # on a half-precision input, it starts an fp32 region
    joins_region = True  # an fp32 region grows over it

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
        if current is None:
            return None
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
        if (ctx.call.cheap is not None and ctx.model_remat is None
                and eqn.primitive.name in MATMULS):
            invals = [checkpoint_name(x, _OPERAND) if is_floating_array(x)
                      and id(x) not in ctx.call.cheap and id(x) not in (ctx.call.near or {}) else x
                      for x in invals]
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        outs = out if eqn.primitive.multiple_results else [out]
        if _keeps(ctx, eqn.primitive, invals, params):
            outs = [checkpoint_name(x, _KEPT) if is_floating_array(x) else x for x in outs]
        if eqn.primitive.name in MATMULS:
            _set_near(ctx, outs, 0)  # saved (``_SAVED``)
        return outs


class _Compute(_Rule):
    """``"compute"``: every floating input in the compute dtype (matmuls)."""

    joins_region = False

    def cast(self, ctx, eqn, invals, const_in):
        del eqn, const_in
        outs = []
        for x in invals:
            source = _downcast_source(ctx, x)
            out = _cast(source, ctx.compute)
            ctx.call.inherit(out, x, source)  # the cast of an argument: recomputed, not saved
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

    def for_inputs(self, ctx, eqn, invals):
        """The compute rule for integers, for an operand read from an argument the recipe
        keeps (the head), and for a batched matmul of two computed values (attention) unless
        the recipe quantizes those."""
        if not all(is_floating_array(x) for x in invals):
            return _RULES["compute"]
        recipe = ctx.fp8_recipe
        paths = [ctx.call.argument_path(x) for x in invals]
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
            paths = [ctx.call.argument_path(x) for x in reversed(invals)]
            site = probe.site(_fp8_errors.argument_name(next((p for p in paths if p), None))
                              or where(eqn), lhs, rhs)
            return [_fp8_errors.probed_dot(probe, site, lhs, rhs, dims, ctx.compute,
                                           ctx.fp8_recipe)]
        return [fp8_dot_general(lhs, rhs, dims, preferred_element_type=ctx.compute,
                                recipe=ctx.fp8_recipe)]


_RULES: dict[str, _Rule] = {"compute": _Compute(), "float32": _Float32(), "promote": _Rule(),
                            "original": _Original(), "fp8": _Fp8()}
"""The rule of each name a ``rules=`` entry may give."""
_ORIGINAL_RULE = _RULES["original"]
_FLOAT32_RULE = _RULES["float32"]
_EVERYTHING_FLOAT32_RULE = _EverythingFloat32()


# --------------------------------------------------------------------------------------------
# Control flow (scan, while, cond: _jaxpr.HIGHER_ORDER runs them; the carry keeps its dtype,
# branches agree)
# --------------------------------------------------------------------------------------------

def _each_scan_step(ctx: _Context) -> Callable[[list, list], None] | None:
    """Under ``recompute=True``, a slice of a cheap stacked array is cheap too."""
    cheap = ctx.call.cheap
    if cheap is None:
        return None

    def each_step(slices: list, stacked: list) -> None:
        for x, whole in zip(slices, stacked, strict=True):
            if id(whole) in cheap:
                cheap[id(x)] = x
    return each_step
