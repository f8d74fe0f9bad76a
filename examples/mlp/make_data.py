"""Regenerates data.safetensors: 256 samples x 16 features, 4 classes from a fixed random teacher.

The labels come from a random 2-layer network, so the task is learnable but not linearly trivial.
Deterministic: the same bytes on every run (seeded generator, safetensors sorts its keys).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

SAMPLES, FEATURES, CLASSES, SEED = 256, 16, 4, 1234


def make() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(SAMPLES, FEATURES, generator=g)
    w1 = torch.randn(FEATURES, 24, generator=g)
    w2 = torch.randn(24, CLASSES, generator=g)
    labels = (torch.tanh(inputs @ w1) @ w2).argmax(dim=1)
    return {"inputs": inputs.contiguous(), "labels": labels.to(torch.int64).contiguous()}


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "data.safetensors"
    tensors = make()
    save_file(tensors, str(out))
    out.chmod(0o644)  # safetensors writes 0600; the file is meant to be shared
    counts = torch.bincount(tensors["labels"], minlength=CLASSES).tolist()
    print(f"wrote {out} ({SAMPLES} samples, class counts {counts})")
