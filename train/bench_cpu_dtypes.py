"""bf16 against fp32 on the host CPU: the measurement behind ``get_policy("auto")`` on CPU.

Times a matmul and a convolution in each dtype, interleaved in one process, and prints the
median times and the bf16 / fp32 ratio.

    python -m train.bench_cpu_dtypes [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp


def _ops(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (2048, 2048), dtype)
    b = jax.random.normal(k2, (2048, 2048), dtype)
    img = jax.random.normal(k1, (32, 56, 56, 64), dtype)
    ker = jax.random.normal(k2, (3, 3, 64, 64), dtype)
    matmul = jax.jit(lambda a, b: a @ b)
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    return {"matmul 2048x2048": (matmul, (a, b)), "conv 3x3 32x56x56x64": (conv, (img, ker))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    ops = {dt: _ops(dt) for dt in (jnp.float32, jnp.bfloat16)}
    times = {(name, dt): [] for dt in ops for name in ops[dt]}
    for dt in ops:
        for fn, xs in ops[dt].values():
            jax.block_until_ready(fn(*xs))
    for _ in range(args.rounds):
        for name in ops[jnp.float32]:
            for dt in ops:
                fn, xs = ops[dt][name]
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*xs))
                times[(name, dt)].append(time.perf_counter() - t0)
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} interleaved "
          "rounds")
    print("| op | fp32 ms | bf16 ms | bf16 / fp32 |")
    print("|---|---:|---:|---:|")
    for name in ops[jnp.float32]:
        f32 = statistics.median(times[(name, jnp.float32)]) * 1e3
        bf16 = statistics.median(times[(name, jnp.bfloat16)]) * 1e3
        print(f"| {name} | {f32:.2f} | {bf16:.2f} | {bf16 / f32:.2f} |")


if __name__ == "__main__":
    main()
