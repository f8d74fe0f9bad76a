"""Fault injection for recovery tests and benchmarks: a compnode that SIGKILLs itself at a chosen point.

``FUSIONNET_FAULT=<phase>:<k>[:<microbatch>]`` in a compnode's environment makes it die the hard way
(SIGKILL, no goodbye) in ``phase`` of the k-th step (0-based; or the first one after, when that step was
cut short) *this process* runs, whatever job, attempt or absolute step that is: ``fp`` or ``bp`` (at
that micro-batch, default 0), ``update``, or ``sync`` (while the broker collects its state after that
step). Counting per compnode lets a test arm a backup before anyone knows when it will be brought in;
a compnode's sandbox workers count into its one count (shared memory) and kill the daemon with
themselves, as a compnode dying would. ``crash`` is the other kind of fault: the job's sandbox
worker, not the compnode, dies of SIGSEGV before the FP of that step, as if an op of the job had
crashed the interpreter (once per compnode). Unset (the normal case), no hook is added.

FP, BP and Update points fire from an executor hook (``FaultHook``, see ``fusionnet.dag.hooks``) just
before that compute stretch, on the compute thread; ``sync`` fires in the ``collect`` RPC.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

from fusionnet.dag.hooks import ExecutorHook, Phase

log = logging.getLogger("fusionnet.compnode.faults")

ENV = "FUSIONNET_FAULT"
PHASES = ("fp", "bp", "update", "sync", "crash")
SPENT = -(1 << 40)  # the count of a point that fired and must not fire again


@dataclass
class FaultPoint:
    phase: str
    k: int
    microbatch: int = 0
    # Steps this compnode has started (FP of micro-batch 0). With sandbox workers it lives in shared
    # memory (``share``): every job's worker counts into the daemon's one count.
    count: Any = field(default_factory=lambda: _Count())
    victim: int | None = None  # the pid that dies (None: this process): a worker kills its daemon

    @classmethod
    def from_env(cls) -> FaultPoint | None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in PHASES or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"{ENV}={text!r}: expected PHASE:K[:MICROBATCH] with PHASE one of {PHASES}")
        return cls(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0)

    def share(self) -> None:
        """The count in shared memory, for the sandbox workers this point is handed to."""
        import multiprocessing

        shared = multiprocessing.RawValue("q", self.count.value)
        self.count = shared

    def for_worker(self) -> FaultPoint:
        """This point as a worker arms it: same count, and the daemon dies, as a compnode would."""
        return FaultPoint(self.phase, self.k, self.microbatch, self.count, victim=os.getpid())

    @property
    def steps_begun(self) -> int:
        return int(self.count.value)

    @steps_begun.setter
    def steps_begun(self, value: int) -> None:
        self.count.value = value

    @property
    def current(self) -> int:
        """Index of the step this process is in (or last finished)."""
        return self.steps_begun - 1

    def hit(self, phase: str, microbatch: int = 0) -> None:
        if self.phase == "crash" and phase == "fp" and self.current >= self.k and microbatch == 0:
            log.warning("fault injection: SIGSEGV of this job's process in local step %d", self.k)
            self.steps_begun = SPENT
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGSEGV)
        # ">=": a point whose step was cut short by another node's failure still fires on the replay.
        if phase == self.phase and self.current >= self.k and microbatch == self.microbatch:
            log.warning(
                "fault injection: SIGKILL in %s of local step %d, micro-batch %d", phase, self.k, microbatch
            )
            logging.shutdown()
            if self.victim is not None:
                os.kill(self.victim, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class _Count:
    """The step count of a point no worker shares."""

    def __init__(self) -> None:
        self.value = 0


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
