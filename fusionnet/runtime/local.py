"""``fusionnet run --local N``: the whole job on N virtual compnodes in one process.

Same tracer, partitioner and executor as the swarm; only the channel differs (``LocalHub``). Each
executor runs as its own asyncio task, so FP/BP messages flow exactly as they do between compnodes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusionnet.dag.channel import LocalHub
from fusionnet.dag.executor import StepReport, SubDagExecutor
from fusionnet.job.loader import LoadedJob
from fusionnet.job.optim import build_optimizers, resolve_param_optimizers
from fusionnet.runtime.batches import iter_steps
from fusionnet.runtime.prepare import PreparedJob, prepare_job
from fusionnet.runtime.results import assemble_state, plan_document, write_json, write_metrics, write_tensors


@dataclass
class RunResult:
    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor] | None
    outputs: torch.Tensor | None
    metrics: list[dict[str, Any]]
    plan: dict[str, Any]
    measured_seconds: dict[int, float] = field(default_factory=dict)


def optimizer_factory(
    job: LoadedJob,
) -> Callable[[Mapping[str, torch.nn.Parameter]], list[torch.optim.Optimizer]] | None:
    if job.spec.task != "train" or job.spec.optimizer is None:
        return None
    spec = job.spec.optimizer

    def make(named: Mapping[str, torch.nn.Parameter]) -> list[torch.optim.Optimizer]:
        return build_optimizers(named, resolve_param_optimizers(spec, list(named)))

    return make


def run_local(
    job: LoadedJob,
    pieces: int,
    output_dir: Path | None = None,
    *,
    prepared: PreparedJob | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    prepared = prepared or prepare_job(job, pieces)
    return asyncio.run(_run(prepared, output_dir, on_step))


async def _run(
    prepared: PreparedJob, output_dir: Path | None, on_step: Callable[[dict[str, Any]], None] | None
) -> RunResult:
    job, graph, partition = prepared.job, prepared.traced.graph, prepared.partition
    spec = job.spec
    hub = LocalHub(len(partition.subdags))
    make_optimizers = optimizer_factory(job)
    executors = [
        SubDagExecutor(
            graph,
            s,
            prepared.traced.state,
            hub.channel(s.index),
            task=spec.task,
            make_optimizers=make_optimizers,
            loss_reduction=prepared.loss_reduction,
        )
        for s in partition.subdags
    ]
    metrics: list[dict[str, Any]] = []
    outputs: list[Any] = []
    busy = dict.fromkeys(range(len(executors)), 0.0)
    steps = 0
    for data in iter_steps(
        spec.task, job.inputs, job.labels, spec.data.batch_size, spec.data.microbatches, spec.steps
    ):
        started = time.perf_counter()
        reports: list[StepReport] = await asyncio.gather(
            *(ex.run_step(data.step, _fields_for(ex, data.microbatches), data.sizes) for ex in executors)
        )
        seconds = time.perf_counter() - started
        for ex, r in zip(executors, reports):
            busy[ex.subdag.index] += r.fp_seconds + r.bp_seconds + r.update_seconds
            outputs.extend(r.outputs)
            hub.mailboxes[ex.subdag.index].forget_step(data.step)
        row: dict[str, Any] = {"step": data.step, "seconds": seconds, "samples": sum(data.sizes)}
        loss = next((r.loss for r in reports if r.loss is not None), None)
        if loss is not None:
            row["loss"] = loss
        metrics.append(row)
        steps += 1
        if on_step:
            on_step(row)
    measured = {i: t / max(steps, 1) for i, t in busy.items()}
    weights = assemble_state(
        graph.state_keys, [ex.state() for ex in executors], job.model.state_dict(), graph.aliases
    )
    grads = None
    if spec.task == "grad":
        grads = assemble_state(graph.state_keys, [ex.gradients() for ex in executors], None, graph.aliases)
    out_tensor = torch.cat([o for o in outputs], dim=0) if spec.task == "infer" and outputs else None
    plan = plan_document(
        partition, measured=measured, extra={"job": spec.name, "task": spec.task, "frontend": graph.frontend}
    )
    result = RunResult(
        weights=weights,
        grads=grads,
        outputs=out_tensor,
        metrics=metrics,
        plan=plan,
        measured_seconds=measured,
    )
    if output_dir is not None:
        write_results(Path(output_dir), result, spec.task)
    return result


def _fields_for(
    ex: SubDagExecutor, microbatches: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """Only the dataset fields this sub-DAG's placeholders read (labels go where the loss is)."""
    wanted = {ex.graph.node(p).target for p in ex.subdag.placeholders}
    return [{k: v for k, v in mb.items() if k in wanted} for mb in microbatches]


def write_results(output_dir: Path, result: RunResult, task: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    if task in ("train", "grad"):
        write_tensors(output_dir / "weights.safetensors", result.weights)
    if task == "grad" and result.grads is not None:
        write_tensors(output_dir / "grads.safetensors", result.grads)
    if task == "infer" and result.outputs is not None:
        write_tensors(output_dir / "outputs.safetensors", {"outputs": result.outputs})
    write_metrics(output_dir / "metrics.jsonl", result.metrics)
    write_json(output_dir / "plan.json", result.plan)
