"""Job -> traced IR, initial state and partition: the part that ``plan``, ``run`` and ``submit`` share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fusionnet.dag.partition import Partition, balanced_assignment, build_partition
from fusionnet.dag.trace import TracedModel, reproduces_on, trace_model
from fusionnet.errors import JobError
from fusionnet.job.loader import LoadedJob, infer_batches, split_microbatches
from fusionnet.runtime.batches import iter_steps


@dataclass
class PreparedJob:
    job: LoadedJob
    traced: TracedModel
    partition: Partition

    @property
    def loss_reduction(self) -> str:
        return loss_reduction_of(self.job)


def loss_reduction_of(job: LoadedJob) -> str:
    """How the job's loss reduces over a batch (decides how micro-batch losses are weighted)."""
    loss = job.spec.loss
    return str(loss.kwargs.get("reduction", "mean")) if loss is not None else "mean"


def example_microbatch(job: LoadedJob) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first micro-batch of the first step: what the model is traced (and costed) on."""
    spec = job.spec
    first = next(
        iter_steps(spec.task, job.inputs, job.labels, spec.data.batch_size, spec.data.microbatches, 1)
    )
    mb = first.microbatches[0]
    return mb["inputs"], mb.get("labels")


def trace_job(job: LoadedJob, *, every_size: bool = True) -> TracedModel:
    """The job's IR, traced on its first micro-batch. ``every_size``: also checked on a micro-batch of
    every other size the job runs (``JobError`` naming the keys when it fails there); a deployment,
    which pads every micro-batch to the traced size, does not need that."""
    inputs, labels = example_microbatch(job)
    traced = trace_model(job.model, inputs, labels, job.loss_fn, job.spec.task)
    if every_size:
        check_every_microbatch_size(job, traced, len(inputs))
    return traced


def microbatch_sizes(job: LoadedJob) -> dict[int, str]:
    """Every micro-batch size the job runs, each with the first reason it occurs (job file terms)."""
    spec = job.spec
    b, m = spec.data.batch_size, spec.data.microbatches
    batches = [len(idx) for idx in infer_batches(job.n_samples, b)] if spec.task == "infer" else [b]
    sizes: dict[int, str] = {}
    for i, n in enumerate(batches):
        for part in split_microbatches(n, min(m, n)):
            why = (
                f"the last batch holds the last {n} of the dataset's {job.n_samples} samples"
                if i and i == len(batches) - 1 and n != b
                else f"data.batch_size {b} in data.microbatches {min(m, n)}"
            )
            sizes.setdefault(part.stop - part.start, why)
    return sizes


def check_every_microbatch_size(job: LoadedJob, traced: TracedModel, traced_size: int) -> None:
    """Raises ``JobError`` when the graph traced on micro-batches of ``traced_size`` samples fails or
    differs on another size the job runs: a ``torch.export`` graph fixes the batch dimension, so an
    uneven split (``batch_size: 5`` in 2 micro-batches: 3 and 2) or a short last ``infer`` batch would
    otherwise fail in the middle of the run."""
    for size, why in microbatch_sizes(job).items():
        if size == traced_size:
            continue
        labels = None if job.labels is None else job.labels[:size]
        problem = reproduces_on(traced, job.model, job.inputs[:size], labels, job.loss_fn)
        if problem is None:
            continue
        fix = (
            "make the number of samples a multiple of data.batch_size"
            if why.startswith("the last batch")
            else "make data.batch_size a multiple of data.microbatches"
        )
        key = "data.batch_size" if why.startswith("the last batch") else "data.microbatches"
        raise JobError(
            f"{key}: the model's graph ({traced.graph.frontend}) was traced on micro-batches of "
            f"{traced_size} samples and does not run on {size} ({problem}), which this job needs ({why}): "
            f"{fix}"
        )


def prepare_job(
    job: LoadedJob,
    pieces: int | None = None,
    *,
    traced: TracedModel | None = None,
    assignment: Mapping[str, int] | None = None,
) -> PreparedJob:
    """Traces the job (unless ``traced`` is given) and partitions it into ``pieces`` sub-DAGs
    (default: ``placement.compnodes``) with the given assignment or the default balanced policy."""
    traced = traced or trace_job(job)
    pieces = pieces or job.spec.placement.compnodes
    assignment = assignment or balanced_assignment(traced.graph, pieces)
    return PreparedJob(job=job, traced=traced, partition=build_partition(traced.graph, assignment))
