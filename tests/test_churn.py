"""How often compnodes fail as the broker sees it (``broker.churn``), and failover rounds spaced by
Young's interval for it (``broker.replicas.ReplicaBook`` with ``mtbf``)."""

from __future__ import annotations

import math

import pytest

from fusionnet.broker.churn import PRIOR_MTBF, ChurnBook, young_interval
from fusionnet.broker.registry import RegistryEvent
from fusionnet.broker.replicas import REPLICA_TIME_SHARE, ReplicaBook
from tests.test_replicas import spaced_rounds

pytestmark = pytest.mark.timeout(30)


def test_a_broker_that_has_watched_nothing_assumes_the_prior() -> None:
    churn = ChurnBook()
    assert churn.compnode_mtbf(now=50.0) == PRIOR_MTBF
    assert churn.job_mtbf(3, now=50.0) == pytest.approx(PRIOR_MTBF / 3)
    assert churn.job_mtbf(0, now=50.0) is None
    assert ChurnBook(prior_mtbf=0.0).job_mtbf(3, now=50.0) is None  # --compnode-mtbf 0: Young off


def test_watched_compnode_seconds_and_unplanned_losses_move_the_estimate() -> None:
    churn = ChurnBook(prior_mtbf=1000.0)
    churn.observe(RegistryEvent("a", "joined"), now=0.0)
    churn.observe(RegistryEvent("b", "joined"), now=0.0)
    # two compnodes watched for 2000 s without a loss: 4000 compnode-seconds beside the prior's 1000
    assert churn.compnode_mtbf(now=2000.0) == pytest.approx(5000.0)
    churn.observe(RegistryEvent("a", "unreachable"), now=2000.0)  # a SIGKILL: one loss
    churn.observe(RegistryEvent("a", "unreachable"), now=2001.0)  # said again: still one
    assert churn.losses == 1
    # from 2000 s only b is up: 1000 s more of one compnode
    assert churn.compnode_mtbf(now=3000.0) == pytest.approx((4000.0 + 1000.0 + 1000.0) / 2)
    churn.observe(RegistryEvent("a", "reachable"), now=3000.0)
    churn.observe(RegistryEvent("b", "left"), now=3000.0)  # left on purpose: handed over, no replay
    assert churn.losses == 1 and churn.up == {"a"}
    assert churn.compnode_mtbf(now=2500.0) == pytest.approx(3000.0)  # an earlier clock adds nothing


def test_young_interval_minimises_the_time_lost_to_rounds_and_replays() -> None:
    cost, mtbf = 0.8, 1200.0
    best = young_interval(cost, mtbf)
    assert best == pytest.approx(math.sqrt(2 * cost * mtbf))

    def lost(spacing: float) -> float:  # per second: rounds, plus half a spacing replayed per failure
        return cost / spacing + spacing / (2 * mtbf)

    assert all(lost(best) < lost(best * f) for f in (0.5, 0.8, 1.25, 2.0))
    assert young_interval(-1.0, mtbf) == 0.0


def test_rounds_are_spaced_by_young_interval_when_failures_are_rare() -> None:
    """The same job as ``test_costly_rounds_are_spaced_to_a_share_of_the_time``: with compnodes that
    fail once in 1600 s between them, a 2 s round waits sqrt(2 x 2 x 1600) = 80 s, not 2 / 0.1 = 20 s;
    with failures every 50 s the share still rules (Young's 14 s is shorter)."""
    now = [0.0]
    rare = ReplicaBook(interval=2.0, clock=lambda: now[0], mtbf=lambda: 1600.0)
    rare.reset(2, enabled=True)
    # round 1 starts at 0 s and step 2 at 3.0 s: round 2 at step 2 + (80 - 3.0) / 0.5 = 156
    assert spaced_rounds(rare, now, 200) == [0, 156]
    assert rare.not_before == pytest.approx(156 * 0.5 + 2 * 1.0 + 80.0)  # round 2's own price

    now = [0.0]
    often = ReplicaBook(interval=2.0, clock=lambda: now[0], mtbf=lambda: 50.0)
    often.reset(2, enabled=True)
    assert spaced_rounds(often, now, 80) == [0, 36, 72]  # as with the share alone: every 20 s
    assert often.not_before == pytest.approx(40.0 + 2.0 / REPLICA_TIME_SHARE)


def test_history_resumed_by_a_restarted_broker_counts_beside_what_it_watches() -> None:
    before = ChurnBook(prior_mtbf=1000.0)
    before.observe(RegistryEvent("a", "joined"), now=0.0)
    before.observe(RegistryEvent("a", "unreachable"), now=500.0)
    assert before.history(now=600.0) == (1, 500.0)  # nothing up after the loss: no more seconds
    after = ChurnBook(prior_mtbf=1000.0)
    after.resume(*before.history(now=600.0))
    after.observe(RegistryEvent("b", "joined"), now=10_000.0)  # the broker was down: not watched
    assert after.compnode_mtbf(now=10_500.0) == pytest.approx((500.0 + 500.0 + 1000.0) / 2)
    for losses, watched in ((-1, 0.0), (0, -1.0), (0, math.inf), (0, math.nan)):
        with pytest.raises(ValueError, match="churn history needs"):
            after.resume(losses, watched)
