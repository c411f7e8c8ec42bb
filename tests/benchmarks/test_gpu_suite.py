"""The gpu suite (``python -m benchmarks gpu``, ``benchmarks/gpu.sh``) on the CPU: every row at a
tiny size in a process where jmp, equinox and torch cannot be imported (as on the GPU
machine), the sets, the budget, the concurrent compiles, and the report."""

import argparse
import importlib.util
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import ROOT
from helpers import read_jsonl

from benchmarks import gpu
from benchmarks.__main__ import main

# Under pytest-xdist, the tests sharing the module-scoped fixture run on one worker.
pytestmark = pytest.mark.xdist_group("gpu_tiny")

# Runs `python -m benchmarks ARGS` where importing jmp, equinox, torch or torchvision fails,
# as on the GPU machine (which has no jmp) or a user's without the bench extra.
WITHOUT_PEERS = """
import importlib.abc, runpy, sys
BLOCKED = {"jmp", "equinox", "torch", "torchvision"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
sys.argv = ["benchmarks", *sys.argv[1:]]
runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
"""


def without_peers(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", WITHOUT_PEERS, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)



@pytest.fixture(scope="module")
def gpu_tiny(tmp_path_factory):
    """Every row of the suite at --tiny, its JAX rows compiled two at a time, in a process
    without jmp, equinox and torch."""
    out = tmp_path_factory.mktemp("gpu")
    proc = without_peers("gpu", "--tiny", "--compile-workers", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_the_suites_start_without_jmp_equinox_and_torch(gpu_tiny):
    for suite in ("gpu", "memory", "overhead", "autocast"):
        proc = without_peers(suite, "--help", timeout=120)
        assert proc.returncode == 0 and "--tiny" in proc.stdout, proc.stderr[-2000:]
    proc = without_peers("--help", timeout=120)
    assert proc.returncode == 0 and "gpu" in proc.stdout and "memory" in proc.stdout
    assert "--budget" in without_peers("gpu", "--help", timeout=120).stdout
    # The tiny run (the fixture) ran in such a process: every torch row is an error row.
    out, printed = gpu_tiny
    assert "## gpu: cpu" in printed
    assert "bert_large: 12 JAX rows lowered and compiled on 2 threads" in printed


def test_concurrent_compiles_build_the_programs_compiled_one_at_a_time(gpu_tiny, tmp_path):
    """The same optimized HLO (on a GPU it holds the autotuned kernels) whether a model's rows
    compile two at a time or one after another."""
    out, _ = gpu_tiny
    concurrent = {r["precision"]: r for r in read_jsonl(out / "gpu.jsonl")
                  if r["model"] == "nnx_gpt"}
    main(["gpu", "--tiny", "--models", "nnx_gpt", "--compile-workers", "1", "--out",
          str(tmp_path)])
    alone = {r["precision"]: r for r in read_jsonl(tmp_path / "gpu.jsonl")}
    assert set(alone) == set(concurrent) == {"autocast_bf16", "fp32_default"}
    for p, r in alone.items():
        assert not r["compiled_concurrently"] and concurrent[p]["compiled_concurrently"]
        assert (r["hlo_sha"], r["loss"]) == (concurrent[p]["hlo_sha"], concurrent[p]["loss"]), p


def test_the_core_set_is_the_rows_that_decide_the_gpu_goals():
    assert gpu.CORE == {
        "resnet50": ("mixed_bfloat16", "bare_bf16", "mixed_bfloat16_select", "torch_amp_bf16",
                     "fp32_default", "fp32_highest", "torch_compile_bf16"),
        "bert_large": ("mixed_bfloat16", "bare_bf16", "mixed_bfloat16_select", "fp32_default",
                       "fp32_highest", "mixed_fp8_current", "mixed_bfloat16_kahan"),
        "nnx_gpt": ("autocast_bf16", "fp32_default")}
    for model in gpu.CORE:  # the two sets split every row of the suite, once
        assert sorted(gpu.CORE[model] + gpu.EXTENDED[model]) == sorted(
            gpu.MODEL_PRECISIONS[model]) and not set(gpu.CORE[model]) & set(gpu.EXTENDED[model])
    # Every row has an H200 estimate for --budget.
    assert set(gpu.H200_SECONDS) == {(m, p) for m, ps in gpu.MODEL_PRECISIONS.items() for p in ps}


def test_the_core_set_fits_one_command_by_the_h200_estimates():
    """The arithmetic of BENCHMARKS.md: the core set, its JAX rows compiled four at a time
    (counted as a speed-up of 3), within gpu.sh's default budget of 510 s (9 minutes less the
    report and a margin); compiled one at a time it would not fit."""
    assert gpu.h200_estimate(gpu.CORE) == pytest.approx(486.4, abs=0.1)
    assert gpu.h200_estimate(gpu.CORE, workers=1) > 600
    assert gpu.h200_estimate(gpu.EXTENDED) < 510


def test_budget_stops_with_every_finished_row_on_disk(tmp_path, monkeypatch):
    """A row that overruns the budget is stopped by the alarm and written as such, after the
    rows finished before it; the report is rendered from what is on disk."""
    def measure(model, precision, ctx):
        time.sleep(0.2 if precision == "mixed_bfloat16" else 60.0)
        return {"step_ms": 1.0, "flops": 1e9, "loss": 1.0, "skipped_steps": 0}
    monkeypatch.setattr(gpu, "measure", measure)
    monkeypatch.setattr(gpu, "_measure_peaks", lambda plan, tiny: {})
    monkeypatch.setattr(gpu, "_environment_info", lambda: None)
    t0 = time.monotonic()
    main(["gpu", "--tiny", "--models", "resnet50", "--precisions",
          "mixed_bfloat16,bare_bf16,fp32_default", "--budget",
          f"{time.monotonic() - gpu.START + 4.0:.2f}", "--out", str(tmp_path)])
    assert time.monotonic() - t0 < 20  # not the 60 s of the second row
    rows = read_jsonl(tmp_path / "gpu.jsonl")
    assert [(r["precision"], r["error"] is None) for r in rows] == [
        ("mixed_bfloat16", True), ("bare_bf16", False)]
    assert rows[0]["per_s"] > 0
    assert rows[1]["error"].startswith("stopped: --budget") and rows[1]["not_run"]
    assert "stopped: --budget" in (tmp_path / "gpu.md").read_text()


def test_budget_writes_the_rows_that_no_longer_fit_as_not_run(tmp_path, monkeypatch):
    budget = gpu.Budget(10.0, time.monotonic(), on_gpu=True)
    fit = budget.fit(["mixed_bfloat16", "bare_bf16"], "bert_large", workers=1)
    assert fit == [("mixed_bfloat16", False), ("bare_bf16", False)]
    assert budget.why_not("bert_large", "bare_bf16").startswith(
        "not run: --budget 10 s (estimate 38 s,")
    # Elsewhere a row is estimated by the longest row so far.
    budget = gpu.Budget(5.0, time.monotonic(), on_gpu=False, history=[1.0, 3.0])
    assert budget.fit(["bare_bf16", "fp32_default"], "resnet50", workers=1) == [
        ("bare_bf16", True), ("fp32_default", False)]
    # The run writes them, in their place, and the alarm's flag is checked between rows.
    monkeypatch.setattr(gpu, "measure", lambda model, precision, ctx: {
        "step_ms": 1.0, "flops": 1e9, "loss": 1.0, "skipped_steps": 0})
    monkeypatch.setattr(gpu.Budget, "fit", lambda self, ps, model, workers: [
        (p, p != "bare_bf16") for p in ps])
    main(["gpu", "--tiny", "--models", "resnet50", "--precisions",
          "mixed_bfloat16,bare_bf16,fp32_default", "--budget", "1e6", "--out", str(tmp_path)])
    rows = read_jsonl(tmp_path / "gpu.jsonl")
    assert [(r["precision"], r.get("not_run", False)) for r in rows] == [
        ("mixed_bfloat16", False), ("bare_bf16", True), ("fp32_default", False)]
    budget = gpu.Budget(1.0, time.monotonic(), on_gpu=False, rung=True)
    with pytest.raises(gpu.BudgetExceeded):
        budget.check()


def test_gpu_suite_at_a_tiny_size(gpu_tiny):
    out, _ = gpu_tiny
    rows = read_jsonl(out / "gpu.jsonl")
    assert [(r["model"], r["precision"]) for r in rows] == [
        (m, p) for m, ps in gpu.MODEL_PRECISIONS.items() for p in ps]
    by = {(r["model"], r["precision"]): r for r in rows}
    for r in rows:
        prec = gpu.PRECISIONS[r["precision"]]
        assert r["unit"] == ("img/s" if r["model"] == "resnet50" else "seq/s")
        if prec.kind == "torch":  # no torch in this process, and no torch.compile at --tiny
            assert r.get("per_s") is None and ("No module named 'torch" in r["error"] or (
                prec.torch_compile and "not run at --tiny" in r["error"])), r["error"]
            continue
        assert r["error"] is None, r
        assert r["per_s"] > 0 and r["step_ms"] > 0 and np.isfinite(r["loss"])
        assert r["flops"] > 0 and r["tflops"] > 0 and r["mem_gb"] > 0
        # MFU against the measured peak of the row's own kind of matmul, never fp32 over bf16;
        # no datasheet for a CPU.
        assert r["peak_class"] == f"{prec.peak}/{prec.matmul_precision or 'default'}"
        assert r["mfu_measured"] > 0 and r["mfu_datasheet"] is None
        assert r["skipped_steps"] == (None if prec.kind == "bare" else 0)
        highest = r["precision"] == "fp32_highest"
        assert r["matmul_precision"] == ("highest" if highest else "unset (DEFAULT)")
        assert r["dot_precision"] == ("HIGHEST" if highest else "DEFAULT")
        assert r["compiled_concurrently"] and len(r["hlo_sha"]) == 16
    for model in ("resnet50", "bert_large"):
        assert by[(model, "fp32_highest")]["vs_fp32_highest"] == 1.0
        assert by[(model, "fp32_default")]["vs_fp32_default"] == 1.0
        assert by[(model, "bare_bf16")]["time_vs_bare_bf16"] == 1.0
        cond, select = by[(model, "mixed_bfloat16")], by[(model, "mixed_bfloat16_select")]
        assert select["time_vs_cond"] == pytest.approx(select["step_ms"] / cond["step_ms"])
        assert select["loss"] == pytest.approx(cond["loss"], rel=1e-4)  # the same steps
        # FLOPs come from the trace: the same whatever the precision.
        assert len({by[(model, p)]["flops"] for p in gpu.MODEL_PRECISIONS[model]
                    if gpu.PRECISIONS[p].kind != "torch"}) == 1
    # The sharded state trains the same model as the plain step (over a mesh of the devices
    # that split the tiny batch, so in fp32 rather than bf16 partial sums: close, not equal).
    zero3 = by[("bert_large", "mixed_bfloat16_zero3")]
    assert zero3["loss"] == pytest.approx(by[("bert_large", "mixed_bfloat16")]["loss"], rel=1e-2)
    # master="kahan" keeps every param's fp32 value (its moments are bf16: close, not equal).
    for model in ("resnet50", "bert_large"):
        kahan = by[(model, "mixed_bfloat16_kahan")]
        assert kahan["loss"] == pytest.approx(by[(model, "mixed_bfloat16")]["loss"], rel=1e-2)
    assert np.isfinite(by[("bert_large", "mixed_bfloat16_stochastic")]["loss"])
    # On a CPU "auto" attention is the explicit path: the same program as mixed_bfloat16.
    explicit = by[("bert_large", "mixed_bfloat16_explicit")]
    assert explicit["loss"] == by[("bert_large", "mixed_bfloat16")]["loss"]
    # FP8 rows: every matmul in FP8, the same model and steps as bf16 (close, not equal), MFU
    # against the FP8 peak and the speedup over mixed_bfloat16.
    for recipe in ("current", "delayed"):
        row = by[("bert_large", f"mixed_fp8_{recipe}")]
        assert row["fp8_share"] == 1.0 and row["peak_class"] == "float8/default"
        assert row["loss"] == pytest.approx(by[("bert_large", "mixed_bfloat16")]["loss"],
                                            rel=5e-2)
        assert row["vs_mixed_bf16"] > 0
    assert by[("nnx_gpt", "autocast_bf16")]["vs_fp32_default"] > 0
    runs = read_jsonl(out / "gpu_runs.jsonl")
    assert len(runs) == 1 and runs[0]["jax"] == jax.__version__ and runs[0]["tiny"]
    assert runs[0]["default_matmul_precision"] == "unset (DEFAULT)"
    assert all(v > 0 for v in runs[0]["measured_peaks_tflops"].values())
    assert set(runs[0]["measured_peaks_tflops"]) == {r["peak_class"] for r in rows
                                                     if r.get("peak_class")}
    text = (out / "gpu.md").read_text()
    assert "| resnet50 | mixed_bfloat16 | 2 |" in text and "never divided by a bf16" in text
    assert (out / "gpu.png").stat().st_size > 1000


def test_gpu_suite_writes_each_row_when_measured_and_survives_a_failing_one(tmp_path,
                                                                           monkeypatch):
    """Every row is on disk before the next configuration starts; a failing configuration
    leaves an error row and the suite goes on; a run that dies keeps what it measured."""
    seen = []

    def measure(model, precision, ctx):
        assert len(read_jsonl(tmp_path / "gpu.jsonl") if seen else []) == len(seen)
        seen.append(precision)
        if precision == "fp32_highest":
            raise FloatingPointError("overflow in the first step\nsecond line")
        if precision == "mixed_float16":
            raise KeyboardInterrupt  # the process is killed here
        return {"step_ms": 2.0 if precision == "bare_bf16" else 4.0, "flops": 1e9,
                "loss": 1.0, "skipped_steps": None if precision == "bare_bf16" else 0}
    monkeypatch.setattr(gpu, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        main(["gpu", "--tiny", "--models", "bert_large", "--precisions",
              "fp32_highest,mixed_float16,fp32_default,bare_bf16", "--out", str(tmp_path)])
    assert seen == ["bare_bf16", "fp32_default", "fp32_highest", "mixed_float16"]
    rows = read_jsonl(tmp_path / "gpu.jsonl")
    assert [(r["precision"], r["error"]) for r in rows] == [
        ("bare_bf16", None), ("fp32_default", None),
        ("fp32_highest", "FloatingPointError: overflow in the first step")]
    assert rows[2].get("per_s") is None and rows[2]["model"] == "bert_large"
    # The report is rendered from what is on disk.
    main(["gpu", "--render-only", "--out", str(tmp_path)])
    rows = {r["precision"]: r for r in read_jsonl(tmp_path / "gpu.jsonl")}
    assert rows["fp32_default"]["time_vs_bare_bf16"] == 2.0
    assert rows["bare_bf16"]["vs_fp32_default"] == 2.0
    assert rows["bare_bf16"]["vs_fp32_highest"] is None  # its row never got measured
    assert "FloatingPointError: overflow in the first step" in (tmp_path / "gpu.md").read_text()


def test_gpu_suite_fails_loudly_without_a_gpu(tmp_path, capsys):
    if jax.devices()[0].platform == "gpu":
        pytest.fail("these tests run on the CPU")
    with pytest.raises(SystemExit) as e:
        main(["gpu", "--out", str(tmp_path)])
    assert "JAX is on cpu" in str(e.value.code) and "--tiny" in str(e.value.code)
    printed = capsys.readouterr().out
    assert printed.startswith("## gpu: cpu") and f"- jax: {jax.__version__}" in printed
    assert not (tmp_path / "gpu.jsonl").exists()
    # Under `python -m benchmarks all` it says so and skips, so the CPU suites still run.
    assert gpu._check_device(argparse.Namespace(tiny=False, via_all=True)) is False
    assert "Skipped under `all`" in capsys.readouterr().out


def test_gpu_suite_peaks_memory_and_flops_survive_what_xla_leaves_out():
    assert gpu.datasheet_peak(gpu.PRECISIONS["mixed_bfloat16"], "NVIDIA H200", {})[0] == 989e12
    fp32_default, fp32_highest = gpu.PRECISIONS["fp32_default"], gpu.PRECISIONS["fp32_highest"]
    assert gpu.datasheet_peak(fp32_highest, "NVIDIA H100 80GB HBM3", {})[0] == 67e12
    # The default precision is TF32 only where the fp32 matmul ran faster than fp32 can.
    assert gpu.datasheet_peak(fp32_default, "NVIDIA H200", {"float32/default": 400e12})[0] == \
        494e12
    assert gpu.datasheet_peak(fp32_default, "NVIDIA H200", {"float32/default": 60e12})[0] == \
        67e12
    assert gpu.datasheet_peak(fp32_default, "NVIDIA H200", {})[0] is None
    assert gpu.datasheet_peak(fp32_default, "NVIDIA A100-SXM4-80GB", {})[0] is None

    class Compiled:
        def __init__(self, cost=None, memory=None):
            self.cost, self.memory = cost, memory

        def cost_analysis(self):
            if isinstance(self.cost, Exception):
                raise self.cost
            return self.cost

        def memory_analysis(self):
            return self.memory
    for cost in (None, [], {"flops": -1.0}, [{"flops": 0.0}], {}, RuntimeError("no")):
        assert gpu.xla_flops(Compiled(cost=cost)) is None
    assert gpu.xla_flops(Compiled(cost=[{"flops": 5.0}])) == 5.0
    assert gpu.compiled_memory(Compiled()) == {"mem_gb": None, "xla_peak_gb": None}
    stats = argparse.Namespace(argument_size_in_bytes=4e9, output_size_in_bytes=3e9,
                               alias_size_in_bytes=2.5e9, temp_size_in_bytes=1e9)
    assert gpu.compiled_memory(Compiled(memory=stats)) == {"mem_gb": 5.5, "xla_peak_gb": None}
    assert gpu.compiled_memory(Compiled(memory=argparse.Namespace(temp_size_in_bytes=1))) == \
        {"mem_gb": None, "xla_peak_gb": None}
    text = ("stablehlo.dot_general %a, %b, precision = [HIGHEST, HIGHEST]\n"
            "stablehlo.convolution ... precision_config = [#stablehlo<precision DEFAULT>, "
            "#stablehlo<precision DEFAULT>]")
    assert gpu.dot_precisions(text) == "DEFAULT+HIGHEST" and gpu.dot_precisions("") == "none"


def test_gpu_suite_torch_rows_on_a_stand_in_for_torchvision(tmp_path, monkeypatch):
    """The torch rows' recipe (autocast, GradScaler, the FLOP counter, the skip count) on the
    CPU, with a small convolutional net in torchvision's place (torchvision is not installed
    here)."""
    if importlib.util.find_spec("torch") is None:   # what a machine without torch gets
        _check_torch_rows_say_torch_is_missing(tmp_path)
        return
    import types

    import torch

    def resnet50():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                   torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(8, 1000))
    monkeypatch.setitem(sys.modules, "torchvision",
                        types.SimpleNamespace(models=types.SimpleNamespace(resnet50=resnet50)))
    main(["gpu", "--tiny", "--models", "resnet50", "--precisions",
          "mixed_bfloat16,mixed_float16,torch_amp_bf16,torch_amp_fp16", "--out", str(tmp_path)])
    by = {r["precision"]: r for r in read_jsonl(tmp_path / "gpu.jsonl")}
    for name, dtype in (("torch_amp_bf16", "mixed_bfloat16"), ("torch_amp_fp16", "mixed_float16")):
        r = by[name]
        assert r["error"] is None and r["per_s"] > 0 and r["flops"] > 0 and r["tflops"] > 0
        assert r["peak_class"] == ("float16/default" if "fp16" in name else "bfloat16/default")
        assert r["jaxamp_vs_torch"] == pytest.approx(by[dtype]["per_s"] / r["per_s"])
        assert r["skipped_steps"] == (0 if "fp16" in name else None) and np.isfinite(r["loss"])
        assert r["live_peak_gb"] is None  # CUDA only


def test_gpu_sh_runs_a_set_per_command_and_the_report(tmp_path):
    """``bash benchmarks/gpu.sh --tiny`` end to end on the CPU: the core set afresh, then the
    extended set appended; a failing command gives its exit status and the report is still
    written."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable,
           "OUT": str(tmp_path / "out")}
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    args = ["bash", "benchmarks/gpu.sh", "--tiny", "--models", "bert_large,nnx_gpt",
            "--precisions", "mixed_bfloat16,fp32_default,autocast_bf16,mixed_float16"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run(args, cwd=ROOT, env={**env, "SET": "extended"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = read_jsonl(out / "gpu.jsonl")
    assert [(r["model"], r["precision"]) for r in rows] == [
        ("bert_large", "mixed_bfloat16"), ("bert_large", "fp32_default"),
        ("nnx_gpt", "autocast_bf16"), ("nnx_gpt", "fp32_default"),
        ("bert_large", "mixed_float16")]
    assert all(r["error"] is None and r["vs_fp32_default"] > 0 for r in rows)
    runs = read_jsonl(out / "gpu_runs.jsonl")
    assert [r["argv"][:5] for r in runs] == [["gpu", "--set", "core", "--budget", "510"],
                                             ["gpu", "--set", "extended", "--budget", "510"]]
    for r in runs:
        assert r["env"]["JAX_PLATFORMS"] == "cpu"
        assert r["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.78"
        assert f"--xla_gpu_per_fusion_autotune_cache_dir={out}/autotune" in r["env"]["XLA_FLAGS"]
    text = (out / "gpu.md").read_text()
    assert "- Run 2 (" in text and "| nnx_gpt | autocast_bf16 |" in text
    assert (out / "gpu.png").stat().st_size > 1000
    assert "nnx_gpt / autocast_bf16:" in (out / "gpu_core.log").read_text()
    assert "bert_large / mixed_float16:" in (out / "gpu_extended.log").read_text()

    proc = subprocess.run(["bash", "benchmarks/gpu.sh", "--tiny", "--models", "no_such_model"],
                          cwd=ROOT, env={**env, "OUT": str(tmp_path / "failed")},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "the suite exited with 2" in proc.stderr
    assert (tmp_path / "failed" / "gpu.md").exists()
    proc = subprocess.run(["bash", "benchmarks/gpu.sh"], cwd=ROOT, env={**env, "SET": "most"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "expected core, extended or all" in proc.stderr


def _check_torch_rows_say_torch_is_missing(out):
    main(["gpu", "--tiny", "--models", "resnet50", "--precisions",
          "mixed_bfloat16,torch_amp_bf16,torch_amp_fp16", "--out", str(out)])
    by = {r["precision"]: r for r in read_jsonl(out / "gpu.jsonl")}
    assert by["mixed_bfloat16"]["error"] is None and by["mixed_bfloat16"]["per_s"] > 0
    for name in ("torch_amp_bf16", "torch_amp_fp16"):
        assert by[name].get("per_s") is None and "torch" in by[name]["error"], by[name]


def test_gpu_suite_torch_rows_are_error_rows_without_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)   # import torch raises ImportError
    monkeypatch.setitem(sys.modules, "torchvision", None)
    _check_torch_rows_say_torch_is_missing(tmp_path)




def test_the_init_runs_on_the_host_and_moves_to_the_device(monkeypatch):
    """With a CPU backend beside the GPU (gpu.sh's JAX_PLATFORMS=cuda,cpu) the params are drawn
    by XLA:CPU and put on the GPU; here another CPU device stands in for the host."""
    case = gpu._cases(tiny=True)["nnx_gpt"]
    direct, _ = gpu._init(case, tiny=True)
    monkeypatch.setattr(gpu, "_host_device", lambda: jax.devices()[1])
    moved, _ = gpu._init(case, tiny=True)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(direct), strict=True):
        assert a.devices() == {jax.devices()[0]}
        np.testing.assert_allclose(a, b, rtol=1e-6)  # the host compiles at -O2, --tiny at -O0
