"""A pipeline schedule as data: per-stage lists of actions, with a readable text form.

An action is one compute stretch of one stage: ``F3`` (forward of micro-batch 3), ``B3`` (its whole
backward), ``I3`` / ``W3`` (the backward split into the input-gradient half, which the earlier stages
wait for, and the weight-gradient half, which nobody waits for), or ``U`` (the optimizer update).
Sends and receives are implicit: a stage receives what an action needs just before it (activations
for F, gradients for B/I) and sends what it produced just after it (activations after F, input
gradients after B/I). The executor runs a B as I (its gradients then leave) and W, and may run that W
later, never past the stage's next F or its U (``dag.schedule_loop.run_device_step``).
The text form of a schedule is one line per stage::

    gpipe p=2 m=3
    0: F0 F1 F2 B2 B1 B0 U
    1: F0 F1 F2 B2 B1 B0 U

An interleaved schedule (``chunks`` v > 1) gives each stage line to a *device* that holds v sub-DAGs
(virtual stages, Narayanan et al. 2021): device d's chunk c is sub-DAG ``c * p + d``, and an action
names its chunk after a dot (``F3.1``: micro-batch 3 of the device's chunk 1; no dot: chunk 0). Its
``U`` updates every chunk of the device::

    interleaved-1f1b p=2 m=2 v=2
    0: F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1 U
    1: F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1 U

``Schedule.parse(schedule.text())`` gives the schedule back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("F", "B", "I", "W", "U")
_ACTION = re.compile(r"^([FBIWU])(\d*)(?:\.(\d+))?$")
_HEADER = re.compile(r"^(\S+)\s+p=(\d+)\s+m=(\d+)(?:\s+v=(\d+))?$")


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # one of KINDS
    mb: int = -1  # micro-batch; -1 for the update
    chunk: int = 0  # which of the device's sub-DAGs (interleaved schedules); 0 for the update

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if (self.kind == "U") != (self.mb == -1):
            raise ValueError(f"action {self.kind}{self.mb}: only the update U has no micro-batch")
        if self.mb < -1:
            raise ValueError(f"action {self.kind}{self.mb}: micro-batch must be >= 0")
        if self.chunk < 0 or (self.kind == "U" and self.chunk):
            raise ValueError(f"action {self.kind}{self.mb}: chunk {self.chunk} (>= 0; the update U has none)")

    def __str__(self) -> str:
        if self.kind == "U":
            return "U"
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, word: str) -> Action:
        found = _ACTION.fullmatch(word)
        if found is None:
            raise ValueError(f"schedule action {word!r} must look like F3, B3, I3, W3, F3.1 or U")
        kind, digits, chunk = found.groups()
        if kind == "U":
            if digits or chunk:
                raise ValueError(f"schedule action {word!r}: the update U takes no micro-batch or chunk")
            return cls("U")
        if not digits:
            raise ValueError(f"schedule action {word!r} needs a micro-batch number")
        return cls(kind, int(digits), int(chunk or 0))


@dataclass(frozen=True)
class Schedule:
    """``programs[d]`` is device ``d``'s actions in the order it runs them (``microbatches`` per step).
    With ``chunks`` 1 a device is one stage (sub-DAG); with v chunks device d runs sub-DAGs d, p + d, ...,
    (v - 1) p + d, one loop over all of them."""

    name: str
    microbatches: int
    programs: tuple[tuple[Action, ...], ...]
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"schedule {self.name!r}: chunks must be >= 1, got {self.chunks}")
        for d, prog in enumerate(self.programs):
            far = [str(a) for a in prog if a.chunk >= self.chunks]
            if far:
                raise ValueError(
                    f"schedule {self.name!r} device {d}: {far[:3]} name a chunk >= {self.chunks}"
                )

    @property
    def devices(self) -> int:
        return len(self.programs)

    @property
    def stages(self) -> int:
        """The sub-DAGs the schedule runs (devices x chunks)."""
        return len(self.programs) * self.chunks

    def device_of(self, stage: int) -> int:
        return stage % self.devices

    def stage_of(self, device: int, action: Action) -> int:
        return action.chunk * self.devices + device

    def program(self, stage: int) -> tuple[Action, ...]:
        """Stage (sub-DAG) ``stage``'s own actions, in its device's order (the update included)."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"schedule {self.name!r} has stages 0..{self.stages - 1}, not {stage}")
        chunk = stage // self.devices
        return tuple(a for a in self.programs[stage % self.devices] if a.kind == "U" or a.chunk == chunk)

    def splits_backward(self) -> bool:
        return any(a.kind in ("I", "W") for prog in self.programs for a in prog)

    def for_task(self, task: str) -> Schedule:
        """The schedule a task runs: ``infer`` only forwards, ``grad`` no update, ``train`` all."""
        if task == "train":
            return self
        keep = ("F",) if task == "infer" else ("F", "B", "I", "W")
        progs = tuple(tuple(a for a in prog if a.kind in keep) for prog in self.programs)
        return Schedule(self.name, self.microbatches, progs, self.chunks)

    def text(self) -> str:
        v = f" v={self.chunks}" if self.chunks > 1 else ""
        lines = [f"{self.name} p={self.devices} m={self.microbatches}{v}"]
        lines += [f"{s}: " + " ".join(str(a) for a in prog) for s, prog in enumerate(self.programs)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    @classmethod
    def parse(cls, text: str) -> Schedule:
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines:
            raise ValueError("an empty schedule text")
        head = _HEADER.fullmatch(lines[0])
        if head is None:
            raise ValueError(
                f"schedule header {lines[0]!r} must look like 'NAME p=DEVICES m=MICROBATCHES [v=CHUNKS]'"
            )
        name, p, m = head.group(1), int(head.group(2)), int(head.group(3))
        v = int(head.group(4) or 1)
        if len(lines) - 1 != p:
            raise ValueError(f"schedule {name!r} says p={p} but has {len(lines) - 1} stage lines")
        programs: list[tuple[Action, ...]] = []
        for s, line in enumerate(lines[1:]):
            label, sep, body = line.partition(":")
            if not sep or label.strip() != str(s):
                raise ValueError(f"schedule line {line!r} must start with '{s}:'")
            programs.append(tuple(Action.parse(w) for w in body.split()))
        return cls(name, m, tuple(programs), v)


def programs_of(rows: Sequence[Sequence[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(r) for r in rows)
