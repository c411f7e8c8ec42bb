"""PyTorch's recipe: ``torch.autocast`` plus ``GradScaler``, on the benchmarks' encoder (CPU) and
on torchvision's ResNet-50 (CUDA). torch is imported only when a recipe is built."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from train.models.encoder import EncoderConfig


def encoder_step(cfg: EncoderConfig, batch: dict, amp: bool,
                 lr: float = 1e-3) -> Callable[[], object]:
    """The encoder of ``train/models/encoder.py`` in PyTorch, trained with AdamW; returns a step
    closure that returns the loss. ``amp``: ``torch.autocast(bfloat16)`` plus ``GradScaler``."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = _torch_encoder(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=amp)
    tokens = torch.from_numpy(np.asarray(batch["tokens"], np.int64))
    targets = torch.from_numpy(np.asarray(batch["targets"], np.int64)).reshape(-1)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def _torch_encoder(cfg: EncoderConfig):
    """``train.models.encoder.forward`` as a ``torch.nn.Module`` (fp32 logits)."""
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

    return Encoder()


def resnet50_step_stats(batch: int, dtype_name: str, *, steps: int, seconds: float,
                        compiled: bool = False, device: str = "cuda", image_size: int = 224,
                        warmup: int = 5) -> dict:
    """torchvision's ResNet-50 trained eagerly (or under ``torch.compile``) with
    ``torch.autocast(dtype)``, ``torch.optim.AdamW``'s defaults and, for float16, ``GradScaler``;
    ``channels_last``, ``cudnn.benchmark = True``.

    Returns ``{"step_ms", "per_s", "steps", "flops", "live_peak_gb", "compile_s", "loss",
    "skipped_steps"}``: ``flops`` per step from ``torch.utils.flop_counter`` (one step, or
    ``None``), ``live_peak_gb`` from ``torch.cuda.max_memory_allocated`` after a reset (CUDA
    only), ``compile_s`` the first step's seconds (``torch.compile``'s compilation, or cuDNN's
    search under ``cudnn.benchmark``), ``skipped_steps`` the steps GradScaler
    skipped (float16; ``None`` for bfloat16, which has no scaler). Raises whatever goes wrong
    (no torchvision, no CUDA, out of memory): the caller reports it.
    """
    import torch
    import torchvision

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    torch.backends.cudnn.benchmark = True
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    sync()
    compile_s = time.perf_counter() - t0
    # The counter's dispatch mode would send a compiled model back to dynamo: eager only.
    flops = None if compiled else _counted_flops(step)
    skipped = 0
    for _ in range(warmup):
        before = scaler.get_scale() if scaler.is_enabled() else None
        t0 = time.perf_counter()
        step()
        sync()
        one = time.perf_counter() - t0
        if before is not None and scaler.get_scale() < before:
            skipped += 1
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    n = max(3, min(steps, int(seconds / max(one, 1e-6))))
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / n
    if scale_before is not None:  # no growth within 2000 steps: each backoff halves the scale
        skipped += round(np.log2(scale_before / scaler.get_scale()))
    return {"step_ms": 1e3 * dt, "per_s": batch / dt, "steps": n, "flops": flops,
            "live_peak_gb": (torch.cuda.max_memory_allocated() / 1e9 if device == "cuda"
                             else None),
            "compile_s": compile_s, "loss": float(loss.detach()), "skipped_steps":
            skipped if scaler.is_enabled() else None}


def _counted_flops(step: Callable[[], object]) -> float | None:
    """FLOPs of one step (forward and backward matmuls and convolutions), or ``None``."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
        counter = FlopCounterMode(display=False)
        with counter:
            step()
        return float(counter.get_total_flops())
    except Exception:  # a torch without the counter, or an op it cannot follow
        return None
