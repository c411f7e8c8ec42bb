"""Two processes × 2 CPU devices under jax.distributed (gloo on 127.0.0.1), with the state
sharded over the 4 devices (ZeRO-3), give the result of one process with 4 devices and a
replicated state."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT
from helpers import dying_with_its_parent

ARGS = ["-m", "train", "--config", "tiny", "--steps", "4", "--checkpoint-every", "4",
        "--parallel", "jit", "--precision", "mixed_float16", "--no-progress"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return env


def _state(workdir):
    """The saved train state, restored onto this process's first device."""
    path = os.path.join(workdir, "checkpoints", "4", "state")
    device = jax.sharding.make_single_device_sharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(path)
        tree = getattr(meta, "item_metadata", meta)
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree,
            is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
        return ckpt.restore(path, target)


def test_two_processes_equal_one_process_with_four_devices(tmp_path):
    port = _free_port()
    multi = tmp_path / "multi"
    # Each child is killed when this test's process dies (a `make test` stopped by SIGTERM or
    # SIGINT runs no finally), and here where the test fails.
    procs = [subprocess.Popen(dying_with_its_parent(
        [sys.executable, *ARGS, "--zero", "3", "--workdir", str(multi), "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]),
        cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    single = tmp_path / "single"
    out = subprocess.run(dying_with_its_parent([sys.executable, *ARGS, "--workdir", str(single)]),
                         cwd=ROOT, env=_env(4), capture_output=True, timeout=300)
    assert out.returncode == 0, out.stdout.decode()[-3000:] + out.stderr.decode()[-3000:]

    a, b = _state(multi), _state(single)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 10
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
            # The same per-device gradients, reduced in fp32 by gloo across processes and
            # reduce-scattered onto the shards, or all-reduced within one process: the fp32
            # sums may associate differently (measured: at most 7.5e-9 apart), so the fp32
            # master agrees to 1e-6 and a half-precision copy to one ulp.
            ulp = float(np.finfo(x.dtype).eps)
            rtol = 1e-6 if x.dtype == np.float32 else ulp
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32),
                                       rtol=rtol, atol=1e-7)
        else:
            np.testing.assert_array_equal(x, y)
    # Metrics agree across processes, and only process 0 wrote logs (one header, 4 rows).
    summaries = [json.loads(o[o.index("{"):]) for o in outs]
    assert summaries[0]["eval_loss"] == summaries[1]["eval_loss"]
    with open(multi / "metrics.csv") as f:
        assert len(f.read().strip().splitlines()) == 1 + 4


@pytest.mark.slow  # 45 s; the mechanism itself is tested below, in a second
def test_a_stopped_test_run_leaves_no_child_behind(tmp_path):
    """SIGTERM or SIGINT to a pytest running the test above, while its two processes wait for
    each other: the children go with it (they ignored SIGTERM, waiting in
    jax.distributed, and stayed behind after an interrupted `make test`)."""
    import signal
    import time
    tag = f"jaxamp-cleanup-{os.getpid()}"
    for sig in (signal.SIGTERM, signal.SIGINT):
        run = subprocess.Popen(dying_with_its_parent(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/train/test_multihost.py::test_two_processes_equal_one_process_with_four_"
             "devices"]), cwd=ROOT, env={**os.environ, "JAXAMP_CLEANUP_TAG": tag},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while len(_tagged(tag)) < 3 and time.monotonic() < deadline:  # pytest + 2
                time.sleep(0.5)
            assert len(_tagged(tag)) >= 3, "the children never started"
            run.send_signal(sig)
            run.wait(timeout=60)
            deadline = time.monotonic() + 30
            while _tagged(tag) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _tagged(tag) == [], (sig, _tagged(tag))
        finally:
            run.kill()


def _tagged(tag: str) -> list[int]:
    """The live processes whose environment holds ``tag``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as g:
                        if g.read().split(") ", 1)[1].startswith("Z"):
                            continue  # exited, not yet reaped
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_child_started_dying_with_its_parent_goes_when_the_parent_is_stopped(sig):
    """What the test above relies on, in a second: a parent stopped by a signal, which runs no
    cleanup, takes its child along."""
    import signal
    import time
    tag = f"jaxamp-child-{os.getpid()}-{sig}"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         # SIGINT as an interactive shell leaves it: a job started in the background of a
         # script inherits it ignored.
         "import signal, subprocess, sys, time; sys.path.insert(0, 'tests'); "
         "signal.signal(signal.SIGINT, signal.default_int_handler); "
         "from processes import dying_with_its_parent; "
         "subprocess.Popen(dying_with_its_parent(['sleep', '60'])); "
         "print('started', flush=True); time.sleep(60)"],
        cwd=ROOT, env={**os.environ, "JAXAMP_CLEANUP_TAG": tag}, stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == b"started"
        deadline = time.monotonic() + 30  # the child's wrapper starts, then execs sleep
        while len(_tagged(tag)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_tagged(tag)) == 2
        parent.send_signal(getattr(signal, sig))
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tagged(tag) == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
