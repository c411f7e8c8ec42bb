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
from helpers import ROOT

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
    procs = [subprocess.Popen(
        [sys.executable, *ARGS, "--zero", "3", "--workdir", str(multi), "--coordinator",
         f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
        cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in range(2)]
    outs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    single = tmp_path / "single"
    out = subprocess.run([sys.executable, *ARGS, "--workdir", str(single)], cwd=ROOT,
                         env=_env(4), capture_output=True, timeout=300)
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
