"""The cost of jaxamp's machinery over a bare bf16 step, on a BERT-style encoder.

Variants, all with adamw and buffer donation, timed interleaved (A B C A B C ...) in one process:

* ``fp32``: fp32 params and compute;
* ``bare_bf16``: fp32 params cast to bf16 inside the loss, fp32 grads, no scaling, no skip;
* ``jaxamp_mixed_bf16``: ``jaxamp.make_train_step`` with ``mixed_bfloat16``, fp32 master weights in
  the optimizer state and a ``DynamicLossScale`` (unscale, finite check, skip, scale update).

Prints the median step time, ratios, and XLA ``cost_analysis()`` flops and bytes accessed.

    python -m train.bench_overhead [--rounds 30] [--batch 16] [--depth 4] [--width 256]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jaxamp
from train import encoder


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes": float(cost.get("bytes accessed", 0.0))}


def build_variants(cfg: encoder.EncoderConfig, batch_size: int, lr: float = 1e-3):
    key = jax.random.key(0)
    params = encoder.init_params(key, cfg)
    batch = encoder.synthetic_batch(jax.random.key(1), batch_size, cfg)
    loss = functools.partial(encoder.loss_fn, cfg=cfg)
    tx = optax.adamw(lr)
    variants = {}

    def plain_step(cast_dtype):
        def step(state, batch):
            params, opt_state = state
            def f(p):
                return loss(jax.tree.map(lambda x: x.astype(cast_dtype), p), batch)
            value, grads = jax.value_and_grad(f)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value
        return step

    def fresh_params():  # a new copy each time: the steps donate their state
        return jax.tree.map(jnp.copy, params)

    def fresh_plain():
        p = fresh_params()
        return (p, tx.init(p))

    variants["fp32"] = (plain_step(jnp.float32), fresh_plain)
    variants["bare_bf16"] = (plain_step(jnp.bfloat16), fresh_plain)

    amp_tx = jaxamp.mixed_precision(tx, "mixed_bfloat16", loss_scale=jaxamp.DynamicLossScale())
    amp_step = jaxamp.make_train_step(loss)

    def fresh_amp():
        return jaxamp.TrainState.create(params=fresh_params(), tx=amp_tx)

    variants["jaxamp_mixed_bf16"] = (amp_step, fresh_amp)
    return variants, batch


def run(rounds: int, batch_size: int, cfg: encoder.EncoderConfig) -> list[dict]:
    variants, batch = build_variants(cfg, batch_size)
    compiled, states, cost = {}, {}, {}
    for name, (step, fresh) in variants.items():
        state = fresh()
        jitted = jax.jit(step, donate_argnums=0)
        c = jitted.lower(state, batch).compile()
        compiled[name], cost[name] = c, _cost(c)
        state, _ = c(fresh(), batch)  # warm up
        jax.block_until_ready(state)
        states[name] = state
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            t0 = time.perf_counter()
            states[name], out = compiled[name](states[name], batch)
            jax.block_until_ready((states[name], out))
            times[name].append(time.perf_counter() - t0)
    rows = []
    base = {k: statistics.median(v) for k, v in times.items()}
    for name in variants:
        rows.append({
            "variant": name,
            "median_ms": 1e3 * base[name],
            "time_vs_bare_bf16": base[name] / base["bare_bf16"],
            "time_vs_fp32": base[name] / base["fp32"],
            "gflops": cost[name]["flops"] / 1e9,
            "gbytes_accessed": cost[name]["bytes"] / 1e9,
            "bytes_vs_bare_bf16": cost[name]["bytes"] / cost["bare_bf16"]["bytes"],
            "flops_vs_bare_bf16": cost[name]["flops"] / cost["bare_bf16"]["flops"],
        })
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args(argv)
    cfg = encoder.EncoderConfig(vocab=args.vocab, width=args.width, depth=args.depth,
                                heads=max(1, args.width // 64), mlp=4 * args.width,
                                seq_len=args.seq_len)
    rows = run(args.rounds, args.batch, cfg)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"# {cfg}, batch {args.batch}, {args.rounds} interleaved rounds; "
          f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{jax.devices()[0].device_kind}")
    print("| variant | median ms/step | time / bare bf16 | time / fp32 | GFLOP | GB accessed "
          "| bytes / bare bf16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_ms']:.1f} | {r['time_vs_bare_bf16']:.3f} | "
              f"{r['time_vs_fp32']:.3f} | {r['gflops']:.2f} | {r['gbytes_accessed']:.3f} | "
              f"{r['bytes_vs_bare_bf16']:.4f} |")


if __name__ == "__main__":
    main()
