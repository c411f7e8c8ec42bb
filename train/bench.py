"""Benchmark suites: jaxamp side by side with jmp, flax ``DynamicScale``, optax and PyTorch AMP.

    python -m train.bench overhead [--rounds 30]   # CPU: the AMP machinery's cost per step
    python -m train.bench memory                   # saved activations and optimizer-state bytes
    python -m train.bench torch [--rounds 20]      # PyTorch autocast against jaxamp, alternated
    python -m train.bench cpu_flags                # the torch suite under each XLA:CPU option
    python -m train.bench gpu                      # throughput, MFU and peak memory on a GPU
    python -m train.bench all --tiny               # every suite at a tiny size (what the tests run)

Each suite prints a markdown table, writes one JSON line per row to ``OUT/<suite>.jsonl`` and a
bar chart to ``OUT/<suite>.png`` (``--out``, default ``runs/bench``). Times are medians over
interleaved rounds in one process (A B C A B C ...), and ratios are taken within the process;
flops and bytes come from XLA's ``cost_analysis()`` and are deterministic.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from train import encoder

BF16 = jnp.bfloat16
# Dense bf16/fp16 peak of an H100/H200 SXM, the denominator of MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12}


@dataclasses.dataclass
class Variant:
    """A step ``step(state, batch) -> (state, loss)`` plus what the tables need about it."""

    step: Callable[[Any, Any], tuple[Any, jax.Array]]
    fresh: Callable[[], Any]  # a new state: the steps donate theirs
    saved: Callable[[], int] | None = None  # saved-activation bytes of one step
    batch: Any = None


# --------------------------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------------------------

def cost(compiled) -> dict[str, float]:
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


def compile_variants(variants: dict[str, Variant], batch):
    """Jits each step with donation; returns the compiled steps, their costs and live states."""
    compiled, states = {}, {}
    for name, v in variants.items():
        b = batch if v.batch is None else v.batch
        compiled[name] = jax.jit(v.step, donate_argnums=0).lower(v.fresh(), b).compile()
        states[name] = v.fresh()
    return compiled, states


def stepper(compiled, states: dict, name: str, batch) -> Callable[[], None]:
    def run():
        states[name], loss = compiled[name](states[name], batch)
        jax.block_until_ready((states[name], loss))
    return run


def machine() -> str:
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
        fig.savefig(os.path.join(out, f"{suite}.png"), dpi=110)
        plt.close(fig)


# --------------------------------------------------------------------------------------------
# Suite 1: overhead of the AMP machinery on the encoder step
# --------------------------------------------------------------------------------------------

def encoder_config(tiny: bool) -> tuple[encoder.EncoderConfig, int]:
    if tiny:
        return encoder.EncoderConfig(vocab=64, width=32, depth=1, heads=2, mlp=64, seq_len=16), 8
    return encoder.EncoderConfig(), 16


def overhead_variants(cfg: encoder.EncoderConfig, batch_size: int, lr: float = 1e-3):
    """Every way of building the same encoder step; each returns ``(state, fp32 loss)``."""
    import jmp
    from flax.training import dynamic_scale

    params = encoder.init_params(jax.random.key(0), cfg)
    batch = encoder.synthetic_batch(jax.random.key(1), batch_size, cfg)
    loss = functools.partial(encoder.loss_fn, cfg=cfg)
    tx = optax.adamw(lr)

    def to_bf16(tree):
        return jax.tree.map(lambda x: x.astype(BF16), tree)

    def fresh_params():
        return jax.tree.map(jnp.copy, params)

    def fresh_plain():
        p = fresh_params()
        return p, tx.init(p)

    def saved(f, p):
        return lambda: jaxamp.audit_grad(f, p, batch).saved_bytes

    def cast_loss(p, b):
        return loss(to_bf16(p), b)

    def plain(cast: bool):
        f = cast_loss if cast else loss

        def step(state, batch):
            p, opt_state = state
            value, grads = jax.value_and_grad(f)(p, batch)
            updates, opt_state = tx.update(grads, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), value
        return step

    v: dict[str, Variant] = {}
    v["fp32"] = Variant(plain(False), fresh_plain, saved(loss, params))
    v["bare_bf16"] = Variant(plain(True), fresh_plain, saved(cast_loss, params))

    # jmp's recipe: cast the params to compute, scale, unscale, check, adjust, select_tree.
    # The loss scale's arrays live in the state; the object is rebuilt inside the step (a step
    # that takes jmp's object as an argument cannot be lowered on this jax).
    jmp_policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def jmp_step(state, batch):
        p, opt_state, (scale_value, counter) = state
        scale = jmp.DynamicLossScale(scale_value, counter)

        def f(p):
            value = loss(jmp_policy.cast_to_compute(p), batch)
            return scale.scale(value), value
        grads, value = jax.grad(f, has_aux=True)(p)
        grads = scale.unscale(jmp_policy.cast_to_param(grads))
        finite = jmp.all_finite(grads)
        scale = scale.adjust(finite)
        updates, new_opt = tx.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        p, opt_state = jmp.select_tree(finite, (new_p, new_opt), (p, opt_state))
        return (p, opt_state, (scale.loss_scale, scale.counter)), value

    def fresh_jmp():
        p, o = fresh_plain()
        return p, o, (jnp.float32(2 ** 15), jnp.int32(0))

    v["jmp"] = Variant(jmp_step, fresh_jmp, saved(cast_loss, params))

    # flax: layers computing in bf16 (here: the params cast in the forward), DynamicScale.
    def flax_step(state, batch):
        p, opt_state, ds = state
        ds, finite, value, grads = ds.value_and_grad(cast_loss)(p, batch)
        updates, new_opt = tx.update(grads, opt_state, p)
        new_p = optax.apply_updates(p, updates)
        select = functools.partial(jnp.where, finite)
        p = jax.tree.map(select, new_p, p)
        opt_state = jax.tree.map(select, new_opt, opt_state)
        return (p, opt_state, ds), value

    def fresh_flax():
        p, o = fresh_plain()
        return p, o, dynamic_scale.DynamicScale()

    v["flax_DynamicScale"] = Variant(flax_step, fresh_flax, saved(cast_loss, params))

    # optax: bf16 compute, no scaling, the update applied only when finite.
    safe_tx = optax.apply_if_finite(tx, max_consecutive_errors=5)

    def optax_step(state, batch):
        p, opt_state = state
        value, grads = jax.value_and_grad(cast_loss)(p, batch)
        updates, opt_state = safe_tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), value

    def fresh_optax():
        p = fresh_params()
        return p, safe_tx.init(p)

    v["optax_apply_if_finite"] = Variant(optax_step, fresh_optax, saved(cast_loss, params))

    def jaxamp_variant(policy: str, accum_steps: int = 1) -> Variant:
        amp_tx = jaxamp.mixed_precision(tx, policy, loss_scale=jaxamp.DynamicLossScale())
        amp_step = jaxamp.make_train_step(loss, accum_steps=accum_steps)

        def step(state, batch):
            state, metrics = amp_step(state, batch)
            return state, metrics["loss"]

        def fresh():
            return jaxamp.TrainState.create(params=fresh_params(), tx=amp_tx)

        micro = jax.tree.map(lambda x: x[: x.shape[0] // accum_steps], batch)
        working = jaxamp.get_policy(policy).cast_params_to_compute(params)
        return Variant(step, fresh, lambda: jaxamp.audit_grad(loss, working, micro).saved_bytes)

    v["jaxamp_mixed_bf16"] = jaxamp_variant("mixed_bfloat16")
    v["jaxamp_mixed_fp16"] = jaxamp_variant("mixed_float16")
    v["jaxamp_bf16_accum4"] = jaxamp_variant("mixed_bfloat16", accum_steps=4)
    return v, batch


def first_step_losses(variants: dict[str, Variant], batch) -> dict[str, float]:
    """The loss each variant reports on its first step, from a fresh state."""
    out = {}
    for name, v in variants.items():
        _, value = jax.jit(v.step)(v.fresh(), batch)
        out[name] = float(value)
    return out


def suite_overhead(args) -> list[dict]:
    cfg, batch_size = encoder_config(args.tiny)
    variants, batch = overhead_variants(cfg, batch_size, lr=1e-2 if args.tiny else 1e-3)
    compiled, states = compile_variants(variants, batch)
    costs = {k: cost(c) for k, c in compiled.items()}
    # The first step's loss from a fresh state: every variant must train the same model.
    first = {k: float(compiled[k](v.fresh(), batch)[1]) for k, v in variants.items()}
    last: dict[str, float] = {}

    def runner(name):
        run = stepper(compiled, states, name, batch)

        def run_and_keep_loss():
            run()
            last[name] = float(compiled[name](jax.tree.map(jnp.copy, states[name]), batch)[1])
        return run if not args.tiny else run_and_keep_loss

    times = time_rounds({k: runner(k) for k in variants}, args.rounds)
    rows = []
    for name, v in variants.items():
        saved = v.saved() if v.saved else None
        vs_bare, q25, q75 = paired_ratio(times, name, "bare_bf16")
        rows.append({
            "variant": name, "median_ms": 1e3 * statistics.median(times[name]),
            "time_vs_bare_bf16": vs_bare,
            "time_vs_bare_bf16_iqr": f"{q25:.3f}–{q75:.3f}",
            "time_vs_fp32": paired_ratio(times, name, "fp32")[0],
            "gflops": costs[name]["flops"] / 1e9,
            "gbytes_accessed": costs[name]["bytes"] / 1e9,
            "bytes_vs_bare_bf16": costs[name]["bytes"] / costs["bare_bf16"]["bytes"],
            "bytes_vs_fp32": costs[name]["bytes"] / costs["fp32"]["bytes"],
            "entry_ops": entry_op_count(compiled[name]),
            "saved_mb": None if saved is None else saved / 1e6,
            "first_loss": first[name], "last_loss": last.get(name),
        })
    fp32_saved = rows[0]["saved_mb"]
    for r in rows:
        r["saved_vs_fp32"] = r["saved_mb"] / fp32_saved
    header = (f"{machine()}; encoder {cfg}, batch {batch_size}, adamw, donated state, "
              f"{args.rounds} interleaved rounds; ratios are the median and quartiles of the "
              "per-round ratios")
    write_outputs("overhead", rows, ["variant", "median_ms", "time_vs_bare_bf16",
                                     "time_vs_bare_bf16_iqr", "time_vs_fp32",
                                     "gflops", "gbytes_accessed", "bytes_vs_bare_bf16",
                                     "entry_ops", "saved_mb", "saved_vs_fp32"],
                  args.out, ("variant", "time_vs_bare_bf16"), header)
    return rows


# --------------------------------------------------------------------------------------------
# Suite 2: memory (abstract: saved activations and the bytes of the training state)
# --------------------------------------------------------------------------------------------

def tree_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def _memory_cases(tiny: bool):
    from train import flax_encoder
    from train import flax_resnet
    if tiny:
        img, batch, seq = 32, 2, 16
        resnet_kw = dict(stage_sizes=(1, 1), width=8, num_classes=10)
        bert_kw = dict(vocab=128, width=32, depth=1, heads=2, mlp=64)
        nnx_resnet = ("resnet50_small", dict(stage_sizes=(1, 1), width=8))
        nnx_bert = ("bert_tiny", dict(depth=1, width=32))
    else:
        img, batch, seq = 224, 8, 128
        resnet_kw = dict(num_classes=1000)
        bert_kw = dict(vocab=30522, width=1024, depth=24, heads=16, mlp=4096)
        nnx_resnet = ("resnet50", {})
        nnx_bert = ("bert_large", {})
    return {
        f"ResNet-50 ({img}x{img}, batch {batch})" if not tiny else "ResNet (tiny)": dict(
            kind="image", nnx=nnx_resnet, shape=(batch, img, img, 3),
            linen=lambda **kw: flax_resnet.ResNet(**resnet_kw, **kw)),
        f"BERT-Large ({seq} tokens, batch {batch})" if not tiny else "BERT (tiny)": dict(
            kind="text", nnx=nnx_bert, shape=(batch, seq),
            linen=lambda **kw: flax_encoder.Encoder(**bert_kw, **kw)),
    }


def _linen_memory(case: dict, variant: str) -> tuple[int, int]:
    """``(saved activation bytes, params + adamw state bytes)`` of a Linen peer variant."""
    import jmp
    kind, shape = case["kind"], case["shape"]
    if variant == "flax dtype=bf16":
        model = case["linen"](dtype=BF16, norm_dtype=BF16)
    else:
        model = case["linen"](norm_dtype=jnp.float32)
    rng = jax.random.key(0)
    if kind == "image":
        x = jnp.zeros(shape, jnp.float32)
        labels = jnp.zeros(shape[:1], jnp.int32)
        variables = model.init(rng, x[:1], train=False)
        params, stats = variables["params"], variables["batch_stats"]

        def logits_of(p, x):
            out, _ = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            return out, labels
    else:
        x = jnp.zeros(shape, jnp.int32)
        variables = model.init(rng, x[:1])
        params = variables["params"]

        def logits_of(p, x):
            return model.apply({"params": p}, x), x

    policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")

    def loss(p, x):
        if variant == "jmp recipe":
            p, x = policy.cast_to_compute((p, x))
        logits, labels = logits_of(p, x)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], -1))

    saved = jaxamp.audit_grad(loss, params, x).saved_bytes
    state = tree_bytes(params) + tree_bytes(jax.eval_shape(optax.adamw(1e-3).init, params))
    return saved, state


def _jaxamp_memory(case: dict, policy: str) -> tuple[int, int]:
    """``(saved activation bytes, params + master + adamw state bytes)`` of a reference model."""
    from train import models
    name, kw = case["nnx"]
    model = models.build(name, policy, **kw)
    graphdef, params, model_state = models.split(model)
    if policy == "float32":  # what an fp32 user holds: params and adamw's moments
        state_bytes = tree_bytes(params) + tree_bytes(
            jax.eval_shape(optax.adamw(1e-3).init, params))
    else:  # working params, and the fp32 master with adamw's moments in the optimizer state
        tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
        state = jax.eval_shape(lambda p: jaxamp.TrainState.create(params=p, tx=tx), params)
        state_bytes = tree_bytes(state.params) + tree_bytes(state.opt_state)
    working = jaxamp.get_policy(policy).cast_params_to_compute(params)
    shape = case["shape"]
    if case["kind"] == "image":
        batch = {"image": jnp.zeros(shape, jnp.float32), "label": jnp.zeros(shape[:1], jnp.int32)}
        closs = models.classification_loss(graphdef)

        def loss(p, b):
            return closs(p, b, model_state=model_state)[0]
    else:
        batch = {"tokens": jnp.zeros(shape, jnp.int32), "targets": jnp.zeros(shape, jnp.int32)}
        mlm = models.mlm_loss(graphdef)

        def loss(p, b):
            return mlm(p, b)[0]
    report = jaxamp.audit_grad(loss, working, batch)
    return report.saved_bytes, state_bytes


def suite_memory(args) -> list[dict]:
    rows = []
    for label, case in _memory_cases(args.tiny).items():
        measured = {
            "fp32 (reference model)": _jaxamp_memory(case, "float32"),
            "jaxamp mixed_bfloat16": _jaxamp_memory(case, "mixed_bfloat16"),
            "flax fp32 (Linen)": _linen_memory(case, "fp32"),
            "jmp recipe (Linen)": _linen_memory(case, "jmp recipe"),
            "flax dtype=bf16 (Linen)": _linen_memory(case, "flax dtype=bf16"),
        }
        for variant, (saved, state) in measured.items():
            base = measured["flax fp32 (Linen)" if "Linen" in variant
                            else "fp32 (reference model)"]
            rows.append({"model": label, "variant": variant, "saved_mb": saved / 1e6,
                         "saved_vs_fp32": saved / base[0], "state_mb": state / 1e6,
                         "state_vs_fp32": state / base[1],
                         "label": f"{label.split(' ')[0]} {variant.split(' (')[0]}"})
    header = (f"{machine()}; abstract trace, nothing runs. Ratios are against the fp32 model of "
              "the same code: jaxamp against the reference model in float32, the Linen peers "
              "against the Linen model in fp32. State = params (+ master) + adamw moments.")
    write_outputs("memory", rows, ["model", "variant", "saved_mb", "saved_vs_fp32", "state_mb",
                                   "state_vs_fp32"], args.out, ("label", "saved_vs_fp32"), header)
    return rows


# --------------------------------------------------------------------------------------------
# Suite 3: PyTorch AMP on the CPU, alternated with jaxamp in one process
# --------------------------------------------------------------------------------------------

def torch_encoder_step(cfg: encoder.EncoderConfig, batch: dict, amp: bool, lr: float = 1e-3):
    """The encoder of ``train/encoder.py`` in PyTorch, trained with AdamW; returns a step
    closure that returns the loss. ``amp``: ``torch.autocast(bfloat16)`` plus ``GradScaler``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            w = cfg.width
            self.norm1, self.norm2 = nn.LayerNorm(w, eps=1e-6), nn.LayerNorm(w, eps=1e-6)
            self.qkv, self.out = nn.Linear(w, 3 * w), nn.Linear(w, w)
            self.mlp_in, self.mlp_out = nn.Linear(w, cfg.mlp), nn.Linear(cfg.mlp, w)

        def forward(self, x):
            B, L, W = x.shape
            h = self.norm1(x)
            q, k, v = (t.reshape(B, L, cfg.heads, -1).transpose(1, 2)
                       for t in self.qkv(h).chunk(3, dim=-1))
            scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
            att = (probs @ v).transpose(1, 2).reshape(B, L, W)
            x = x + self.out(att)
            return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab, cfg.width)
            self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.width) * 0.02)
            self.layers = nn.ModuleList([Layer() for _ in range(cfg.depth)])
            self.final_norm = nn.LayerNorm(cfg.width, eps=1e-6)
            self.head = nn.Linear(cfg.width, cfg.vocab)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for layer in self.layers:
                x = layer(x)
            return self.head(self.final_norm(x)).float()

    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    tokens = torch.from_numpy(np.asarray(batch["tokens"], np.int64))
    targets = torch.from_numpy(np.asarray(batch["targets"], np.int64)).reshape(-1)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def _skip_without_torch(suite: str, out: str) -> bool:
    if importlib.util.find_spec("torch") is not None:
        return False
    print(f"## {suite}\n\ntorch is not installed: suite skipped (`pip install torch==2.13.0` "
          "takes the CPU build).\n", flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{suite}.jsonl"), "w") as f:
        f.write(json.dumps({"suite": suite, "skipped": "torch is not installed"}) + "\n")
    return True


def suite_torch(args) -> list[dict]:
    if _skip_without_torch("torch", args.out):
        return []
    import torch
    cfg, batch_size = encoder_config(args.tiny)
    variants, batch = overhead_variants(cfg, batch_size)
    auto = jaxamp.get_policy("auto")
    jax_names = {"jax fp32": "fp32", "jaxamp mixed_bfloat16": "jaxamp_mixed_bf16"}
    compiled, states = compile_variants({v: variants[v] for v in jax_names.values()}, batch)
    runners: dict[str, Callable[[], None]] = {}
    first_loss: dict[str, float] = {}
    for label, name in jax_names.items():
        first_loss[label] = float(compiled[name](variants[name].fresh(), batch)[1])
        runners[label] = stepper(compiled, states, name, batch)
    for label, amp in (("PyTorch fp32", False), ("PyTorch autocast-bf16", True)):
        step = torch_encoder_step(cfg, batch, amp)
        runners[label] = step
    times = time_rounds(runners, args.rounds)
    secs = {k: statistics.median(t) for k, t in times.items()}
    rows = [{"system": k, "median_ms": 1e3 * s,
             "vs_torch_autocast": paired_ratio(times, k, "PyTorch autocast-bf16")[0],
             "vs_torch_fp32": paired_ratio(times, k, "PyTorch fp32")[0],
             "first_loss": first_loss.get(k),
             "xla_flags": os.environ.get("XLA_FLAGS", "")} for k, s in secs.items()]
    best = min(("jax fp32", "jaxamp mixed_bfloat16"), key=secs.__getitem__)
    header = (f"{machine()}, torch {torch.__version__} ({torch.get_num_threads()} threads); "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; encoder {cfg}, batch "
              f"{batch_size}, adamw; {args.rounds} alternated rounds. `auto` resolves to "
              f"{auto.compute_dtype.name} here; the fastest jax row is `{best}`.")
    write_outputs("torch", rows, ["system", "median_ms", "vs_torch_autocast", "vs_torch_fp32"],
                  args.out, ("system", "vs_torch_autocast"), header)
    return rows


# --------------------------------------------------------------------------------------------
# Suite 4: GPU throughput, MFU and peak memory
# --------------------------------------------------------------------------------------------

def _gpu_cases(tiny: bool):
    if tiny:
        return {"resnet50": dict(model="resnet50_small", kind="image", batch=4, shape=(8, 8, 3),
                                 kw=dict(stage_sizes=(1, 1), width=8)),
                "bert_large": dict(model="bert_tiny", kind="text", batch=4, seq=16,
                                   kw=dict(depth=1, width=32))}
    return {"resnet50": dict(model="resnet50", kind="image", batch=256, shape=(224, 224, 3),
                             kw={}),
            "bert_large": dict(model="bert_large", kind="text", batch=64, seq=512, kw={})}


GPU_PRECISIONS = {  # label: (policy, default matmul precision)
    "fp32 strict (TF32 off)": ("float32", "highest"),
    "fp32 default (TF32)": ("float32", "default"),
    "mixed_bfloat16": ("mixed_bfloat16", "default"),
    "mixed_float16": ("mixed_float16", "default"),
}


def _gpu_step(case: dict, policy: str):
    from train import models
    model = models.build(case["model"], policy, **case["kw"])
    graphdef, params, model_state = models.split(model)
    tx = jaxamp.mixed_precision(optax.adamw(1e-3), policy)
    b = case["batch"]
    if case["kind"] == "image":
        batch = {"image": jax.random.normal(jax.random.key(1), (b, *case["shape"])),
                 "label": jnp.zeros((b,), jnp.int32)}
        step = jaxamp.make_train_step(models.classification_loss(graphdef), has_aux=True,
                                      has_model_state=True)
    else:
        vocab = models.config_of(case["model"]).vocab
        tokens = jax.random.randint(jax.random.key(1), (b, case["seq"]), 0, vocab)
        batch = {"tokens": tokens, "targets": tokens}
        step = jaxamp.make_train_step(models.mlm_loss(graphdef), has_aux=True)
    state = jaxamp.TrainState.create(params=params, tx=tx, model_state=model_state)
    return step, state, batch


def _torchvision_resnet50(batch: int, steps: int, dtype_name: str) -> float | None:
    """img/s of torchvision's ResNet-50 under PyTorch AMP on CUDA, or None without it."""
    try:
        import torch
        import torchvision
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.zeros(batch, dtype=torch.long, device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def suite_gpu(args) -> list[dict]:
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not args.tiny:
        print(f"## gpu\n\nno GPU here ({dev.platform}): suite skipped. `--tiny` runs it on this "
              "device at a tiny size.\n", flush=True)
        return []
    peak = next((v for k, v in PEAK_FLOPS.items() if k in dev.device_kind), None)
    steps = 3 if args.tiny else args.steps
    rows = []
    for case_name, case in _gpu_cases(args.tiny).items():
        for label, (policy, precision) in GPU_PRECISIONS.items():
            with jax.default_matmul_precision(precision):
                step, state, batch = _gpu_step(case, policy)
                compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
                flops = cost(compiled)["flops"]
                for _ in range(2):  # warm up
                    state, m = compiled(state, batch)
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                for _ in range(steps):
                    state, m = compiled(state, batch)
                jax.block_until_ready((state, m))
                dt = (time.perf_counter() - t0) / steps
            stats = dev.memory_stats() or {}
            rows.append({"model": case_name, "built_as": case["model"], "precision": label,
                         "batch": case["batch"], "step_ms": 1e3 * dt,
                         "per_s": case["batch"] / dt,
                         "unit": "img/s" if case["kind"] == "image" else "seq/s",
                         "tflops": flops / dt / 1e12,
                         "mfu": None if peak is None else flops / dt / peak,
                         "peak_mem_gb": stats.get("peak_bytes_in_use", 0) / 1e9 or None,
                         "loss": float(m["loss"])})
            del state, compiled
    for r in rows:
        strict = next(x for x in rows if x["model"] == r["model"] and "strict" in x["precision"])
        tf32 = next(x for x in rows if x["model"] == r["model"] and "TF32)" in x["precision"])
        r["vs_fp32_strict"] = r["per_s"] / strict["per_s"]
        r["vs_tf32"] = r["per_s"] / tf32["per_s"]
        r["label"] = f"{r['model']} {r['precision'].split(' (')[0]}"
    if not args.tiny:
        for dt_name in ("bfloat16", "float16"):
            ips = _torchvision_resnet50(256, args.steps, dt_name)
            if ips is not None:
                ours = next(r for r in rows if r["model"] == "resnet50"
                            and r["precision"] == f"mixed_{dt_name}")
                rows.append({"model": "resnet50", "built_as": "torchvision",
                             "precision": f"PyTorch AMP {dt_name}", "batch": 256,
                             "per_s": ips, "unit": "img/s",
                             "jaxamp_vs_torch": ours["per_s"] / ips,
                             "label": f"torch AMP {dt_name}"})
    header = (f"{machine()}; {steps} timed steps after 2 warm-up steps; adamw; "
              f"MFU against {peak and f'{peak / 1e12:.0f} TFLOP/s'}")
    write_outputs("gpu", rows, ["model", "precision", "batch", "step_ms", "per_s", "unit",
                                "vs_fp32_strict", "vs_tf32", "tflops", "mfu", "peak_mem_gb",
                                "jaxamp_vs_torch"], args.out, ("label", "per_s"), header)
    return rows


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


def suite_cpu_flags(args) -> list[dict]:
    """The torch suite once per XLA:CPU flag set, each in its own process (XLA reads its flags
    once), with PyTorch autocast as the yardstick inside every process."""
    import subprocess
    import tempfile
    if _skip_without_torch("cpu_flags", args.out):
        return []
    rows: list[dict] = []
    ref_loss: dict[str, float] = {}
    flag_sets = list(CPU_FLAG_SETS.items())[:2] if args.tiny else CPU_FLAG_SETS.items()
    for label, flags in flag_sets:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "train.bench", "torch", "--rounds", str(args.rounds),
                   "--out", tmp] + (["--tiny"] if args.tiny else [])
            env = {**os.environ, "XLA_FLAGS": flags}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            path = os.path.join(tmp, "torch.jsonl")
            if proc.returncode != 0 or not os.path.exists(path):
                rows.append({"flags": label, "error": proc.stderr.strip().splitlines()[-1:]})
                continue
            got = {r["system"]: r for r in map(json.loads, open(path)) if "system" in r}
        for system in ("jax fp32", "jaxamp mixed_bfloat16"):
            r = got[system]
            ref_loss.setdefault(system, r["first_loss"])
            rows.append({"flags": label, "xla_flags": flags, "system": system,
                         "median_ms": r["median_ms"], "vs_torch_autocast": r["vs_torch_autocast"],
                         "torch_autocast_ms": got["PyTorch autocast-bf16"]["median_ms"],
                         "first_loss": r["first_loss"],
                         "loss_vs_default": r["first_loss"] / ref_loss[system] - 1,
                         "label": f"{label} / {system.split()[-1]}"})
    header = (f"{machine()}; one process per flag set, each timing the jax steps alternated with "
              f"PyTorch autocast-bf16 ({args.rounds} rounds); `loss_vs_default`: the first "
              "step's loss against the default flags' (a flag must not change the numerics "
              "beyond rounding).")
    write_outputs("cpu_flags", rows, ["flags", "system", "median_ms", "vs_torch_autocast",
                                      "torch_autocast_ms", "loss_vs_default"], args.out,
                  ("label", "vs_torch_autocast"), header)
    return rows


SUITES = {"overhead": suite_overhead, "memory": suite_memory, "torch": suite_torch,
          "cpu_flags": suite_cpu_flags, "gpu": suite_gpu}


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(prog="python -m train.bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("suite", choices=[*SUITES, "all"])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, for tests)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds (default 30; 2 with --tiny)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per gpu variant")
    ap.add_argument("--out", default="runs/bench", help="folder for JSON lines and charts")
    ap.add_argument("--xla-flags", default=None,
                    help="extra XLA_FLAGS for this run (set before the backend starts)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.tiny else 30
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    names = list(SUITES) if args.suite == "all" else [args.suite]
    return {name: SUITES[name](args) for name in names}


if __name__ == "__main__":
    main(sys.argv[1:])
