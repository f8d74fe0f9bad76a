"""Job -> traced IR, initial state and partition: the part that ``plan``, ``run`` and ``submit`` share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fusionnet.dag.cuts import cut_assignment
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition, balanced_assignment, build_partition
from fusionnet.dag.trace import TracedModel, trace_model
from fusionnet.errors import JobError, PartitionError
from fusionnet.job.loader import LoadedJob
from fusionnet.runtime.batches import iter_steps
from fusionnet.runtime.microbatch_sizes import check_every_microbatch_size, traced_count


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
    first = next(iter_steps(spec.task, job.inputs, job.labels, spec.data.batch_size, traced_count(spec), 1))
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


def prepare_job(
    job: LoadedJob,
    pieces: int | None = None,
    *,
    traced: TracedModel | None = None,
    assignment: Mapping[str, int] | None = None,
) -> PreparedJob:
    """Traces the job (unless ``traced`` is given) and partitions it for ``pieces`` compnodes (default:
    ``placement.compnodes``) with the given assignment or the default balanced policy: one sub-DAG per
    compnode, or ``placement.chunks`` per compnode for interleaved-1f1b (a chain of pieces x chunks)."""
    traced = traced or trace_job(job)
    pieces = (pieces or job.spec.placement.compnodes) * job.spec.placement.chunks_per_compnode
    assignment = assignment or job_assignment(job, traced.graph, pieces)
    return PreparedJob(job=job, traced=traced, partition=build_partition(traced.graph, assignment))


def job_assignment(job: LoadedJob, graph: IRGraph, subdags: int) -> dict[str, int]:
    """``subdags`` pieces of ``graph``: at the job's ``placement.cuts`` when it names them (``JobError``
    when they make another number of pieces, or do not fit the graph), else ``balanced_assignment``."""
    cuts = job.spec.placement.cuts
    if not cuts:
        return balanced_assignment(graph, subdags)
    if len(cuts) + 1 != subdags:
        raise JobError(
            f"placement.cuts: {len(cuts)} cut(s) make {len(cuts) + 1} sub-DAGs, this run asks for {subdags}"
        )
    try:
        return cut_assignment(graph, cuts)
    except PartitionError as e:
        raise JobError(str(e)) from None
