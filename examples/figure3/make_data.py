"""Regenerates data.safetensors: 128 small images (3x8x8) in 4 classes.

Class k images carry a brighter blob in quadrant k on top of Gaussian noise, so both the pooled
branch and the Tensor-A branch of the Figure 3 model have something to learn. Deterministic (seeded).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

SAMPLES, CHANNELS, SIZE, CLASSES, SEED = 128, 3, 8, 4, 2024


def make() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    labels = torch.arange(SAMPLES, dtype=torch.int64) % CLASSES
    labels = labels[torch.randperm(SAMPLES, generator=g)]
    inputs = torch.randn(SAMPLES, CHANNELS, SIZE, SIZE, generator=g)
    half = SIZE // 2
    for k in range(CLASSES):
        r, c = divmod(k, 2)
        rows = slice(r * half, (r + 1) * half)
        cols = slice(c * half, (c + 1) * half)
        inputs[labels == k, :, rows, cols] += 0.75
    return {"inputs": inputs.contiguous(), "labels": labels.contiguous()}


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "data.safetensors"
    save_file(make(), str(out))
    out.chmod(0o644)  # safetensors writes 0600; the file is meant to be shared
    print(f"wrote {out} ({SAMPLES} images of {CHANNELS}x{SIZE}x{SIZE}, {CLASSES} classes)")
