"""The benchmark suites (``python -m benchmarks``) run at a tiny size, write every field, and
compare like with like."""

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT

from benchmarks import cpu_flags
from benchmarks import gpu
from benchmarks import harness
from benchmarks.__main__ import main

# Under pytest-xdist, the tests sharing a module-scoped fixture run on one worker.
pytestmark = pytest.mark.xdist_group("tiny_runs")

OVERHEAD_VARIANTS = ["fp32", "bare_bf16", "jmp", "flax_DynamicScale", "optax_apply_if_finite",
                     "jaxamp_mixed_bf16", "jaxamp_mixed_fp16", "jaxamp_bf16_accum4"]


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    results = main(["all", "--tiny", "--out", str(out)])
    return out, results


def test_overhead_suite_writes_every_field(tiny_runs):
    out, results = tiny_runs
    rows = read_jsonl(out / "overhead.jsonl")
    assert [r["variant"] for r in rows] == OVERHEAD_VARIANTS
    for r in rows:
        for key in ("median_ms", "time_vs_bare_bf16", "time_vs_fp32", "gflops",
                    "gbytes_accessed", "bytes_vs_bare_bf16", "bytes_vs_fp32", "entry_ops",
                    "saved_mb", "saved_vs_fp32"):
            assert isinstance(r[key], int | float) and np.isfinite(r[key]) and r[key] > 0, key
        lo, hi = (float(x) for x in r["time_vs_bare_bf16_iqr"].split("–"))
        assert lo <= r["time_vs_bare_bf16"] <= hi
    by = {r["variant"]: r for r in rows}
    assert by["bare_bf16"]["time_vs_bare_bf16"] == 1.0 and by["fp32"]["time_vs_fp32"] == 1.0
    # bf16 compute saves fewer activation bytes than fp32; accumulation saves a quarter batch.
    assert by["jaxamp_mixed_bf16"]["saved_mb"] < by["fp32"]["saved_mb"]
    assert by["jaxamp_bf16_accum4"]["saved_mb"] < by["jaxamp_mixed_bf16"]["saved_mb"] / 3
    assert (out / "overhead.png").stat().st_size > 1000


def test_memory_suite_writes_every_field(tiny_runs):
    out, _ = tiny_runs
    rows = read_jsonl(out / "memory.jsonl")
    assert len(rows) == 10
    for r in rows:
        for key in ("saved_mb", "saved_vs_fp32", "state_mb", "state_vs_fp32"):
            assert r[key] > 0, key
    by = {(r["model"], r["variant"]): r for r in rows}
    for model in ("ResNet (tiny)", "BERT (tiny)"):
        assert by[(model, "jaxamp mixed_bfloat16")]["saved_vs_fp32"] < 0.55
        # The jmp recipe's params cast does not make the fp32 layers compute in bf16.
        assert by[(model, "jmp recipe (Linen)")]["saved_vs_fp32"] > 1.0
        # Master weights cost a bf16 working copy on top of fp32 params and adam's moments.
        np.testing.assert_allclose(by[(model, "jaxamp mixed_bfloat16")]["state_vs_fp32"],
                                   14 / 12, rtol=1e-3)
    assert (out / "memory.png").exists()


def torch_suite_rows(out, suite: str) -> list[dict] | None:
    """The rows a torch-using suite wrote, or ``None`` after checking it said it skipped."""
    rows = read_jsonl(out / f"{suite}.jsonl")
    try:
        import torch  # noqa: F401
    except ImportError:
        assert rows == [{"suite": suite, "skipped": "torch is not installed"}]
        return None
    return rows


def test_torch_suite_runs_or_says_it_skipped(tiny_runs):
    out, results = tiny_runs
    rows = torch_suite_rows(out, "torch")
    if rows is None:
        return
    assert {r["system"] for r in rows} == {"jax fp32", "jaxamp mixed_bfloat16", "PyTorch fp32",
                                           "PyTorch autocast-bf16"}
    assert all(r["median_ms"] > 0 and r["vs_torch_autocast"] > 0 for r in rows)


def test_cpu_flags_suite_runs_each_flag_set_in_its_own_process(tiny_runs):
    out, _ = tiny_runs
    rows = torch_suite_rows(out, "cpu_flags")
    if rows is None:
        return
    assert [(r["flags"], r["system"]) for r in rows] == [
        (f, s) for f in list(cpu_flags.CPU_FLAG_SETS)[:2]
        for s in ("jax fp32", "jaxamp mixed_bfloat16")]
    assert rows[2]["xla_flags"] == cpu_flags.CPU_FLAG_SETS[rows[2]["flags"]]
    for r in rows:
        assert r["median_ms"] > 0 and r["torch_autocast_ms"] > 0
        assert abs(r["loss_vs_default"]) < 2e-2


def test_fp8_suite_writes_parity_and_cost(tiny_runs):
    out, _ = tiny_runs
    parity = read_jsonl(out / "fp8_parity.jsonl")
    assert [(r["seed"], r["precision"]) for r in parity] == [
        (s, p) for s in (0, "mean") for p in ("bf16", "fp8_current", "fp8_delayed")]
    for r in parity:
        assert np.isfinite(r["eval_loss"]) and abs(r["vs_bf16"]) < 0.05
    cost = {r["precision"]: r for r in read_jsonl(out / "fp8_cost.jsonl")}
    assert cost["bf16"]["fp8_share"] == 0.0
    assert cost["fp8_current"]["fp8_share"] == cost["fp8_delayed"]["fp8_share"] == 1.0
    for r in cost.values():  # the same model: the same matmul FLOPs
        assert r["matmul_gflop"] == cost["bf16"]["matmul_gflop"] and r["xla_gbytes"] > 0
    assert cost["fp8_current"]["saved_by_dtype"]["float8_e4m3fn"] > 0


def test_gpu_suite_at_a_tiny_size(tiny_runs):
    out, _ = tiny_runs
    rows = read_jsonl(out / "gpu.jsonl")
    assert [(r["model"], r["precision"]) for r in rows] == [
        (m, p) for m, ps in gpu.MODEL_PRECISIONS.items() for p in ps]
    by = {(r["model"], r["precision"]): r for r in rows}
    for r in rows:
        prec = gpu.PRECISIONS[r["precision"]]
        assert r["unit"] == ("img/s" if r["model"] == "resnet50" else "seq/s")
        if prec.kind == "torch":  # no torchvision here, and no torch.compile at --tiny
            assert r["error"] or r["per_s"] > 0, r
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
        if precision == "mixed_float16":
            raise FloatingPointError("overflow in the first step\nsecond line")
        if precision == "fp32_highest":
            raise KeyboardInterrupt  # the process is killed here
        return {"step_ms": 2.0 if precision == "bare_bf16" else 4.0, "flops": 1e9,
                "loss": 1.0, "skipped_steps": None if precision == "bare_bf16" else 0}
    monkeypatch.setattr(gpu, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        main(["gpu", "--tiny", "--models", "bert_large", "--precisions",
              "fp32_highest,mixed_float16,fp32_default,bare_bf16", "--out", str(tmp_path)])
    assert seen == ["bare_bf16", "fp32_default", "mixed_float16", "fp32_highest"]
    rows = read_jsonl(tmp_path / "gpu.jsonl")
    assert [(r["precision"], r["error"]) for r in rows] == [
        ("bare_bf16", None), ("fp32_default", None),
        ("mixed_float16", "FloatingPointError: overflow in the first step")]
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


def test_gpu_sh_runs_both_halves_and_the_report(tmp_path):
    """``bash benchmarks/gpu.sh --tiny`` end to end on the CPU, then with a first half that
    fails: the second half still runs and the exit status says so."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable,
           "OUT": str(tmp_path / "out")}
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    args = ["bash", "benchmarks/gpu.sh", "--tiny", "--precisions",
            "mixed_bfloat16,fp32_default,autocast_bf16,torch_amp_bf16"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = read_jsonl(out / "gpu.jsonl")
    assert [(r["model"], r["precision"]) for r in rows] == [
        ("resnet50", "mixed_bfloat16"), ("resnet50", "torch_amp_bf16"),
        ("resnet50", "fp32_default"), ("bert_large", "mixed_bfloat16"),
        ("bert_large", "fp32_default"), ("nnx_gpt", "autocast_bf16"),
        ("nnx_gpt", "fp32_default")]
    assert all(r["error"] is None and r["vs_fp32_default"] > 0 for r in rows
               if r["precision"] != "torch_amp_bf16")
    runs = read_jsonl(out / "gpu_runs.jsonl")
    assert [r["models"] for r in runs] == [["resnet50"], ["bert_large", "nnx_gpt"]]
    for r in runs:
        assert r["env"]["JAX_PLATFORMS"] == "cpu"
        assert r["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.78"
    text = (out / "gpu.md").read_text()
    assert "- Run 2 (" in text and "| nnx_gpt | autocast_bf16 |" in text
    assert (out / "gpu.png").stat().st_size > 1000
    assert "resnet50 / mixed_bfloat16:" in (out / "gpu_first.log").read_text()
    assert "nnx_gpt / autocast_bf16:" in (out / "gpu_second.log").read_text()

    env = {**env, "OUT": str(tmp_path / "failed"), "GPU_FIRST": "--models no_such_model",
           "GPU_SECOND": "--models nnx_gpt"}
    proc = subprocess.run(["bash", "benchmarks/gpu.sh", "--tiny", "--precisions",
                           "fp32_default"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2 and "the first half exited with 2" in proc.stderr
    rows = read_jsonl(tmp_path / "failed" / "gpu.jsonl")
    assert [(r["model"], r["precision"], r["error"]) for r in rows] == [
        ("nnx_gpt", "fp32_default", None)]


def test_peer_steps_compute_the_same_first_loss_and_train(tiny_runs):
    """A fair comparison: every variant trains the same model on the same batch, for real."""
    out, _ = tiny_runs
    rows = {r["variant"]: r for r in read_jsonl(out / "overhead.jsonl")}
    ref = rows["jaxamp_mixed_bf16"]["first_loss"]
    for name, r in rows.items():
        assert abs(r["first_loss"] - ref) <= 2e-2 * abs(ref), (name, r["first_loss"], ref)
        # Three timed steps on the repeated batch (warm-up plus two rounds) lower the loss.
        assert r["last_loss"] < r["first_loss"] - 0.05, name


def test_time_rounds_rotates_the_order_and_pairs_the_ratios():
    calls = []
    runners = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = harness.time_rounds(runners, rounds=3)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")  # warm-up, 3 rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    paired = {"x": [2.0, 4.0, 9.0, 1.0], "ref": [1.0, 2.0, 3.0, 1.0]}  # ratios 2, 2, 3, 1
    assert harness.paired_ratio(paired, "x", "ref") == (2.0, 1.75, 2.25)
    assert harness.paired_ratio(paired, "ref", "ref") == (1.0, 1.0, 1.0)


def test_bench_layout_counts_the_bytes_of_each_instruction(capsys):
    total = main(["layout", "--tiny", "--rounds", "1"])["layout"]
    out = capsys.readouterr().out
    assert "| **total** |" in out and "| jaxamp pinned |" in out
    # The shipped step (gradients pinned to row-major) accesses fewer bytes than without the pin.
    assert total["bare_bf16"] < total["jaxamp pinned"] < total["jaxamp not pinned"]


def test_autocast_suite_meets_the_dtype_goals_on_users_models(tiny_runs):
    out, results = tiny_runs
    rows = [r for r in read_jsonl(out / "autocast.jsonl")
            if not r["variant"].startswith("PyTorch")]
    assert len(rows) == 12  # four models, three variants each
    by = {(r["model"].split(")")[0], r["variant"]): r for r in rows}
    for model in ("(a", "(b", "(c", "(d"):
        fp32, trap, ac = (by[(model, v)] for v in ("fp32", "cast params (jmp recipe)",
                                                    "jaxamp.autocast"))
        assert fp32["bf16_share"] == 0.0 and trap["bf16_share"] == 0.0  # the promotion trap
        assert ac["bf16_share"] >= 0.99 and ac["half_sensitive_ops"] == 0
        assert ac["saved_vs_fp32"] < min(1.0, trap["saved_vs_fp32"])
    timing = results["autocast"][-1]
    assert timing["variant"] == "trace+compile" and timing["ratio"] > 0


def test_autocast_suite_counts_what_torch_autocast_saves_on_the_twin_of_c(tiny_runs):
    out, _ = tiny_runs
    rows = [r for r in read_jsonl(out / "autocast.jsonl") if r["model"].startswith("(c)")]
    by = {r["variant"]: r for r in rows}
    torch_rows = [by["PyTorch fp32"], by["PyTorch autocast"]]
    if importlib.util.find_spec("torch") is None:
        assert all(r["skipped"] == "torch is not installed" for r in torch_rows)
        return
    fp32, ac = torch_rows
    for r in torch_rows:  # the twin has the Linen model's parameters, one for one
        assert r["param_count"] == r["flax_param_count"] > 0
        assert r["saved_mb"] > 0 and r["param_saved_mb"] > 0 and r["input_saved_mb"] > 0
        assert sum(r["saved_mb_by_dtype"].values()) == pytest.approx(r["saved_mb"])
    assert fp32["saved_vs_fp32"] == 1.0 and ac["vs_torch_autocast"] == 1.0
    assert set(fp32["saved_mb_by_dtype"]) == {"float32"}
    assert ac["saved_mb_by_dtype"]["bfloat16"] > 0 and ac["saved_mb"] < fp32["saved_mb"]
    # Autocast saves the bf16 copies of the weights, fp32 saves the fp32 weights themselves.
    assert set(ac["param_saved_mb_by_dtype"]) == {"bfloat16", "float32"}  # float32: norms
    assert ac["param_saved_mb"] < fp32["param_saved_mb"]
    jax_ac = by["jaxamp.autocast"]
    assert jax_ac["vs_torch_autocast"] == pytest.approx(jax_ac["saved_mb"] / ac["saved_mb"])


def test_autocast_step_suite_compares_the_users_model_with_the_reference(tiny_runs):
    out, _ = tiny_runs
    rows = read_jsonl(out / "autocast_step.jsonl")
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"reference, mixed_bfloat16", "user's model + autocast",
                       "reference + autocast", "user's model, mixed_bfloat16 (trap)",
                       "user's model, fp32"}
    ref = by["reference, mixed_bfloat16"]
    assert ref["time_vs_reference"] == 1.0 and ref["bytes_vs_reference"] == 1.0
    for r in rows:
        assert r["median_ms"] > 0 and r["saved_mb"] > 0 and r["gbytes_accessed"] > 0
        # Same shapes: the two models run the same matmul FLOPs.
        assert r["matmul_gflops"] == pytest.approx(ref["matmul_gflops"], rel=1e-9)
    for name in ("user's model + autocast", "reference + autocast", "reference, mixed_bfloat16"):
        assert by[name]["bf16_share"] >= 0.99
    assert by["user's model, mixed_bfloat16 (trap)"]["bf16_share"] == 0.0
    # Autocast saves less than the trap, which saves more than fp32 would in bf16.
    assert by["user's model + autocast"]["saved_mb"] < 0.5 * by["user's model, fp32"]["saved_mb"]


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


def test_zero_suite_shards_the_state_and_reduces_in_fp32(tiny_runs):
    out, _ = tiny_runs
    rows = read_jsonl(out / "zero.jsonl")
    state = {r["layout"]: r for r in rows if r["table"] == "state"}
    steps = {r["layout"]: r for r in rows if r["table"] == "steps"}
    assert list(state) == ["replicated", "zero1", "zero3"]
    assert list(steps) == ["implicit", "replicated", "zero1", "zero3", "zero1_auto"]
    # bf16 working params + fp32 master + two fp32 moments, per param, on 8 devices.
    assert state["replicated"]["bytes_per_param"] == pytest.approx(14.0, rel=1e-3)
    assert state["zero1"]["master_and_moments"] < 12 / 8 * 1.2
    assert state["zero3"]["bytes_per_param"] < 14 / 8 * 1.2
    assert state["zero3"]["bytes_per_param"] < state["zero1"]["bytes_per_param"]
    # The program's reductions: none of its own when left to XLA, fp32 collectives otherwise,
    # reduce-scatters onto the shards of a sharded state on an Explicit mesh, bf16 gathers.
    assert steps["implicit"]["jaxpr_collectives"] == ""
    for layout in ("replicated", "zero1", "zero3", "zero1_auto"):
        assert "psum_invariant float32" in steps[layout]["jaxpr_collectives"]
        assert "bfloat16" not in steps[layout]["jaxpr_collectives"].replace(
            "all_gather bfloat16", "")
    for layout in ("zero1", "zero3"):
        assert "reduce_scatter float32" in steps[layout]["jaxpr_collectives"]
        assert "reduce-scatter" in steps[layout]["hlo_collectives"]
    assert "all_gather bfloat16" in steps["zero3"]["jaxpr_collectives"]
    assert steps["zero3"]["state_mb_per_device"] < steps["zero1"]["state_mb_per_device"] \
        < steps["replicated"]["state_mb_per_device"]
    assert steps["replicated"]["time_vs_replicated"] == 1.0


def test_step_memory_suite_counts_each_options_bytes(tiny_runs):
    out, _ = tiny_runs
    rows = read_jsonl(out / "step_memory.jsonl")
    for model in {r["model"] for r in rows}:
        by = {r["option"]: r for r in rows if r["model"] == model}
        assert by["fp32 (float32 policy)"]["total_vs_fp32"] == 1.0
        # Adam: 2 + 4 + 8 bytes per param with the master; 2 + 2 + 2 + 2 with kahan and bf16
        # moments (the rounding key and the counters add a little on a tiny model).
        assert by["float32"]["state_bytes_per_param"] == pytest.approx(14, abs=0.1)
        assert by["kahan+bf16_moments"]["state_bytes_per_param"] == pytest.approx(8, abs=0.1)
        assert by["fp32 (float32 policy)"]["state_bytes_per_param"] == pytest.approx(12, abs=0.1)
        assert (by["kahan+bf16_moments"]["total_vs_fp32"] < by["float32"]["total_vs_fp32"]
                < 1.0)
    timed = {r["option"]: r for r in read_jsonl(out / "step_memory_time.jsonl")}
    assert timed["float32"]["vs_float32"] == 1.0
    for r in timed.values():
        assert np.isfinite(r["step_ms"]) and r["step_ms"] > 0 and r["q25"] <= r["q75"]


def test_master_numerics_suite_trains_each_option(tiny_runs):
    out, _ = tiny_runs
    rows = read_jsonl(out / "master_numerics.jsonl")
    runs = [r for r in rows if r["seed"] != "mean"]
    assert [r["option"] for r in runs] == ["float32", "kahan", "stochastic+bf16_moments"]
    assert all(np.isfinite(r["eval_loss"]) for r in rows)
    # kahan keeps the fp32 value of every bf16 param: it trains as the master does.
    assert abs(runs[1]["vs_float32"]) < 1e-3
