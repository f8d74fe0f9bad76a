"""The synthetic models the executor calibration runs (``calibration.py``).

Between them they exercise every op class the performance model prices (views, elementwise ops,
norms, pooling, losses, embeddings, cat, matmuls, convolutions), parameters used as broadcast
variables, first layers whose input needs no gradient, and the optimizers jobs use most (SGD with
and without momentum, Adam, AdamW, RMSprop), in mixes and sizes unlike the examples', so that the
fit learns the machine and not the examples. Each is small: the whole calibration runs in about a
second. Deterministic: weights and data come from seeded generators.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ConvPool(nn.Module):
    """conv -> relu -> max-pool -> conv + skip -> flatten -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(6, 3, 3, padding=1)
        self.head = nn.Linear(3 * 10 * 10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(torch.relu(self.conv1(x)), 3, stride=1, padding=1)
        h = self.conv2(h) + x
        return self.head(h.flatten(1))


class PoolNet(nn.Module):
    """max-pool on the raw input -> conv -> tanh -> 2x2 max-pool -> flatten -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(F.max_pool2d(x, 3, stride=1, padding=1)))
        return self.head(F.max_pool2d(h, 2).flatten(1))


class Inception(nn.Module):
    """An inception-style block: a 1x1 conv and a max-pool side by side, concatenated -> relu -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(3, 2, 1)
        self.head = nn.Linear(5 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.squeeze(x), F.max_pool2d(x, 3, stride=1, padding=1)], dim=1)
        return self.head(torch.relu(h).flatten(1))


class Gated(nn.Module):
    """A gated residual unit with a learned per-feature gain and a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(12, 12)
        self.gate = nn.Linear(12, 12)
        self.gain = nn.Parameter(torch.ones(12))
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.value(x) * torch.sigmoid(self.gate(x)) * self.gain + x
        return self.head(self.norm(torch.cat([h, x - h], dim=1)))


class NormMLP(nn.Module):
    """linear -> layer norm -> gelu -> linear -> tanh -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 48)
        self.norm = nn.LayerNorm(48)
        self.fc2 = nn.Linear(48, 48)
        self.fc3 = nn.Linear(48, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        return self.fc3(torch.tanh(self.fc2(h)))


class Embedder(nn.Module):
    """embedding + position variable -> layer norm -> linear -> relu -> mean -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.position = nn.Parameter(torch.randn(12, 16) * 0.1)
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x) + self.position)
        h = torch.relu(self.fc(h)).mean(dim=1)
        return self.head(h)


class Branches(nn.Module):
    """two linear branches -> cat -> scale by a variable -> softmax -> linear."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(20, 16)
        self.right = nn.Linear(20, 16)
        self.scale = nn.Parameter(torch.ones(32))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.left(x), torch.sigmoid(self.right(x))], dim=1) * self.scale
        return self.head(F.softmax(h, dim=-1))


class Attention(nn.Module):
    """One head of self-attention: qkv projection, scores, softmax, weighted sum, projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(8 * 16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(16, dim=-1)
        scores = F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
        h = self.proj(scores @ v) + x
        return self.head(h.reshape(h.shape[0], -1))


class DeepChain(nn.Module):
    """Six narrow linear + relu layers: many small ops of few classes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


@dataclass(frozen=True)
class CalibrationModel:
    name: str
    build: Callable[[], nn.Module]
    data: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]  # (inputs, labels) of n
    batch_size: int
    microbatches: int
    optimizer: str  # torch.optim class name
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)


def _dense(
    features: int, classes: int
) -> Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]:
    return lambda g, n: (torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def _images(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 10, 10, generator=g), torch.randint(0, 5, (n,), generator=g)


def _small_images(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 2, 12, 12, generator=g), torch.randint(0, 3, (n,), generator=g)


def _rgb8(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _tokens(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 40, (n, 12), generator=g), torch.randint(0, 4, (n,), generator=g)


def _sequences(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


CALIBRATION_MODELS: tuple[CalibrationModel, ...] = (
    CalibrationModel("convpool", ConvPool, _images, 12, 2, "SGD"),
    CalibrationModel("normmlp", NormMLP, _dense(24, 6), 48, 2, "Adam"),
    CalibrationModel("embedder", Embedder, _tokens, 16, 2, "AdamW", {"weight_decay": 0.01}),
    CalibrationModel("branches", Branches, _dense(20, 3), 24, 3, "SGD", {"momentum": 0.9}),
    CalibrationModel("attention", Attention, _sequences, 8, 2, "RMSprop"),
    CalibrationModel("deepchain", DeepChain, _dense(8, 2), 40, 2, "Adam"),
)
