"""Peers whose direct data path failed: their values take the fallback for a while, then TCP is tried again.

Why: a connect to an address that black-holes its SYNs (a NAT host whose data port was not forwarded, a
wrong ``--announce-maddrs``) costs the connect timeout, 10 s, on a step's critical path. Paid once per
frame, then once per job, that made a step of 8 micro-batches take 80 s. So the compnode daemon keeps
one ``DownPeers`` for all its jobs: a new job's sandbox worker starts with what it holds
(``worker_process.WorkerConfig.tcp_down``), a failure the daemon meets later is passed on to the running
workers, and a failure a worker meets is reported to the daemon with the value it hands over
(``sandbox_client.SandboxedJob``), so each of them pays for a bad address at most once.

An entry names the peer and the address that failed: a peer that announces a fixed address gets TCP at
once in its next job, and the same address is tried again after ``RETRY_AFTER`` (a port forward added
meanwhile), so one wrong address costs one connect timeout per ``RETRY_AFTER`` at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

RETRY_AFTER = 600.0  # seconds before TCP to an address that failed is tried again
MAX_ENTRIES = 4096  # peers a swarm's churn could leave behind: the oldest entries go first


@dataclass(frozen=True)
class Down:
    """One failed peer, as handed to a worker (picklable: it crosses into the worker's process)."""

    peer_id: str
    address: str  # its data path address, HOST:PORT
    why: str  # the first failure, for the log
    seconds_left: float  # until TCP is tried again


class DownPeers:
    """``on_mark`` (optional) is told of every peer newly marked down (the daemon tells its workers)."""

    def __init__(
        self,
        retry_after: float = RETRY_AFTER,
        clock: Callable[[], float] = time.monotonic,
        on_mark: Callable[[Down], None] | None = None,
    ) -> None:
        self.retry_after = retry_after
        self.clock = clock
        self.on_mark = on_mark
        self._until: dict[tuple[str, str], tuple[float, str]] = {}  # (peer, address) -> (retry at, why)

    def mark(self, peer_id: str, address: str, why: str, seconds: float | None = None) -> bool:
        """TCP to ``peer_id`` at ``address`` failed (``why``): down for ``seconds`` (default
        ``retry_after``). True when it was not down already."""
        if self.is_down(peer_id, address):
            return False
        seconds = self.retry_after if seconds is None else min(max(seconds, 0.0), self.retry_after)
        if len(self._until) >= MAX_ENTRIES:
            self._expire()
            while len(self._until) >= MAX_ENTRIES:
                del self._until[min(self._until, key=lambda k: self._until[k][0])]
        self._until[(peer_id, address)] = (self.clock() + seconds, why)
        if self.on_mark is not None:
            self.on_mark(Down(peer_id, address, why, seconds))
        return True

    def learn(self, entries: Iterable[Down]) -> None:
        """Entries another process marked (a worker starts with its daemon's)."""
        for entry in entries:
            self.mark(entry.peer_id, entry.address, entry.why, entry.seconds_left)

    def is_down(self, peer_id: str, address: str) -> bool:
        key = (peer_id, address)
        entry = self._until.get(key)
        if entry is None:
            return False
        if self.clock() >= entry[0]:
            del self._until[key]  # time to try TCP again
            return False
        return True

    def entries(self) -> list[Down]:
        """What is down now, with the time each has left (sorted: deterministic)."""
        self._expire()
        now = self.clock()
        return [Down(p, a, why, until - now) for (p, a), (until, why) in sorted(self._until.items())]

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (until, _) in self._until.items() if now >= until]:
            del self._until[key]

    def __len__(self) -> int:
        self._expire()
        return len(self._until)
