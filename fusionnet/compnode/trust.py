"""Which peers a compnode takes orders from, and when an assignment has lost its broker.

A compnode runs other people's jobs on behalf of a broker it trusts. Without this check any peer that
can reach the compnode could assign itself a job (compute theft), fill the job slots (denial of
service for the real broker) or make the compnode connect wherever an assignment says. So
``assign`` (and everything that follows it) is taken only from trusted brokers: the peers named by
id (``/p2p/<id>``) in the compnode's ``--initial-peers`` (it joined the swarm through its broker), plus
any ``--trusted-broker PEER_ID``. The caller's peer id is authenticated by libp2p, so it cannot be
forged. A refusal is logged once per peer and minute (a flood must not flood the log) and counted.

An assignment whose broker stops driving it (no step, no call about it and no heartbeat ping from
that broker for ``assignment_ttl`` seconds, while no step of it is running) is released, so a broker
that crashed or lost the job cannot hold the compnode's job slots for ever. A live broker's heartbeat
lists the jobs it runs, and a job of that broker held for over ``FORGOTTEN_GRACE`` that the list leaves
out is released too (``forgotten_jobs``): a release that never arrived must not hold a slot while the
broker lives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fusionnet.dht.peerids import peer_ids_of_maddrs
from fusionnet.errors import JobError

log = logging.getLogger("fusionnet.compnode.trust")

DEFAULT_ASSIGNMENT_TTL = 60.0  # s without a word from a job's broker before its assignment is void
_LOG_EVERY = 60.0  # s between two log lines about refusals of one peer

BROKER_METHODS = frozenset({"assign", "step", "collect", "release", "probe_links"})


@dataclass
class TrustedBrokers:
    """The peer ids whose ``assign`` this compnode obeys."""

    peers: frozenset[str]
    refused: int = 0
    _last_log: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, initial_peers: Sequence[str], trusted: Sequence[str]) -> TrustedBrokers:
        return cls(frozenset(peer_ids_of_maddrs(initial_peers)) | frozenset(trusted))

    def check(self, peer: str, method: str) -> None:
        """Raises ``JobError`` (and logs, rate-limited) unless ``peer`` is a trusted broker."""
        if peer in self.peers:
            return
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log.get(peer, -_LOG_EVERY) >= _LOG_EVERY:
            self._last_log[peer] = now
            if len(self._last_log) > 1024:  # bounded: a flood from many ids must not grow it for ever
                self._last_log.clear()
            log.warning(
                "refused %s from %s: not a trusted broker (trusted: %s; %d refusals so far)",
                method, peer, ", ".join(sorted(self.peers)) or "none", self.refused,
            )  # fmt: skip
        raise JobError(
            f"{method} refused: peer {peer} is not a broker this compnode trusts "
            "(its --initial-peers or --trusted-broker)"
        )


def stale_jobs(
    brokers: Mapping[str, str],
    last_seen: Mapping[str, float],
    busy: Iterable[str],
    ttl: float,
    now: float | None = None,
) -> list[str]:
    """The jobs (id -> broker in ``brokers``) whose broker was last heard from (``last_seen``: per job
    and per broker, monotonic seconds) over ``ttl`` seconds ago; jobs in ``busy`` (a step running) never."""
    now = time.monotonic() if now is None else now
    busy = set(busy)
    stale = []
    for job_id, broker in sorted(brokers.items()):
        heard = max(last_seen.get(job_id, 0.0), last_seen.get(broker, 0.0))
        if job_id not in busy and now - heard > ttl:
            stale.append(job_id)
    return stale


FORGOTTEN_GRACE = 30.0  # s a job is held before a heartbeat that leaves it out may drop it (a late ping)


def forgotten_jobs(
    held: Mapping[str, tuple[str, float]], broker: str, running: set[str], busy: set[str], now: float
) -> list[str]:
    """The jobs (id -> (broker, held since, wall seconds) in ``held``) of ``broker`` that it no longer
    runs (not in ``running``, its heartbeat's list), held for over ``FORGOTTEN_GRACE`` (a heartbeat sent
    before an assignment may arrive after it) and with no call in progress (``busy``)."""
    return [
        job_id
        for job_id, (owner, since) in held.items()
        if owner == broker and job_id not in running and job_id not in busy and now - since > FORGOTTEN_GRACE
    ]
