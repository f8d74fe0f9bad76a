"""The FusionAI paper's Figure 3 / Table 2 DAG, op for op.

    Input ──► Conv ──► Add ──► Pool ─────────────┐
      └───────────────► ▲ └──► Multiply ──► Concat ──► (flatten) ──► Linear ──► CrossEntropy ◄── Label
                  Tensor A ───────► ▲

- Input has two users, Conv and Add (the skip connection);
- Tensor A is a *variable*: a trainable ``nn.Parameter`` directly on the root module, owned by no
  layer, multiplied with Add's output;
- Pool keeps the 8x8 size (3x3 window, stride 1, padding 1) so that Concat can join Multiply and Pool
  along the channel dimension, in Table 2's argument order (Multiply, Pool);
- Linear needs a flat vector, hence the one ``flatten`` between Concat and Linear that the paper's
  figure leaves implicit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Figure3(nn.Module):
    def __init__(self, channels: int = 3, size: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.A = nn.Parameter(torch.randn(channels, size, size) * 0.5)  # Tensor A, a variable
        self.linear = nn.Linear(2 * channels * size * size, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        add = self.conv(x) + x
        pool = F.max_pool2d(add, kernel_size=3, stride=1, padding=1)
        multiply = self.A * add
        concat = torch.cat([multiply, pool], dim=1)
        return self.linear(concat.flatten(1))


def build(channels: int = 3, size: int = 8, classes: int = 4) -> Figure3:
    return Figure3(channels, size, classes)
