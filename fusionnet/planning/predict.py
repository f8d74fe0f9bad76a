"""Predictions for a partition that is already chosen: per sub-DAG FP + BP + Update seconds and the
step time, as the planner would have priced them (``fusionnet run --local``'s predicted-vs-measured,
the broker's balanced policy, the elastic-join rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition
from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import DeviceSpec, Workload
from fusionnet.planning.costgraph import cost_graph, micro_batch_scale
from fusionnet.planning.planner import IN_PROCESS, Links, make_swarm, stage_timing
from fusionnet.planning.scheduler import plan_for_assignment


def predict_subdags(
    graph: IRGraph,
    partition: Partition,
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    optimizer: str | Mapping[str, str] | None = None,
    links: Links = IN_PROCESS,
    pipeline_schedule: str = "gpipe",
    batch_size: int | None = None,
    chunks: int = 1,
) -> dict[int, float]:
    """Predicted FP + BP + Update seconds per step of each sub-DAG of ``partition``, sub-DAG ``i`` on
    ``devices[i]`` (one device for all when a single one is given). ``batch_size``: the costs of the
    traced micro-batch are rescaled to ``batch_size / microbatches`` samples (a count other than the
    traced one, ``data.microbatches: auto``); ``chunks``: sub-DAGs per device (interleaved-1f1b)."""
    k = len(partition.subdags)
    devs = list(devices) * k if len(devices) == 1 else list(devices)
    if len(devs) != k:
        raise PlanError(f"need one device per sub-DAG: {k} sub-DAGs, {len(devices)} devices")
    scale = micro_batch_scale(graph, batch_size, microbatches)
    cg = cost_graph(graph, optimizer, scale=scale, microbatches=microbatches)
    plan = plan_for_assignment(
        cg,
        make_swarm(devs, links, None),
        Workload(microbatches, graph.task, pipeline_schedule, chunks),
        {op.name: partition.assignment[op.name] for op in cg.ops},
        check_memory=False,
    )
    return {s.device: s.compute_seconds for s in plan.stages}


@dataclass(frozen=True)
class AssignmentPrediction:
    per_subdag: dict[int, float]  # sub-DAG -> predicted FP + BP + Update seconds per step
    step_seconds: float  # the schedule simulator's step
    stage_timing: dict[int, tuple[float, float]]  # sub-DAG -> (C_p, R_p) per micro-batch


def predict_assignment(
    graph: IRGraph,
    assignment: Mapping[str, int],
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Links = None,
    pipeline_schedule: str = "gpipe",
    chunks: int = 1,
) -> AssignmentPrediction:
    """The predictions for an IR assignment whose sub-DAG ``i`` runs on ``devices[i]``."""
    cg = cost_graph(
        graph, optimizer, scale=micro_batch_scale(graph, batch_size, microbatches), microbatches=microbatches
    )
    plan = plan_for_assignment(
        cg,
        make_swarm(devices, links, None),
        Workload(microbatches, graph.task, pipeline_schedule, chunks),
        {op.name: assignment[op.name] for op in cg.ops},
        check_memory=False,
    )
    return AssignmentPrediction(
        per_subdag={s.device: s.compute_seconds for s in plan.stages},
        step_seconds=plan.predicted_step_seconds,
        stage_timing={s.device: stage_timing(s) for s in plan.stages},
    )
