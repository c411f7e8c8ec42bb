"""Suite ``conformance``: autocast against JAX's own primitive test harnesses, harness by harness.

    python -m benchmarks conformance [--per-group N] [--groups REGEX] [--tiny]

JAX ships a corpus of primitive use cases, ``test_harnesses.all_harnesses`` (about 5600
harnesses in 132 groups, mostly one group per primitive: each a function of its dynamic
arguments and a maker of those arguments). For every harness with floating inputs (bf16, fp16,
fp32 or fp64 arrays), under each of ``mixed_bfloat16`` and ``mixed_float16``, in two input modes,
it runs ``jax.jit(jaxamp.autocast(f, policy))`` (``recompute`` left at its default, what users
get) and the same ``f`` in plain fp32 JAX, and compares both the forward outputs and the VJP
with respect to the floating inputs:

- ``inputs``: the floating inputs as the harness makes them (fp64 as fp32: x64 is off), their
  values rounded to the half dtype, so that autocast and the reference read the same numbers;
- ``matmul``: each floating input made inside the traced function by a matmul, in fp32 as
  written: ``x[..., None] @ [[1.0]]`` (``lax.dot_general`` with a 1x1 fp32 identity, reshaped
  back), so that under autocast the matmul's output is half and the primitive runs on half
  values inside a program traced in fp32. A 1x1 identity rather than the identity of the last
  dimension: ``x @ I`` multiplies an inf by the zeros of ``I`` and turns the whole row NaN,
  which would erase what the harnesses with special values test; both are the matmul of a
  half operand with an exact fp32 identity.

The reference is the same function (same mode, same matmul) in plain fp32 on the inputs
rounded to the half dtype (``x.astype(half).astype(f32)``): the matmul's half output in the
``matmul`` mode is those values exactly, so the two runs differ only by what autocast computes
in half. The VJP's cotangent is fixed (gaussian, seeded by the harness's name), one per inexact
output, rounded to the half dtype too; integer and boolean outputs get none.

Outcomes, one JSON line per harness x policy x mode in ``OUT/conformance.jsonl``:

- ``holds``: autocast runs where ``f`` does, every output and every gradient within tolerance;
- ``raises``: autocast raises where the reference runs (``stage``: forward or vjp; the
  exception's class and the first line of its message);
- ``differs``: beyond tolerance (the largest error over tolerance, ``ratio``, and where);
- ``skipped``: no floating inputs, marked unimplemented on cpu by JAX (``jax_unimplemented``),
  larger than ``MAX_ELEMENTS``, or the reference raises (JAX does not run it here). Where the
  harness hands ``f`` half arrays and ``f`` takes no fp32 (a half init value of ``lax.reduce``,
  ``preferred_element_type=float16``), the reference is ``f`` on the harness's own dtypes
  (``reference`` says so), in the ``inputs`` mode; the ``matmul`` mode of such a harness is
  skipped. A reference VJP that raises (a primitive without a transpose) leaves the forward
  pass compared alone (``vjp``: why).

Tolerance, per output: ``|a - r| <= C * eps * (|r| + max|r|)`` with ``eps`` the machine epsilon
(spacing at 1) of the widest-spaced half dtype in play (the policy's compute dtype; in the
``inputs`` mode also a half dtype the harness hands autocast, which its ops keep), ``max|r|``
over the output's finite values, NaN where the reference has NaN and the same infinities.
``C = 16``, so 32 roundings to nearest (``eps / 2`` each): what the rules put in half is a
primitive and its derivative, a few ops each (``div``'s VJP: a division, a product and a
negation; a ``tanh``'s: ``1 - y*y`` and a product; a matmul's transposes: one rounding of a sum
accumulated in fp32), on operands that are already half, so a handful of roundings of values
no larger than the output's range; the ``max|r|`` term is the absolute part: a difference of
rounded values (``1 - y*y`` near 1, a cancelling sum) is off by a rounding of the operands, not
of the small result. Measured on the whole corpus (jax 0.10.2): 99.9% of the rows that hold
are within ``3 eps``, all within ``6 eps`` (``igamma``'s gradients); the rows that differed
before autocast's fixes (a sampler, a negative power and a pad's transpose run in half) were
off by ``17 eps`` and more. An output computed in fp32 alone is expected to agree to the last
bit; the suite records ``max_rel_err`` (``|a - r| / (|r| + max|r|)``, the largest over the
outputs) for every compared row, so that such a row shows it (0 for three rows in four).

Two disagreements are the half dtype's, not autocast's, and are accepted (and counted): an
infinity of the sign of a reference value beyond the half dtype's largest finite value
(``overflows``: rounding to fp16 overflows there), and integer outputs that differ only by
indices swapped between equal values (``tie_swaps``: a top-k of fp16 values breaks ties in
another order than of fp32 ones; the VJP of such a row is not compared, its cotangents moved
with the indices). Other integer and boolean outputs must agree exactly.

Prints a markdown table, group by group (holds / raises / differs / skipped), and the list of
the rows that do not hold. ``--per-group N`` samples N harnesses per group (deterministic: the
group's eligible harnesses ordered by the CRC32 of their names; 0: all), ``--groups`` keeps the
groups whose name matches a regex; ``--tiny``: one harness of each of a few groups.
``tests/test_conformance.py`` runs one harness per group (and the whole corpus, slow).
"""

from __future__ import annotations

import collections
import json
import os
import re
import time
import traceback
import warnings
import zlib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxamp
from benchmarks import harness as bench_harness

ROUNDS = None  # nothing is timed
POLICIES = ("mixed_bfloat16", "mixed_float16")
MODES = ("inputs", "matmul")
OUTCOMES = ("holds", "raises", "differs", "skipped")
C = 16
# A harness whose arguments hold more elements than this is skipped (none of JAX's does today:
# the largest, an fft's, holds 57120); a guard against a corpus that grows a huge case.
MAX_ELEMENTS = 1 << 22
TINY_GROUPS = "^(exp|mul|dot_general|reduce_sum|cumsum)$"

_FLOATING = tuple(np.dtype(d) for d in (jnp.bfloat16, np.float16, np.float32, np.float64))
_HALF = {np.dtype(jnp.bfloat16), np.dtype(np.float16)}


def corpus() -> list:
    """JAX's primitive test harnesses, ``test_harnesses.all_harnesses``.

    The one private import of the benchmarks and tests: JAX keeps the corpus in
    ``jax._src.internal_test_util`` (its own test suites read it there) and publishes no
    equivalent, and it is the widest list of primitive use cases there is (every primitive,
    its dtypes, shapes and options, with JAX's record of what is unimplemented where). It is
    imported here alone; ``tests/test_jax_apis.py`` pins that it still imports and still holds
    harnesses with ``group_name``, ``dyn_fun`` and ``dyn_args_maker``.
    """
    from jax._src.internal_test_util import test_harnesses
    return list(test_harnesses.all_harnesses)


def add_arguments(parser) -> None:
    parser.add_argument("--per-group", type=int, default=0,
                        help="harnesses per group, sampled deterministically (default 0: all)")
    parser.add_argument("--groups", default=None,
                        help="a regex: only the groups whose name it matches (re.search)")


# --------------------------------------------------------------------------------------------
# The harnesses
# --------------------------------------------------------------------------------------------

def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic | jax.Array)


def _is_floating(x: Any) -> bool:
    return _is_array(x) and np.dtype(x.dtype) in _FLOATING


def _seed(h) -> int:
    return zlib.crc32(f"{h.group_name}/{h.name}".encode())


def arguments(h) -> list:
    """The harness's dynamic arguments, made with a generator seeded by its name."""
    return list(h.dyn_args_maker(np.random.RandomState(_seed(h))))


def unimplemented_on_cpu(h) -> str | None:
    """JAX's own limitation that keeps the harness off the CPU, or ``None``."""
    if h.filter("cpu", include_jax_unimpl=False):
        return None
    return "; ".join(str(lim.description) for lim in h.jax_unimplemented
                     if lim.filter(device="cpu", dtype=h.dtype))


def select(harnesses: Iterable, per_group: int = 0, groups: str | None = None) -> list:
    """The harnesses to run: those of the groups matching ``groups``, ``per_group`` of each
    group's harnesses with floating inputs and no JAX limitation on the CPU (all of them with
    0), in the order of the CRC32 of their names, a deterministic sample spread over the
    group's dtypes and shapes. With a sample, a group with no such harness keeps one harness,
    so that the table shows it as skipped."""
    by_group: dict[str, list] = collections.defaultdict(list)
    for h in harnesses:
        if groups is None or re.search(groups, h.group_name):
            by_group[h.group_name].append(h)
    chosen = []
    for name in sorted(by_group):
        members = sorted(by_group[name], key=_seed)
        if not per_group:
            chosen += by_group[name]
            continue
        eligible = [h for h in members if unimplemented_on_cpu(h) is None
                    and any(_is_floating(a) for a in arguments(h))]
        chosen += (eligible or members)[:per_group]
    return chosen


# --------------------------------------------------------------------------------------------
# Running one harness
# --------------------------------------------------------------------------------------------

def _round(x: np.ndarray, half) -> np.ndarray:
    """``x``'s values rounded to ``half``, in fp32."""
    return np.asarray(x, np.float32).astype(half).astype(np.float32)


def _through_matmul(x: jax.Array) -> jax.Array:
    """``x`` made by a matmul: ``x[..., None] @ [[1.0]]`` in ``x``'s dtype, reshaped back."""
    column = x.reshape(x.shape + (1,))
    eye = jnp.ones((1, 1), x.dtype)
    return lax.dot_general(column, eye, (((x.ndim,), (0,)), ((), ()))).reshape(x.shape)


def _program(h, args: Sequence, mode: str) -> tuple[Callable, list[int], list[int]]:
    """``(fn, arrays, floats)``: ``fn`` takes the harness's array arguments (``arrays``: their
    positions in ``args``; the others are closed over), ``floats`` the positions in that list
    of the floating ones, each first made by a matmul in the ``matmul`` mode."""
    arrays = [i for i, a in enumerate(args) if _is_array(a)]
    floats = [k for k, i in enumerate(arrays) if _is_floating(args[i])]

    def fn(*xs):
        full = list(args)
        for k, (i, x) in enumerate(zip(arrays, xs, strict=True)):
            full[i] = _through_matmul(x) if mode == "matmul" and k in floats else x
        return h.dyn_fun(*full)
    return fn, arrays, floats


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _forward_and_vjp(fn: Callable, floats: list[int], with_vjp: bool) -> Callable:
    """``jit(xs, cts) -> (outputs, gradients)``: ``fn``'s outputs (flat) and, with
    ``with_vjp``, the VJP of its inexact outputs with respect to ``xs[floats]``, each cotangent
    in its output's dtype (autocast returns ``output_dtype`` where ``f`` may return half)."""
    def run(xs, cts):
        outs = jax.tree.leaves(fn(*xs))
        if not with_vjp:
            return outs, []

        def inexact_outputs(*fs):
            full = list(xs)
            for k, f in zip(floats, fs, strict=True):
                full[k] = f
            return [o for o in jax.tree.leaves(fn(*full)) if _inexact(o)]
        primals, pullback = jax.vjp(inexact_outputs, *[xs[k] for k in floats])
        return outs, list(pullback([ct.astype(p.dtype)
                                    for ct, p in zip(cts, primals, strict=True)]))
    return jax.jit(run)


def _cotangents(shapes: list, halves: Iterable, seed: int) -> list[np.ndarray]:
    """A gaussian cotangent per inexact output (complex for a complex one), in fp32, rounded
    to each of ``halves`` and to the output's own dtype: the same values in every dtype."""
    rng = np.random.RandomState(seed)
    own = {np.dtype(s.dtype) for s in shapes} & _HALF
    steps = [*halves, *sorted(own - set(halves), key=str)]

    def rounded(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        for d in steps:
            x = _round(x, d)
        return x
    cts = []
    for s in shapes:
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            continue
        ct = rounded(s.shape)
        cts.append(ct + 1j * rounded(s.shape) if jnp.issubdtype(s.dtype, jnp.complexfloating)
                   else ct)
    return cts


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _tie_swaps(a: np.ndarray, r: np.ndarray, values: tuple | None) -> int | None:
    """How many of the integer output's disagreeing places are indices swapped between equal
    values, or ``None`` if any is not: ``values`` is a ``(got, ref)`` inexact output of the same
    shape (top_k's values next to its indices), equal at each such place, where the reference
    holds that value at least twice along the last axis."""
    off = a != r
    if values is None:
        return None
    va, vr = values
    if not np.all(va[off] == vr[off]):
        return None
    rows = vr.reshape(-1, vr.shape[-1]) if vr.ndim else vr.reshape(1, 1)
    offs = off.reshape(rows.shape)
    for row, row_off in zip(rows, offs, strict=True):
        for v in row[row_off]:
            if np.sum(row == v) < 2:
                return None
    return int(np.sum(off))


def compare(got: Sequence, ref: Sequence, eps: float, max_finite: float = np.inf) -> dict:
    """``got`` against ``ref``, output by output: ``ratio``, the largest error over tolerance
    (inf where a shape, a NaN, an infinity or an integer disagrees); ``max_rel_err``, the
    largest error relative to ``|r| + max|r|``; ``where``, the worst output's worst place;
    ``overflows``, the places where ``got`` is the infinity of a reference value beyond
    ``max_finite`` (the half dtype's range, which rounding to it overflows: accepted); and
    ``tie_swaps``, the integer places that are indices swapped between equal values (accepted:
    a sort or top-k of half values breaks ties in another order than of fp32 ones)."""
    worst, worst_rel, where = 0.0, 0.0, ""
    overflows = tie_swaps = 0

    def fail(text: str) -> dict:
        return {"ratio": np.inf, "max_rel_err": np.inf, "where": text, "overflows": overflows,
                "tie_swaps": tie_swaps}
    got = [np.asarray(a) for a in got]
    ref = [np.asarray(r) for r in ref]
    for i, (a, r) in enumerate(zip(got, ref, strict=True)):
        if a.shape != r.shape:
            return fail(f"output {i}: shape {a.shape} against {r.shape}")
        if not (jnp.issubdtype(a.dtype, jnp.inexact) or jnp.issubdtype(r.dtype, jnp.inexact)):
            if np.any(a != r):
                values = next(((va, vr) for va, vr in zip(got, ref, strict=True)
                               if vr.shape == r.shape and r.ndim
                               and jnp.issubdtype(vr.dtype, jnp.inexact)), None)
                swaps = _tie_swaps(a, r, values)
                if swaps is None:
                    return fail(f"output {i}: {int(np.sum(a != r))} of {r.size} {r.dtype} "
                                "values differ")
                tie_swaps += swaps
            continue
        wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(r) else np.float64
        a, r = a.astype(wide), r.astype(wide)
        nan_a, nan_r = np.isnan(a), np.isnan(r)
        if np.any(nan_a != nan_r):
            return fail(f"output {i}: NaN at {int(np.sum(nan_a & ~nan_r))} places where the "
                        f"reference is not, not at {int(np.sum(nan_r & ~nan_a))} where it is")
        inf_r = np.isinf(r)
        overflow = (np.isinf(a) & ~inf_r & ~nan_r & (np.abs(r) > max_finite)
                    & (np.sign(a.real) == np.sign(r.real)))
        off = ((np.isinf(a) != inf_r) | (inf_r & (a != r))) & ~overflow
        if np.any(off):
            k = np.flatnonzero(off)[0]
            return fail(f"output {i}: infinities disagree at {int(np.sum(off))} places "
                        f"(e.g. {a.flat[k]:.6g} against {r.flat[k]:.6g})")
        overflows += int(np.sum(overflow))
        finite = ~(nan_r | inf_r | overflow)
        if not np.any(finite):
            continue
        a, r = a[finite], r[finite]
        scale = float(np.max(np.abs(r)))
        err = np.abs(a - r)
        rel = err / (np.abs(r) + scale) if scale else np.where(err > 0, np.inf, 0.0)
        k = int(np.argmax(rel))
        worst_rel = max(worst_rel, float(rel[k]))
        if rel[k] / (C * eps) > worst or not where:
            worst = float(rel[k] / (C * eps))
            where = f"output {i}: {a[k]:.6g} against {r[k]:.6g}, max|r| {scale:.3g}"
    return {"ratio": worst, "max_rel_err": worst_rel, "where": where, "overflows": overflows,
            "tie_swaps": tie_swaps}


def run_one(h, policies: Sequence[str] = POLICIES, modes: Sequence[str] = MODES,
            autocast: Callable = jaxamp.autocast) -> list[dict]:
    """The rows of one harness: one per policy and mode. Never raises. ``autocast(fn,
    policy)`` is the transformation under test (a ``functools.partial`` of it with ``rules``
    checks an override)."""
    base = {"group": h.group_name, "harness": h.name,
            "dtype": np.dtype(h.dtype).name if h.dtype is not None else None}
    start = time.perf_counter()

    def rows(outcome: str, reason: str, **extra) -> list[dict]:
        return [{**base, "policy": p, "mode": m, "outcome": outcome, "reason": reason,
                 **extra} for p in policies for m in modes]

    why = unimplemented_on_cpu(h)
    if why is not None:
        return rows("skipped", f"jax_unimplemented on cpu: {why}")
    try:
        args = arguments(h)
    except Exception as e:  # a harness's maker may need what this JAX lacks
        return rows("skipped", f"the arguments cannot be made: {_first_line(e)}")
    if not any(_is_floating(a) for a in args):
        return rows("skipped", "no floating inputs")
    size = sum(int(np.size(a)) for a in args if _is_array(a))
    if size > MAX_ELEMENTS:
        return rows("skipped", f"{size} input elements > MAX_ELEMENTS")
    out: list[dict] = []
    reference: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in modes:
            for policy in policies:
                try:
                    out.append(_run_config(h, args, policy, mode, base, reference, autocast))
                except Exception as e:  # the suite's own defect: shown, not fatal
                    out.append({**base, "policy": policy, "mode": mode, "outcome": "raises",
                                "stage": "suite", "reason": _first_line(e)})
                out[-1]["seconds"] = round(time.perf_counter() - start, 3)
                start = time.perf_counter()
    messages = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}"
                       for w in caught})
    for r in out:
        r["warnings"] = messages
    return out


def _run_config(h, args: Sequence, policy_name: str, mode: str, base: dict,
                reference: dict, autocast: Callable) -> dict:
    """One row: the harness under one policy in one mode. ``reference`` caches the plain
    program's jitted runs by mode (its inputs' values change with the policy, not its types)."""
    row = {**base, "policy": policy_name, "mode": mode}
    policy = jaxamp.get_policy(policy_name)
    compute = np.dtype(policy.compute_dtype)
    fn, arrays, floats = _program(h, args, mode)
    xs = [np.asarray(args[i]) for i in arrays]
    # Autocast reads the harness's own floating dtypes in the inputs mode (fp64 as fp32), fp32
    # in the matmul mode; the values are rounded to the compute dtype, and the reference reads
    # the same values in fp32.
    for k in floats:
        own = np.dtype(np.float32) if xs[k].dtype == np.float64 else xs[k].dtype
        xs[k] = _round(xs[k], compute).astype(own if mode == "inputs" else np.float32)
    halves = {compute} | {np.dtype(xs[k].dtype) for k in floats if xs[k].dtype in _HALF}
    eps = max(float(jnp.finfo(d).eps) for d in halves)
    max_finite = min(float(jnp.finfo(d).max) for d in halves)
    ref_xs = [x.astype(np.float32) if k in floats else x for k, x in enumerate(xs)]
    if mode not in reference:
        reference[mode] = _reference(fn, floats, ref_xs)
        if (isinstance(reference[mode], str) and mode == "inputs"
                and any(xs[k].dtype in _HALF for k in floats)):
            # f takes no fp32 where the harness hands it half arrays (a half constant of its
            # own meets them): f on its own dtypes, whose ops round to them, is the reference.
            fp32_error = str(reference[mode]).split(": ", 1)[-1]
            mine = _reference(fn, floats, xs)
            reference[mode] = mine if isinstance(mine, str) else (*mine, fp32_error)
    ref = reference[mode]
    if isinstance(ref, str):
        return {**row, "outcome": "skipped", "reason": ref}
    ref_run, with_vjp, vjp, shapes, *fallback = ref
    if fallback:
        row["reference"] = f"f on the harness's own dtypes (in fp32 it raises {fallback[0]})"
        ref_xs = xs
    cts = (_cotangents(shapes, [compute, *sorted(halves - {compute}, key=str)], _seed(h) + 1)
           if with_vjp else [])
    try:
        ref_out, ref_grads = ref_run(ref_xs, cts)
    except Exception as e:
        return {**row, "outcome": "skipped",
                "reason": f"the fp32 reference raises: {_first_line(e)}"}
    ac = autocast(fn, policy)
    try:
        got, grads = _forward_and_vjp(ac, floats, with_vjp)(xs, cts)
    except Exception as e:
        error, stage = e, "forward"
        if with_vjp:  # which pass raises: the forward alone, or the VJP
            try:
                _forward_and_vjp(ac, floats, False)(xs, [])
                stage = "vjp"
            except Exception as e2:
                error = e2
        return {**row, "outcome": "raises", "stage": stage, "reason": _first_line(error),
                "vjp": vjp, "where": _traceback_tail(error)}
    forward = compare(got, ref_out, eps, max_finite)
    if with_vjp and forward["tie_swaps"]:
        with_vjp, vjp = False, ("not compared: the forward pass swaps the indices of tied "
                                "values, which moves their cotangents")
    backward = compare(grads, ref_grads, eps, max_finite) if with_vjp else None
    worst, stage = forward, "forward"
    if backward is not None and backward["ratio"] > forward["ratio"]:
        worst, stage = backward, "vjp"
        worst["where"] = worst["where"].replace("output", "gradient")
    ratio = worst["ratio"]
    outcome = "holds" if ratio <= 1 else "differs"
    reason = ("" if outcome == "holds"
              else f"{stage}: error {ratio:.3g}x the tolerance ({worst['where']})")
    return {**row, "outcome": outcome, "reason": reason,
            "stage": stage if outcome == "differs" else None, "ratio": ratio,
            "max_rel_err": max(forward["max_rel_err"],
                               backward["max_rel_err"] if backward else 0.0),
            "eps": eps, "vjp": vjp, "where": worst["where"],
            "overflows": forward["overflows"] + (backward["overflows"] if backward else 0),
            "tie_swaps": forward["tie_swaps"] + (backward["tie_swaps"] if backward else 0)}


def _reference(fn: Callable, floats: list[int], xs: list) -> tuple | str:
    """``(run, with_vjp, vjp, shapes)``: the plain program jitted, forward and VJP where the
    VJP runs (``vjp`` says why not where it does not), and its output types; or why it is
    skipped: the fp32 program raises."""
    try:
        shapes = jax.tree.leaves(jax.eval_shape(fn, *xs))
    except Exception as e:
        return f"the fp32 reference raises: {_first_line(e)}"
    inexact = [s for s in shapes if jnp.issubdtype(s.dtype, jnp.inexact)]
    cts = _cotangents(shapes, [], 0)
    if inexact:
        run = _forward_and_vjp(fn, floats, True)
        try:
            jax.block_until_ready(run(xs, cts))
            return run, True, "compared", shapes
        except Exception as e:
            vjp = f"not compared: the fp32 reference's VJP raises: {_first_line(e)}"
    else:
        vjp = "not compared: no inexact outputs"
    run = _forward_and_vjp(fn, floats, False)
    try:
        jax.block_until_ready(run(xs, []))
    except Exception as e:
        return f"the fp32 reference raises: {_first_line(e)}"
    return run, False, vjp, shapes


def _traceback_tail(e: BaseException) -> str:
    """The innermost frame of jaxamp's in the exception's traceback: where autocast gave up."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/jaxamp/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"


def run_all(harnesses: Iterable, policies: Sequence[str] = POLICIES,
            modes: Sequence[str] = MODES, progress: Callable[[dict], None] | None = None,
            autocast: Callable = jaxamp.autocast) -> list[dict]:
    """Every harness's rows, in order; ``progress(row)`` after each row."""
    out = []
    for h in harnesses:
        for r in run_one(h, policies, modes, autocast):
            out.append(r)
            if progress is not None:
                progress(r)
    return out


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

def counts_table(rows: Sequence[dict]) -> list[dict]:
    """Per group: how many rows hold, raise, differ and were skipped; a total last."""
    by_group: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        by_group[r["group"]][r["outcome"]] += 1
    total: collections.Counter = sum(by_group.values(), collections.Counter())
    return ([{"group": g, **{o: c[o] for o in OUTCOMES}} for g, c in sorted(by_group.items())]
            + [{"group": "**total**", **{o: total[o] for o in OUTCOMES}}])


def failures(rows: Sequence[dict]) -> list[dict]:
    """The rows that raise or differ."""
    return [r for r in rows if r["outcome"] in ("raises", "differs")]


def cause(row: dict) -> str:
    """What a failing row's failure is, for grouping: a raising row's exception without its
    numbers and dtypes; a differing row's group, pass and kind of disagreement."""
    if row["outcome"] == "differs":
        where = row.get("where") or ""
        kind = ("an infinity where the reference is finite" if "infinities" in where else
                "NaN where the reference is not" if "NaN" in where else
                "integer values differ" if "values differ" in where else
                "shapes differ" if "shape" in where else "beyond tolerance")
        return f"differs: {row['group']} {row['stage']}: {kind}"
    reason = re.sub(r"\b(b?float|u?int|complex)\d+", "DTYPE", row["reason"])
    return f"raises ({row.get('stage')}): " + re.sub(r"\d[\d.e+-]*", "N", reason)[:160]


def report(rows: Sequence[dict]) -> str:
    """The markdown of both tables and of the failures grouped by cause."""
    table = counts_table(rows)
    fails = failures(rows)
    lines = [bench_harness.markdown(table, ["group", *OUTCOMES]), ""]
    if fails:
        lines += [f"### {len(fails)} rows that do not hold", "",
                  bench_harness.markdown(fails, ["group", "harness", "policy", "mode",
                                                 "outcome", "stage", "reason"]), ""]
        causes: dict[str, list[dict]] = collections.defaultdict(list)
        for r in fails:
            causes[cause(r)].append(r)
        lines += ["### by cause", ""]
        for why, rs in sorted(causes.items(), key=lambda kv: -len(kv[1])):
            groups = sorted({r["group"] for r in rs})
            e = rs[0]
            lines.append(f"- {why}: {len(rs)} rows, {len(groups)} groups "
                         f"({', '.join(groups)}); e.g. {e['group']}/{e['harness']} "
                         f"({e['policy']}, {e['mode']}): {e['reason']}")
    return "\n".join(lines)


def run(args) -> dict:
    groups = TINY_GROUPS if args.tiny and args.groups is None else args.groups
    per_group = 1 if args.tiny and not args.per_group else args.per_group
    chosen = select(corpus(), per_group, groups)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "conformance.jsonl")
    start = time.perf_counter()
    with open(path, "w") as f:
        def progress(r):
            f.write(json.dumps({"suite": "conformance", **r}, default=str) + "\n")
            f.flush()
        rows = run_all(chosen, progress=progress)
    seconds = time.perf_counter() - start
    print(f"## conformance\n\n{bench_harness.machine()}; {len(chosen)} harnesses "
          f"({per_group or 'all'} per group{f', groups {groups!r}' if groups else ''}), "
          f"{len(rows)} rows in {seconds:.0f} s; C = {C}\n\n{report(rows)}\n", flush=True)
    return {"conformance": rows, "seconds": seconds}
