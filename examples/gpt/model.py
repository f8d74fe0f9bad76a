"""A small character-level GPT written with plain tensor ops.

Why plain ops: every step of attention is then its own DAG node (``q @ k^T``, ``masked_fill`` with
the causal mask, ``softmax``, ``@ v``) that the partitioner can place anywhere, and the model traces
with both ``torch.fx.symbolic_trace`` (no leaf modules) and ``torch.export``. No Python control flow
depends on tensor values, and shapes are read with ``size(i)`` (never unpacked), which fx can follow.

The input and output embeddings are tied: the LM head is ``F.linear(x, self.wte.weight)``, so one
parameter feeds two ops far apart in the graph and its gradient is the sum of both uses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, block_size: int) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # True above the diagonal: position t must not see positions after t.
        future = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", future.view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        q, k, v = self.qkv(x).split(self.n_head * self.head_dim, dim=2)
        # (batch, time, d_model) -> (batch, head, time, head_dim)
        q = q.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        k = k.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        v = v.unflatten(2, (self.n_head, self.head_dim)).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # narrow, not [..., :t, :t]: fx cannot put a traced size inside a Python slice of a buffer.
        mask = self.causal_mask.narrow(2, 0, t).narrow(3, 0, t)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).flatten(2)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, block_size)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, d_model: int, n_head: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, time, vocab)``, or the mean next-token cross-entropy when ``targets`` is
        given (the job file then has no ``loss:``)."""
        t = idx.size(1)
        x = self.wte(idx) + self.wpe.weight.narrow(0, 0, t)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied with the input embedding
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(vocab_size: int, block_size: int = 32, n_layer: int = 2, d_model: int = 64, n_head: int = 4) -> GPT:
    return GPT(vocab_size, block_size, n_layer, d_model, n_head)
