"""One step of a compnode that holds several sub-DAGs of a job (``placement.schedule: interleaved-1f1b``).

With p compnodes and v chunks the job is cut into p v sub-DAGs and compnode d holds d, p + d, ...,
(v - 1) p + d. The interleaved schedule orders all of them on the compnode as one program
(``fusionnet.schedules``: ``F3.1`` is micro-batch 3 of chunk 1), so one loop runs every chunk's
actions in that order (``dag.schedule_loop.run_device_step``), on the one compute thread; each chunk
keeps its own executor, channel and mailbox, and gets its own report. The broker's step calls come one
per sub-DAG: the first one for a step runs the compnode's step, the others get their own sub-DAG's share
of it (``DeviceSteps``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import torch

from fusionnet.compnode.assignment_intake import JobAssignment
from fusionnet.dag.hooks import StepReport
from fusionnet.dag.schedule_loop import run_device_step
from fusionnet.errors import JobError

KEPT_STEPS = 4  # steps whose reports are kept for the sub-DAGs' calls still to come


def chunks_of(jobs: Mapping[int, JobAssignment]) -> list[JobAssignment]:
    """The compnode's sub-DAGs in chunk order (chunk c is sub-DAG c p + d); ``JobError`` while one of
    them has not been assigned here yet."""
    first = next(iter(jobs.values()))
    chunks = first.spec.chunks
    p = len(first.peers) // chunks
    device = min(jobs) % p
    wanted = [c * p + device for c in range(chunks)]
    missing = [s for s in wanted if s not in jobs]
    if missing or len(jobs) != chunks:
        raise JobError(
            f"job {first.job_id}: this compnode holds sub-DAGs {sorted(jobs)}, its step needs {wanted}"
            + (f" ({missing} not assigned yet)" if missing else "")
        )
    return [jobs[s] for s in wanted]


def merged_data(jobs: list[JobAssignment], step: int) -> list[dict[str, torch.Tensor]]:
    """Per micro-batch, the dataset fields any chunk reads (each executor picks its own placeholders')."""
    merged: list[dict[str, torch.Tensor]] = []
    for job in jobs:
        for i, fields in enumerate(job.step_data(step)):
            if i == len(merged):
                merged.append({})
            merged[i].update(fields)
    return merged


async def run_chunks(jobs: list[JobAssignment], step: int) -> dict[int, StepReport]:
    """One step of the compnode's chunks, in its program's order: sub-DAG -> its report."""
    first = jobs[0]
    sizes = first.spec.microbatch_sizes(step)
    executors = [j.executor for j in jobs]
    schedule = executors[0].schedule_for(len(sizes))
    device = first.index % schedule.devices
    program = [(a, a.chunk) for a in schedule.programs[device]]
    sent = [j.channel.bytes_sent for j in jobs]
    reports = await run_device_step(executors, program, step, merged_data(jobs, step), sizes)
    out: dict[int, StepReport] = {}
    for job, report, before in zip(jobs, reports, sent):
        report.sent_bytes = job.channel.bytes_sent - before
        job.channel.mailbox.forget_step(step)
        job.steps_done.add(step)
        job.last_report = report
        out[job.index] = report
    return out


class DeviceSteps:
    """The compnode's steps, each run once for all its chunks whichever sub-DAG's call comes first."""

    def __init__(self) -> None:
        self._steps: dict[int, asyncio.Future[dict[int, StepReport]]] = {}

    async def report(self, jobs: Mapping[int, JobAssignment], step: int, subdag: int) -> StepReport:
        if subdag not in jobs:
            raise JobError(f"sub-DAG {subdag} is not held by this compnode (it holds {sorted(jobs)})")
        running = self._steps.get(step)
        if running is None:
            running = asyncio.ensure_future(run_chunks(chunks_of(jobs), step))
            self._steps[step] = running
            for old in [s for s in self._steps if s < step - KEPT_STEPS]:
                del self._steps[old]
        reports = await asyncio.shield(running)
        return reports[subdag]

    def forget(self) -> None:
        """After a failed step (dropped in-flight state): the next call runs the step afresh."""
        self._steps.clear()
