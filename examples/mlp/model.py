"""A 3-layer MLP classifier: the smallest example, three parametric ops and two activations."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def build(features: int = 16, hidden: int = 32, classes: int = 4) -> MLP:
    return MLP(features, hidden, classes)
