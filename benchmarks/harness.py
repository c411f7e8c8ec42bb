"""What every suite shares: compiling and timing steps, XLA's cost analysis, the optimized HLO's
text, and the outputs (a markdown table, JSON lines and a bar chart).

Times are taken interleaved in one process (A B C, B C A, C A B, ...) and compared as ratios
round by round; flops and bytes come from XLA's ``cost_analysis()`` and are deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Variant:
    """A step ``step(state, batch) -> (state, loss)`` plus what the tables need about it."""

    step: Callable[[Any, Any], tuple[Any, jax.Array]]
    fresh: Callable[[], Any]  # a new state: the steps donate theirs
    saved: Callable[[], int] | None = None  # saved-activation bytes of one step
    batch: Any = None


# --------------------------------------------------------------------------------------------
# XLA's view of a compiled step
# --------------------------------------------------------------------------------------------

def cost(compiled) -> dict[str, float]:
    """``{"flops", "bytes"}`` of a compiled step, from XLA's ``cost_analysis()``."""
    c = compiled.cost_analysis()
    if isinstance(c, list | tuple):
        c = c[0]
    return {"flops": float(c.get("flops", 0.0)), "bytes": float(c.get("bytes accessed", 0.0))}


def hlo_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """``({computation name: its instruction lines}, entry name)`` of an HLO module's text."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY ")) and line.rstrip().endswith("{"):
            name = (line.split()[1] if line.startswith("ENTRY ") else line.split()[0]).lstrip("%")
            entry = name if line.startswith("ENTRY ") else entry
            current = comps[name] = []
        elif line.startswith("}"):
            current = None
        elif current is not None and " = " in line:
            current.append(line.strip())
    return comps, entry


def entry_op_count(compiled) -> int:
    """Instructions in the optimized HLO's entry computation (fusions count once)."""
    comps, entry = hlo_computations(compiled.as_text())
    return len(comps[entry])


def tree_bytes(tree) -> int:
    """Bytes of a tree's array leaves (concrete or abstract)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------------------------
# Compiling and timing
# --------------------------------------------------------------------------------------------

# XLA:CPU options that cut the compile time of the little --tiny programs: -O0 and, where the
# XLA in use has them, no fusion emitters (a third of the time). jax 0.11 dropped
# xla_cpu_use_fusion_emitters ("No such compile option"): each option is tried once on a
# trivial program and passed only where the running XLA accepts it.
_TINY_CPU_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                     "xla_cpu_use_fusion_emitters": False}


@functools.cache
def supported_compiler_options(**options: Any) -> dict[str, Any]:
    """The subset of XLA compiler ``options`` that the running jax accepts (each tried once)."""
    probe = jax.jit(lambda x: x + 1).lower(jnp.zeros((), jnp.float32))
    kept = {}
    for name, value in options.items():
        try:
            probe.compile({name: value})
        except Exception as e:  # JaxRuntimeError: INVALID_ARGUMENT: No such compile option
            if "No such compile option" not in str(e):
                raise
            continue
        kept[name] = value
    return kept


def tiny_compiler_options(tiny: bool) -> dict | None:
    """At ``--tiny`` on a CPU, compiling dominates: XLA:CPU builds the little programs at -O0
    (and without its fusion emitters, where it has them). Nothing changes elsewhere."""
    if tiny and jax.default_backend() == "cpu":
        return supported_compiler_options(**_TINY_CPU_OPTIONS) or None
    return None


def compile_variants(variants: dict[str, Variant], batch, options: dict | None = None):
    """Jits each step with donation (compiled with XLA ``options``, e.g.
    :func:`tiny_compiler_options`); returns the compiled steps and a live state for each."""
    compiled, states = {}, {}
    for name, v in variants.items():
        b = batch if v.batch is None else v.batch
        compiled[name] = jax.jit(v.step, donate_argnums=0).lower(v.fresh(), b).compile(options)
        states[name] = v.fresh()
    return compiled, states


def stepper(compiled, states: dict, name: str, batch) -> Callable[[], None]:
    """A runner that advances ``states[name]`` by one compiled step and waits for it."""
    def run():
        states[name], loss = compiled[name](states[name], batch)
        jax.block_until_ready((states[name], loss))
    return run


def time_rounds(runners: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, list[float]]:
    """Seconds of each runner in each of ``rounds`` rounds (after one warm-up call each).

    Every round calls each runner once, the order rotating by one from round to round, so no
    runner always follows the same neighbour or holds the same place in the round.
    """
    for run in runners.values():
        run()
    names = list(runners)
    times: dict[Any, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def time_interleaved(runners: dict[Any, Callable[[], Any]], rounds: int) -> dict[Any, float]:
    """Median seconds of each runner over :func:`time_rounds`."""
    return {name: statistics.median(t) for name, t in time_rounds(runners, rounds).items()}


def paired_ratio(times: dict[Any, list[float]], name: Any, ref: Any) -> tuple[float, float, float]:
    """``(median, q25, q75)`` of ``name``'s time over ``ref``'s, round by round.

    Each round's ratio compares two calls made a few seconds apart, so the drift of a shared
    machine over minutes cancels out; the quartiles say how much the rounds still disagree.
    """
    ratios = sorted(a / b for a, b in zip(times[name], times[ref], strict=True))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), q[0], q[-1]


def machine() -> str:
    """``"<platform>: <device kind> x<count>, jax <version>"`` of this process."""
    dev = jax.devices()[0]
    kind = dev.device_kind if dev.platform != "cpu" else (platform.processor()
                                                         or platform.machine())
    return f"{dev.platform}: {kind} x{jax.local_device_count()}, jax {jax.__version__}"


# --------------------------------------------------------------------------------------------
# Output: a markdown table, JSON lines and a bar chart
# --------------------------------------------------------------------------------------------

def _fmt(x: Any) -> str:
    if isinstance(x, bool) or x is None:
        return "" if x is None else str(x)
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)


def markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_outputs(suite: str, rows: list[dict], columns: list[str], out: str,
                  chart: tuple[str, str] | None, header: str) -> None:
    """Prints the table; writes ``<suite>.jsonl`` and, with ``chart=(label_key, value_key)``,
    a bar chart ``<suite>.png``."""
    os.makedirs(out, exist_ok=True)
    print(f"## {suite}\n\n{header}\n\n{markdown(rows, columns)}\n", flush=True)
    with open(os.path.join(out, f"{suite}.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps({"suite": suite, **r}) + "\n")
    if chart and rows:
        _bar_chart(suite, rows, chart, os.path.join(out, f"{suite}.png"))


def _bar_chart(suite: str, rows: list[dict], chart: tuple[str, str], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    label, value = chart
    bars = [(str(r[label]), r[value]) for r in rows if r.get(value) is not None]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(bars), 3.6))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_ylabel(value)
    ax.set_title(f"{suite}: {value}")
    ax.tick_params(axis="x", labelrotation=35)
    for t in ax.get_xticklabels():
        t.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def skip_without_torch(suite: str, out: str) -> bool:
    """``True``, after saying so and writing a one-line ``<suite>.jsonl``, when torch is missing."""
    if importlib.util.find_spec("torch") is not None:
        return False
    print(f"## {suite}\n\ntorch is not installed: suite skipped (`pip install torch==2.13.0` "
          "takes the CPU build).\n", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{suite}.jsonl"), "w") as f:
        f.write(json.dumps({"suite": suite, "skipped": "torch is not installed"}) + "\n")
    return True
