"""``Plan``: the scheduler's answer as data, with the reasons attached (text and dict forms)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fusionnet.errors import PlanError
from fusionnet.perfmodel.memory import MemoryBreakdown, MemoryDemand, fmt_bytes
from fusionnet.perfmodel.placement_cost import AssignmentCost
from fusionnet.perfmodel.timing import latency_eq3, pipelined_eq4
from fusionnet.perfmodel.types import Swarm, Workload


@dataclass(frozen=True)
class StagePlan:
    """One sub-DAG: where it runs and what the performance model predicts for it."""

    index: int  # position in the pipeline
    device: int  # index into Swarm.devices
    device_name: str
    ops: tuple[str, ...]
    fp_seconds: float  # per micro-batch
    bp_seconds: float  # per micro-batch
    update_seconds: float  # per step
    comm_seconds: float  # per micro-batch: activations received + gradients received
    comm_fwd_seconds: float  # per micro-batch: activations received (R_p of eq. (3))
    compute_seconds: float  # per step: m * (fp + bp) + update
    in_bytes: int
    out_bytes: int
    memory: MemoryBreakdown
    demand: MemoryDemand

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "device": self.device,
            "device_name": self.device_name,
            "ops": list(self.ops),
            "fp_seconds": self.fp_seconds,
            "bp_seconds": self.bp_seconds,
            "update_seconds": self.update_seconds,
            "comm_seconds": self.comm_seconds,
            "comm_fwd_seconds": self.comm_fwd_seconds,
            "compute_seconds": self.compute_seconds,
            "in_bytes": self.in_bytes,
            "out_bytes": self.out_bytes,
            "memory": self.memory.to_dict(),
            "demand": self.demand.to_dict(),
        }


@dataclass(frozen=True)
class Plan:
    assignment: Mapping[str, int]  # op name -> device index
    devices_used: tuple[int, ...]  # in pipeline order
    stages: tuple[StagePlan, ...]
    link_seconds: Mapping[tuple[int, int], float]  # busy seconds per step of each directed stage link
    bottleneck: str
    predicted_step_seconds: float  # schedule simulator
    makespan_seconds: float  # problem (2) objective (overlapped form)
    objective: str
    workload: Workload
    candidates_considered: int = 0

    def predicted_subdag_seconds(self, stage: int) -> float:
        """Compute seconds per step of sub-DAG ``stage`` (pipeline position): m*(FP+BP)+Update."""
        if not isinstance(stage, int) or not 0 <= stage < len(self.stages):
            raise PlanError(f"stage {stage!r} is not in this {len(self.stages)}-stage plan")
        return self.stages[stage].compute_seconds

    def latency_eq3(self) -> float:
        """Eq. (3): FP latency of one micro-batch through the pipeline."""
        return latency_eq3([s.fp_seconds for s in self.stages], [s.comm_fwd_seconds for s in self.stages])

    def pipelined_eq4(self, n_batches: int) -> float:
        """Eq. (4): FP time of ``n_batches`` pipelined micro-batches."""
        fwd_comm = [s.comm_fwd_seconds for s in self.stages]
        return pipelined_eq4([s.fp_seconds for s in self.stages], fwd_comm, n_batches)

    def describe(self) -> str:
        w = self.workload
        lines = [
            f"plan: {len(self.stages)} stage(s) on devices {list(self.devices_used)}, task {w.task}, "
            f"{w.microbatches} micro-batch(es), {w.schedule} schedule, objective {self.objective}",
            f"predicted step time {self.predicted_step_seconds:.6g} s (simulated); "
            f"bottleneck {self.bottleneck} at {self.makespan_seconds:.6g} s per step",
            "",
            f"{'stage':>5}  {'device':<22} {'ops':>5} {'fp/mb s':>10} {'bp/mb s':>10} {'update s':>10} "
            f"{'comm/mb s':>10} {'compute/step':>12} {'d_gpu':>11} {'d_cpu':>11} {'d_disk':>11} inflight",
        ]
        for s in self.stages:
            name = f"{s.device}:{s.device_name}"[:22]
            lines.append(
                f"{s.index:>5}  {name:<22} {len(s.ops):>5} {s.fp_seconds:>10.4g} {s.bp_seconds:>10.4g} "
                f"{s.update_seconds:>10.4g} {s.comm_seconds:>10.4g} {s.compute_seconds:>12.4g} "
                f"{fmt_bytes(s.demand.gpu):>11} {fmt_bytes(s.demand.cpu):>11} {fmt_bytes(s.demand.disk):>11} "
                f"{s.memory.inflight:>8}"
            )
        if self.link_seconds:
            lines.append("")
            lines.append(
                "links (busy seconds per step): "
                + ", ".join(f"{a}->{b} {t:.4g}" for (a, b), t in sorted(self.link_seconds.items()))
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "workload": {
                "microbatches": self.workload.microbatches,
                "task": self.workload.task,
                "schedule": self.workload.schedule,
            },
            "devices_used": list(self.devices_used),
            "predicted_step_seconds": self.predicted_step_seconds,
            "makespan_seconds": self.makespan_seconds,
            "bottleneck": self.bottleneck,
            "latency_eq3_seconds": self.latency_eq3(),
            "stages": [s.to_dict() for s in self.stages],
            "links": [
                {"from_stage": a, "to_stage": b, "seconds": t}
                for (a, b), t in sorted(self.link_seconds.items())
            ],
            "assignment": dict(self.assignment),
            "candidates_considered": self.candidates_considered,
        }


def plan_from_cost(
    cost: AssignmentCost, swarm: Swarm, assignment: Mapping[str, int], objective: str, candidates: int = 0
) -> Plan:
    """Packages an evaluated assignment as a ``Plan``."""
    stages = tuple(
        StagePlan(
            index=i,
            device=s.device,
            device_name=swarm.devices[s.device].name,
            ops=s.ops,
            fp_seconds=s.fp,
            bp_seconds=s.bp,
            update_seconds=s.update,
            comm_seconds=s.recv_fwd + s.recv_bwd,
            comm_fwd_seconds=s.recv_fwd,
            compute_seconds=cost.compute_seconds(i),
            in_bytes=s.in_bytes,
            out_bytes=s.out_bytes,
            memory=s.memory,
            demand=s.demand,
        )
        for i, s in enumerate(cost.stages)
    )
    makespan, bottleneck = cost.makespan_and_bottleneck
    return Plan(
        assignment=MappingProxyType(dict(assignment)),
        devices_used=tuple(s.device for s in cost.stages),
        stages=stages,
        link_seconds=MappingProxyType(dict(cost.link_loads)),
        bottleneck=bottleneck,
        predicted_step_seconds=cost.step_seconds,
        makespan_seconds=makespan,
        objective=objective,
        workload=cost.workload,
        candidates_considered=candidates,
    )
