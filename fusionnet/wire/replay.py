"""Replay protection: every frame carries its receiver's id and a sequence number under its MAC.

A captured frame is otherwise valid forever for every receiver of its job (the MAC key is per job).
The header now names the receiver (``to``) and a sequence number (``seq``), both authenticated by
the head tag, so a receiver refuses a frame meant for another peer, and a ``ReplayWindow`` per
(job, sender) refuses a sequence number it has already accepted.

Sequence numbers come from ``next_seq``: one process-wide counter, strictly increasing, started
from the wall clock in nanoseconds. Starting from the clock means a restarted sender continues
above the numbers it used before (so its fresh frames are not mistaken for replays), and one counter
for every destination and both transports means a receiver never sees two frames of one sender
with the same number, whichever path each took.

A compnode's sandbox workers send their job's values themselves (``compnode.worker_sends``), under
the compnode's peer id like the daemon: two processes, two counters. Each process numbers in a lane
of its own (``set_seq_lane``: the number modulo ``SEQ_LANES``), so their numbers never meet.

A window accepts a number once, and nothing older than ``span`` (nanoseconds, i.e. time) below the
highest number seen: frames of one sender can arrive out of order (TCP path and P2P fallback,
reconnects), but not minutes late. Its memory is bounded: at most ``max_seen`` numbers are kept;
when full, the oldest half is dropped and the floor rises to the newest dropped number, so the
window can only become stricter, never forget a number it would still accept.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

DEFAULT_SPAN_NS = 120 * 10**9
DEFAULT_MAX_SEEN = 1 << 16

SEQ_LANES = 4
_lock = threading.Lock()
_last = [0]
_lane = [0]  # 0: a daemon; a sandbox worker numbers in lane 1


def set_seq_lane(lane: int) -> None:
    """This process's lane: every later number is ``lane`` modulo ``SEQ_LANES``."""
    if not 0 <= lane < SEQ_LANES:
        raise ValueError(f"sequence lane must be in [0, {SEQ_LANES}), got {lane}")
    with _lock:
        _lane[0] = lane


def next_seq() -> int:
    """The next sequence number of this process (strictly increasing, >= the clock in ns, in its lane)."""
    with _lock:
        seq = max(_last[0] + 1, time.time_ns())
        seq += (_lane[0] - seq) % SEQ_LANES
        _last[0] = seq
        return seq


_lanes_last: dict[int, int] = {}


def next_seq_in(lane: int) -> int:
    """``next_seq`` in ``lane``, whatever this process's own lane: a broker writing a deployment's batches
    to sandbox workers numbers them in the lane the workers read (``handoff.WORKER_LANE``)."""
    if not 0 <= lane < SEQ_LANES:
        raise ValueError(f"sequence lane must be in [0, {SEQ_LANES}), got {lane}")
    with _lock:
        seq = max(_lanes_last.get(lane, 0) + 1, time.time_ns())
        seq += (lane - seq) % SEQ_LANES
        _lanes_last[lane] = seq
        return seq


# Frame nonces (``mac.py``): 8 random bytes drawn once per process, then a counter. Unique per
# frame, which is all the MAC needs of them, without a getrandom syscall per frame.
_nonce = [os.urandom(8), itertools.count()]


def _reseed_nonces() -> None:  # a forked child must not repeat its parent's nonces
    _nonce[:] = [os.urandom(8), itertools.count()]


os.register_at_fork(after_in_child=_reseed_nonces)


def next_nonce() -> bytes:
    """A 16-byte frame nonce never returned before by this process (``next`` on a count is atomic)."""
    prefix, counter = _nonce
    return prefix + next(counter).to_bytes(8, "big")


class ReplayWindow:
    """Sequence numbers accepted from one sender for one job."""

    def __init__(self, span: int = DEFAULT_SPAN_NS, max_seen: int = DEFAULT_MAX_SEEN) -> None:
        self.span = span
        self.max_seen = max_seen
        self.top = 0  # highest number accepted
        self.floor = 0  # numbers <= floor are refused
        self._seen: set[int] = set()

    def fresh(self, seq: int) -> bool:
        """Whether ``seq`` would be accepted (not seen, not too old). Does not record it."""
        return seq > max(self.floor, self.top - self.span) and seq not in self._seen

    def accept(self, seq: int) -> bool:
        """Records ``seq``; False (and nothing recorded) for a replay or a number too old."""
        if not self.fresh(seq):
            return False
        self._seen.add(seq)
        self.top = max(self.top, seq)
        if len(self._seen) > self.max_seen or (self._seen and min_below(self._seen, self.top - self.span)):
            self._compact()
        return True

    def _compact(self) -> None:
        ordered = sorted(self._seen)
        cut = max(len(ordered) - self.max_seen // 2, 0) if len(ordered) > self.max_seen else 0
        limit = self.top - self.span
        while cut < len(ordered) and ordered[cut] <= limit:
            cut += 1
        if cut:
            self.floor = max(self.floor, ordered[cut - 1])
            self._seen = set(ordered[cut:])


def min_below(seen: set[int], limit: int) -> bool:
    """Cheap check used after each accept: is the set likely to hold numbers below ``limit``?

    Only looked at every 1024 additions (the set's size modulo), so compaction stays amortised O(1).
    """
    return len(seen) % 1024 == 0 and min(seen) <= limit


__all__ = ["DEFAULT_MAX_SEEN", "DEFAULT_SPAN_NS", "ReplayWindow", "next_nonce", "next_seq", "next_seq_in"]
