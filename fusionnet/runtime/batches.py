"""Which samples each step uses and how they are cut into micro-batches (interface.md semantics)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fusionnet.job.loader import batch_indices, infer_batches, split_microbatches


@dataclass(frozen=True)
class StepData:
    step: int
    microbatches: list[dict[str, torch.Tensor]]  # dataset field -> tensor, per micro-batch
    sizes: list[int]


def iter_steps(
    task: str,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    batch_size: int,
    microbatches: int,
    steps: int,
) -> Iterator[StepData]:
    """Train/grad: ``steps`` batches of ``batch_size`` (wrapping around the dataset); infer: every
    sample once in order. Each batch is split into contiguous micro-batches."""
    n = inputs.shape[0]
    batches = (
        infer_batches(n, batch_size)
        if task == "infer"
        else (batch_indices(s, batch_size, n) for s in range(steps))
    )
    for step, idx in enumerate(batches):
        chunks = split_microbatches(len(idx), min(microbatches, len(idx)))
        mbs = []
        for sl in chunks:
            sel = idx[sl]
            fields = {"inputs": inputs[sel]}
            if labels is not None:
                fields["labels"] = labels[sel]
            mbs.append(fields)
        yield StepData(step=step, microbatches=mbs, sizes=[len(idx[sl]) for sl in chunks])
