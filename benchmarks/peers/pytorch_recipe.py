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


def resnet50_images_per_second(batch: int, steps: int, dtype_name: str) -> float | None:
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
