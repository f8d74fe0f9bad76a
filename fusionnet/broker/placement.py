"""Which compnodes run a job: the first placement, and the replacement after a failure or a leave.

Pure functions over ``Candidate`` values (peer id, backup flag, speed), so the policy is tested
without a swarm. Rules:

- a first placement uses regular compnodes (the backup pool stands by), the fastest first, up to the
  job's ``placement.compnodes``; backups only when no regular compnode is free;
- after a failure the survivors keep their sub-DAGs; each lost slot goes to the fastest backup, else
  the fastest free regular compnode (the one that best keeps the balance of the plan); when nobody is
  free the job is re-planned over the survivors, with fewer sub-DAGs;
- a join is used at a step boundary when it adds a sub-DAG the job asked for and did not get.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fusionnet.errors import PlanError


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    backup: bool
    speed: float  # effective FLOP/s (peak x fitted factor); 0 when unknown


def _fastest(cands: Iterable[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: (-c.speed, c.peer_id))


def first_placement(candidates: Sequence[Candidate], wanted: int) -> list[str]:
    if not candidates:
        raise PlanError("no ONLINE compnode with a data path is registered with the broker")
    regular = _fastest(c for c in candidates if not c.backup)
    backups = _fastest(c for c in candidates if c.backup)
    chosen = (regular + backups)[: max(1, wanted)]
    return [c.peer_id for c in chosen]


def replacement_placement(
    current: Sequence[str], lost: set[str], candidates: Sequence[Candidate]
) -> tuple[list[str], bool]:
    """The new peer list after losing ``lost`` from ``current``; True when its length is unchanged
    (the old cut can be kept), False when the job must be re-planned over fewer compnodes."""
    in_use = set(current)
    free = [c for c in candidates if c.peer_id not in in_use and c.peer_id not in lost]
    pool = _fastest(c for c in free if c.backup) + _fastest(c for c in free if not c.backup)
    out: list[str] = []
    shrunk = False
    for peer in current:
        if peer not in lost:
            out.append(peer)
        elif pool:
            out.append(pool.pop(0).peer_id)
        else:
            shrunk = True
    if not out:
        raise PlanError(f"every compnode of the job is gone ({len(lost)} lost) and none is free to take over")
    return out, not shrunk


def grown_placement(current: Sequence[str], wanted: int, candidates: Sequence[Candidate]) -> list[str] | None:
    """More compnodes for a job that runs on fewer than it asked for, or None when nobody new is free."""
    if len(current) >= wanted:
        return None
    in_use = set(current)
    free = _fastest(c for c in candidates if c.peer_id not in in_use and not c.backup)
    if not free:
        return None
    return [*current, *(c.peer_id for c in free[: wanted - len(current)])]
