"""What ``master="stochastic"`` does to each param along a run: a preset trained with the fp32
master and, at each step, per param, the update against bf16's spacing at its value and the
variance stochastic rounding would add to it (``s^2 f (1 - f)``, ``f`` the update's fraction of
the spacing ``s``), accumulated against the param's net movement.

    python -m benchmarks.stochastic_follow [PRESET] [SEED] [preset|protocol] [OUT_DIR]
    python -m benchmarks.stochastic_follow plot OUT_DIR PNG   # text, seed 0, both settings

``preset``: the preset as it ships; ``protocol``: the numerics protocol's setting (1500 steps,
100 warmup steps, gradients clipped to norm 1). Writes
``OUT_DIR/follow_<preset>_<seed>_<setting>.json``: at every 20th of the run, the medians of
each group of params (matrices; vectors: norm scales and biases).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import numpy as np

import jaxamp

PROTOCOL = {"warmup_steps": 100, "grad_clip": 1.0, "steps": 1500}


def spacing(x: np.ndarray) -> np.ndarray:
    """bf16's spacing at each value (8 significant bits)."""
    a = np.maximum(np.abs(x), np.float32(2.0 ** -126))
    return np.exp2(np.floor(np.log2(a)) - 7).astype(np.float32)


def _masters(state: Any) -> list[np.ndarray]:
    master = jaxamp.state.find_state(state.opt_state).master.params
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(master)]


def follow(preset: str, seed: int, setting: str) -> dict:
    from train import train as train_lib
    from train.configs import get_config
    config = get_config(preset, precision="mixed_bfloat16", seed=seed, progress=False,
                        **(PROTOCOL if setting == "protocol" else {}))
    policy = train_lib.policy_of(config)
    batches, _, meta = train_lib.build_data(config)
    params, model_state, loss_fn, _, flags = train_lib.build_model(config, policy, meta)
    state = train_lib.create_train_state(config, policy, params, model_state)
    step = jax.jit(jaxamp.make_train_step(loss_fn, **flags))
    before = _masters(state)
    groups = {"matrices": [i for i, m in enumerate(before) if m.ndim >= 2],
              "vectors": [i for i, m in enumerate(before) if m.ndim <= 1]}
    variance = [np.zeros_like(m) for m in before]
    drift = [np.zeros_like(m) for m in before]
    rows, feed, every = [], iter(batches), config.steps // 20
    for t in range(config.steps):
        state, _ = step(state, next(feed))
        after = _masters(state)
        ratios = []
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            u, s = a - b, spacing(b)
            f = np.abs(u) / s - np.floor(np.abs(u) / s)
            variance[i] += s * s * f * (1 - f)
            drift[i] += u
            ratios.append(np.abs(u) / s)
        if (t + 1) % every == 0:
            row: dict[str, Any] = {"step": t + 1}
            for name, idx in groups.items():
                ratio = np.concatenate([ratios[i].ravel() for i in idx])
                noise = np.concatenate([np.sqrt(variance[i]).ravel() for i in idx])
                moved = np.concatenate([np.abs(drift[i]).ravel() for i in idx])
                row[name] = {
                    "update_over_spacing_median": float(np.median(ratio)),
                    "below_quarter_spacing": float(np.mean(ratio < 0.25)),
                    "noise_over_drift_median": float(np.median(noise / np.maximum(moved,
                                                                                  1e-30)))}
            rows.append(row)
            print(json.dumps(row), flush=True)
        before = after
    sizes = {name: int(sum(before[i].size for i in idx)) for name, idx in groups.items()}
    return {"preset": preset, "seed": seed, "setting": setting, "sizes": sizes, "rows": rows}


def plot(out: str, png: str) -> None:
    """The text preset's seed 0 in both settings: the update against the spacing, and the
    accumulated noise against the net movement, along training."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = {"preset": "text preset as it ships (500 steps, 20 warmup, no clipping)",
              "protocol": "protocol setting (1500 steps, 100 warmup, clip 1)"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for setting, color in (("preset", "C3"), ("protocol", "C0")):
        with open(os.path.join(out, f"follow_text_0_{setting}.json")) as f:
            rows = json.load(f)["rows"]
        x = [r["step"] / rows[-1]["step"] for r in rows]
        for group, style in (("matrices", "-"), ("vectors", "--")):
            left.plot(x, [r[group]["update_over_spacing_median"] for r in rows], style,
                      color=color, lw=1.2, label=f"{labels[setting]}, {group}")
            right.plot(x, [r[group]["noise_over_drift_median"] for r in rows], style,
                       color=color, lw=1.2)
    left.set(yscale="log", xlabel="fraction of training", ylabel="median |update| / bf16 spacing",
             title="Each step's update against bf16's spacing at the param")
    right.set(xlabel="fraction of training", ylabel="median rounding noise / net movement",
              title="Stochastic rounding's accumulated noise, per param")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "plot":
        plot(argv[1], argv[2])
        return
    preset = argv[0] if argv else "text"
    seed = int(argv[1]) if len(argv) > 1 else 0
    setting = argv[2] if len(argv) > 2 else "preset"
    out = argv[3] if len(argv) > 3 else "runs/stochastic"
    found = follow(preset, seed, setting)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"follow_{preset}_{seed}_{setting}.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main(sys.argv[1:])
