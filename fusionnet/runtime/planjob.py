"""``fusionnet plan``: a job file traced and planned for a swarm, nothing run.

The swarm is a nodes file (``perfmodel.nodes``) or ``placement.compnodes`` compnodes like this machine
(``profiling.calibration.local_device_spec``: profiled once, cached) on loopback links. The planning
itself is ``planning.planner.plan_graph``; this module only drives it and shapes its answer (the text
the command prints and plan.json's form).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fusionnet.dag.ir import IRGraph
from fusionnet.job.loader import LoadedJob, load_job
from fusionnet.perfmodel.nodes import load_nodes_file
from fusionnet.perfmodel.types import DeviceSpec, Link, link_between
from fusionnet.planning.auto_interleaved import best_interleaved, interleaving_pays, why_interleaved
from fusionnet.planning.cut_plan import plan_cuts
from fusionnet.planning.optimizers import job_optimizers
from fusionnet.planning.pipeline_schedule import AUTO, ScheduleChoice, choose_schedule
from fusionnet.planning.planner import LOOPBACK, PlannedJob, plan_graph, plan_interleaved, priced_with
from fusionnet.profiling.calibration import local_device_spec
from fusionnet.results.files import plan_document
from fusionnet.runtime.microbatch_sizes import runnable_counts, traced_count, with_microbatches
from fusionnet.runtime.prepare import PreparedJob, job_assignment, prepare_job, trace_job
from fusionnet.schedules import INTERLEAVED, make_schedule


@dataclass
class JobPlan:
    """``plan_job``'s answer: the job partitioned as planned, the plan, its text and its JSON form."""

    prepared: PreparedJob  # with the planned partition
    planned: PlannedJob
    devices: list[DeviceSpec]  # the swarm planned for
    explanation: str
    document: dict[str, Any]  # plan.json form (results.files.plan_document + the plan)


def plan_job(
    job: Any,
    nodes_file: str | Path | None = None,
    *,
    seconds_budget: float = 1.0,
    cache_dir: str | Path | None = None,
) -> JobPlan:
    """``fusionnet plan``: traces ``job`` (a ``LoadedJob`` or a job file path) and plans it for the
    swarm in ``nodes_file`` or, without one, for ``placement.compnodes`` compnodes like this machine
    (profiled once, cached) on loopback links; at the job's ``placement.cuts`` when it names them (then
    only priced). Nothing runs."""
    if not isinstance(job, LoadedJob):
        job = load_job(job)
    spec = job.spec
    if nodes_file is not None:
        swarm = load_nodes_file(nodes_file)  # before tracing: a bad nodes file fails fast
        devices, links, default, cap = list(swarm.devices), dict(swarm.links), swarm.default_link, None
        where = f"the {len(devices)} device(s) of {nodes_file}"
    else:
        local = local_device_spec(seconds_budget=seconds_budget, cache_dir=cache_dir)
        n = spec.placement.compnodes
        devices = [replace(local, name=f"local #{i}") for i in range(n)]
        links, default, cap = {}, LOOPBACK, n
        where = (
            f"{n} compnode(s) like this machine (placement.compnodes; profiled: peak "
            f"{local.peak_flops / 1e9:.3g} GFLOP/s x lambda {local.speed_factor:.3g}, memory bandwidth "
            f"{local.mem_bandwidth / 1e9:.3g} GB/s), loopback links"
        )
    chunks = spec.placement.chunks_per_compnode
    if chunks > 1:
        devices, links, where = _interleaved_devices(devices, links, spec.placement.compnodes, where)
    traced = trace_job(job)
    cuts = spec.placement.cuts
    cut = job_assignment(job, traced.graph, len(cuts) + 1) if cuts else None
    optimizer = job_optimizers(job, traced.graph)
    priced_by = {"batch_size": spec.data.batch_size, "optimizer": optimizer}

    def plan(microbatches: int) -> PlannedJob:
        priced: dict[str, Any] = {
            "microbatches": microbatches,
            "batch_size": spec.data.batch_size,
            "optimizer": optimizer,
            "links": links,
            "default_link": default,
        }
        if chunks > 1:  # interleaved-1f1b: cut evenly (or at the job's cuts), as the broker does
            return plan_interleaved(traced.graph, devices, chunks, assignment=cut, **priced)
        # priced with the job's schedule, as the broker prices its cuts (``auto``: 1f1b's, GPipe's step)
        wanted = spec.placement.schedule
        if cut is not None:
            return plan_cuts(
                traced.graph, devices, cut, pipeline_schedule="1f1b" if wanted == AUTO else wanted, **priced
            )
        return plan_graph(
            traced.graph,
            devices,
            max_devices=cap,
            pipeline_schedule="1f1b" if wanted == AUTO else wanted,
            **priced,
        )

    m = traced_count(spec)
    planned = plan(m)
    prepared = prepare_job(job, len(planned.devices), traced=traced, assignment=planned.assignment)
    used = [devices[d] for d in planned.devices]

    def choose(counts: list[int]) -> ScheduleChoice:
        """The schedule (and with ``counts``, the micro-batch count) the broker would run on this cut."""
        by_index = {
            (i, j): link_between(links, a, b, default or LOOPBACK)
            for i, a in enumerate(planned.devices)
            for j, b in enumerate(planned.devices)
            if a != b
        }
        return choose_schedule(
            spec.placement.schedule,
            traced.graph,
            prepared.partition,
            microbatches=m,
            devices=used,
            links=by_index,
            microbatch_choices=counts,
            chunks=chunks,
            **priced_by,
        )

    counts = runnable_counts(job, traced)
    chosen: dict[str, Any] = {}
    if counts:  # data.microbatches: auto: priced on the cut planned with the traced count, then re-planned
        choice = choose(counts)
        chosen = {"schedule": choice.to_dict()}  # the count and the schedule that run
        if choice.microbatches is not None and choice.microbatches != m:
            job = with_microbatches(job, choice.microbatches)
            planned = plan(choice.microbatches)
            prepared = prepare_job(job, len(planned.devices), traced=traced, assignment=planned.assignment)
            used = [devices[d] for d in planned.devices]
            m = choice.microbatches
    if spec.placement.schedule == AUTO and chunks == 1 and spec.task != "infer" and cut is None:
        interleaved = _interleaved_if_faster(
            traced.graph, prepared, planned, devices, links, default, m, priced_by
        )
        if interleaved is not None:
            planned, choice = interleaved
            prepared = prepare_job(job, len(planned.devices), traced=traced, assignment=planned.assignment)
            used = [devices[d] for d in planned.devices]
            chosen["schedule"] = choice.to_dict()
    if "schedule" not in chosen:  # the schedule that runs on this cut, as the broker chooses it
        chosen["schedule"] = choose([]).to_dict()
    schedule = chosen["schedule"]
    if spec.placement.schedule == AUTO and schedule["name"] != planned.plan.workload.schedule:
        # searched with 1F1B's pricing, run with another: the plan describes what runs
        priced = {"microbatches": m, "links": links, "default_link": default, **priced_by}
        allowed = cap if cut is None else len(planned.devices)  # as ``plan`` above priced it
        planned = priced_with(traced.graph, planned, devices, schedule["name"], max_devices=allowed, **priced)
    # each compnode's program, as ``run --local`` and the broker write it into plan.json
    per_compnode = int(schedule.get("chunks", 1))  # interleaved-1f1b's, which auto may choose
    program = make_schedule(schedule["name"], len(planned.devices), m, spec.task, per_compnode)
    schedule["text"] = program.text()
    step = schedule["predicted_step_seconds"].get(schedule["name"], planned.predicted_step_seconds)
    explanation = (
        f"planned for {where}\n\n{planned.explanation}\n"
        f"schedule: {schedule['name']} ({schedule['why']}), predicted step {step * 1e3:.3f} ms"
    )
    document = plan_document(
        prepared.partition,
        predicted=planned.predicted_seconds,
        extra={
            "job": spec.name,
            "task": spec.task,
            "frontend": traced.graph.frontend,
            "swarm": where,
            "devices": [
                {"subdag": i, "device": d, "name": dev.name, "kind": dev.kind, "speed_flops": dev.speed}
                for i, (d, dev) in enumerate(zip(planned.devices, used))
            ],
            "predicted_step_seconds": step,
            "plan": planned.plan.to_dict(),
            **chosen,
        },
    )
    return JobPlan(prepared, planned, devices, explanation, document)


def _interleaved_if_faster(
    graph: IRGraph,
    prepared: PreparedJob,
    planned: PlannedJob,
    devices: list[DeviceSpec],
    links: dict[tuple[int, int], Link],
    default: Link | None,
    microbatches: int,
    priced_by: dict[str, Any],
) -> tuple[PlannedJob, ScheduleChoice] | None:
    """``auto``: the planned compnodes running interleaved-1f1b, as the broker decides it
    (``placement._interleaved_if_faster``), when the model predicts it clearly faster than the best
    schedule of one sub-DAG per compnode; its plan (devices indexing ``devices``) and the choice."""
    fast = sorted(dict.fromkeys(planned.devices), key=lambda d: -devices[d].speed)
    used = [devices[d] for d in planned.devices]
    link = {(a, b): link_between(links, a, b, default or LOOPBACK) for a in fast for b in fast if a != b}
    among = {(i, j): link[a, b] for i, a in enumerate(fast) for j, b in enumerate(fast) if i != j}
    order = planned.devices
    by_index = {(i, j): link[a, b] for i, a in enumerate(order) for j, b in enumerate(order) if a != b}
    best = choose_schedule(
        AUTO, graph, prepared.partition, microbatches=microbatches, devices=used, links=by_index, **priced_by
    )
    best_step = best.predicted[best.name]
    option = best_interleaved(
        graph, [devices[d] for d in fast], microbatches=microbatches, links=among, **priced_by
    )
    if option is None or not interleaving_pays(best_step, option):
        return None
    chosen = ScheduleChoice(
        INTERLEAVED,
        why_interleaved(option, best.name, best_step),
        {**best.predicted, INTERLEAVED: option.step_seconds},
        chunks=option.chunks,
    )
    return replace(option.planned, devices=[fast[d] for d in option.planned.devices]), chosen


def _interleaved_devices(
    devices: list[DeviceSpec], links: dict[tuple[int, int], Link], compnodes: int, where: str
) -> tuple[list[DeviceSpec], dict[tuple[int, int], Link], str]:
    """interleaved-1f1b runs on the ``compnodes`` fastest devices, fastest first (sub-DAG s on device s
    mod p: the broker orders the fastest compnodes of its pool the same way), their links renumbered."""
    order = sorted(range(len(devices)), key=lambda d: -devices[d].speed)[: max(1, compnodes)]
    new = {d: i for i, d in enumerate(order)}
    kept = {(new[a], new[b]): link for (a, b), link in links.items() if a in new and b in new}
    if len(order) < len(devices):
        where = f"{where}; interleaved-1f1b on the {len(order)} fastest (placement.compnodes)"
    return [devices[d] for d in order], kept, where
