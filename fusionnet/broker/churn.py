"""How often compnodes fail, as this broker has seen it, and how far apart failover rounds should be.

Replication rounds (``broker.replicas``) trade two costs: a round takes the cores and links from the
steps it spans (its cost ``C``), and a failure replays the steps since the newest complete round (half
the spacing ``T`` on average). Per second of the job that is ``C / T + T / (2 M)`` for a job whose
compnodes fail once every ``M`` seconds between them, least at Young's interval ``T = sqrt(2 C M)``
(J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 1974). Spacing
rounds by a fixed share of the time instead (``REPLICA_TIME_SHARE``: ``T = 10 C``) paid 10 % of every
step on a realistic model (``benchmarks/pipeline_vs_torch.py``) for replays that, at one failure an
hour, cost a hundredth of that.

``ChurnBook`` estimates ``M`` from the registry's events: unplanned losses (a compnode turning
unreachable) over the compnode-seconds it watched, with a prior of one loss per ``prior_mtbf`` seconds
of one compnode (so a broker that has watched little assumes the prior, and one that has watched many
compnodes for hours without a loss spaces rounds farther). A compnode that leaves on purpose hands its
sub-DAG over at a step boundary without replay, so it is not counted.

Pure state, no I/O: the broker's registry listener feeds it (``observe``), the clock is passed in. The
broker saves its ``history`` in its database and ``resume``s it at start-up (``broker.store``): the
estimate is of the swarm, which outlives one run of the broker. Time the broker was down was not
watched and is not counted.
"""

from __future__ import annotations

import math

from fusionnet.broker.registry import RegistryEvent

# The prior: one unplanned loss per this many seconds of one compnode (``--compnode-mtbf``). Consumer
# machines come and go; an hour is pessimistic for a desktop left on and optimistic for a laptop.
PRIOR_MTBF = 3600.0
_UP = frozenset({"joined", "reachable"})


class ChurnBook:
    def __init__(self, prior_mtbf: float = PRIOR_MTBF) -> None:
        self.prior_mtbf = prior_mtbf
        self.up: set[str] = set()  # compnodes reachable now
        self.losses = 0  # unplanned: reachable -> unreachable
        self.watched = 0.0  # compnode-seconds watched up to ``self.at``
        self.at: float | None = None

    def _advance(self, now: float) -> None:
        if self.at is not None and now > self.at:
            self.watched += (now - self.at) * len(self.up)
        self.at = now if self.at is None else max(self.at, now)

    def observe(self, event: RegistryEvent, now: float) -> None:
        self._advance(now)
        if event.kind in _UP:
            self.up.add(event.peer_id)
        elif event.kind == "unreachable":
            if event.peer_id in self.up:
                self.losses += 1
            self.up.discard(event.peer_id)
        elif event.kind == "left":
            self.up.discard(event.peer_id)

    def history(self, now: float) -> tuple[int, float]:
        """``(unplanned losses, compnode-seconds watched)`` up to ``now``: what a restarted broker resumes."""
        self._advance(now)
        return self.losses, self.watched

    def resume(self, losses: int, watched: float) -> None:
        """Adds what an earlier run of this broker watched (``history``) to what this one has."""
        if losses < 0 or not 0 <= watched < math.inf:
            raise ValueError(
                f"churn history needs losses >= 0 and finite seconds >= 0, got {losses!r}, {watched!r}"
            )
        self.losses += losses
        self.watched += watched

    def compnode_mtbf(self, now: float) -> float | None:
        """Seconds between unplanned losses of one compnode; None when the prior is 0 (Young's interval
        off, ``--compnode-mtbf 0``)."""
        if self.prior_mtbf <= 0:
            return None
        self._advance(now)
        return (self.watched + self.prior_mtbf) / (self.losses + 1)

    def job_mtbf(self, compnodes: int, now: float) -> float | None:
        """Seconds between unplanned losses among a job's ``compnodes`` (each may fail on its own)."""
        mtbf = self.compnode_mtbf(now)
        return None if mtbf is None or compnodes < 1 else mtbf / compnodes


def young_interval(cost: float, mtbf: float) -> float:
    """Young's checkpoint interval: the spacing of rounds that each cost ``cost`` seconds which least
    loses time to rounds and replays together, for failures ``mtbf`` seconds apart."""
    return math.sqrt(2.0 * max(cost, 0.0) * max(mtbf, 0.0))
