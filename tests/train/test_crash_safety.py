"""Crash safety of the training CLI: ``python -m train`` killed with SIGKILL at random points and
in the middle of checkpoint writes, then resumed, ends bit-identical to a run never interrupted.

How orbax-checkpoint (0.12) commits, which these tests rely on and check: a checkpoint of step N
is written into ``N.orbax-checkpoint-tmp`` (each item in its own ``<item>.orbax-checkpoint-tmp``
inside it); when every item is written it gets a ``commit_success.txt`` and the directory is
renamed to ``N``. ``CheckpointManager.latest_step()`` only sees renamed directories, and a later
save of step N removes the leftover temporary directory first.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT
from helpers import assert_tree_bitwise_equal
from helpers import final_state as _final_state

from train import train as train_lib

STEPS = 56
EVERY = 4
ARGS = ["--config", "tiny", "--no-progress", "--task", "synthetic_text", "--model", "gpt_tiny",
        "--seq-len", "16", "--precision", "mixed_float16", "--growth-interval", "3",
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--keep-checkpoints", "100"]

# Runs the CLI's own __main__ with orbax's commit steps patched to SIGKILL the process at one
# point of the write of step KILL_AT_STEP:
#   created       the step's temporary directory exists, nothing is written in it yet;
#   first_item    the first item is written, the other may not be, none is committed;
#   before_rename every item is written and committed inside the temporary directory, which
#                 is not renamed yet.
KILL_DURING_WRITE = r"""
import os, re, runpy, signal, sys
from orbax.checkpoint._src.path import atomicity

STEP, POINT = int(os.environ["KILL_AT_STEP"]), os.environ["KILL_POINT"]
Tmp = atomicity.AtomicRenameTemporaryPath
create, finalize = Tmp.create, Tmp.finalize


def step_of(path):
    match = re.search(r"(\d+)\.orbax-checkpoint-tmp", str(path))
    return int(match.group(1)) if match else None


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


async def create_then_kill(self):
    out = await create(self)
    if POINT == "created" and self.get_final().name == str(STEP):
        kill()
    return out


async def kill_then_finalize(self):
    if step_of(self.get()) == STEP:
        if POINT == "first_item" or (POINT == "before_rename"
                                     and self.get_final().name == str(STEP)):
            kill()
    return await finalize(self)


Tmp.create, Tmp.finalize = create_then_kill, kill_then_finalize
sys.argv[0] = "python -m train"
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def _env(tmp_path):
    # One device, and a compilation cache shared by all the runs: only the first one compiles.
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _start(tmp_path, workdir, *extra, kill_at=None):
    args = [*ARGS, "--workdir", str(workdir), *extra]
    env = _env(tmp_path)
    if kill_at is None:
        cmd = [sys.executable, "-m", "train", *args]
    else:
        cmd = [sys.executable, "-c", KILL_DURING_WRITE, *args]
        env.update(KILL_AT_STEP=str(kill_at[0]), KILL_POINT=kill_at[1])
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _logged_steps(workdir):
    try:
        with open(workdir / "metrics.csv") as f:
            return max(0, len(f.read().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def _kill_when_logged(proc, workdir, rows):
    """SIGKILLs ``proc`` as soon as the metrics log holds ``rows`` rows: a random point of the
    run (a step, a log write or a checkpoint write; the process runs on while we look)."""
    deadline = time.time() + 300
    while _logged_steps(workdir) < rows and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    return proc.communicate(timeout=60)[0]


def _checkpoints(workdir):
    names = os.listdir(workdir / "checkpoints") if (workdir / "checkpoints").exists() else []
    complete = sorted(int(n) for n in names if n.isdigit())
    partial = sorted(n for n in names if not n.isdigit())
    return complete, partial


def _latest_step(workdir):
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(workdir / "checkpoints", options=options,
                               item_names=("state", "data")) as manager:
        return manager.latest_step()


def _data_position(workdir, step):
    with open(workdir / "checkpoints" / str(step) / "data" / "metadata") as f:
        return json.load(f)


# test_cli.py's resume test (interrupted at a checkpoint, resumed bit for bit) runs in
# `make test`; the kills mid-step and mid-write, in `make test-all`.
@pytest.mark.slow
def test_kill_9_at_random_points_and_mid_write_then_resume_is_bit_identical(tmp_path):
    # The uninterrupted run (a checkpoint every EVERY steps, all kept) runs alongside.
    reference = tmp_path / "straight"
    straight = _start(tmp_path, reference)
    workdir = tmp_path / "killed"
    rng = np.random.default_rng(0)
    kills = ["random", "first_item", "random", "before_rename", "created"]
    history = []
    for kill in kills:
        resumed_from = _latest_step(workdir) if (workdir / "checkpoints").exists() else None
        start = resumed_from or 0
        target = start - start % EVERY + 2 * EVERY  # a checkpoint two saves ahead
        # --resume continues the run in the workdir; the first start has none to continue.
        resume = ("--resume",) if (workdir / "config.json").exists() else ()
        if kill == "random":
            proc = _start(tmp_path, workdir, *resume)
            # At least one checkpoint past the start: a row is logged after the save before it.
            rows = max(_logged_steps(workdir), start) + int(rng.integers(EVERY + 1, 2 * EVERY))
            out = _kill_when_logged(proc, workdir, rows)
        else:
            assert target <= STEPS
            proc = _start(tmp_path, workdir, *resume, kill_at=(target, kill))
            out = proc.communicate(timeout=600)[0]
        assert proc.returncode == -signal.SIGKILL, out[-3000:]
        # The resumed run started from the latest complete checkpoint (never a partial one).
        if resumed_from is not None:
            assert f"resuming from the checkpoint of step {resumed_from} in" in out, out[-3000:]
        complete, partial = _checkpoints(workdir)
        if kill != "random":
            # Killed mid-write: the checkpoint is left as a temporary directory only...
            assert f"{target}.orbax-checkpoint-tmp" in partial, (complete, partial)
            assert target not in complete and max(complete) == target - EVERY
        # ...which orbax never counts: the latest step is the latest complete checkpoint.
        assert _latest_step(workdir) == max(complete)
        history.append((kill, max(complete), partial))

    proc = _start(tmp_path, workdir, "--resume")
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    out = straight.communicate(timeout=600)[0]
    assert straight.returncode == 0, out[-3000:]
    assert _checkpoints(reference) == (list(range(EVERY, STEPS + 1, EVERY)), [])

    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from"] == history[-1][1] and summary["steps"] == STEPS
    # Each checkpoint a killed run left as its latest restores, equal bit for bit to the
    # uninterrupted run's; so does every other one, written before or after the kills.
    assert _checkpoints(workdir) == (list(range(EVERY, STEPS + 1, EVERY)), [])
    for step in range(EVERY, STEPS + 1, EVERY):
        assert_tree_bitwise_equal(_final_state(workdir, step), _final_state(reference, step))
        assert _data_position(workdir, step) == _data_position(reference, step)
    # The metrics log dropped what the killed runs wrote after their last checkpoint: one row
    # per step, with the uninterrupted run's values (throughput aside).
    got, want = train_lib.read_metrics(str(workdir)), train_lib.read_metrics(str(reference))
    assert list(got["step"]) == list(range(1, STEPS + 1))
    for key in want:
        if key != "throughput":
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    reference_summary = json.loads((reference / "summary.json").read_text())
    assert summary["eval_loss"] == reference_summary["eval_loss"]
    print("kill point, latest complete checkpoint, temporary directories left:", history)
    # The kills landed at five different points of the run, which skipped some steps too.
    assert len({latest for _, latest, _ in history}) == len(kills), history
    assert summary["skipped_steps"] >= 1
