"""``python -m benchmarks gpu --deviceless h200``: the gpu suite compiled for a GPU, here.

    make gpu-memory                                   # every JAX row for an H200, into runs/
    JAX_PLATFORMS=cpu .venv-gpu/bin/python -m benchmarks gpu --deviceless h100 \\
        [--set core|extended|all] [--models ...] [--precisions ...] [--zero-devices 8] [--tiny]

The same rows, built by the same code as the timed suite (``benchmarks/gpu.py``), are compiled
by XLA:GPU for the named GPU on this machine, with no GPU: the params and batches stay abstract
and nothing runs. Each row records the compiled step's memory (``memory_analysis()``:
arguments + outputs - donated + temporaries) and its parts, the temporary buffer split by dtype
and by shape (``jaxamp.memory.gpu_memory``'s reading of XLA's buffer assignment), the compile
time and the matmul FLOPs of the trace. ZeRO rows are compiled for ``--zero-devices`` GPUs (8: one
host) and report one GPU's share. PyTorch rows are left out.

Rows go to ``OUT/gpu_deviceless_<gpu>.jsonl`` as they finish, and ``OUT/gpu_deviceless_<gpu>.md``
is the table, with each row against its model's fp32_default row and, for the rows the H200
run measured (``benchmarks/results/gpu-h200-2026-12-04/``), against the real GPU's figure.
Compile times are this machine's (on 2 cores: 20-30 s for BERT-Large's rows); kernel choices
and timings are not autotuned, so only the sizes are the GPU's.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import time
from typing import Any

import jax

from benchmarks import gpu
from benchmarks import harness
from jaxamp import memory
from jaxamp._diagnoses import _memory

H200_RUN = os.path.join(os.path.dirname(__file__), "results", "gpu-h200-2026-12-04")
GB = 1e9


def _measured_on_h200() -> dict[tuple[str, str], float]:
    """``(model, precision) -> mem_gb`` of the first H200 run (same code as this suite's rows
    at that run's commit)."""
    out = {}
    for name in ("gpu.jsonl", "gpu_nnx_gpt.jsonl"):
        path = os.path.join(H200_RUN, name)
        if os.path.exists(path):
            for r in gpu._read(path):
                if r.get("mem_gb"):
                    out[(r["model"], r["precision"])] = r["mem_gb"]
    return out


def _placed(built: gpu.Built, prec: gpu.Precision, target: str,
            zero_devices: int) -> tuple[gpu.Built, dict, int]:
    """The state and batch laid out on compile-only GPUs: one, or ``zero_devices`` for a ZeRO
    row; the ``jax.jit`` keywords, and the GPU count."""
    if prec.zero:
        mesh = memory.gpu_mesh(target, zero_devices)
        placed, jit_kwargs = gpu._on_mesh(built, prec.zero, list(mesh.devices.flat))
        return placed, jit_kwargs, len(jax.tree.leaves(placed.batch)[0].sharding.device_set)
    mesh = memory.gpu_mesh(target)
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def abstract(tree):
        return jax.tree.map(lambda x: _memory._abstract(x, one), tree)
    return dataclasses.replace(built, state=abstract(built.state),
                               batch=abstract(built.batch)), {}, 1


def compile_row(model: str, precision: str, ctx: gpu.Context, target: str) -> dict:
    """One row's fields: the step compiled for ``target``."""
    prec = gpu.PRECISIONS[precision]
    params, model_state = ctx.params(model)
    built = gpu._build(ctx.cases[model], prec, params, model_state, None, init=ctx.init)
    flops = ctx.trace_flops(model, prec, built)
    built, jit_kwargs, devices = _placed(built, prec, target, ctx.args.zero_devices)
    with gpu._precision_context(prec.matmul_precision):
        effective = gpu.effective_matmul_precision()
        t0 = time.perf_counter()
        lowered = jax.jit(built.step, donate_argnums=0, **jit_kwargs).lower(built.state,
                                                                             built.batch)
        report, compiled = _memory.compile_report(lowered, ctx.device_kind, devices,
                                                      (built.state, built.batch))
        compile_s = time.perf_counter() - t0
    return {"devices": devices, "compile_s": compile_s, "matmul_precision": effective,
            "mem_gb": report.total_bytes / GB, "argument_gb": report.argument_bytes / GB,
            "output_gb": report.output_bytes / GB, "alias_gb": report.alias_bytes / GB,
            "temp_gb": report.temp_bytes / GB,
            "live_peak_gb": None if report.live_peak_bytes is None
            else report.live_peak_bytes / GB,
            "argument_by_dtype_gb": {k: v / GB for k, v in report.argument_by_dtype.items()},
            "temp_by_dtype_gb": {k: v / GB for k, v in report.temp_by_dtype.items()},
            "temp_largest": [[label, n, b / GB] for label, n, b in report.temp_by_shape[:8]],
            "gemms_by_operands": report.gemms, **_gemm_counts(report.gemms),
            "flops": flops, **gpu.kernel_fingerprint(compiled)}


def _gemm_counts(gemms: dict[str, int]) -> dict[str, int]:
    """The compiled step's GEMMs, and those whose two operands are 8-bit (an FP8 GEMM, not a
    dequantized one)."""
    return {"gemms": sum(gemms.values()),
            "fp8_gemms": sum(n for k, n in gemms.items() if k.count("f8") == 2)}


def run(args) -> list[dict]:
    target = args.deviceless
    name, _ = _memory._target_text(target)
    os.makedirs(args.out, exist_ok=True)
    rows_path = os.path.join(args.out, f"gpu_deviceless_{target}.jsonl")
    if args.render_only:
        return render(args.out, target)
    memory.gpu_mesh(target)  # fails early, with the install's instructions
    plan = [(m, p) for m, p in gpu._plan(args) if gpu.PRECISIONS[p].kind != "torch"]
    info = {"target": name, **gpu.versions(),
            "cuda_plugin": gpu._version("jax-cuda13-plugin") or gpu._version(
                "jax-cuda12-plugin"), "machine": harness.machine(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "tiny": bool(args.tiny), "zero_devices": args.zero_devices}
    print(f"## {gpu.SUITE} --deviceless {target}: compiled for {name} on "
          f"{harness.machine()}\n", flush=True)
    for k, v in info.items():
        print(f"- {k}: {v}", flush=True)
    print(f"- plan: {len(plan)} configurations: " + ", ".join(f"{m}/{p}" for m, p in plan),
          flush=True)
    if not args.append and os.path.exists(rows_path):
        os.remove(rows_path)
    ctx = gpu.Context(args, gpu._cases(args.tiny), name, {}, init=gpu.abstract_init)
    for model, precision in plan:
        row: dict[str, Any] = {"suite": "gpu_deviceless", **info, "model": model,
                               "precision": precision, "batch": ctx.cases[model]["batch"],
                               "description": gpu.PRECISIONS[precision].description,
                               "error": None}
        t0 = time.perf_counter()
        try:
            row.update(compile_row(model, precision, ctx, target))
        except Exception as e:
            row["error"] = gpu.error_text(e)
        finally:
            gc.collect()
        row["seconds"] = time.perf_counter() - t0
        gpu._append(rows_path, row)
        print(_summary(row), flush=True)
    return render(args.out, target)


def _summary(row: dict) -> str:
    head = f"  {row['model']} / {row['precision']}:"
    if row.get("error"):
        return f"{head} ERROR {row['error']}"
    return (f"{head} {row['mem_gb']:.2f} GB on each of {row['devices']} "
            f"(arguments {row['argument_gb']:.2f}, temporaries {row['temp_gb']:.2f}: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["temp_by_dtype_gb"].items(),
                                                           key=lambda kv: -kv[1]))
            + f"), compiled in {row['compile_s']:.1f} s")


def _largest(row: dict, n: int = 3) -> str:
    return "; ".join(f"{count}× {label} {gb:.2f}" for label, count, gb in row["temp_largest"][:n])


def render(out: str, target: str) -> list[dict]:
    """``OUT/gpu_deviceless_<target>.md`` from the rows: every row against its model's fp32
    row and against the H200 run's figure where it measured the row."""
    rows = gpu._read(os.path.join(out, f"gpu_deviceless_{target}.jsonl"))
    fp32 = {r["model"]: r["mem_gb"] for r in rows
            if r["precision"] == "fp32_default" and r.get("mem_gb")}
    measured = _measured_on_h200() if target == "h200" and not any(
        r.get("tiny") for r in rows) else {}
    for r in rows:
        ok = r.get("mem_gb") is not None
        r["vs_fp32_default"] = r["mem_gb"] / fp32[r["model"]] if ok and r["model"] in fp32 \
            else None
        real = measured.get((r["model"], r["precision"]))
        r["h200_measured_gb"] = real
        r["off_by"] = None if real is None or not ok else r["mem_gb"] / real - 1
    first = rows[0] if rows else {}
    lines = [
        f"# The gpu suite compiled for {first.get('target', target)}, without a GPU",
        "",
        f"jax {first.get('jax')}, jaxlib {first.get('jaxlib')}, CUDA plugin "
        f"{first.get('cuda_plugin')}, flax {first.get('flax')}, optax {first.get('optax')}; "
        f"{first.get('machine')}; {first.get('started')}. Memory is XLA:GPU's compiled step: "
        "arguments + outputs - donated + temporaries, per GPU, in GB; ZeRO rows on "
        f"{first.get('zero_devices')} GPUs. `vs fp32`: against the model's fp32_default row. "
        "`H200 run`: what the H200 measured on 2026-12-04 for that day's program (commit "
        "59515a2); `vs H200 run` is the deviceless compile's error only where the program is "
        "still that day's (benchmarks/results/gpu-deviceless-h200/before.md), elsewhere it "
        "includes every change since.",
        "",
        "| model | precision | GPUs | mem GB | vs fp32 | arguments | temporaries | temporaries "
        "by dtype | largest temporaries (values × shape, GB) | fusions (cuDNN attention) | "
        "FP8 GEMMs / GEMMs | compile s | H200 run | vs H200 run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['precision']} | | error: {r['error'][:120]} "
                         "| | | | | | | | | | |")
            continue
        dtypes = ", ".join(f"{k} {v:.2f}" for k, v in sorted(
            r["temp_by_dtype_gb"].items(), key=lambda kv: -kv[1]) if v >= 0.005)
        vs = "" if r["vs_fp32_default"] is None else f"{r['vs_fp32_default']:.3f}"
        real = "" if r["h200_measured_gb"] is None else f"{r['h200_measured_gb']:.2f}"
        off = "" if r["off_by"] is None else f"{100 * r['off_by']:+.1f}%"
        fusions = "" if r.get("fusions") is None else \
            f"{r['fusions']} ({r['cudnn_attention']})"
        gemms = "" if r.get("gemms") is None else f"{r['fp8_gemms']} / {r['gemms']}"
        lines.append(f"| {r['model']} | {r['precision']} | {r['devices']} | "
                     f"{r['mem_gb']:.2f} | {vs} | {r['argument_gb']:.2f} | {r['temp_gb']:.2f} "
                     f"| {dtypes} | {_largest(r)} | {fusions} | {gemms} | {r['compile_s']:.1f} "
                     f"| {real} "
                     f"| {off} |")
    path = os.path.join(out, f"gpu_deviceless_{target}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\n{path}:\n" + "\n".join(lines), flush=True)
    return rows
