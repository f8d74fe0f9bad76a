"""Job -> traced IR, initial state and partition: the part that ``plan``, ``run`` and ``submit`` share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fusionnet.dag.cuts import cut_assignment
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition, balanced_assignment, build_partition, op_nodes
from fusionnet.dag.trace import ForwardFailed, TracedModel, buffers_kept, eager_result, trace_model
from fusionnet.errors import JobError, PartitionError, TraceError
from fusionnet.job.loader import LoadedJob
from fusionnet.runtime.batches import iter_steps
from fusionnet.runtime.loss_reduction import check_own_loss_combines, loss_reduction_of, traced_loss_fn
from fusionnet.runtime.microbatch_sizes import check_every_microbatch_size, check_outputs_join, traced_count


@dataclass
class PreparedJob:
    job: LoadedJob
    traced: TracedModel
    partition: Partition

    @property
    def loss_reduction(self) -> str:
        return loss_reduction_of(self.job)


def example_microbatch(job: LoadedJob) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first micro-batch of the first step: what the model is traced (and costed) on."""
    spec = job.spec
    first = next(iter_steps(spec.task, job.inputs, job.labels, spec.data.batch_size, traced_count(spec), 1))
    mb = first.microbatches[0]
    return mb["inputs"], mb.get("labels")


def example_shapes(job: LoadedJob) -> str:
    """The first micro-batch's shapes as messages show them: ``inputs (8, 16), labels (8,)``."""
    inputs, labels = example_microbatch(job)
    named = [("inputs", inputs)] + ([("labels", labels)] if labels is not None else [])
    return ", ".join(f"{name} {tuple(t.shape)}" for name, t in named)


def forward_on_example(job: LoadedJob) -> None:
    """Runs the model's eager forward on the first micro-batch exactly as ``trace_job`` will before it
    traces (with its loss and in train mode for train/grad), and nothing else: the load check runs this in
    its child process, so that model code that exits, hangs or crashes on a whole micro-batch ends the
    child, not the command. Raises what ``trace_model``'s eager run raises; buffers are left as they were."""
    inputs, labels = example_microbatch(job)
    with buffers_kept(job.model):
        eager_result(job.model, inputs, labels, traced_loss_fn(job), job.spec.task)


def trace_job(
    job: LoadedJob, *, every_size: bool = True, compnodes_key: str = "placement.compnodes"
) -> TracedModel:
    """The job's IR, traced on its first micro-batch. ``every_size``: also checked on a micro-batch of
    every other size the job runs (``JobError`` naming the keys when it fails there); a deployment,
    which pads every micro-batch to the traced size, does not need that. interleaved-1f1b cuts the
    model into exactly compnodes x chunks sub-DAGs, so that count is checked against the graph here,
    naming ``compnodes_key`` (``--local`` where the command line set the compnodes).

    A model that cannot be traced, or whose forward raises on the micro-batch, is a ``TraceError``
    naming ``model.entrypoint`` (``model.kwargs`` when an embedding is too small for the data)."""
    check_own_loss_combines(job)
    inputs, labels = example_microbatch(job)
    try:
        traced = trace_model(job.model, inputs, labels, traced_loss_fn(job), job.spec.task)
    except ForwardFailed as e:
        raise TraceError(_forward_failure(job, e)) from None
    except TraceError as e:
        raise TraceError(f"model.entrypoint: {job.spec.model.entrypoint}: {e}") from None
    placement = job.spec.placement
    if placement.chunks_per_compnode > 1 and not placement.cuts:
        check_subdags_fit(traced.graph, placement.compnodes, placement.chunks_per_compnode, compnodes_key)
    check_outputs_join(job, traced, len(inputs))
    if every_size:
        check_every_microbatch_size(job, traced, len(inputs))
    return traced


def _forward_failure(job: LoadedJob, failure: ForwardFailed) -> str:
    """The message for a model that raised on its first micro-batch. An index error with integer
    inputs past an embedding's rows is almost always a size in ``model.kwargs`` (``vocab_size``) smaller
    than the data's token ids: then that key is named, with both numbers."""
    entrypoint = job.spec.model.entrypoint
    small = _embedding_too_small(job) if isinstance(failure.cause, IndexError) else None
    if small is None:
        return f"model.entrypoint: {entrypoint}: {failure}"
    name, rows, top = small
    return (
        f"model.kwargs: {failure}; data.inputs ({job.spec.data.path}) holds token ids up to {top}, but "
        f"model.{name} (an nn.Embedding built by {entrypoint}) has only {rows} rows: is a size in "
        "model.kwargs (the vocabulary's) too small for the data?"
    )


def _embedding_too_small(job: LoadedJob) -> tuple[str, int, int] | None:
    """(module path, rows, the data's largest id) of the first embedding the job's integer inputs
    overflow, or None."""
    if job.inputs.is_floating_point() or job.inputs.numel() == 0:
        return None
    top = int(job.inputs.max())
    for name, module in job.model.named_modules():
        if isinstance(module, torch.nn.Embedding) and module.num_embeddings <= top:
            return name, module.num_embeddings, top
    return None


def check_subdags_fit(graph: IRGraph, compnodes: int, chunks: int, key: str) -> None:
    """Every sub-DAG needs at least one op: ``compnodes`` x ``chunks`` sub-DAGs of a graph with fewer
    ops is the job's (or the command line's) mistake, refused naming ``key``; the partitioner's own
    ``PartitionError`` would not say which setting asked for them."""
    ops, subdags = len(op_nodes(graph)), compnodes * chunks
    if subdags <= ops:
        return
    asked = f"{compnodes} compnode(s)" + (f" x placement.chunks {chunks}" if chunks > 1 else "")
    fix = f"use at most {ops // chunks} compnode(s)" if ops >= chunks else f"use at most {ops} chunks"
    raise JobError(
        f"{key}: {asked} make {subdags} sub-DAGs, but the model traces to only {ops} ops and every "
        f"sub-DAG needs at least one: {fix}"
    )


def prepare_job(
    job: LoadedJob,
    pieces: int | None = None,
    *,
    traced: TracedModel | None = None,
    assignment: Mapping[str, int] | None = None,
) -> PreparedJob:
    """Traces the job (unless ``traced`` is given) and partitions it for ``pieces`` compnodes (default:
    ``placement.compnodes``; given, the command line's ``--local N``, which refusals then name) with the
    given assignment or the default balanced policy: one sub-DAG per compnode, or ``placement.chunks``
    per compnode for interleaved-1f1b (a chain of pieces x chunks)."""
    key = "placement.compnodes" if pieces is None else "--local"
    traced = traced or trace_job(job, compnodes_key=key)
    compnodes, chunks = pieces or job.spec.placement.compnodes, job.spec.placement.chunks_per_compnode
    if assignment is None and not job.spec.placement.cuts:
        check_subdags_fit(traced.graph, compnodes, chunks, key)
    assignment = assignment or job_assignment(job, traced.graph, compnodes * chunks)
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
