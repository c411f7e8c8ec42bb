"""bf16 against fp32 on the host CPU: the measurement behind ``get_policy("auto")`` on CPU.

Times matmuls (the encoder's shapes and a square one) and a convolution in each dtype,
interleaved in one process, and prints GFLOP/s and the bf16 / fp32 time ratio. Where PyTorch is
installed, its kernels (oneDNN) are timed alongside on the same shapes, which shows where XLA:CPU
stands against them.

    python -m train.bench_cpu_dtypes [--rounds 30]
"""

from __future__ import annotations

import argparse
import importlib.util

import jax
import jax.numpy as jnp

from train.bench import time_interleaved

MATMULS = [(2048, 2048, 2048), (2048, 256, 1024), (2048, 1024, 256), (2048, 256, 8192)]
CONV = (32, 56, 56, 64)  # NHWC, 3x3 kernel, 64 output channels


def _jax_ops(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    matmul = jax.jit(lambda a, b: a @ b)
    ops = {}
    for m, k, n in MATMULS:
        a, b = jax.random.normal(k1, (m, k), dtype), jax.random.normal(k2, (k, n), dtype)
        ops[f"matmul {m}x{k}x{n}"] = (lambda a=a, b=b: matmul(a, b), 2 * m * k * n)
    img = jax.random.normal(k1, CONV, dtype)
    ker = jax.random.normal(k2, (3, 3, CONV[-1], 64), dtype)
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    flops = 2 * CONV[0] * CONV[1] * CONV[2] * 9 * CONV[3] * 64
    ops["conv 3x3 " + "x".join(map(str, CONV))] = (lambda: conv(img, ker), flops)
    return {name: (lambda f=f: jax.block_until_ready(f()), fl) for name, (f, fl) in ops.items()}


def _torch_ops(dtype_name):
    import torch
    dtype = getattr(torch, dtype_name)
    ops = {}
    for m, k, n in MATMULS:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        ops[f"matmul {m}x{k}x{n}"] = (lambda a=a, b=b: a @ b, 2 * m * k * n)
    x = torch.randn(CONV[0], CONV[3], CONV[1], CONV[2], dtype=dtype)
    w = torch.randn(64, CONV[3], 3, 3, dtype=dtype)
    flops = 2 * CONV[0] * CONV[1] * CONV[2] * 9 * CONV[3] * 64
    ops["conv 3x3 " + "x".join(map(str, CONV))] = (
        lambda: torch.nn.functional.conv2d(x, w, padding=1), flops)
    return ops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    systems = {"jax fp32": _jax_ops(jnp.float32), "jax bf16": _jax_ops(jnp.bfloat16)}
    if importlib.util.find_spec("torch") is not None:
        systems["torch fp32"] = _torch_ops("float32")
        systems["torch bf16"] = _torch_ops("bfloat16")
    names = list(systems["jax fp32"])
    secs = time_interleaved({(s, n): systems[s][n][0] for n in names for s in systems},
                            args.rounds)
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} interleaved "
          "rounds; GFLOP/s (median)")
    print("| op | " + " | ".join(systems) + " | jax bf16 / fp32 time |")
    print("|---|" + "---:|" * (len(systems) + 1))
    for name in names:
        rate = {s: systems[s][name][1] / secs[(s, name)] / 1e9 for s in systems}
        print(f"| {name} | " + " | ".join(f"{rate[s]:.0f}" for s in systems)
              + f" | {rate['jax fp32'] / rate['jax bf16']:.2f} |")


if __name__ == "__main__":
    main()
