"""A job as the broker received it, and the checks a submission must pass before it is accepted.

``check_submission`` refuses a submission whose parts disagree (state against the IR's parameters and
buffers, the job's cuts against the IR's ops and modules, data against the spec) with a message naming
the part, before anything is planned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fusionnet.dag.cuts import cut_positions
from fusionnet.dag.ir import IRGraph
from fusionnet.errors import JobError, PartitionError
from fusionnet.messages.jobwire import RunSpec


@dataclass
class SubmittedJob:
    job_id: str
    spec: RunSpec
    ir: bytes
    graph: IRGraph
    state: Mapping[str, torch.Tensor]  # once saved: ``TensorFiles`` over submission/state.safetensors
    data: dict[str, torch.Tensor]
    submitter: str


def check_submission(
    graph: IRGraph, state: dict[str, torch.Tensor], data: dict[str, torch.Tensor], spec: RunSpec
) -> None:
    """Refuses a submission whose parts disagree: state vs the IR's parameters, data vs the spec."""
    for table in (graph.params, graph.buffers):
        for k, meta in table.items():
            if k not in state:
                raise JobError(f"submission: state lacks {k!r}, which the IR reads")
            if list(state[k].shape) != list(meta["shape"]):
                raise JobError(
                    f"submission: state {k!r} has shape {list(state[k].shape)}, the IR says {meta['shape']}"
                )
    if spec.cuts:
        try:
            cut_positions(graph, spec.cuts)
        except PartitionError as e:
            raise JobError(f"submission: {e}") from None
    if "inputs" not in data:
        raise JobError("submission: data lacks the 'inputs' tensor")
    needs_labels = any(n.kind == "placeholder" and n.target == "labels" for n in graph.nodes)
    if needs_labels and "labels" not in data:
        raise JobError("submission: data lacks the 'labels' tensor the loss reads")
    for name, t in data.items():
        if t.dim() == 0 or t.shape[0] != spec.n_samples:
            raise JobError(
                f"submission: data {name!r} has {t.shape[0] if t.dim() else 0} samples, "
                f"the spec says {spec.n_samples}"
            )
