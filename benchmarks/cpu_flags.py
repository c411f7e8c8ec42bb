"""Suite ``cpu_flags``: the torch suite once per XLA:CPU flag set, each in its own process (XLA
reads its flags once), with PyTorch autocast as the yardstick inside every process.

    python -m benchmarks cpu_flags [--rounds 10]   # needs torch
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from benchmarks import harness

ROUNDS = 30
# XLA:CPU options for dots and convolutions (from ``XLA_FLAGS=--helpfull`` of jaxlib 0.10.2).
CPU_FLAG_SETS = {
    "default": "",
    "oneDNN fusion: dot": "--xla_cpu_experimental_onednn_fusion_type=dot",
    "oneDNN custom calls": "--xla_cpu_use_onednn=true "
                           "--xla_cpu_experimental_onednn_custom_call=true",
    "XNNPACK fusion: dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "YNNPACK fusion: dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
    "YNNPACK: dot, conv": "--xla_cpu_experimental_ynn_fusion_type="
                          "individual_dot,individual_convolution",
}
# The folder that holds the benchmarks package: where the child processes run.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch_suite_in_process(flags: str, rounds: int, tiny: bool) -> dict[str, dict] | list[str]:
    """The torch suite's rows by system, run under ``XLA_FLAGS=flags``; or ``[last error line]``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "benchmarks", "torch", "--rounds", str(rounds),
               "--out", tmp] + (["--tiny"] if tiny else [])
        env = {**os.environ, "XLA_FLAGS": flags}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=_ROOT)
        path = os.path.join(tmp, "torch.jsonl")
        if proc.returncode != 0 or not os.path.exists(path):
            return proc.stderr.strip().splitlines()[-1:]
        with open(path) as f:
            return {r["system"]: r for r in map(json.loads, f) if "system" in r}


def run(args) -> list[dict]:
    if harness.skip_without_torch("cpu_flags", args.out):
        return []
    rows: list[dict] = []
    ref_loss: dict[str, float] = {}
    flag_sets = list(CPU_FLAG_SETS.items())[:2] if args.tiny else CPU_FLAG_SETS.items()
    for label, flags in flag_sets:
        got = _torch_suite_in_process(flags, args.rounds, args.tiny)
        if not isinstance(got, dict):
            rows.append({"flags": label, "error": got})
            continue
        for system in ("jax fp32", "jaxamp mixed_bfloat16"):
            r = got[system]
            ref_loss.setdefault(system, r["first_loss"])
            rows.append({"flags": label, "xla_flags": flags, "system": system,
                         "median_ms": r["median_ms"], "vs_torch_autocast": r["vs_torch_autocast"],
                         "torch_autocast_ms": got["PyTorch autocast-bf16"]["median_ms"],
                         "first_loss": r["first_loss"],
                         "loss_vs_default": r["first_loss"] / ref_loss[system] - 1,
                         "label": f"{label} / {system.split()[-1]}"})
    header = (f"{harness.machine()}; one process per flag set, each timing the jax steps "
              f"alternated with PyTorch autocast-bf16 ({args.rounds} rounds); `loss_vs_default`: "
              "the first step's loss against the default flags' (a flag must not change the "
              "numerics beyond rounding).")
    harness.write_outputs("cpu_flags", rows, ["flags", "system", "median_ms",
                                              "vs_torch_autocast", "torch_autocast_ms",
                                              "loss_vs_default"], args.out,
                          ("label", "vs_torch_autocast"), header)
    return rows
