"""Every script in examples/ runs, through the public ``jaxamp`` API only, and shows what it
says it shows."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest
from helpers import ROOT

EXAMPLES = pathlib.Path(ROOT) / "examples"
NAMES = ["equinox_batchnorm", "fp8_nnx", "linen_batchnorm_dropout", "linen_trainstate",
         "mlp_digits", "nnx_batchnorm_dropout", "nnx_optimizer", "promotion_trap"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (a Linen module) look their module up
    spec.loader.exec_module(module)
    return module


def test_the_examples_are_there():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_an_example_imports_jaxamp_and_never_train(name):
    tree = ast.parse((EXAMPLES / f"{name}.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert "jaxamp" in imported and "train" not in imported
    assert 'if __name__ == "__main__":' in (EXAMPLES / f"{name}.py").read_text()


def test_mlp_digits_learns_under_bf16_and_fp16():
    out = _load("mlp_digits").main(steps=150)
    for precision, dtype in (("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")):
        figures = out[precision]
        assert figures["last_loss"] < 0.1 * figures["first_loss"]
        assert figures["accuracy"] > 0.9
        assert (figures["params_dtype"], figures["logits_dtype"]) == (dtype, dtype)
        assert figures["skipped_steps"] == 0
    assert out["mixed_bfloat16"]["loss_scale"] == 1.0  # no loss scale under bf16
    # fp16: 2**16 at first, doubled after steps 50 and 100 (growth_interval=50, no overflow);
    # step 150 reports the scale it used.
    assert out["mixed_float16"]["loss_scale"] == 2.0**18


def test_linen_example_trains_with_flax_train_state():
    out = _load("linen_trainstate").main(steps=100)
    assert out["accuracy"] > 0.85
    assert (out["params_dtype"], out["master_dtype"]) == ("float16", "float32")


def test_nnx_optimizer_keeps_bf16_working_params_and_an_fp32_master():
    out = _load("nnx_optimizer").main(steps=100)
    assert out["last_loss"] < 0.1 * out["first_loss"]
    assert (out["params_dtypes"], out["master_dtypes"]) == (["bfloat16"], ["float32"])
    assert out["working_is_rounded_master"]
    assert out["output_dtype"] == "bfloat16"
    assert out["skipped_steps"] == 0


def test_fp8_example_trains_with_both_recipes_every_matmul_in_fp8():
    out = _load("fp8_nnx").main(steps=100)
    for recipe in ("current", "delayed"):
        figures = out[recipe]
        assert figures["last_loss"] < 0.1 * figures["first_loss"]
        assert figures["fp8_share"] == 1.0 and figures["skipped_steps"] == 0
    assert out["current"]["fp8_states"] == 0 and out["delayed"]["fp8_states"] == 2
    assert all(a > 0 for a in out["delayed"]["input_amax_history"])  # it rolled


def test_promotion_trap_shows_the_fp32_matmuls_and_their_fix():
    batch = 32
    out = _load("promotion_trap").main(batch=batch)
    # Only dense1 stays in bf16: its forward and weight-gradient matmuls, 2 * 2·B·64·256
    # FLOPs. dense2 and head take an fp32 LayerNorm output, so their forward, weight-gradient
    # and input-gradient matmuls (3 * 2·B·256·256 and 3 * 2·B·256·10) run in fp32.
    bf16 = 4 * batch * 64 * 256
    fp32 = 6 * batch * 256 * 256 + 6 * batch * 256 * 10
    trap, fixed = out["cast_params"], out["dtype_bf16"]
    assert trap["matmul_flops"] == fixed["matmul_flops"] == bf16 + fp32
    assert trap["bf16_share"] == pytest.approx(bf16 / (bf16 + fp32), rel=1e-12)
    assert trap["fp32_share"] == pytest.approx(fp32 / (bf16 + fp32), rel=1e-12)
    assert "Net/norm2" in trap["fp32_sources"]
    assert (fixed["bf16_share"], fixed["fp32_share"], fixed["fp32_sources"]) == (1.0, 0.0, [])


def test_an_example_runs_as_a_script():
    out = subprocess.run([sys.executable, str(EXAMPLES / "promotion_trap.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dtype_bf16   matmul FLOPs in bf16: 100.0%" in out.stdout


@pytest.mark.parametrize("name", ["nnx_batchnorm_dropout", "linen_batchnorm_dropout",
                                  "equinox_batchnorm"])
def test_a_model_with_batchnorm_and_dropout_trains_through_the_step(name):
    """The page of each model kind a user brings (docs/how-to/model-state.md): BatchNorm's
    statistics as the step's fp32 model state, updated; dropout on the step's rng; every
    matmul in bf16 under autocast; the model learns."""
    out = _load(name).main(steps=40)
    assert out["last_loss"] < 0.5 * out["first_loss"] and out["accuracy"] > 0.85, out
    assert out["bf16_share"] == 1.0
    assert out["params_dtypes"] == ["bfloat16"] and out["batch_stats_dtypes"] == ["float32"]
    assert out["batch_stats_moved"] > 0
