"""The training CLI end to end, on tiny configurations."""

import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from helpers import final_state as _final_state

import jaxamp
from train import cli
from train import train as train_lib

TINY = {
    "digits": ["--model", "resnet18_small"],
    "synthetic_images": ["--model", "resnet18_small"],
    "text": ["--model", "gpt_tiny", "--seq-len", "16"],
    "mlm": ["--model", "bert_tiny", "--seq-len", "16"],
    "synthetic_text": ["--model", "gpt_tiny", "--seq-len", "16"],
}


def _run(tmp_path, *args):
    cli.main(["--config", "tiny", "--no-progress", "--workdir", str(tmp_path), *args])
    with open(tmp_path / "summary.json") as f:
        return json.load(f)


@pytest.mark.parametrize("task", sorted(TINY))
def test_each_task_runs_and_writes_logs_checkpoint_and_plot(tmp_path, task):
    summary = _run(tmp_path, "--task", task, "--precision", "mixed_bfloat16", *TINY[task])
    assert summary["steps"] == 3 and not summary["stopped_by_signal"]
    assert np.isfinite(summary["eval_loss"])
    metrics = train_lib.read_metrics(str(tmp_path))
    assert list(metrics["step"]) == [1, 2, 3]
    assert {"loss", "loss_scale", "grads_finite", "skipped_steps", "grad_norm",
            "nonfinite_leaves", "throughput"} <= set(metrics)
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert os.listdir(tmp_path / "tensorboard")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]


def test_autocast_flag_trains_under_jaxamp_autocast(tmp_path):
    summary = _run(tmp_path, "--task", "text", "--precision", "mixed_bfloat16", "--autocast",
                   *TINY["text"])
    assert summary["config"]["autocast"] is True
    assert summary["steps"] == 3 and np.isfinite(summary["eval_loss"])
    plain = _run(tmp_path / "plain", "--task", "text", "--precision", "mixed_bfloat16",
                 *TINY["text"])
    assert plain["config"]["autocast"] is False
    # The reference GPT is already mixed-precision clean: autocast keeps its numerics.
    np.testing.assert_allclose(summary["eval_loss"], plain["eval_loss"], rtol=2e-2)



def test_the_users_nnx_gpt_trains_in_bf16_only_under_autocast(tmp_path):
    summary = _run(tmp_path, "--task", "text", "--model", "nnx_gpt_tiny", "--seq-len", "16",
                   "--precision", "mixed_bfloat16", "--autocast")
    assert summary["steps"] == 3 and np.isfinite(summary["eval_loss"])
    from train.configs import tiny
    config = tiny.get_config()
    policy = jaxamp.get_policy("mixed_bfloat16")
    params, _, loss_fn, _, _ = train_lib.build_model(
        dataclasses.replace(config, task="text", model="nnx_gpt_tiny"), policy, {"vocab": 256})
    working = policy.cast_params_to_compute(params)
    batch = {"tokens": jnp.zeros((2, 17), jnp.int32)}

    def loss(p, b):
        return loss_fn(p, b)[0]
    assert jaxamp.audit_grad(loss, working, batch).share("bfloat16") == 0.0   # the trap
    assert jaxamp.audit_grad(jaxamp.autocast(loss, policy), working,
                             batch).share("bfloat16") >= 0.99

def test_resume_equals_an_uninterrupted_run_bit_for_bit(tmp_path, caplog):
    args = ["--precision", "mixed_float16", "--steps", "10", "--checkpoint-every", "5",
            "--growth-interval", "3"]
    _run(tmp_path / "straight", *args)
    # The same run stopped after 5 steps, then resumed to 10.
    _run(tmp_path / "resumed", *args[:2], "--steps", "5", *args[4:])
    with caplog.at_level(logging.INFO):
        _run(tmp_path / "resumed", *args, "--resume")
    # Reading the checkpoint's layout logs nothing (orbax's StandardCheckpointer warned
    # "Metadata file does not exist" at every resume).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    a, b = _final_state(tmp_path / "straight", 10), _final_state(tmp_path / "resumed", 10)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 10
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The data position (epoch, batch) is saved with the state, the same in both runs.
    for run in ("straight", "resumed"):
        with open(tmp_path / run / "checkpoints" / "10" / "data" / "metadata") as f:
            assert json.load(f) == [0, 10]
    # The metrics log continues instead of starting over.
    steps = train_lib.read_metrics(str(tmp_path / "resumed"))["step"]
    assert list(steps) == list(range(1, 11))


def test_a_second_run_into_a_workdir_resumes_its_own_config_or_is_refused_at_once(
        tmp_path, capsys):
    """`make demo` twice, `python -m train` twice: orbax raised StepAlreadyExistsError at the
    first checkpoint. The same config resumes (a finished run trains no step and reports
    again; an interrupted one goes on); another config is refused before anything is built,
    in one line naming --resume and --workdir."""
    first = _run(tmp_path, "--precision", "mixed_bfloat16", "--steps", "3")
    again = _run(tmp_path, "--precision", "mixed_bfloat16", "--steps", "3")
    assert again["resumed_from"] == 3 and again["eval_loss"] == first["eval_loss"]
    assert list(train_lib.read_metrics(str(tmp_path))["step"]) == [1, 2, 3]
    capsys.readouterr()
    started = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        _run(tmp_path, "--precision", "mixed_float16", "--steps", "3")
    assert stop.value.code == 2 and time.perf_counter() - started < 5
    err = capsys.readouterr().err.strip()
    assert err == (f"python -m train: error: {tmp_path} holds a run of another config: "
                   "precision 'mixed_bfloat16' there, 'mixed_float16' asked; pass --resume "
                   "to continue it, or another --workdir"), err
    # An interrupted run (its config and a checkpoint, no summary) goes on when run again.
    os.remove(tmp_path / "summary.json")
    resumed = _run(tmp_path, "--precision", "mixed_bfloat16", "--steps", "3")
    assert resumed["resumed_from"] == 3


def test_resume_alone_restores_the_runs_config_and_refuses_a_contradicting_flag(
        tmp_path, capsys):
    """`python -m train --resume --workdir runs/text`, as the CLI page shows, asked for
    --config after 49 s."""
    stored = _run(tmp_path, "--task", "text", *TINY["text"], "--precision", "mixed_bfloat16",
                  "--steps", "2")
    cli.main(["--resume", "--no-progress", "--workdir", str(tmp_path), "--steps", "3"])
    with open(tmp_path / "summary.json") as f:
        resumed = json.load(f)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 3
    assert {**resumed["config"], "steps": 2, "progress": True} == {**stored["config"],
                                                                  "progress": True}
    capsys.readouterr()
    for flags, said in ((["--precision", "mixed_float16"],
                         "has precision 'mixed_bfloat16', and --precision 'mixed_float16' was "
                         "given"),
                        (["--config", "default"], "has task 'text', and --config default gives "
                                                  "'digits'")):
        with pytest.raises(SystemExit) as stop:
            cli.main(["--resume", "--no-progress", "--workdir", str(tmp_path), *flags])
        assert stop.value.code == 2
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--resume", "--workdir", str(tmp_path / "nothing")])
    assert "holds no run" in capsys.readouterr().err


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", "--config", "tiny", "--steps", "100000",
         "--checkpoint-every", "100000", "--no-progress", "--workdir", str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (tmp_path / "metrics.csv").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert (tmp_path / "metrics.csv").exists(), proc.communicate(timeout=30)[0][-2000:]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by_signal"]
    steps = [int(d) for d in os.listdir(tmp_path / "checkpoints")]
    assert steps == [summary["steps"]]


# tests/test_sharding.py checks pmap and the data-parallel jit bit for bit in process.
@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["pmap", "jit"])
def test_parallel_layouts_run(tmp_path, parallel):
    summary = _run(tmp_path, "--parallel", parallel, "--precision", "mixed_bfloat16")
    assert summary["steps"] == 3 and np.isfinite(summary["eval_loss"])


def test_compare_writes_one_table_and_one_plot(tmp_path):
    cli.main(["--config", "tiny", "--no-progress", "--workdir", str(tmp_path),
              "--compare", "float32,mixed_float16"])
    table = (tmp_path / "compare.md").read_text()
    assert "float32" in table and "mixed_float16" in table
    assert (tmp_path / "compare.png").stat().st_size > 1000



def test_the_cli_page_names_every_flag_of_help_and_its_defaults():
    """docs/how-to/training-cli.md's flag tables against `python -m train --help`: every flag
    is on the page, and a default the help states is the page's (the page said 1024 for
    --fp8-history, 16 in the code; three FP8 flags were missing)."""
    import re
    page = (pathlib.Path(ROOT) / "docs" / "how-to" / "training-cli.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `--")]
    on_page = set(re.findall(r"`(--[a-z0-9-]+)", "\n".join(r.split(" | ")[0] for r in rows)))
    parser = cli.parser()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    assert flags - {"--help"} == on_page, (flags - on_page, on_page - flags)
    for action in parser._actions:
        stated = re.search(r"\(default (\d+)\)", action.help or "")
        if stated and action.option_strings[0] in on_page:
            (row,) = [r for r in rows if f"`{action.option_strings[0]}" in r.split(" | ")[0]]
            assert f"default {stated.group(1)}" in row, (action.option_strings[0], row)


def test_a_skipped_steps_non_finite_loss_stays_in_the_csv_and_out_of_tensorboard(tmp_path, caplog):
    """An fp16 run's skipped step logs an inf loss: the CSV keeps it, TensorBoard gets the
    finite values of the row (tensorboardX warned 'NaN or Inf found' at each one)."""
    from train import metrics_log
    logger = metrics_log.MetricsLogger(str(tmp_path), enabled=True)
    with caplog.at_level(logging.WARNING):
        logger.write(1, {"loss": float("inf"), "loss_scale": 65536.0})
        logger.write(2, {"loss": 2.5, "loss_scale": 32768.0})
    logger.close()
    assert not [r for r in caplog.records if "NaN or Inf" in r.getMessage()]
    with open(tmp_path / "metrics.csv") as f:
        assert f.read().splitlines()[1:] == ["1,inf,65536.0", "2,2.5,32768.0"]
