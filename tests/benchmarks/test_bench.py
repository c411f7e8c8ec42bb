"""The benchmark suites (``python -m benchmarks``) run at a tiny size, write every field, and
compare like with like."""

import importlib.util
import json
import os
import re

import jax
import numpy as np
import pytest
from helpers import ROOT
from helpers import read_jsonl

import jaxamp
from benchmarks import cpu_flags
from benchmarks import harness
from benchmarks.__main__ import SUITES
from benchmarks.__main__ import _parsers
from benchmarks.__main__ import _suite_args
from benchmarks.__main__ import main

# Under pytest-xdist, the tests sharing a module-scoped fixture run on one worker.
pytestmark = pytest.mark.xdist_group("tiny_runs")

OVERHEAD_VARIANTS = ["fp32", "bare_bf16", "jmp", "flax_DynamicScale", "optax_apply_if_finite",
                     "jaxamp_mixed_bf16", "jaxamp_mixed_fp16", "jaxamp_bf16_accum4",
                     "jaxamp_mixed_fp16_retry"]



@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """Every suite at --tiny but gpu, long_fp16 and numerics, which their own fixtures run once
    (test_gpu_suite.py in a process without jmp, equinox and torch; test_long_fp16.py for 600
    steps; ``numerics_tiny`` below, in `make test` as well), on the other xdist worker."""
    out = tmp_path_factory.mktemp("bench")
    results = {}
    for name in SUITES:
        if name not in ("gpu", "long_fp16", "numerics"):
            results.update(main([name, "--tiny", "--out", str(out)]))
    return out, results


@pytest.fixture(scope="module")
def numerics_tiny(tmp_path_factory):
    """The numerics protocol's tiny pass (`make test` runs it; tiny_runs is `make test-all`'s)."""
    out = tmp_path_factory.mktemp("numerics")
    return out, main(["numerics", "--tiny", "--out", str(out)])


def test_all_runs_every_suite_with_its_own_defaults(capsys):
    ap, suites = _parsers(tuple(SUITES))
    args = ap.parse_args(["all", "--tiny", "--out", "x"])
    for name in SUITES:
        ns = _suite_args(ap, suites, name, args)
        assert ns.suite == name and ns.via_all and ns.tiny and ns.out == "x" and ns.rounds == 2
    assert _suite_args(ap, suites, "gpu", args).steps == 20  # gpu's own default
    # Every module of the package but the harness, the gpu suite's deviceless mode and the
    # study of stochastic rounding along a run (run by hand, its figure in BENCHMARKS.md) is
    # a suite, named in SUITES.
    assert set(SUITES.values()) == {
        p.removesuffix(".py") for p in os.listdir(os.path.join(ROOT, "benchmarks"))
        if p.endswith(".py") and p not in ("__init__.py", "__main__.py", "harness.py",
                                           "gpu_deviceless.py", "stochastic_follow.py")}


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
    retry = by["jaxamp_mixed_fp16_retry"]
    assert retry["bytes_vs_no_retry"] > 0 and retry["time_vs_no_retry"] > 0
    lo, hi = (float(x) for x in retry["time_vs_no_retry_iqr"].split("–"))
    assert lo <= retry["time_vs_no_retry"] <= hi
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
    # The default recipe's FP8 matmuls (the blocks' kernels), at steps 0, 2 and 4.
    errors = read_jsonl(out / "fp8_errors.jsonl")
    assert sorted({r["step"] for r in errors}) == [0, 2, 4]
    assert {r["granularity"] for r in errors} == {"tensor"}  # --error-granularities' default
    sites = list(dict.fromkeys(r["matmul"] for r in errors))
    assert sites and all(s.startswith("args[0]/") and "kernel" in s for s in sites), sites
    keep = jaxamp.fp8.CurrentScaling.KEEP
    assert not [s for s in sites if re.search(keep, s)]  # the head stays bf16
    assert all(0 < r[g] < 0.2 for r in errors for g in ("forward", "grad_lhs", "grad_rhs"))
    assert (out / "fp8_errors.png").stat().st_size > 10_000


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
    # On XLA:CPU the default pins a step whose params are on one device, in this process of
    # 8 devices too.
    assert total["jaxamp default"] == total["jaxamp pinned"]
    total = main(["layout", "--tiny", "--rounds", "0", "--model", "linen"])["layout"]
    assert "Linen encoder" in capsys.readouterr().out
    assert total["bare_bf16"] < total["jaxamp default"] < total["jaxamp not pinned"]


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
        assert by["kahan+bf16_mu"]["state_bytes_per_param"] == pytest.approx(10, abs=0.1)
        # 8-bit codes for the moments of 4096 values or more; the tiny ResNet has none.
        assert by["kahan+8bit_moments"]["state_bytes_per_param"] <= 12.1
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


def test_remat_suite_keeps_the_models_remat_under_autocast(tiny_runs):
    out, _ = tiny_runs
    rows = {r["model remat"]: r for r in read_jsonl(out / "remat.jsonl")}
    assert set(rows) == {"no remat", "checkpoint", "checkpoint, dots_with_no_batch_dims_saveable"}
    for r in rows.values():
        assert 0 < r["saved_vs_fp32"] <= 0.6
    # the model's remat saves less than no remat, under autocast as in fp32
    assert rows["checkpoint"]["autocast_saved_mb"] < rows["no remat"]["autocast_saved_mb"]


def test_compile_time_suite_times_both_steps_interleaved(tiny_runs):
    out, _ = tiny_runs
    rows = [r for r in read_jsonl(out / "compile_time.jsonl") if r["compiler"] == "XLA:CPU"]
    assert [r["step"] for r in rows] == ["plain", "bf16 layers", "autocast=True"]
    for r in rows:
        assert r["total_s"] > 0 and r["compile_s"] > 0 and r["trace_s"] > 0
        assert r["vs_plain"] > 0 and r["vs_bf16_layers"] > 0 and len(r["ratios_vs_plain"]) == 2
    assert rows[0]["vs_plain"] == 1.0 and rows[1]["vs_bf16_layers"] == 1.0


def test_maxtext_suite_runs_or_says_it_skipped(tiny_runs):
    """Without maxtext (every environment but .venv-maxtext) the suite says it skipped; with it,
    each policy has every arm, the same model matmul FLOPs, autocast in bf16 throughout,
    and the loss of the anchor within a percent."""
    from benchmarks import maxtext
    rows = read_jsonl(tiny_runs[0] / "maxtext.jsonl")
    if importlib.util.find_spec("maxtext") is None:
        assert rows == [{"suite": "maxtext", "skipped": "maxtext is not installed"}]
        return
    assert [(r["policy"], r["arm"]) for r in rows] == [
        (p, a) for p in maxtext.POLICIES for a in maxtext.ARMS]
    for r in rows:
        assert r["model_flops_vs_anchor"] == 1.0 and abs(r["loss_vs_anchor"]) < 1e-2
        if r["arm"].startswith("jaxamp_autocast"):
            assert r["bf16_share"] == 1.0 and r["half_sensitive_ops"] == []
        if r["arm"] == "jaxamp_autocast":
            assert r["compile_vs_anchor"] > 0 and len(r["compile_ratios_vs_anchor"]) == 2
            assert r["compile_vs_step"] > 0 and len(r["compile_ratios_vs_step"]) == 2
        if r.get("gpu_gb") is not None:
            assert r["gemms"] > 0 and r["gpu_temp_gb"] > 0


def test_only_the_compiler_options_the_running_jax_accepts_are_passed():
    assert harness.supported_compiler_options(
        xla_backend_optimization_level=0, xla_no_such_option_anywhere=True) == {
        "xla_backend_optimization_level": 0}
    # What the --tiny runs pass on this jax (jax 0.11 dropped xla_cpu_use_fusion_emitters).
    options = harness.tiny_compiler_options(True)
    assert options is not None and options["xla_backend_optimization_level"] == 0
    assert set(options) <= set(harness._TINY_CPU_OPTIONS)
    jax.jit(lambda x: x * 2).lower(1.0).compile(options)


def test_numerics_suite_evaluates_each_arm_on_the_whole_split(numerics_tiny):
    out, _ = numerics_tiny
    runs = read_jsonl(out / "numerics_runs.jsonl")
    assert [(r["arm"], r["seed"]) for r in runs] == [("bf16", 0), ("fp32", 0)]
    for r in runs:
        assert r["curve_step"] == [1, 2, 3, 4] and np.all(np.isfinite(r["curve_loss"]))
    # bf16 and fp32 of the same seed start from the same init and see the same batches.
    assert abs(runs[1]["eval_loss"] / runs[0]["eval_loss"] - 1) < 1e-3
    rows = {(r["arm"], r["vs"]): r for r in read_jsonl(out / "numerics.jsonl")}
    assert set(rows) == {("bf16", None), ("fp32", "bf16")}
    null = rows["fp32", "bf16"]
    assert null["seeds"] == 1 and null["gap"] == pytest.approx(runs[1]["eval_loss"]
                                                              / runs[0]["eval_loss"] - 1)
    assert null["ci_high"] is None and null["holds"] is None  # one seed: no interval
    assert (out / "numerics.png").stat().st_size > 10_000


def test_the_numerics_presets_train_in_their_own_setting(tmp_path):
    """``--models text,mlm``: the CLI's presets as they ship, each with its own learning rate,
    warmup and clipping recorded in its rows (not the protocol's setting), paired by seed."""
    from benchmarks import numerics
    main(["numerics", "--tiny", "--models", "text,mlm", "--out", str(tmp_path)])
    runs = read_jsonl(tmp_path / "numerics_runs.jsonl")
    assert [(r["model"], r["arm"]) for r in runs] == [
        ("text", "bf16"), ("text", "fp32"), ("mlm", "bf16"), ("mlm", "fp32")]
    settings = {r["model"]: r["setting"] for r in runs}
    assert settings == {"text": {"lr": 3e-3, "warmup_steps": 20, "grad_clip": 0.0},
                        "mlm": {"lr": 1e-3, "warmup_steps": 20, "grad_clip": 0.0}}
    assert numerics.preset_setting("text") == (500, settings["text"])
    for model in ("text", "mlm"):
        bf16, fp32 = (r["eval_loss"] for r in runs if r["model"] == model)
        assert abs(fp32 / bf16 - 1) < 1e-3  # the same init and batches


def _numerics_rows(losses: dict[str, list[float]], model: str = "char") -> list[dict]:
    return [{"model": model, "arm": arm, "seed": seed, "steps": 3, "eval_loss": loss,
             "curve_step": [1, 2, 3], "curve_loss": [3.0 * loss, 2.0 * loss, loss]}
            for arm, values in losses.items() for seed, loss in enumerate(values)]


def test_the_numerics_interval_is_students_t_on_the_paired_gaps():
    from benchmarks import numerics
    mean, low, high = numerics.interval([0.01, 0.03])
    half = 12.706204736174707 * 0.01 * 2**0.5 / 2**0.5  # t(0.975, 1) * sd / sqrt(n)
    assert (mean, low, high) == pytest.approx((0.02, 0.02 - half, 0.02 + half))
    gaps = [0.004, 0.006, 0.005, 0.003, 0.007, 0.005, 0.004, 0.006, 0.005, 0.005]
    mean, low, high = numerics.interval(gaps)
    sd = np.std(gaps, ddof=1)
    assert (low, high) == pytest.approx((mean - 2.2621571627 * sd / 10**0.5,
                                         mean + 2.2621571627 * sd / 10**0.5))
    assert numerics.interval([0.02]) == (0.02, None, None)


def test_numerics_pairs_runs_by_seed_and_holds_a_goal_on_the_upper_bound(tmp_path):
    from benchmarks import numerics
    bf16 = [2.0, 2.1, 1.9, 2.0]
    rows = _numerics_rows({
        "bf16": bf16,
        # +1.0% on every seed: the interval is a point, under the 1.5% goal.
        "fp8_tensor_all": [x * 1.01 for x in bf16],
        # fp8_tensor_all +0.1%, +0.4%, -0.1%: mean 0.13%, upper bound 0.51% > 0.25%.
        "fp8_delayed": [x * 1.01 * g for x, g in zip(bf16, (1.001, 1.004, 0.999), strict=False)],
        "fp32": bf16[:2],  # seeds 0 and 1 only
    })
    rows.append({**rows[0], "arm": "kahan", "seed": 7})  # no bf16 run of seed 7: not paired
    got = {(r["arm"], r["vs"]): r for r in numerics.summarize(rows)}
    assert got["fp8_tensor_all", "bf16"]["gap"] == pytest.approx(0.01)
    assert got["fp8_tensor_all", "bf16"]["ci_high"] == pytest.approx(0.01)
    assert got["fp8_tensor_all", "bf16"]["holds"] is True
    delayed = got["fp8_delayed", "fp8_tensor_all"]
    assert delayed["seeds"] == 3 and delayed["goal"] == 0.0025
    assert delayed["gap"] == pytest.approx(0.004 / 3) and delayed["ci_high"] > 0.0025
    assert delayed["holds"] is False
    assert got["fp8_delayed", "bf16"]["goal"] is None  # its goal compares with fp8_tensor_all
    assert got["fp32", "bf16"]["seeds"] == 2 and got["fp32", "bf16"]["gap"] == 0.0
    assert got["kahan", "bf16"]["seeds"] == 0 and got["kahan", "bf16"]["gap"] is None
    assert got["bf16", None]["eval_loss"] == pytest.approx(2.0)
    numerics.plot(rows, str(tmp_path / "numerics.png"))
    assert (tmp_path / "numerics.png").stat().st_size > 10_000


def test_an_interrupted_numerics_protocol_resumes_where_it_stopped(tmp_path, monkeypatch):
    from benchmarks import numerics
    trained = []

    def fake_train(model, arm, seed, steps, tiny, setting):
        trained.append((model, arm, seed))
        return {**_numerics_rows({arm: [2.0 + seed]}, model)[0], "seed": seed, "steps": steps,
                "tiny": tiny, "setting": setting, "seconds": 0.0}

    monkeypatch.setattr(numerics, "_train", fake_train)
    path = str(tmp_path / "numerics_runs.jsonl")
    first = [("char", a, s) for s in range(2) for a in ("bf16", "fp32")]
    numerics.run_protocol(first, 3, False, path)
    assert trained == first
    more = first + [("char", a, 2) for a in ("bf16", "fp32")] + [("wide", "bf16", 0)]
    rows = numerics.run_protocol(more, 3, False, path)
    assert trained == more  # the first four were not run again
    assert [(r["model"], r["arm"], r["seed"]) for r in rows] == more
    assert len(numerics.read_runs(path)) == 7
    numerics.run_protocol(more, 4, False, path)  # other steps: other runs
    assert len(trained) == 14
    clipped = numerics.run_protocol(more[:2], 4, False, path, {"grad_clip": 0.5})  # and so on
    assert len(trained) == 16 and [r["setting"]["grad_clip"] for r in clipped] == [0.5, 0.5]
    assert clipped[0]["setting"]["lr"] == numerics.SETTING["lr"]
    # A row without a setting (the protocol's first runs) is of FIRST_SETTING.
    legacy = fake_train("char", "none", 0, 3, False, None)
    del legacy["setting"]
    with open(path, "a") as f:
        f.write(json.dumps(legacy) + "\n")
    numerics.run_protocol([("char", "none", 0)], 3, False, path, numerics.FIRST_SETTING)
    assert len(trained) == 17  # the one fake_train call above; the run was not repeated
    # A run another process appends while this one works through its plan is not run again.
    other = ("char", "fp8_current", 0)
    real_train = fake_train

    def train_while_another_process_appends(model, arm, seed, steps, tiny, setting):
        row = real_train(model, arm, seed, steps, tiny, setting)
        with open(path, "a") as f:
            f.write(json.dumps({**row, "arm": other[1], "seed": other[2]}) + "\n")
        return row

    monkeypatch.setattr(numerics, "_train", train_while_another_process_appends)
    rows = numerics.run_protocol([("char", "kahan", 0), other], 3, False, path)
    assert trained[-1] == ("char", "kahan", 0) and len(trained) == 18
    assert [r["arm"] for r in rows] == ["kahan", "fp8_current"]


def test_numerics_runs_the_twin_and_every_arm_a_goal_compares_with():
    from benchmarks import numerics
    assert numerics.arms_to_run(["fp8_delayed"]) == ["bf16", "fp8_tensor_all", "fp8_delayed"]
    assert numerics.arms_to_run(["fp32"]) == ["bf16", "fp32"]
    with pytest.raises(ValueError, match="unknown arm.*fp9"):
        numerics.arms_to_run(["fp9"])
    config = numerics._config("wide", "kahan_bf16_moments", 3, 1500, tiny=False)
    assert (config.master, config.moments_dtype, config.precision) == (
        "kahan", "bfloat16", "mixed_bfloat16")
    assert config.model_overrides == {"gpt": {"width": 256, "heads": 4, "mlp": 1024}}
    assert config.eval_batches == 0 and config.seed == 3 and config.model == "gpt_tiny"


def test_a_numerics_run_a_signal_stopped_is_not_recorded(tmp_path, monkeypatch):
    from benchmarks import numerics
    from train import train as train_lib
    monkeypatch.setattr(train_lib, "train_and_evaluate",
                        lambda config, workdir: {"stopped_by_signal": True, "steps": 7})
    path = tmp_path / "numerics_runs.jsonl"
    with pytest.raises(SystemExit, match="wide bf16 seed 0 stopped by a signal at step 7"):
        numerics.run_protocol([("wide", "bf16", 0)], 1500, False, str(path))
    assert numerics.read_runs(str(path)) == []


def test_the_preset_tables_are_the_committed_runs():
    """The master-weights page's and BENCHMARKS.md's table of the lighter state at the CLI's
    presets is what ``benchmarks.numerics.summarize`` makes of the committed runs."""
    from benchmarks import numerics
    rows = read_jsonl(os.path.join(ROOT, "benchmarks/results/numerics_presets_runs.jsonl"))
    found = {(r["model"], r["arm"]): r for r in numerics.summarize(rows) if r["vs"] == "bf16"}
    labels = {"fp32": "`float32` (the null)", "stochastic": '`master="stochastic"`',
              "kahan": '`master="kahan"`', "kahan_bf16_mu": '`"kahan"`, `{"mu": "bfloat16"}`',
              "kahan_bf16_moments": '`"kahan"`, `"bfloat16"` moments',
              "kahan_8bit": '`"kahan"`, `"8bit"` moments',
              "fp8_current": "`mixed_fp8` (its default recipe)"}

    def cell(r):
        return (f"{r['gap'] * 100:+.2f}% [{r['ci_low'] * 100:+.2f}%, "
                f"{r['ci_high'] * 100:+.2f}%], {r['seeds']}")
    for page in ("BENCHMARKS.md", "docs/concepts/master-weights.md"):
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for arm, label in labels.items():
            want = f"| {cell(found['text', arm])} | {cell(found['mlm', arm])} |"
            assert any(x.startswith(f"| {label} |") and x.endswith(want)
                       for x in text.splitlines()), (page, label, want)
