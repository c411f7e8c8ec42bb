"""Which FP8 matmul of a loss loses what: the probe behind :func:`jaxamp.fp8.error_report`.

Each matmul that autocast runs in FP8 under an FP8 policy is run a second time, on the same
compute-dtype operands, in fp32 at ``HIGHEST`` precision; so are its two gradient GEMMs, on the
same incoming gradient. The relative error of each of the three FP8 products against its twin
(the mean over its rows of each row's relative error) is what FP8 alone costs that matmul: the
forward (the activation and the weight quantized), the input gradient (the incoming gradient
and the weight) and the weight gradient (the activation and the incoming gradient). The report
names each matmul by the argument path of the operand it reads (``args[0]/head/kernel``: the
head's kernel in the first argument) or by the source line that made it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._fp8 import fp8_dot_general

_F32 = jnp.float32
GEMMS = ("forward", "grad_lhs", "grad_rhs")
"""The three GEMMs of a matmul: its product and the gradients of its lhs and rhs."""


@dataclasses.dataclass(frozen=True)
class MatmulError:
    """One FP8 matmul's relative errors: of each GEMM's output, the mean over its rows of
    ``‖fp8 − ref‖ / ‖ref‖``, the largest over its ``calls`` (NaN for a GEMM that never ran)."""

    site: str
    """The argument path of the operand it reads (``args[0]/head/kernel``), or the source line
    that made it (``model.py:12:8 (Block.__call__)``)."""
    shapes: str
    """The operands' shapes: ``"(32, 64) x (64, 256)"``."""
    calls: int
    """How many times it ran (a layer in a ``scan`` runs once per step)."""
    forward: float
    """The relative error of its product: the activation and the weight quantized."""
    grad_lhs: float
    """Of the lhs's gradient (the input gradient): the incoming gradient and the weight."""
    grad_rhs: float
    """Of the rhs's gradient (the weight gradient): the activation and the incoming gradient,
    contracted over the tokens."""

    @property
    def worst(self) -> float:
        """The largest of its three errors."""
        return max((e for e in (self.forward, self.grad_lhs, self.grad_rhs) if e == e),
                   default=float("nan"))


@dataclasses.dataclass(frozen=True)
class Fp8ErrorReport:
    """The FP8 matmuls of one loss and gradient, in the order they first ran
    (:func:`jaxamp.fp8.error_report`); ``print(report)`` shows one line per matmul."""

    matmuls: tuple[MatmulError, ...]
    """One entry per matmul, in the order they first ran. Each entry has its ``site`` (the
    argument path of the operand it reads, ``args[0]/head/kernel``, or the source line that
    made it), its operands' ``shapes`` (``"(32, 64) x (64, 256)"``), its ``calls`` (a layer in
    a ``scan`` runs once per step) and three relative errors: ``forward`` (the activation and
    the weight quantized), ``grad_lhs`` (the input gradient: the incoming gradient and the
    weight) and ``grad_rhs`` (the weight gradient: the activation and the incoming gradient),
    each the mean over the output's rows of ``‖fp8 − ref‖ / ‖ref‖``, the largest over the
    calls (NaN for a GEMM that never ran); ``worst``, the largest of the three."""

    def worst(self, n: int = 5) -> list[MatmulError]:
        """The ``n`` matmuls with the largest error of any of their GEMMs."""
        return sorted(self.matmuls, key=lambda m: -m.worst if m.worst == m.worst else 0.0)[:n]

    def __str__(self) -> str:
        lines = [f"{'forward':>9} {'grad_lhs':>9} {'grad_rhs':>9}  matmul (relative error "
                 "of each FP8 GEMM against fp32)"]
        for m in self.matmuls:
            calls = f", {m.calls} calls" if m.calls > 1 else ""
            lines.append(f"{m.forward:9.2%} {m.grad_lhs:9.2%} {m.grad_rhs:9.2%}  {m.site} "
                         f"[{m.shapes}{calls}]")
        return "\n".join(lines)


class _Probe:
    """The matmuls of one report: each site's shapes and its errors as they arrive."""

    def __init__(self):
        self.sites: dict[str, str] = {}
        self.errors: dict[tuple[str, int], list[float]] = {}

    def site(self, name: str, lhs: Any, rhs: Any) -> str:
        """A key for a matmul traced at ``name`` (a second trace of the same name, a layer
        called twice, gets its own)."""
        key, n = name, 1
        while key in self.sites:
            n += 1
            key = f"{name} (call {n})"
        self.sites[key] = f"{tuple(lhs.shape)} x {tuple(rhs.shape)}"
        return key

    def record(self, key: str, gemm: int, error: Any) -> None:
        self.errors.setdefault((key, gemm), []).append(float(error))

    def report(self) -> Fp8ErrorReport:
        rows = []
        for key, shapes in self.sites.items():
            errors = [self.errors.get((key, g), []) for g in range(len(GEMMS))]
            if not any(errors):  # traced, never run (a branch not taken)
                continue
            rows.append(MatmulError(key, shapes, len(errors[0]),
                                    *(max(e) if e else float("nan") for e in errors)))
        return Fp8ErrorReport(tuple(rows))


_PROBE: contextvars.ContextVar[_Probe | None] = contextvars.ContextVar(
    "jaxamp_fp8_probe", default=None)


def active_probe() -> _Probe | None:
    """The probe of the :func:`error_report` being traced, or ``None``."""
    return _PROBE.get()


@contextlib.contextmanager
def probing() -> Iterator[_Probe]:
    probe = _Probe()
    token = _PROBE.set(probe)
    try:
        yield probe
    finally:
        _PROBE.reset(token)


def argument_name(path: str | None) -> str | None:
    """``args[1]/head/kernel`` for autocast's path ``0/1/head/kernel`` (the positional
    arguments are its first subtree, the keyword arguments its second)."""
    if path is None:
        return None
    parts = path.split("/")
    if len(parts) < 2:
        return path
    where = f"args[{parts[1]}]" if parts[0] == "0" else f"{parts[1]}="
    return "/".join([where, *parts[2:]])


def _reference(a, b, dims):
    return lax.dot_general(a.astype(_F32), b.astype(_F32), dims, precision=lax.Precision.HIGHEST,
                           preferred_element_type=_F32)


def _relative(x, ref):
    """The mean over the rows (along the last axis) of each row's relative error, rows of
    zeros left out: every token (or feature) counts alike, so that the rows a per-tensor scale
    flushes below FP8's range show under one large row (an outlier token) that would dominate
    the norm of the whole tensor."""
    last = ref.shape[-1] if ref.ndim else 1
    diff = jnp.linalg.norm((x.astype(_F32) - ref).reshape(-1, last), axis=-1)
    norm = jnp.linalg.norm(ref.reshape(-1, last), axis=-1)
    rows = norm > 0
    errors = jnp.where(rows, diff / jnp.where(rows, norm, 1.0), 0.0)
    return jnp.where(rows.any(), jnp.sum(errors) / jnp.maximum(jnp.sum(rows), 1),
                     jnp.max(diff, initial=0.0))


def probed_dot(probe: _Probe, key: str, lhs, rhs, dims, out_dtype, recipe):
    """``fp8_dot_general(lhs, rhs, ...)``, its three GEMMs' errors sent to ``probe``."""

    def fp8(a, b):
        return fp8_dot_general(a, b, dims, preferred_element_type=out_dtype, recipe=recipe)

    def send(gemm, x, ref):
        jax.debug.callback(lambda e: probe.record(key, gemm, e), _relative(x, ref))

    @jax.custom_vjp
    def dot(a, b):
        return fp8(a, b)

    def fwd(a, b):
        # Each product's vjp (a pytree of its residuals) is kept: the backward pass runs the
        # two gradient GEMMs of each without running either forward again.
        out, fp8_vjp = jax.vjp(fp8, a, b)
        ref, ref_vjp = jax.vjp(lambda x, y: _reference(x, y, dims), a.astype(_F32),
                               b.astype(_F32))  # gradients in fp32 too
        send(0, out, ref)
        return out, (fp8_vjp, ref_vjp)

    def bwd(res, g):
        fp8_vjp, ref_vjp = res
        da, db = fp8_vjp(g)
        ref_a, ref_b = ref_vjp(g.astype(_F32))
        send(1, da, ref_a)
        send(2, db, ref_b)
        return da, db

    dot.defvjp(fwd, bwd)
    return dot(lhs, rhs)
