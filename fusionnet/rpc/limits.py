"""What one peer, and all peers together, may hold of an RPC server at once: calls in flight, bytes of
request bodies in flight, and how long a request may take.

Without these a peer that can reach a daemon could open calls until it runs out of memory (three
concurrent 200 MiB requests grew a broker by 1 GB) or hold handlers for ever with an upload that
trickles one byte per idle period. ``CallBudget`` is checked before anything is read or allocated: a
call over the per-peer or total count, or a body whose declared length does not fit the per-peer or
total byte budget, is refused at once with a ``WireError`` naming the limit, and the server goes on
serving everybody else. Budgets are returned when the call's answer is written.

A request's body must arrive within ``read_base + length / min_rate`` seconds (a total deadline, on
top of the per-chunk idle timeout), and a handler must answer within ``handler_timeout`` seconds.

``SLOWEST_LINK`` is the slowest link FusionNet promises to work over (0.5 Mbit/s: a consumer uplink).
Both ends size their deadlines by it: the server's ``min_rate``, and the client's (``rpc.client``)
time for a call, which grows by the request's and the answer's bytes at that rate. Before, the server
asked 1 MiB/s of every upload and callers gave a 32 MiB state part a fixed 120 s: a healthy job failed
below about 4 Mbit/s, with a timeout that named neither the link nor the size.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fusionnet.errors import WireError

SLOWEST_LINK = 64 * 1024  # bytes/s: 0.5 Mbit/s


def transfer_seconds(nbytes: int) -> float:
    """What ``nbytes`` take at the slowest link FusionNet works over."""
    return nbytes / SLOWEST_LINK


@dataclass(frozen=True)
class CallLimits:
    calls_per_peer: int = 64
    calls_total: int = 512
    bytes_per_peer: int | None = None  # request bytes in flight per peer; None: one largest message
    bytes_total: int | None = None  # for all peers; None: two largest messages
    read_base: float = 30.0  # s: a request body's deadline is read_base + length / min_rate
    min_rate: float = SLOWEST_LINK  # bytes/s a large upload must keep up on average
    handler_timeout: float = 1800.0  # s a handler may take (above any caller's timeout: a step, 600 s)

    def __post_init__(self) -> None:
        if self.calls_per_peer < 1 or self.calls_total < self.calls_per_peer:
            raise ValueError(f"rpc call limits must be 1 <= per peer <= total, got {self}")
        if self.read_base <= 0 or self.min_rate <= 0 or self.handler_timeout <= 0:
            raise ValueError(f"rpc deadlines must be > 0, got {self}")

    def read_deadline(self, length: int) -> float:
        return self.read_base + length / self.min_rate


@dataclass
class CallBudget:
    """Calls and request bytes in flight, per peer and in total."""

    limits: CallLimits
    max_message_bytes: int
    calls: Counter[str] = field(default_factory=Counter)
    held: Counter[str] = field(default_factory=Counter)
    refused: int = 0

    @property
    def bytes_per_peer(self) -> int:
        return self.limits.bytes_per_peer or self.max_message_bytes

    @property
    def bytes_total(self) -> int:
        return self.limits.bytes_total or 2 * self.max_message_bytes

    def enter(self, peer: str) -> None:
        """Counts a new call of ``peer``, or refuses it (``WireError``) over a call limit."""
        if self.calls[peer] >= self.limits.calls_per_peer:
            self._refuse(f"peer {peer} already has {self.calls[peer]} rpc calls in flight (the limit)")
        total = sum(self.calls.values())
        if total >= self.limits.calls_total:
            self._refuse(f"this peer serves {total} rpc calls already (the limit); retry later")
        self.calls[peer] += 1

    def reserve(self, peer: str, nbytes: int) -> None:
        """Holds ``nbytes`` of request body for ``peer``'s call, or refuses it over a byte budget."""
        if self.held[peer] + nbytes > self.bytes_per_peer:
            self._refuse(
                f"request of {nbytes} bytes refused: peer {peer} already has {self.held[peer]} bytes of "
                f"requests in flight (limit {self.bytes_per_peer})"
            )
        total = sum(self.held.values())
        if total + nbytes > self.bytes_total:
            self._refuse(
                f"request of {nbytes} bytes refused: {total} bytes of requests are in flight here "
                f"(limit {self.bytes_total}); retry later"
            )
        self.held[peer] += nbytes

    def leave(self, peer: str, nbytes: int) -> None:
        """Returns a call's count and its reserved bytes (``nbytes``: what ``reserve`` took, or 0)."""
        self.calls[peer] -= 1
        if self.calls[peer] <= 0:
            del self.calls[peer]
        self.held[peer] -= nbytes
        if self.held[peer] <= 0:
            del self.held[peer]

    def _refuse(self, why: str) -> None:
        self.refused += 1
        raise WireError(why)
