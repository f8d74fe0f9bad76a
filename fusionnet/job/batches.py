"""Which samples a step uses, and how a batch is cut into micro-batches (interface.md "Semantics").

Pure index arithmetic shared by the reference loop and the distributed runtime, so both see exactly
the same samples in the same order.
"""

from __future__ import annotations

import torch

from fusionnet.errors import JobError


def batch_indices(step: int, batch_size: int, n_samples: int) -> torch.Tensor:
    """Samples ``[step*B, (step+1)*B)`` modulo ``n_samples`` (int64), so batches wrap around the
    dataset and a batch larger than the dataset repeats samples."""
    if step < 0:
        raise JobError(f"steps: step index must be >= 0 (got {step})")
    if batch_size <= 0:
        raise JobError(f"data.batch_size: must be > 0 (got {batch_size})")
    if n_samples <= 0:
        raise JobError(f"data.path: the dataset has no samples (n={n_samples})")
    start = step * batch_size
    return torch.arange(start, start + batch_size, dtype=torch.int64) % n_samples


def infer_batches(n_samples: int, batch_size: int) -> list[torch.Tensor]:
    """Every sample once, in order, in batches of ``batch_size`` (the last may be shorter)."""
    if batch_size <= 0:
        raise JobError(f"data.batch_size: must be > 0 (got {batch_size})")
    if n_samples <= 0:
        raise JobError(f"data.path: the dataset has no samples (n={n_samples})")
    return list(torch.arange(n_samples, dtype=torch.int64).split(batch_size))


def split_microbatches(n: int, microbatches: int) -> list[slice]:
    """``n`` samples -> ``microbatches`` contiguous slices whose sizes differ by at most one (the
    larger ones first), covering ``[0, n)`` in order."""
    if microbatches <= 0:
        raise JobError(f"data.microbatches: must be > 0 (got {microbatches})")
    if microbatches > n:
        raise JobError(
            f"data.microbatches: {microbatches} micro-batches cannot be cut from a batch of {n} sample(s)"
        )
    base, extra = divmod(n, microbatches)
    out, start = [], 0
    for i in range(microbatches):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


AUTO_MICROBATCHES = "auto"
MICROBATCHES_PER_STAGE = 4  # the most micro-batches per pipeline stage ``auto`` considers


def microbatch_candidates(batch_size: int, stages: int, multiple_of: int = 1) -> list[int]:
    """The micro-batch counts ``data.microbatches: auto`` chooses among: the divisors of the batch size up
    to ``MICROBATCHES_PER_STAGE`` per stage, and multiples of ``multiple_of`` (interleaved-1f1b trains on
    a multiple of its compnodes). Divisors only: every micro-batch then has the same size, which a graph
    traced by ``torch.export`` needs, and each count is priced at one size."""
    top = min(batch_size, MICROBATCHES_PER_STAGE * max(stages, multiple_of, 1))
    return [m for m in range(1, top + 1) if batch_size % m == 0 and m % multiple_of == 0]


def fallback_microbatches(batch_size: int, stages: int, multiple_of: int = 1) -> int:
    """``auto`` without a performance model to ask (no device profile): one micro-batch for one stage, else
    the largest candidate up to two per stage, which keeps 1F1B's bubble, (p - 1) / (m + p - 1), near a
    third (the fewest above that where no candidate is that small). Also the size the job is traced with
    before the count is chosen. ``JobError`` when no candidate is a multiple of ``multiple_of``."""
    if stages <= 1 and multiple_of == 1:
        return 1
    counts = microbatch_candidates(batch_size, stages, multiple_of)
    if not counts:
        raise JobError(
            f"data.microbatches: auto finds no divisor of data.batch_size ({batch_size}) that is a multiple "
            f"of {multiple_of}, the compnodes interleaved-1f1b trains on (placement.schedule); make "
            f"data.batch_size a multiple of {multiple_of}"
        )
    few = [m for m in counts if m <= 2 * stages]
    return max(few) if few else min(counts)
