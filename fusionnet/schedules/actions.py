"""A pipeline schedule as data: per-stage lists of actions, with a readable text form.

An action is one compute stretch of one stage: ``F3`` (forward of micro-batch 3), ``B3`` (its whole
backward), ``I3`` / ``W3`` (the backward split into the input-gradient half, which the earlier stages
wait for, and the weight-gradient half, which nobody waits for), or ``U`` (the optimizer update).
Sends and receives are implicit: a stage receives what an action needs just before it (activations
for F, gradients for B/I) and sends what it produced just after it (activations after F, input
gradients after B/I). The text form of a schedule is one line per stage::

    gpipe p=2 m=3
    0: F0 F1 F2 B2 B1 B0 U
    1: F0 F1 F2 B2 B1 B0 U

``Schedule.parse(schedule.text())`` gives the schedule back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("F", "B", "I", "W", "U")
_ACTION = re.compile(r"^([FBIWU])(\d*)$")
_HEADER = re.compile(r"^(\S+)\s+p=(\d+)\s+m=(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # one of KINDS
    mb: int = -1  # micro-batch; -1 for the update

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind {self.kind!r} must be one of {', '.join(KINDS)}")
        if (self.kind == "U") != (self.mb == -1):
            raise ValueError(f"action {self.kind}{self.mb}: only the update U has no micro-batch")
        if self.mb < -1:
            raise ValueError(f"action {self.kind}{self.mb}: micro-batch must be >= 0")

    def __str__(self) -> str:
        return self.kind if self.kind == "U" else f"{self.kind}{self.mb}"

    @classmethod
    def parse(cls, word: str) -> Action:
        found = _ACTION.match(word)
        if found is None:
            raise ValueError(f"schedule action {word!r} must look like F3, B3, I3, W3 or U")
        kind, digits = found.groups()
        if kind == "U":
            if digits:
                raise ValueError(f"schedule action {word!r}: the update U takes no micro-batch")
            return cls("U")
        if not digits:
            raise ValueError(f"schedule action {word!r} needs a micro-batch number")
        return cls(kind, int(digits))


@dataclass(frozen=True)
class Schedule:
    """``programs[s]`` is stage ``s``'s actions in the order it runs them (``microbatches`` per step)."""

    name: str
    microbatches: int
    programs: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return len(self.programs)

    def program(self, stage: int) -> tuple[Action, ...]:
        if not 0 <= stage < self.stages:
            raise ValueError(f"schedule {self.name!r} has stages 0..{self.stages - 1}, not {stage}")
        return self.programs[stage]

    def splits_backward(self) -> bool:
        return any(a.kind in ("I", "W") for prog in self.programs for a in prog)

    def for_task(self, task: str) -> Schedule:
        """The schedule a task runs: ``infer`` only forwards, ``grad`` no update, ``train`` all."""
        if task == "train":
            return self
        keep = ("F",) if task == "infer" else ("F", "B", "I", "W")
        progs = tuple(tuple(a for a in prog if a.kind in keep) for prog in self.programs)
        return Schedule(self.name, self.microbatches, progs)

    def text(self) -> str:
        lines = [f"{self.name} p={self.stages} m={self.microbatches}"]
        lines += [f"{s}: " + " ".join(str(a) for a in prog) for s, prog in enumerate(self.programs)]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    @classmethod
    def parse(cls, text: str) -> Schedule:
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
        if not lines:
            raise ValueError("an empty schedule text")
        head = _HEADER.match(lines[0])
        if head is None:
            raise ValueError(f"schedule header {lines[0]!r} must look like 'NAME p=STAGES m=MICROBATCHES'")
        name, p, m = head.group(1), int(head.group(2)), int(head.group(3))
        if len(lines) - 1 != p:
            raise ValueError(f"schedule {name!r} says p={p} but has {len(lines) - 1} stage lines")
        programs: list[tuple[Action, ...]] = []
        for s, line in enumerate(lines[1:]):
            label, sep, body = line.partition(":")
            if not sep or label.strip() != str(s):
                raise ValueError(f"schedule line {line!r} must start with '{s}:'")
            programs.append(tuple(Action.parse(w) for w in body.split()))
        return cls(name, m, tuple(programs))


def programs_of(rows: Sequence[Sequence[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(r) for r in rows)
