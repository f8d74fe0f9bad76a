"""``placement.schedule: auto`` and interleaved-1f1b: whether cutting the model into p x v sub-DAGs (each
compnode looping over v of them) is predicted to beat the best one-sub-DAG-per-compnode schedule.

The scheduler's search cuts for one sub-DAG per compnode, so interleaving is a second candidate priced
beside it: the model cut evenly into p x v chunks on the same p compnodes (``planner.plan_interleaved``,
the cut the broker runs for ``placement.schedule: interleaved-1f1b``), for each v of ``CHUNK_CHOICES``
that fits in memory, whose schedule runs on the cut (skip edges included) and whose micro-batch count is
a multiple of p. Interleaving shrinks the bubble to about 1/v of 1F1B's but sends v times the frames and
holds more activations on the first compnode, so it is taken only when the simulator, which prices both
with the same links and schedule objects, predicts a step shorter by more than ``MIN_GAIN``: where a
stage's compute is long against a frame's fixed cost, and the bubble is a large share of the step
(few micro-batches per stage). Pure functions of data, as the rest of the planner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import build_partition, op_nodes
from fusionnet.errors import PlanError
from fusionnet.perfmodel.types import DeviceSpec, Link
from fusionnet.planning.pipeline_schedule import check_schedule
from fusionnet.planning.planner import PlannedJob, plan_interleaved
from fusionnet.schedules import INTERLEAVED

CHUNK_CHOICES = (2, 3, 4)  # sub-DAGs per compnode tried; more multiply the frames for ever less bubble
MIN_GAIN = 0.05  # interleaving must be predicted this much faster: its frames and memory cost more


@dataclass(frozen=True)
class InterleavedOption:
    """The fastest interleaved-1f1b cut found: ``chunks`` sub-DAGs per device, planned."""

    chunks: int
    planned: PlannedJob
    tried: dict[int, str]  # chunks -> the predicted step, or why that count was left out

    @property
    def step_seconds(self) -> float:
        return self.planned.predicted_step_seconds


def best_interleaved(
    graph: IRGraph,
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Mapping[tuple[int, int], Link] | None = None,
    chunk_choices: Sequence[int] = CHUNK_CHOICES,
) -> InterleavedOption | None:
    """The interleaved-1f1b cut on ``devices`` (fastest first, sub-DAG s on device s mod p) with the
    shortest predicted step among ``chunk_choices``, or None when none can run: fewer than 2 devices, a
    micro-batch count that is not a multiple of them, too few ops to cut, or no chunk count that fits."""
    p = len(devices)
    if p < 2 or graph.task == "infer" or microbatches % p:
        return None
    ops = len(op_nodes(graph))
    best: tuple[float, int, PlannedJob] | None = None
    tried: dict[int, str] = {}
    for v in chunk_choices:
        if p * v > ops:
            tried[v] = f"{p * v} sub-DAGs for {ops} ops"
            continue
        try:
            planned = plan_interleaved(
                graph,
                devices,
                v,
                microbatches=microbatches,
                batch_size=batch_size,
                optimizer=optimizer,
                links=links,
            )
            check_schedule(
                INTERLEAVED, build_partition(graph, planned.assignment), microbatches, graph.task, v
            )
        except PlanError as e:
            tried[v] = str(e)
            continue
        tried[v] = f"{planned.predicted_step_seconds:.6g} s"
        if best is None or planned.predicted_step_seconds < best[0]:
            best = (planned.predicted_step_seconds, v, planned)
    if best is None:
        return None
    return InterleavedOption(best[1], best[2], tried)


def interleaving_pays(
    best_step: float | None, option: InterleavedOption | None, gain: float | None = None
) -> bool:
    """Whether ``option`` is predicted faster than ``best_step`` (the best one-sub-DAG-per-compnode
    schedule's step) by more than ``gain`` (the broker's ``--interleave-gain``; default ``MIN_GAIN``).
    A gain of -1, the lowest, takes any option there is, however slow: the way to try the schedule on
    compnodes whose measured speeds differ so much that an even cut loses to the planned one by more
    than any margin (a survivor of a failover measured on a loaded machine, say)."""
    if option is None or best_step is None or best_step <= 0:
        return False
    margin = MIN_GAIN if gain is None else gain
    return margin <= -1.0 or option.step_seconds < best_step * (1.0 - margin)


def why_interleaved(
    option: InterleavedOption, best_name: str, best_step: float, gain: float | None = None
) -> str:
    """plan.json's reason for an ``auto`` that chose interleaving."""
    gain = MIN_GAIN if gain is None else gain
    return (
        f"auto: interleaved-1f1b with {option.chunks} chunks per compnode, predicted "
        f"{option.step_seconds:.4g} s a step against {best_step:.4g} s for {best_name} on one sub-DAG per "
        f"compnode (the margin: {gain:.0%}; chunk counts tried: "
        + ", ".join(f"{v}: {t}" for v, t in sorted(option.tried.items()))
        + ")"
    )
