"""The model of ``benchmarks/pipeline_vs_torch.py``: a stack of identical pre-norm MLP blocks.

Every block is ``x + fc2(gelu(fc1(layer_norm(x))))`` (a transformer block without attention), so all
blocks cost the same and a balanced pipeline split falls on block boundaries. The output of the last
block is used directly as logits over ``dim`` classes (no head), which keeps the stages uniform.

The job file references ``build`` (``model.entrypoint: pipeline_model.py:build``); the torch contenders
import this module and cut ``model.blocks`` at the same boundaries as FusionNet's plan.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, hidden) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build(dim: int = 256, hidden: int = 1024, layers: int = 6) -> BlockStack:
    return BlockStack(dim, hidden, layers)


def stage_module(model: BlockStack, first: int, last: int) -> nn.Sequential:
    """Blocks ``first .. last`` (inclusive) of ``model`` as one module (shares the parameters)."""
    return nn.Sequential(*model.blocks[first : last + 1])
