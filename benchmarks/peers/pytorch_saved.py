"""What ``torch.autocast`` saves for the backward pass: the Linen encoder of
``train/models/linen_encoder.py`` written in PyTorch, and the bytes its forward keeps for
``backward()``, counted with ``torch.autograd.graph.saved_tensors_hooks``.

The twin has the Linen model's layers and parameters, one for one: a token embedding, pre-LN
blocks (LayerNorm, multi-head attention with separate query/key/value projections with bias
and an output projection, as ``nn.MultiHeadDotProductAttention`` computes it with the query
scaled first and no mask; residual; LayerNorm, Dense, tanh GELU, Dense; residual), a final
LayerNorm and a head to the vocabulary, with the loss of ``benchmarks.memory._linen_loss`` (the
log-softmax of the fp32 logits at the tokens, averaged). torch is imported only when a twin is
built.

Each saved tensor is counted once per storage (``untyped_storage().data_ptr()``, at the
storage's ``nbytes()``), so views of one buffer and tensors saved by several nodes count once.
A saved tensor is a *parameter* when its storage is a parameter's, or when it is a parameter
seen through casts and views (autocast's cached bf16 copy of a weight, ``weight.t()``); an
*input* when its storage is the tokens'; an *activation* otherwise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

# Autograd nodes that only cast or view their one input: a saved tensor reached from a parameter
# through these alone is (a copy of) the parameter.
_CAST_OR_VIEW = ("ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                 "PermuteBackward0", "ExpandBackward0", "UnsafeViewBackward0",
                 "ReshapeAliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                 "SqueezeBackward1", "AsStridedBackward0", "AliasBackward0")


def linen_encoder_twin(vocab: int, width: int, depth: int, heads: int, mlp: int):
    """``train.models.linen_encoder.Encoder(vocab, width, depth, heads, mlp)`` as a
    ``torch.nn.Module`` returning the logits."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value, self.out = (nn.Linear(width, width)
                                                          for _ in range(4))

        def forward(self, x):
            B, L, _ = x.shape
            q, k, v = (f(x).view(B, L, heads, width // heads)
                       for f in (self.query, self.key, self.value))
            q = q / math.sqrt(width // heads)
            probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k), dim=-1)
            return self.out(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, L, width))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
            self.attention = Attention()
            self.mlp_in, self.mlp_out = nn.Linear(width, mlp), nn.Linear(mlp, width)

        def forward(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x)), approximate="tanh"))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.layers = nn.ModuleList([Block() for _ in range(depth)])
            self.final_norm = nn.LayerNorm(width, eps=1e-6)
            self.head = nn.Linear(width, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.final_norm(x))

    torch.manual_seed(0)
    return Encoder()


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _is_param_copy(t, param_storages: set) -> bool:
    """Whether ``t`` is a parameter seen through casts and views only."""
    node = t.grad_fn
    for _ in range(16):
        if node is None:
            return False
        if type(node).__name__ == "AccumulateGrad":
            return node.variable.untyped_storage().data_ptr() in param_storages
        if type(node).__name__ not in _CAST_OR_VIEW:
            return False
        nexts = [n for n, _ in node.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        node = nexts[0]
    return False


def saved_bytes(model, tokens, amp: bool) -> dict[str, Any]:
    """The bytes one forward and loss of ``model`` on ``tokens`` (an int64 tensor) keep for
    ``backward()``, under ``torch.autocast("cpu", dtype=torch.bfloat16)`` when ``amp``:
    ``{"activations", "params", "inputs"}``, each ``{dtype name: bytes}``."""
    import torch

    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    input_storages = {tokens.untyped_storage().data_ptr()}
    kept: dict[int, tuple[str, str, int]] = {}  # storage -> (kind, dtype, bytes)
    held = []  # every saved tensor stays referenced, so no storage is freed and reused

    def pack(t):
        held.append(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in kept:
            kind = ("params" if ptr in param_storages or _is_param_copy(t, param_storages)
                    else "inputs" if ptr in input_storages else "activations")
            kept[ptr] = (kind, str(t.dtype).removeprefix("torch."), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(tokens)
        logp = torch.log_softmax(logits.float(), dim=-1)
        loss = -logp.gather(-1, tokens[..., None]).mean()
    del loss
    out: dict[str, dict[str, int]] = {k: defaultdict(int) for k in ("activations", "params",
                                                                     "inputs")}
    for kind, dtype, nbytes in kept.values():
        out[kind][dtype] += nbytes
    held.clear()
    return {k: dict(v) for k, v in out.items()}
