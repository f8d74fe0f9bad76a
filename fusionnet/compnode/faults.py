"""Fault injection for recovery tests and benchmarks: a compnode that SIGKILLs itself at a chosen point.

``FUSIONNET_FAULT=<phase>:<k>[:<microbatch>]`` in a compnode's environment makes it die the hard way
(SIGKILL, no goodbye) in ``phase`` of the k-th step (0-based; or the first one after, when that step was
cut short) *this process* runs, whatever job, attempt or absolute step that is: ``fp`` or ``bp`` (at
that micro-batch, default 0), ``update``, or ``sync`` (while the broker collects its state after that
step). Counting per process lets a test arm a backup before anyone knows when it will be brought in.
Unset (the normal case), no hook is added.

FP, BP and Update points fire from an executor hook (``FaultHook``, see ``fusionnet.dag.hooks``) just
before that compute stretch, on the compute thread; ``sync`` fires in the ``collect`` RPC.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

from fusionnet.dag.hooks import ExecutorHook, Phase

log = logging.getLogger("fusionnet.compnode.faults")

ENV = "FUSIONNET_FAULT"
PHASES = ("fp", "bp", "update", "sync")


@dataclass
class FaultPoint:
    phase: str
    k: int
    microbatch: int = 0
    steps_begun: int = 0  # steps this process has started (FP of micro-batch 0)

    @classmethod
    def from_env(cls) -> FaultPoint | None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in PHASES or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"{ENV}={text!r}: expected PHASE:K[:MICROBATCH] with PHASE one of {PHASES}")
        return cls(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0)

    @property
    def current(self) -> int:
        """Index of the step this process is in (or last finished)."""
        return self.steps_begun - 1

    def hit(self, phase: str, microbatch: int = 0) -> None:
        # ">=": a point whose step was cut short by another node's failure still fires on the replay.
        if phase == self.phase and self.current >= self.k and microbatch == self.microbatch:
            log.warning(
                "fault injection: SIGKILL in %s of local step %d, micro-batch %d", phase, self.k, microbatch
            )
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


class FaultHook(ExecutorHook):
    """Counts the steps an executor begins and fires the point before its FP, BP or Update."""

    def __init__(self, point: FaultPoint) -> None:
        self.point = point

    def before(self, phase: Phase, step: int, mb: int) -> None:
        if phase == "fp" and mb == 0:
            self.point.steps_begun += 1
        self.point.hit(phase, mb)


def fault_hooks(point: FaultPoint | None) -> list[ExecutorHook]:
    """The hooks that arm ``point`` (none when fault injection is off)."""
    return [] if point is None else [FaultHook(point)]
