"""``fusionnet run --local N``: the whole job on N virtual compnodes in one process.

Same tracer, partitioner and executor as the swarm; only the channel differs (``LocalHub``). Each
executor runs as its own asyncio task, so FP/BP messages flow exactly as they do between compnodes.

plan.json gets each sub-DAG's measured FP + BP + Update seconds per step (the median over the steps
after the first, which pays for lazy initialisation such as optimizer state) and, when a device is
given (``fusionnet run`` profiles this machine), the performance model's prediction next to it with
the relative error ``(predicted - measured) / measured``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fusionnet.dag.channel import LocalHub
from fusionnet.dag.executor import SubDagExecutor
from fusionnet.dag.hooks import StepReport
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition
from fusionnet.dag.schedule_loop import run_device_step, together
from fusionnet.errors import JobError
from fusionnet.job.loader import LoadedJob
from fusionnet.job.optim import OptimizerFactory, optimizer_factory
from fusionnet.perfmodel.types import DeviceSpec
from fusionnet.planning.optimizers import job_optimizers
from fusionnet.planning.pipeline_schedule import ScheduleChoice, choose_schedule
from fusionnet.planning.planner import IN_PROCESS
from fusionnet.planning.predict import predict_subdags
from fusionnet.results.assemble import RunResult, assemble_result, output_tensors
from fusionnet.results.files import plan_document, write_results
from fusionnet.runtime.batches import StepData, iter_steps
from fusionnet.runtime.microbatch_sizes import runnable_counts, traced_count, with_microbatches
from fusionnet.runtime.prepare import PreparedJob, prepare_job
from fusionnet.schedules import INTERLEAVED, Schedule


class InMemorySwarm:
    """The executors of one prepared job over an in-memory hub, stepped one batch at a time (one process,
    no daemons; ``process_swarm.ProcessSwarm`` is the swarm of real daemon processes)."""

    def __init__(self, prepared: PreparedJob, schedule: str | None = None) -> None:
        """``schedule``: the pipeline schedule to run (default: the job's ``placement.schedule``, with
        ``auto`` settled without a device to price on)."""
        self.prepared = prepared
        chunks = prepared.job.spec.placement.chunks_per_compnode
        if schedule is None:
            spec = prepared.job.spec
            schedule = choose_schedule(
                spec.placement.schedule,
                prepared.traced.graph,
                prepared.partition,
                microbatches=traced_count(spec),
                chunks=chunks,
            ).name
        self.schedule = schedule
        self._start(
            prepared.traced.graph,
            prepared.traced.state,
            prepared.partition,
            task=prepared.job.spec.task,
            make_optimizers=optimizer_factory(prepared.job.spec.task, prepared.job.spec.optimizer),
            loss_reduction=prepared.loss_reduction,
            precision=prepared.job.spec.precision,
            schedule=schedule,
            chunks=chunks if schedule == INTERLEAVED else 1,
        )

    @classmethod
    def from_parts(
        cls,
        graph: IRGraph,
        state: Mapping[str, torch.Tensor],
        partition: Partition,
        *,
        task: str,
        make_optimizers: OptimizerFactory | None,
        loss_reduction: str = "mean",
    ) -> InMemorySwarm:
        """Executors for a traced graph and partition that no job file describes (the executor
        calibration's synthetic models); ``steps()`` needs a job, so such a swarm is fed ``StepData``."""
        swarm = cls.__new__(cls)
        swarm._start(
            graph, state, partition, task=task, make_optimizers=make_optimizers, loss_reduction=loss_reduction
        )
        return swarm

    def _start(
        self,
        graph: IRGraph,
        state: Mapping[str, torch.Tensor],
        partition: Partition,
        *,
        task: str,
        make_optimizers: OptimizerFactory | None,
        loss_reduction: str,
        precision: str = "fp32",
        schedule: str = "gpipe",
        chunks: int = 1,
    ) -> None:
        if len(partition.subdags) % chunks:
            raise JobError(f"{len(partition.subdags)} sub-DAGs do not make compnodes of {chunks} chunks")
        self.chunks = chunks
        self.hub = LocalHub(len(partition.subdags))
        self.executors = [
            SubDagExecutor(
                graph,
                s,
                state,
                self.hub.channel(s.index),
                task=task,
                make_optimizers=make_optimizers,
                loss_reduction=loss_reduction,
                precision=precision,
                subdags=len(partition.subdags),
                schedule=schedule,
                chunks=chunks,
            )
            for s in partition.subdags
        ]

    async def _interleaved_step(self, data: StepData) -> list[StepReport]:
        p = len(self.executors) // self.chunks
        schedule = self.executors[0].schedule_for(len(data.sizes))
        per_device = await asyncio.gather(
            *(_compnode_step(self.executors[d::p], schedule, d, data) for d in range(p))
        )
        reports: list[StepReport] = [None] * len(self.executors)  # type: ignore[list-item]
        for d, rs in enumerate(per_device):
            for c, r in enumerate(rs):
                reports[c * p + d] = r
        return reports

    def steps(self, count: int | None = None) -> Iterator[StepData]:
        """The job's batches (``count`` of them instead of ``steps`` when given), built one at a time as
        they are consumed: a job of millions of steps starts at once and holds one batch."""
        spec, job = self.prepared.job.spec, self.prepared.job
        n = spec.steps if count is None else count
        return iter_steps(spec.task, job.inputs, job.labels, spec.data.batch_size, traced_count(spec), n)

    async def step(self, data: StepData) -> list[StepReport]:
        """Runs one batch on every virtual compnode (one loop per compnode over its sub-DAGs, in the
        schedule's order); reports in sub-DAG order."""
        if self.chunks == 1:
            calls = [
                ex.run_step(data.step, _fields_for(ex, data.microbatches), data.sizes)
                for ex in self.executors
            ]
            reports: list[StepReport] = await together(calls)
        else:
            reports = await self._interleaved_step(data)
        for ex in self.executors:
            self.hub.mailboxes[ex.subdag.index].forget_step(data.step)
        return reports


async def _compnode_step(
    executors: list[SubDagExecutor], schedule: Schedule, device: int, data: StepData
) -> list[StepReport]:
    """One virtual compnode's step: its program over its chunks ``executors`` (chunk c is sub-DAG
    c p + device); each chunk reads the dataset fields its placeholders name."""
    program = [(a, a.chunk) for a in schedule.programs[device]]
    return await run_device_step(executors, program, data.step, data.microbatches, data.sizes)


def run_local(
    job: LoadedJob,
    pieces: int,
    output_dir: Path | None = None,
    *,
    prepared: PreparedJob | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    device: DeviceSpec | None = None,
) -> RunResult:
    """Runs ``job`` on ``pieces`` virtual compnodes; with ``device``, plan.json also gets the
    performance model's prediction for each sub-DAG on that device."""
    prepared = prepared or prepare_job(job, pieces)
    predicted = None
    graph, m = prepared.traced.graph, traced_count(job.spec)
    optimizer = job_optimizers(job, graph) if device is not None else None
    chunks = job.spec.placement.chunks_per_compnode
    choice = choose_schedule(
        job.spec.placement.schedule,
        graph,
        prepared.partition,
        microbatches=m,
        chunks=chunks,
        devices=None if device is None else [device],
        batch_size=job.spec.data.batch_size,
        optimizer=optimizer,
        links=IN_PROCESS,
        microbatch_choices=runnable_counts(job, prepared.traced),
    )
    if choice.microbatches is not None:  # data.microbatches: auto, settled
        m = choice.microbatches
        prepared = replace(prepared, job=with_microbatches(prepared.job, m))
    if device is not None:
        predicted = predict_subdags(
            graph,
            prepared.partition,
            [device],
            microbatches=m,
            optimizer=optimizer,
            pipeline_schedule=choice.name,
            batch_size=job.spec.data.batch_size,
            chunks=chunks if choice.name == INTERLEAVED else 1,
        )
    return asyncio.run(_run(prepared, output_dir, on_step, predicted, device, choice))


def steady_seconds(per_step: list[float]) -> float:
    """A sub-DAG's measured seconds per step: the median after the first (warm-up) step."""
    if not per_step:
        return 0.0
    return statistics.median(per_step[1:] if len(per_step) > 1 else per_step)


async def _run(
    prepared: PreparedJob,
    output_dir: Path | None,
    on_step: Callable[[dict[str, Any]], None] | None,
    predicted: dict[int, float] | None = None,
    device: DeviceSpec | None = None,
    choice: ScheduleChoice | None = None,
) -> RunResult:
    job, graph, partition = prepared.job, prepared.traced.graph, prepared.partition
    spec = job.spec
    swarm = InMemorySwarm(prepared, None if choice is None else choice.name)
    executors = swarm.executors
    metrics: list[dict[str, Any]] = []
    outputs: list[dict[str, torch.Tensor]] = []  # per step: "mb/leaf" tensors, as a compnode sends them
    phases: dict[int, list[tuple[float, float, float]]] = {i: [] for i in range(len(executors))}
    for data in swarm.steps():
        started = time.perf_counter()
        reports = await swarm.step(data)
        seconds = time.perf_counter() - started
        for ex, r in zip(executors, reports):
            phases[ex.subdag.index].append((r.fp_seconds, r.bp_seconds, r.update_seconds))
            if r.outputs:
                outputs.append(output_tensors(r.outputs))
        row: dict[str, Any] = {
            "step": data.step,
            "seconds": seconds,
            "samples": sum(data.sizes),
            "microbatches": len(data.sizes),
        }
        if spec.task != "infer":  # per sub-DAG: the most activation bytes it held at once in the step
            row["activation_peak_bytes"] = [r.activation_peak_bytes for r in reports]
        loss = next((r.loss for r in reports if r.loss is not None), None)
        if loss is not None:
            row["loss"] = loss
        metrics.append(row)
        if on_step:
            on_step(row)
    measured = {i: steady_seconds([sum(p) for p in rows]) for i, rows in phases.items()}
    extra: dict[str, Any] = {"job": spec.name, "task": spec.task, "frontend": graph.frontend}
    extra["schedule"] = (choice or ScheduleChoice(swarm.schedule, "placement.schedule")).to_dict()
    if metrics:  # the programs that ran, one line per compnode (``fusionnet.schedules`` text form)
        extra["schedule"]["text"] = executors[0].schedule_for(metrics[-1]["microbatches"]).text()
    extra["measured_seconds_are"] = "FP+BP+Update seconds per step: median over the steps after the first"
    if device is not None:
        extra["predicted_for"] = {
            "device": device.name,
            "peak_flops": device.peak_flops,
            "speed": device.speed,
        }
    plan = plan_document(partition, predicted=predicted, measured=measured, extra=extra)
    if swarm.chunks > 1:  # interleaved: compnode d holds sub-DAGs d, compnodes + d, ...
        for row in plan["subdags"]:
            row["compnode"] = row["subdag"] % (len(executors) // swarm.chunks)
    if predicted is not None:
        for row in plan["subdags"]:
            want, got = predicted.get(row["subdag"]), measured.get(row["subdag"])
            row["prediction_error"] = (want - got) / got if want is not None and got else None
    result = assemble_result(
        graph,
        spec.task,
        states=[ex.state() for ex in executors],
        initial=job.model.state_dict(),
        grads=[ex.gradients() for ex in executors] if spec.task == "grad" else None,
        outputs=outputs,
        metrics=metrics,
        plan=plan,
    )
    result.measured_seconds, result.phase_seconds, result.predicted_seconds = measured, phases, predicted
    if output_dir is not None:
        write_results(Path(output_dir), result, spec.task)
    return result


def _fields_for(
    ex: SubDagExecutor, microbatches: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """Only the dataset fields this sub-DAG's placeholders read (labels go where the loss is)."""
    wanted = {ex.graph.node(p).target for p in ex.subdag.placeholders}
    return [{k: v for k, v in mb.items() if k in wanted} for mb in microbatches]
