"""Suite ``cpu_dtypes``: bf16 against fp32 on the host CPU, the measurement behind
``get_policy("auto")`` on CPU.

    python -m benchmarks cpu_dtypes [--rounds 30]

Times matmuls (the encoder's shapes and a square one) and a convolution in each dtype,
interleaved in one process, and prints GFLOP/s and the bf16 / fp32 time ratio. Where PyTorch is
installed, its kernels (oneDNN) are timed alongside on the same shapes, which shows where XLA:CPU
stands against them.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from benchmarks.harness import time_interleaved

ROUNDS = 30
MATMULS = [(2048, 2048, 2048), (2048, 256, 1024), (2048, 1024, 256), (2048, 256, 8192)]
CONV = (32, 56, 56, 64)  # NHWC, 3x3 kernel, 64 output channels
TINY_MATMULS = [(64, 64, 64), (64, 32, 128)]
TINY_CONV = (2, 8, 8, 8)


def _conv_flops(conv) -> int:
    return 2 * conv[0] * conv[1] * conv[2] * 9 * conv[3] * 64


def _jax_ops(dtype, matmuls, conv_shape):
    k1, k2 = jax.random.split(jax.random.key(0))
    matmul = jax.jit(lambda a, b: a @ b)
    ops = {}
    for m, k, n in matmuls:
        a, b = jax.random.normal(k1, (m, k), dtype), jax.random.normal(k2, (k, n), dtype)
        ops[f"matmul {m}x{k}x{n}"] = (lambda a=a, b=b: matmul(a, b), 2 * m * k * n)
    img = jax.random.normal(k1, conv_shape, dtype)
    ker = jax.random.normal(k2, (3, 3, conv_shape[-1], 64), dtype)
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    ops["conv 3x3 " + "x".join(map(str, conv_shape))] = (lambda: conv(img, ker),
                                                         _conv_flops(conv_shape))
    return {name: (lambda f=f: jax.block_until_ready(f()), fl) for name, (f, fl) in ops.items()}


def _torch_ops(dtype_name, matmuls, conv_shape):
    import torch
    dtype = getattr(torch, dtype_name)
    ops = {}
    for m, k, n in matmuls:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        ops[f"matmul {m}x{k}x{n}"] = (lambda a=a, b=b: a @ b, 2 * m * k * n)
    x = torch.randn(conv_shape[0], conv_shape[3], conv_shape[1], conv_shape[2], dtype=dtype)
    w = torch.randn(64, conv_shape[3], 3, 3, dtype=dtype)
    ops["conv 3x3 " + "x".join(map(str, conv_shape))] = (
        lambda: torch.nn.functional.conv2d(x, w, padding=1), _conv_flops(conv_shape))
    return ops


def run(args) -> dict[str, dict[str, float]]:
    """Prints the table; returns GFLOP/s by op and system."""
    shapes = (TINY_MATMULS, TINY_CONV) if args.tiny else (MATMULS, CONV)
    systems = {"jax fp32": _jax_ops(jnp.float32, *shapes),
               "jax bf16": _jax_ops(jnp.bfloat16, *shapes)}
    if importlib.util.find_spec("torch") is not None:
        systems["torch fp32"] = _torch_ops("float32", *shapes)
        systems["torch bf16"] = _torch_ops("bfloat16", *shapes)
    names = list(systems["jax fp32"])
    secs = time_interleaved({(s, n): systems[s][n][0] for n in names for s in systems},
                            args.rounds)
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} interleaved "
          "rounds; GFLOP/s (median)")
    print("| op | " + " | ".join(systems) + " | jax bf16 / fp32 time |")
    print("|---|" + "---:|" * (len(systems) + 1))
    rates = {}
    for name in names:
        rate = rates[name] = {s: systems[s][name][1] / secs[(s, name)] / 1e9 for s in systems}
        print(f"| {name} | " + " | ".join(f"{rate[s]:.0f}" for s in systems)
              + f" | {rate['jax fp32'] / rate['jax bf16']:.2f} |")
    return rates
