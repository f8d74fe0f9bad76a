"""What the placement policy works on and answers: compnodes offered (``Candidate``), the job's shape
(``JobShape``), the answer (``Placement``) and the policies' names. Plain values, shared by
``placement`` and the broker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fusionnet.dag.cuts import cut_assignment
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import op_nodes
from fusionnet.perfmodel.types import DeviceSpec, Link
from fusionnet.planning.auto_interleaved import MIN_GAIN
from fusionnet.planning.pipeline_schedule import AUTO, ScheduleChoice

PeerLinks = Mapping[tuple[str, str], Link]  # measured links by (from, to); others: index_links

SCHEDULER = "performance model"
BALANCED = "balanced"
CUTS = "job's cuts"  # placement.cuts named where the sub-DAGs begin: the policy only picks compnodes


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    backup: bool
    device: DeviceSpec | None  # None: hardware not announced (or unusable for the model)

    @property
    def speed(self) -> float:
        return 0.0 if self.device is None else self.device.speed


@dataclass(frozen=True)
class JobShape:
    """What placement needs to know of a job."""

    graph: IRGraph
    wanted: int  # placement.compnodes
    microbatches: int
    batch_size: int
    optimizer: Mapping[str, str] | None  # parameter key -> optimizer profile (train), else None
    schedule: str = "gpipe"  # placement.schedule (``auto``: settled per placement)
    # data.microbatches auto: the counts to choose among on the placed cut (empty: ``microbatches``)
    microbatch_choices: tuple[int, ...] = ()
    chunks: int = 1  # interleaved-1f1b: sub-DAGs per compnode (cut evenly, sub-DAG s on compnode s mod p)
    # ``auto`` interleaves when predicted this much faster (the broker's ``--interleave-gain``)
    interleave_gain: float = MIN_GAIN
    cuts: tuple[str, ...] = ()  # placement.cuts: where sub-DAGs 1, 2, ... begin (``dag.cuts``); () none

    def cut_assignment(self, subdags: int) -> dict[str, int] | None:
        """The IR assignment at the job's cuts, when it names them for ``subdags`` sub-DAGs (a placement
        over fewer compnodes than the cuts need, after a loss, is cut by the policy instead)."""
        if len(self.cuts) + 1 != subdags or not self.cuts:
            return None
        return cut_assignment(self.graph, self.cuts)

    @property
    def priced(self) -> str:
        """The schedule the search prices cuts with (``auto``: 1f1b, whose step is GPipe's)."""
        return "1f1b" if self.schedule == AUTO else self.schedule

    @property
    def ops(self) -> int:
        return len(op_nodes(self.graph))


@dataclass(frozen=True)
class Placement:
    peers: tuple[str, ...]  # sub-DAG i runs on peers[i]
    assignment: dict[str, int]  # IR node -> sub-DAG
    policy: str  # SCHEDULER, BALANCED or CUTS
    predicted: dict[int, float] | None = None  # sub-DAG -> predicted FP+BP+Update seconds per step
    predicted_step: float | None = None  # predicted seconds per step (schedule simulator)
    schedule: ScheduleChoice | None = None  # the pipeline schedule this placement runs
    # sub-DAG -> (C_p, R_p): predicted FP and activations-received seconds per micro-batch
    stage_timing: dict[int, tuple[float, float]] | None = None

    @property
    def chunks(self) -> int:
        """Sub-DAGs per compnode: > 1 for interleaved-1f1b (named by the job, or chosen by ``auto``)."""
        return 1 if self.schedule is None else self.schedule.chunks

    def describe(self) -> str:
        text = f"{len(self.peers)} sub-DAG(s) by the {self.policy} policy"
        if self.predicted_step is not None:
            text += f", predicted step {self.predicted_step:.4g} s"
        if self.schedule is not None:
            text += f", schedule {self.schedule.name}"
            if self.chunks > 1:
                text += f" ({self.chunks} chunks per compnode)"
        return text


def fastest_first(cands: Sequence[Candidate]) -> list[Candidate]:
    """Fastest first (unknown hardware last); ties by peer id, so every broker orders alike."""
    return sorted(cands, key=lambda c: (-c.speed, c.peer_id))
