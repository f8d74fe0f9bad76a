"""Micro-batch sizes: which ones a job runs, whether its traced graph runs them, what
``data.microbatches: auto`` may choose, and whether an ``infer`` job's outputs join across micro-batches.

A graph traced by ``torch.export`` fixes the batch dimension it saw (a ``view`` to ``[3, 16, 96]``), so
it runs micro-batches of the traced size only; a symbolic trace usually runs any. Both are tried, on
the job's own samples, against the eager model (``trace.reproduces_on``): a size that fails is refused
before the job starts (a fixed count) or left out of the counts ``auto`` chooses among.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fusionnet.dag.ir import IRGraph
from fusionnet.dag.trace import TracedModel, reproduces_on
from fusionnet.errors import JobError
from fusionnet.job.batches import (
    AUTO_MICROBATCHES,
    fallback_microbatches,
    infer_batches,
    microbatch_candidates,
    split_microbatches,
)
from fusionnet.job.loader import LoadedJob
from fusionnet.job.schema import JobSpec, interleaved_count_problem
from fusionnet.runtime.loss_reduction import traced_loss_fn


def traced_count(spec: JobSpec) -> int:
    """The micro-batch count the job is traced (and run, unless ``auto`` chooses another) with."""
    m = spec.data.microbatches
    if m == AUTO_MICROBATCHES:
        return fallback_microbatches(spec.data.batch_size, spec.placement.compnodes, count_multiple(spec))
    return int(m)


def count_multiple(spec: JobSpec) -> int:
    """What a step's micro-batch count must be a multiple of: interleaved-1f1b trains on a multiple of
    its compnodes (``schedules.generators.interleaved_1f1b``); anything else runs any count."""
    interleaved = spec.placement.chunks_per_compnode > 1 and spec.task != "infer"
    return spec.placement.compnodes if interleaved else 1


def with_compnodes(job: LoadedJob, compnodes: int) -> LoadedJob:
    """``job`` with ``placement.compnodes`` set to ``compnodes`` (``run --local N``), so that what depends
    on it (the counts ``auto`` chooses among, interleaved-1f1b's multiple) sees the compnodes that run."""
    placement = job.spec.placement.model_copy(update={"compnodes": compnodes})
    spec = job.spec.model_copy(update={"placement": placement})
    problem = interleaved_count_problem(spec)
    if problem is not None:
        raise JobError(f"data.microbatches: {problem} (--local {compnodes})")
    return dataclasses.replace(job, spec=spec)


def with_microbatches(job: LoadedJob, count: int) -> LoadedJob:
    """``job`` with ``data.microbatches`` set to ``count`` (``auto`` resolved)."""
    data = job.spec.data.model_copy(update={"microbatches": count})
    return dataclasses.replace(job, spec=job.spec.model_copy(update={"data": data}))


def _sizes_of(task: str, n_samples: int, batch_size: int, count: int) -> dict[int, str]:
    batches = [len(idx) for idx in infer_batches(n_samples, batch_size)] if task == "infer" else [batch_size]
    sizes: dict[int, str] = {}
    for i, n in enumerate(batches):
        for part in split_microbatches(n, min(count, n)):
            why = (
                f"the last batch holds the last {n} of the dataset's {n_samples} samples"
                if i and i == len(batches) - 1 and n != batch_size
                else f"data.batch_size {batch_size} in data.microbatches {min(count, n)}"
            )
            sizes.setdefault(part.stop - part.start, why)
    return sizes


def microbatch_sizes(job: LoadedJob) -> dict[int, str]:
    """Every micro-batch size the job runs, each with the first reason it occurs (job file terms)."""
    spec = job.spec
    return _sizes_of(spec.task, job.n_samples, spec.data.batch_size, traced_count(spec))


def check_every_microbatch_size(job: LoadedJob, traced: TracedModel, traced_size: int) -> None:
    """Raises ``JobError`` when the graph traced on micro-batches of ``traced_size`` samples fails or
    differs on another size the job runs: a ``torch.export`` graph fixes the batch dimension, so an
    uneven split (``batch_size: 5`` in 2 micro-batches: 3 and 2) or a short last ``infer`` batch would
    otherwise fail in the middle of the run."""
    for size, why in microbatch_sizes(job).items():
        if size == traced_size:
            continue
        problem = _problem_at(job, traced, size)
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


def _problem_at(job: LoadedJob, traced: TracedModel, size: int) -> str | None:
    idx = torch.arange(size) % job.n_samples  # a batch larger than the dataset repeats samples
    labels = None if job.labels is None else job.labels[idx]
    return reproduces_on(traced, job.model, job.inputs[idx], labels, traced_loss_fn(job))


def runnable_counts(job: LoadedJob, traced: TracedModel) -> list[int]:
    """``data.microbatches: auto``: the candidate counts (``batches.microbatch_candidates``) at every one
    of whose sizes the traced graph reproduces the model; the traced count always among them. A fixed
    count: none (nothing to choose)."""
    spec = job.spec
    if spec.data.microbatches != AUTO_MICROBATCHES:
        return []
    traced_size = traced.graph.traced_samples()
    works: dict[int, bool] = {} if traced_size is None else {traced_size: True}
    counts = []
    for m in microbatch_candidates(spec.data.batch_size, spec.placement.compnodes, count_multiple(spec)):
        sizes = _sizes_of(spec.task, job.n_samples, spec.data.batch_size, m)
        for size in sizes:
            if size not in works:
                works[size] = _problem_at(job, traced, size) is None
        if all(works[size] for size in sizes):
            counts.append(m)
    return sorted(set(counts) | {traced_count(spec)})


def _output_leaves(graph: IRGraph, value: Any) -> list[list[int]]:
    """The shapes of the tensors the model's output holds, in order (``results.assemble``'s leaves)."""
    if isinstance(value, dict):
        if "$node" in value:
            return _meta_leaves(graph.node(value["$node"]).meta)
        return [s for v in value.values() for s in _output_leaves(graph, v)]
    if isinstance(value, list):
        return [s for v in value for s in _output_leaves(graph, v)]
    return []


def _meta_leaves(meta: Any) -> list[list[int]]:
    if isinstance(meta, dict) and "shape" in meta:
        return [list(meta["shape"])]
    if isinstance(meta, dict) and "$seq" in meta:
        return [s for m in meta["$seq"] for s in _meta_leaves(m)]
    return []


def check_outputs_join(job: LoadedJob, traced: TracedModel, rows: int) -> None:
    """An ``infer`` job cut into micro-batches joins their outputs along dimension 0, which equals the
    whole batch's output only where every output tensor holds one row per sample there. A scalar (a
    batch's mean) or a tensor of another leading size (a sum over the batch, a sequence-first layout)
    would come back as one value per micro-batch, not the batch's: refused, naming the output."""
    spec = job.spec
    if spec.task != "infer" or spec.data.microbatches == 1:
        return
    for i, shape in enumerate(_output_leaves(traced.graph, traced.graph.output.args)):
        if not shape or shape[0] != rows:
            name = "outputs" if i == 0 else f"outputs.{i}"
            raise JobError(
                f"data.microbatches: the model's output {name} (shape {shape} on a micro-batch of {rows} "
                "samples) does not hold one row per sample along its first dimension, so the "
                "micro-batches' outputs cannot be joined into the batch's; set data.microbatches: 1"
            )
