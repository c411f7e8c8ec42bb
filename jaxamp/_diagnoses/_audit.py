"""The precision audit: which dtype every matmul really runs in, and what is saved for backward.

``audit(fn, *args)`` traces ``fn`` to a jaxpr and walks every nested jaxpr (pjit, scan, while,
cond, custom_jvp, custom_vjp, remat, shard_map, pmap). ``audit_grad`` does the same for the
gradient. The report holds:

* matmul and convolution FLOPs (``dot_general``, ``conv_general_dilated``, ``ragged_dot``,
  cuDNN's fused attention) by operand dtypes and by output dtype, as totals and shares;
* every matmul/conv with an fp32 operand, with its source line, shape and FLOPs, largest first;
* the precision-sensitive ops (exp, log, sums, norms statistics) that run in half precision;
* the activation bytes saved for the backward pass, by dtype (arguments excluded);
* the casts (``convert_element_type``): count and bytes moved, by source and target dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import inspect
import io
import math
import re
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from jaxamp._autocast import _attention
from jaxamp._autocast import _attention_structure
from jaxamp._jaxpr import MATMULS
from jaxamp._jaxpr import Level
from jaxamp._jaxpr import Literal
from jaxamp._jaxpr import RuleNotKeptWarning
from jaxamp._jaxpr import is_backward
from jaxamp._jaxpr import scope
from jaxamp._jaxpr import walk_levels
from jaxamp._jaxpr import where
from jaxamp._loss import split_outputs
from jaxamp._tree import HALF_DTYPES
from jaxamp._tree import floating_leaves

__all__ = ["AuditReport", "MatmulSite", "OpSite", "audit", "audit_grad"]

# Ops that mixed-precision rules keep in fp32 (PyTorch autocast's fp32 list, in primitives).
_SENSITIVE = ("exp", "exp2", "log", "log1p", "expm1", "logistic", "reduce_sum", "cumsum",
              "cumlogsumexp", "rsqrt", "sqrt", "pow", "reduce_prod", "erf_inv")


def _sums_one_value(eqn: Any) -> bool:
    """A reduction over axes of size 1 only (the transpose of a broadcast that adds unit
    axes, ``w[i][None, None, :]``): it sums a single value, exact in any dtype."""
    axes = eqn.params.get("axes")
    shape = getattr(eqn.invars[0].aval, "shape", None) if eqn.invars else None
    return axes is not None and shape is not None and all(shape[a] == 1 for a in axes)


@dataclasses.dataclass(frozen=True)
class MatmulSite:
    """One matmul or convolution equation."""

    primitive: str
    lhs: str
    rhs: str
    out: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    flops: float
    where: str
    name_stack: str
    fp32_source: str = ""  # for fp32 matmuls: the scope that produced the fp32 operand


@dataclasses.dataclass(frozen=True)
class OpSite:
    """A precision-sensitive op running in half precision."""

    primitive: str
    dtype: str
    shape: tuple[int, ...]
    count: float
    where: str


def _is_fp8(dtype_name: str) -> bool:
    return dtype_name.startswith("float8")


def _is_extended(aval: Any) -> bool:
    """A JAX extended dtype, such as a typed PRNG key's (``jax.random.key``: ``key<fry>``),
    which is no NumPy dtype: ``jnp.dtype`` rejects it."""
    return jnp.issubdtype(aval.dtype, jax.dtypes.extended)


def _dtype_name(aval: Any) -> str:
    """``'bfloat16'``, ``'float32'``, ...; an extended dtype by its own name (``'key<fry>'``)."""
    if not hasattr(aval, "dtype"):
        return str(aval)
    return str(aval.dtype) if _is_extended(aval) else jnp.dtype(aval.dtype).name


def _nbytes(aval: Any) -> int:
    """The bytes an array of ``aval`` holds: a typed PRNG key counts its key data (two uint32
    words a key for ``threefry``), another extended dtype nothing."""
    if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0
    if jnp.issubdtype(aval.dtype, jax.dtypes.prng_key):
        aval = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    elif _is_extended(aval):
        return 0
    return int(np.prod(aval.shape, dtype=np.int64)) * jnp.dtype(aval.dtype).itemsize


def dot_general_flops(lhs_shape, rhs_shape, dimension_numbers) -> float:
    """2 × batch × lhs-free × rhs-free × contracting, for ``lax.dot_general``."""
    (lc, rc), (lb, rb) = dimension_numbers
    batch = math.prod(lhs_shape[d] for d in lb)
    contract = math.prod(lhs_shape[d] for d in lc)
    lhs_free = math.prod(s for d, s in enumerate(lhs_shape) if d not in lc and d not in lb)
    rhs_free = math.prod(s for d, s in enumerate(rhs_shape) if d not in rc and d not in rb)
    return 2.0 * batch * lhs_free * rhs_free * contract


# cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``): its
# primitives, and how many times the two matmuls of the forward pass each runs: twice in the
# backward pass (the gradients of both operands of each), as the explicit attention's
# ``dot_general``s do. The flash kernel's recomputation of the scores is not counted.
def ragged_dot_flops(lhs_shape, rhs_shape, params) -> float:
    """2 × lhs elements × rhs-free, for ``lax.ragged_dot`` in every ragged mode: each lhs
    element meets exactly one group's rhs, and each of that rhs's free (not contracting, batch
    or group) entries once."""
    numbers = params.get("ragged_dot_dimension_numbers")
    if numbers is None:  # ragged_dot: lhs (m, k), rhs (groups, k, n)
        return 2.0 * math.prod(lhs_shape) * rhs_shape[-1]
    (_, rc), (_, rb) = numbers.dot_dimension_numbers
    bound = {*rc, *rb, *numbers.rhs_group_dimensions}
    free = math.prod(n for d, n in enumerate(rhs_shape) if d not in bound)
    return 2.0 * math.prod(lhs_shape) * free


FUSED_ATTENTION = {"dot_product_attention_fwd_wrapper": 1, "dot_product_attention_fwd": 1,
                   "dot_product_attention_bwd_wrapper": 2, "dot_product_attention_bwd": 2}


def fused_attention_flops(q_shape, k_shape, v_shape, layout: int) -> float:
    """The forward pass's two matmuls, ``q @ k.T`` and ``probs @ v``: 2 × B × heads × T × S ×
    (head size + value head size). ``layout`` is JAX's ``AttentionLayout``: 0 for (B, T, N,
    H), 1 for (B, N, T, H)."""
    if layout == 0:
        b, t, n, h = q_shape
        s = k_shape[1]
    else:
        b, n, t, h = q_shape
        s = k_shape[2]
    return 2.0 * b * n * t * s * (h + v_shape[-1])


def conv_flops(lhs_shape, rhs_shape, out_shape, params) -> float:
    """Multiply-adds on real data: 2 × (kernel taps landing on real input elements, summed
    over the output positions) × batch × output features × kernel input features (per group).

    Taps on padding, or on the zeros that ``lhs_dilation`` inserts (the input gradient of a
    strided conv), are not counted. So a conv's input gradient and kernel gradient each cost
    exactly its forward, for any stride and padding; for ``SAME`` padding the figure is below
    the textbook ``2 × output elements × Cin × kh × kw`` by the taps that fall on padding.
    """
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n_spatial = len(rhs_spec) - 2
    strides = params.get("window_strides") or (1,) * n_spatial
    padding = params.get("padding") or ((0, 0),) * n_spatial
    lhs_dil = params.get("lhs_dilation") or (1,) * n_spatial
    rhs_dil = params.get("rhs_dilation") or (1,) * n_spatial
    taps = 1
    for d in range(n_spatial):
        size = lhs_shape[lhs_spec[2 + d]]
        dilated = (size - 1) * lhs_dil[d] + 1
        window = rhs_shape[rhs_spec[2 + d]]
        lo = padding[d][0]
        count = 0
        for o in range(out_shape[out_spec[2 + d]]):
            for k in range(window):
                i = o * strides[d] + k * rhs_dil[d] - lo
                if 0 <= i < dilated and i % lhs_dil[d] == 0:
                    count += 1
        taps *= count
    batch = out_shape[out_spec[0]]
    out_features = out_shape[out_spec[1]]
    in_features = rhs_shape[rhs_spec[1]]
    return 2.0 * taps * batch * out_features * in_features


# Ops that move or reshape data without deciding its dtype: looked through to find where an
# fp32 matmul operand really comes from.
_TRANSPARENT = ("reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "copy",
                "copy_p", "slice", "dynamic_slice", "concatenate", "pad", "select_n", "rev")


def _fp32_source(var: Any, level: Level, outer: str = "") -> str | None:
    """Where an fp32 operand comes from: the name scope (or source line) of the op that made it
    fp32, or ``None`` when it was promoted from half precision by a convert (a victim, not a
    cause), or ``"input"`` when it enters the traced function (or the nested jaxpr) as fp32."""
    for _ in range(32):
        if isinstance(var, Literal):
            return "constant"
        eqn = level.producing(var)
        if eqn is None:
            return "input"
        name = eqn.primitive.name
        if name == "convert_element_type":
            src = eqn.invars[0].aval
            if jnp.dtype(src.dtype) in HALF_DTYPES:
                return None
            var = eqn.invars[0]
            continue
        if name in _TRANSPARENT and eqn.invars:
            var = eqn.invars[0]
            continue
        return scope(eqn, outer) or where(eqn)
    return None


def _residuals(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[Any, str]]:
    """``(aval, description)`` of every residual saved to differentiate ``fn``.

    ``jax.ad_checkpoint.print_saved_residuals`` is the public face of this list, but it only
    prints. The function behind it is private, so it is imported here under a guard (the
    JAX range it was checked in, 0.10.2 to 0.12, is pinned by tests/test_jax_apis.py); without
    it, the printed lines are parsed instead.
    """
    try:
        from jax._src.ad_checkpoint import saved_residuals  # private: see the docstring
    except ImportError:
        saved_residuals = None  # type: ignore[assignment]
    if saved_residuals is not None:
        return list(saved_residuals(fn, *args, **kwargs))
    return _printed_residuals(fn, args, kwargs)


def _printed_residuals(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[Any, str]]:
    """The same list, parsed from the public ``print_saved_residuals``."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(fn, *args, **kwargs)
    return [parsed for line in printed.getvalue().splitlines()
            if (parsed := _parse_residual(line)) is not None]


_SHORT_DTYPES = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16",
                 "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8",
                 "u32": "uint32", "bool": "bool"}


def _parse_residual(line: str) -> tuple[Any, str] | None:
    """``('bf16[16,128] from ...')`` as printed by ``print_saved_residuals``."""
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
    if m is None or m.group(1) not in _SHORT_DTYPES:
        return None
    shape = tuple(int(d) for d in m.group(2).split(",") if d)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(_SHORT_DTYPES[m.group(1)])), m.group(3)


def _saved_residuals(fn: Callable, args: tuple, kwargs: dict,
                     argnums: int | tuple[int, ...] | None = None) -> dict[str, int]:
    """Bytes of the residuals saved to differentiate ``fn`` with respect to ``argnums`` (every
    argument when ``None``), by dtype; arguments and closed-over constants excluded."""
    by_dtype: dict[str, int] = defaultdict(int)
    if argnums is not None:
        wrt = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        full_fn, all_args, all_kwargs = fn, args, kwargs

        def of_wrt(*diff):
            full = list(all_args)
            for i, value in zip(wrt, diff, strict=True):
                full[i] = value
            return full_fn(*full, **all_kwargs)
        fn, args, kwargs = of_wrt, tuple(all_args[i] for i in wrt), {}
    try:
        residuals = _residuals(fn, args, kwargs)
    except (TypeError, ValueError) as e:  # e.g. only integer inputs: nothing to differentiate
        warnings.warn(f"jaxamp.audit could not list the saved residuals: {e}", stacklevel=3)
        return {}
    for aval, description in residuals:
        # Arguments and closed-over constants (an NNX module's params) are not activations.
        if description.startswith(("from the argument", "from a constant", "from a literal")):
            continue
        by_dtype[_dtype_name(aval)] += _nbytes(aval)
    return dict(by_dtype)


@dataclasses.dataclass
class AuditReport:
    """What :func:`audit` found. ``to_dict()`` gives plain Python for tests and logs.

    >>> import jax.numpy as jnp
    >>> report = audit(lambda w, x: x @ w, jnp.ones((8, 4), jnp.bfloat16), jnp.ones((2, 8)))
    >>> report.fp32_matmul_share, report.to_dict()["fp32_sources"]
    (1.0, {'input': 128.0})
    """

    title: str
    """The audited function's name, followed by ``(value and grad)`` for :func:`audit_grad`."""
    matmul_flops_by_operands: dict[str, float]
    """Matmul and convolution FLOPs by operand dtypes: ``'bfloat16'`` when both operands are
    bf16, ``'bfloat16 x float32'`` for a mixed pair."""
    matmul_flops_by_output: dict[str, float]
    """Matmul and convolution FLOPs by output dtype."""
    fp32_matmuls: list[MatmulSite]
    """Every matmul or convolution with an fp32 operand, largest FLOPs first."""
    half_sensitive_ops: list[OpSite]
    """The precision-sensitive ops (exp, log, sums, ...) that run on a half-precision operand,
    one entry per primitive, dtype, shape and source line."""
    saved_bytes_by_dtype: dict[str, int]
    """Bytes of the activations saved for the backward pass, by dtype (arguments and
    closed-over constants excluded). A typed PRNG key is counted under its own dtype
    (``'key<fry>'``), by its key data."""
    casts: dict[str, dict[str, float]]
    """The casts (``convert_element_type``) by ``'source -> target'`` dtypes, each a dict of
    ``'count'`` and ``'bytes'`` (read plus written)."""
    matmuls: list[MatmulSite]
    """Every matmul and convolution, whatever its dtypes."""
    attention_not_fused: list[str] = dataclasses.field(default_factory=list)
    """Attention :func:`jaxamp.autocast` does not run as cuDNN's fused kernel, each as
    ``"where: why"``: a matmul that reads a softmax's output but is no attention chain it
    takes (dropout on the weights, a bias added before the scale, the scores read
    elsewhere)."""
    state_bytes_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)
    """For a train step: the bytes of the state it holds (params, master weights, optimizer
    and model state), by dtype; its ``saved_bytes_by_dtype`` are then what the step's loss
    saves for its own backward pass (of one micro-batch), not the step's buffers. Empty for
    any other function."""
    rules_not_kept: list[str] = dataclasses.field(default_factory=list)
    """Custom derivative rules that :func:`jaxamp.autocast` could not keep (a ``custom_jvp``
    whose rule this JAX does not expose where jaxamp reads it): each differentiated through
    its primal body instead. Empty on the JAX versions jaxamp is tested with."""

    @property
    def total_matmul_flops(self) -> float:
        """The FLOPs of all the matmuls and convolutions."""
        return float(sum(self.matmul_flops_by_operands.values()))

    def share(self, operands: str) -> float:
        """The share of matmul FLOPs whose operands are ``operands`` (``'bfloat16'``, or
        ``'float32'``; a mixed pair is written ``'bfloat16 x float32'``)."""
        total = self.total_matmul_flops
        return self.matmul_flops_by_operands.get(operands, 0.0) / total if total else 0.0

    @property
    def fp32_matmul_share(self) -> float:
        """Share of matmul FLOPs with at least one fp32 operand."""
        total = self.total_matmul_flops
        fp32 = sum(s.flops for s in self.matmuls if "float32" in (s.lhs, s.rhs))
        return fp32 / total if total else 0.0

    @property
    def fp8_matmul_flops(self) -> float:
        """Matmul FLOPs whose two operands are FP8 (e4m3, e5m2 or one of each)."""
        return float(sum(s.flops for s in self.matmuls if _is_fp8(s.lhs) and _is_fp8(s.rhs)))

    @property
    def fp8_matmul_share(self) -> float:
        """Share of matmul FLOPs that run in FP8 (the ``mixed_fp8`` policy, ``jaxamp.fp8``)."""
        total = self.total_matmul_flops
        return self.fp8_matmul_flops / total if total else 0.0

    @property
    def fp32_sources(self) -> dict[str, float]:
        """FLOPs of fp32 matmuls by the scope that made their fp32 operand (for example a
        LayerNorm computing in fp32), largest first: where to fix a promotion."""
        out: dict[str, float] = defaultdict(float)
        for s in self.fp32_matmuls:
            for source in (s.fp32_source.split(", ") if s.fp32_source else ["(unknown)"]):
                out[source] += s.flops
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def saved_bytes(self) -> int:
        """The bytes saved for the backward pass, all dtypes together."""
        return int(sum(self.saved_bytes_by_dtype.values()))

    def to_dict(self) -> dict[str, Any]:
        """The report as plain Python (dicts, lists, numbers and strings), the derived totals
        and shares included, for tests and logs."""
        return {
            "title": self.title,
            "total_matmul_flops": self.total_matmul_flops,
            "matmul_flops_by_operands": dict(self.matmul_flops_by_operands),
            "matmul_flops_by_output": dict(self.matmul_flops_by_output),
            "fp32_matmul_share": self.fp32_matmul_share,
            "fp8_matmul_flops": self.fp8_matmul_flops,
            "fp8_matmul_share": self.fp8_matmul_share,
            "fp32_matmuls": [dataclasses.asdict(s) for s in self.fp32_matmuls],
            "rules_not_kept": list(self.rules_not_kept),
            "fp32_sources": self.fp32_sources,
            "half_sensitive_ops": [dataclasses.asdict(s) for s in self.half_sensitive_ops],
            "saved_bytes_by_dtype": dict(self.saved_bytes_by_dtype),
            "saved_bytes": self.saved_bytes,
            "state_bytes_by_dtype": dict(self.state_bytes_by_dtype),
            "attention_not_fused": list(self.attention_not_fused),
            "casts": {k: dict(v) for k, v in self.casts.items()},
        }

    def _rows(self) -> list[tuple[str, list[tuple[str, ...]]]]:
        total = self.total_matmul_flops or 1.0
        sections: list[tuple[str, list[tuple[str, ...]]]] = [
            ("matmul/conv FLOPs by operand dtypes", [
                (k, f"{v / 1e9:.3f} GFLOP", f"{100 * v / total:.1f}%")
                for k, v in sorted(self.matmul_flops_by_operands.items(), key=lambda kv: -kv[1])]),
            ("matmul/conv FLOPs by output dtype", [
                (k, f"{v / 1e9:.3f} GFLOP", f"{100 * v / total:.1f}%")
                for k, v in sorted(self.matmul_flops_by_output.items(), key=lambda kv: -kv[1])]),
            ("where the fp32 operands of fp32 matmuls come from", [
                (k, f"{v / 1e9:.3f} GFLOP", f"{100 * v / total:.1f}%")
                for k, v in list(self.fp32_sources.items())[:15]]),
            ("matmuls with an fp32 operand (largest first)", [
                (s.primitive, s.name_stack or "-",
                 f"{s.lhs}{list(s.lhs_shape)} x {s.rhs}{list(s.rhs_shape)}",
                 f"{s.flops / 1e6:.1f} MFLOP", s.where) for s in self.fp32_matmuls[:15]]),
            ("fp32-preferred ops running in half precision", [
                (s.primitive, f"{s.dtype}{list(s.shape)}", f"x{s.count:g}", s.where)
                for s in self.half_sensitive_ops[:15]]),
            ("activation bytes saved for backward" + (" (the step's loss)"
                                                      if self.state_bytes_by_dtype else ""), [
                *((k, f"{v / 1e6:.3f} MB") for k, v in sorted(self.saved_bytes_by_dtype.items())),
                ("total", f"{self.saved_bytes / 1e6:.3f} MB")]),
            ("casts (convert_element_type)", [
                (k, f"{v['count']:g}", f"{v['bytes'] / 1e6:.3f} MB")
                for k, v in sorted(self.casts.items(), key=lambda kv: -kv[1]["bytes"])]),
        ]
        if self.attention_not_fused:
            sections.insert(-1, ("attention not fused (autocast runs it as written)", [
                (line,) for line in self.attention_not_fused]))
        if self.state_bytes_by_dtype:  # a train step's
            sections.insert(-1, ("the train state's bytes (not saved for backward)", [
                (k, f"{v / 1e6:.3f} MB") for k, v in sorted(self.state_bytes_by_dtype.items())]))
        if self.fp8_matmul_flops:  # its own row, only where FP8 runs
            sections.insert(1, ("FP8 matmul FLOPs (both operands 8-bit)", [
                ("float8", f"{self.fp8_matmul_flops / 1e9:.3f} GFLOP",
                 f"{100 * self.fp8_matmul_flops / total:.1f}%")]))
        return sections

    def _summary(self) -> str:
        s = (f"total matmul/conv FLOPs: {self.total_matmul_flops / 1e9:.3f} GFLOP, "
             f"{100 * self.fp32_matmul_share:.1f}% with an fp32 operand")
        if self.fp8_matmul_flops:
            s += f", {100 * self.fp8_matmul_share:.1f}% in FP8"
        return s

    def __str__(self) -> str:
        lines = [f"jaxamp precision audit: {self.title}", f"  {self._summary()}"]
        for heading, rows in self._rows():
            lines.append(f"  {heading}:")
            if not rows:
                lines.append("    (none)")
            for row in rows:
                lines.append("    " + "  ".join(row))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        parts = [f"<h4>jaxamp precision audit: {html.escape(self.title)}</h4>",
                 f"<p>{html.escape(self._summary())}</p>"]
        for heading, rows in self._rows():
            parts.append(f"<b>{html.escape(heading)}</b><table>")
            for row in rows or [("(none)",)]:
                parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row)
                             + "</tr>")
            parts.append("</table>")
        return "".join(parts)


def _matmul_flops(eqn: Any) -> float | None:
    """The FLOPs of a matmul-like equation: a ``dot_general``, a convolution, or cuDNN's fused
    attention (its first two operands are q and k, its first output the attention's or q's
    gradient). None for any other equation."""
    name = eqn.primitive.name
    if name not in MATMULS and name not in FUSED_ATTENTION:
        return None
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if name == "dot_general":
        return dot_general_flops(lhs, rhs, eqn.params["dimension_numbers"])
    if name == "conv_general_dilated":
        return conv_flops(lhs, rhs, eqn.outvars[0].aval.shape, eqn.params)
    if name in ("ragged_dot", "ragged_dot_general"):
        return ragged_dot_flops(lhs, rhs, eqn.params)
    return FUSED_ATTENTION[name] * fused_attention_flops(
        lhs, rhs, eqn.invars[2].aval.shape, int(eqn.params.get("layout", 0)))


def _report(title: str, jaxpr: Any, saved: dict[str, int]) -> AuditReport:
    by_operands: dict[str, float] = defaultdict(float)
    by_output: dict[str, float] = defaultdict(float)
    matmuls: list[MatmulSite] = []
    sensitive: dict[tuple, float] = defaultdict(float)
    casts: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0.0, "bytes": 0.0})
    for eqn, mult, level, outer in walk_levels(jaxpr):
        name = eqn.primitive.name
        flops = _matmul_flops(eqn)
        if flops is not None:
            flops *= mult
            lhs, rhs = (v.aval for v in eqn.invars[:2])
            out = eqn.outvars[0].aval
            lhs_t, rhs_t = _dtype_name(lhs), _dtype_name(rhs)
            key = lhs_t if lhs_t == rhs_t else " x ".join(sorted((lhs_t, rhs_t)))
            by_operands[key] += flops
            by_output[_dtype_name(out)] += flops
            sources = ""
            if "float32" in (lhs_t, rhs_t):
                found = {_fp32_source(v, level, outer) for v in eqn.invars[:2]
                         if _dtype_name(v.aval) == "float32"}
                sources = ", ".join(sorted(s for s in found if s))
            matmuls.append(MatmulSite(name, lhs_t, rhs_t, _dtype_name(out), tuple(lhs.shape),
                                      tuple(rhs.shape), flops, where(eqn), scope(eqn, outer),
                                      sources))
        elif name in _SENSITIVE and not _sums_one_value(eqn):
            avals = [v.aval for v in eqn.invars if hasattr(v.aval, "dtype")]
            if avals and any(jnp.dtype(a.dtype) in HALF_DTYPES for a in avals):
                a = avals[0]
                sensitive[(name, _dtype_name(a), tuple(a.shape), where(eqn))] += mult
        elif name == "convert_element_type":
            src, dst = eqn.invars[0].aval, eqn.outvars[0].aval
            entry = casts[f"{_dtype_name(src)} -> {_dtype_name(dst)}"]
            entry["count"] += mult
            entry["bytes"] += mult * (_nbytes(src) + _nbytes(dst))
    fp32 = sorted((s for s in matmuls if "float32" in (s.lhs, s.rhs)), key=lambda s: -s.flops)
    ops = [OpSite(n, d, s, c, w) for (n, d, s, w), c in sensitive.items()]
    return AuditReport(title, dict(by_operands), dict(by_output), fp32, ops, saved,
                       dict(casts), matmuls)


def _attention_not_fused(fn: Callable, args: tuple) -> list[str]:
    """``"where: why"`` of each matmul of ``fn`` as written (under no autocast: the one it
    wraps, a step's loss) that reads a softmax's output but is no attention autocast fuses
    (:func:`jaxamp._autocast._attention_structure.why_not`)."""
    try:
        jaxpr = jax.make_jaxpr(fn)(*args)
    except Exception:  # noqa: BLE001 - a function that traces only as wrapped: nothing to say
        return []
    found: dict[str, None] = {}
    for eqn, _, level, outer in walk_levels(jaxpr):
        # A call of jax.nn.dot_product_attention is autocast's other finder's (_attention).
        if (eqn.primitive.name == "dot_general" and not is_backward(eqn, outer)
                and _attention.site(eqn) is None):
            why = _attention_structure.why_not(level, level.index(eqn))
            if why is not None:
                found[f"{where(eqn)}: {why}"] = None
    return list(found)


def _title(fn: Callable, suffix: str = "") -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return name + suffix


def audit(fn: Callable, *args: Any, **kwargs: Any) -> AuditReport:
    """Audits the precision of ``fn(*args, **kwargs)`` (its forward pass).

    Works on any JAX-traceable callable: a plain jnp function, a Flax NNX module call, a Linen
    ``apply``, or a train step from :func:`jaxamp.make_train_step` (whose jaxpr holds the
    backward pass too). ``saved_bytes_by_dtype`` are the residuals that differentiating ``fn``
    with respect to its arguments would keep.

    >>> import jax.numpy as jnp
    >>> r = audit(lambda w, x: x @ w, jnp.ones((8, 4), jnp.bfloat16), jnp.ones((2, 8)))
    >>> r.total_matmul_flops, r.matmul_flops_by_operands
    (128.0, {'bfloat16 x float32': 128.0})
    """
    with _rules_not_kept() as dropped:
        jaxpr = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    step = inspect.unwrap(fn)  # jax.jit, jax.pmap and autocast keep what they wrap
    if getattr(step, "objective", None) is not None and len(args) == 2 and not kwargs:
        try:
            loss, params = _step_loss(step, *args)
            saved = _saved_residuals(loss, (params,), {})
        except Exception as e:  # noqa: BLE001 - a step under pmap: its arguments per device
            warnings.warn(f"jaxamp.audit could not list what the step's loss saves: {e}",
                          stacklevel=2)
            saved = {}
        report = _report(_title(fn), jaxpr, saved)
        report.state_bytes_by_dtype = _bytes_by_dtype(args[0])
        report.attention_not_fused = _attention_not_fused(
            _step_loss(step, *args, written=True)[0], (_on_host(args[0].params),))
    else:
        report = _report(_title(fn), jaxpr, _saved_residuals(fn, args, kwargs))
        report.attention_not_fused = _attention_not_fused(
            lambda *a: step(*a, **kwargs), args)
    report.rules_not_kept = dropped
    return report


def _step_loss(step: Any, state: Any, batch: Any,
               written: bool = False) -> tuple[Callable, Any]:
    """``(loss of the params, params)``: a train step's loss as the step differentiates it, on
    its first micro-batch (the batch as the step hands it, the model state and the rng);
    ``written``: the loss as written, under no autocast."""
    objective, policy = step.objective, state.policy
    if step.accum_steps > 1:
        batch = jax.tree.map(lambda x: x[: x.shape[0] // step.accum_steps], batch)
    # On the host: the loss is traced outside the step's shard_map, where arrays sharded over
    # one mesh axis (the batch, ZeRO-3's params) would meet in a matmul.
    batch = _on_host(objective.batch_under(policy, batch))
    model_state = _on_host(state.model_state)
    loss_fn = objective.loss_fn if written else objective.under(policy)

    def loss(params):
        kwargs: dict[str, Any] = {}
        if objective.has_model_state:
            kwargs["model_state"] = model_state
        if objective.has_rng:  # folded with the step, as the step does
            kwargs["rng"] = jax.random.fold_in(state.rng, state.step)
        out = loss_fn(params, batch, **kwargs)
        return split_outputs(out, objective.has_aux, objective.has_model_state)[0]
    return loss, _on_host(state.params)


def _on_host(tree: Any) -> Any:
    """The arrays of ``tree`` as NumPy arrays (no sharding), PRNG keys as they are."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and not
                        jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)


def _bytes_by_dtype(tree: Any) -> dict[str, int]:
    by_dtype: dict[str, int] = defaultdict(int)
    for x in jax.tree.leaves(tree):
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            by_dtype[_dtype_name(x)] += _nbytes(x)
    return dict(by_dtype)


@contextlib.contextmanager
def _rules_not_kept():
    """The messages of the :class:`RuleNotKeptWarning` raised inside, warned again as they
    came."""
    dropped: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield dropped
    for w in caught:
        if issubclass(w.category, RuleNotKeptWarning):
            dropped.append(str(w.message))
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _scalar_of(out: Any) -> jax.Array:
    leaves = floating_leaves(out)
    if not leaves:
        raise ValueError("audit_grad needs fn to return at least one floating array")
    return sum(jnp.sum(jnp.asarray(x).astype(jnp.float32)) for x in leaves)  # type: ignore[return-value]


def audit_grad(fn: Callable, *args: Any, argnums: int | tuple[int, ...] = 0,
               **kwargs: Any) -> AuditReport:
    """Audits the forward *and* backward pass: ``jax.value_and_grad`` of ``fn``.

    A non-scalar output is reduced to the sum of its floating leaves (a cotangent of ones), so
    a model call can be audited as it is.

    >>> import jax.numpy as jnp
    >>> w, x = jnp.ones((8, 4)), jnp.ones((2, 8))
    >>> audit_grad(lambda w, x: x @ w, w, x).total_matmul_flops  # forward + dW
    256.0
    """
    def scalar(*a):
        return _scalar_of(fn(*a, **kwargs))
    with _rules_not_kept() as dropped:
        jaxpr = jax.make_jaxpr(jax.value_and_grad(scalar, argnums=argnums))(*args)
    report = _report(_title(fn, " (value and grad)"), jaxpr,
                     _saved_residuals(scalar, args, {}, argnums))
    report.rules_not_kept = dropped
    written = inspect.unwrap(fn)
    report.attention_not_fused = _attention_not_fused(lambda *a: written(*a, **kwargs), args)
    return report
