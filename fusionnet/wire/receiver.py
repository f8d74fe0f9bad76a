"""The receiving half shared by both transports: job routes, the per-connection frame loop, counters.

A compnode registers each job it works on with the job's key, the peers allowed to send to it and
a callback. ``serve`` reads frames from one connection and hands each authenticated frame of a
registered job to that job's callback, in arrival order, awaiting it before reading the next
frame (that await is the connection's backpressure). A refused frame is logged with the peer and
the reason and counted; the connection is closed only when the stream can no longer be trusted
to be at a frame boundary. ``serve`` never raises (except cancellation): one bad peer never takes
down the server or another connection.

A frame lost to a failure on our side (``is_local_failure``: out of memory, typically a sandbox worker at
its ``--sandbox-memory-gb`` budget, while allocating the payload) is no refusal: the peer sent it
properly and will not send it again, so the value it carried never comes. The connection is closed and
``on_local_failure`` is told, so that the job fails its waits for values (``NetChannel.fail_receives``)
instead of waiting for them until the submitter's timeout.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from fusionnet.errors import WireError
from fusionnet.wire import refusal as R
from fusionnet.wire.crypt import bare_ok, check_policy, plaintext_ok
from fusionnet.wire.frame_reader import read_frame
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.header import MAX_ID_LEN, check_text
from fusionnet.wire.job_routes import (
    MAX_ENDED_JOBS,
    NO_JOB,
    FrameHandler,
    JobRoute,
    JobStats,
    Timeouts,
    is_local_failure,
)
from fusionnet.wire.mac import check_key
from fusionnet.wire.refusal import FrameRefused, StreamEnded
from fusionnet.wire.replay import SEQ_LANES, ReplayWindow
from fusionnet.wire.sources import ByteSource, PhasedSource

log = logging.getLogger("fusionnet.wire")

# ``(job_id, sender, error)``: an authenticated frame of ``job_id`` from ``sender`` was lost to ``error``, a
# failure on our side. Both are None when the frame's header was not yet authenticated and the
# connection had delivered no frame before (the owner decides: a sandbox worker holds one job only).
LocalFailureHandler = Callable[[str | None, str | None, BaseException], None]


class _Reading:
    """The replay guard ``serve`` hands ``read_frame`` for one connection: the receiver's own windows, and
    a note of the frame being read once its header is authentic and its sequence number fresh, for a
    frame lost mid-way to a failure of ours (``read_frame`` raises such a failure as it is, with nothing
    that names the frame's job)."""

    def __init__(self, receiver: FrameReceiver) -> None:
        self.receiver = receiver
        self.frame: tuple[str, str] | None = None  # (job, sender) of the frame being read, once known

    def next_frame(self) -> None:
        self.frame = None

    def fresh(self, job_id: str, sender: str, seq: int) -> bool:
        # ``read_frame`` asks this right after the header's MAC (and its receiver) checked out and before it
        # allocates the payload: a fresh frame from here on is the sender's own frame of that job. A stale
        # one (a replay, another reader's lane) is skipped and would carry nothing this job waits for.
        fresh = self.receiver.fresh(job_id, sender, seq)
        if fresh:
            self.frame = (job_id, sender)
        return fresh

    def accept(self, job_id: str, sender: str, seq: int) -> bool:
        return self.receiver.accept(job_id, sender, seq)


class FrameReceiver:
    """Job routes, replay windows and counters of one peer; ``serve`` runs one connection's frame loop."""

    def __init__(self, *, peer_id: str, max_payload: int, timeouts: Timeouts | None = None) -> None:
        check_text(peer_id, "peer_id", MAX_ID_LEN)
        if isinstance(max_payload, bool) or not isinstance(max_payload, int) or max_payload < 0:
            raise WireError(f"max_payload must be a non-negative integer, got {max_payload!r}")
        self.peer_id = peer_id
        self.max_payload = max_payload
        self.timeouts = timeouts or Timeouts()
        self._routes: dict[str, JobRoute] = {}
        # One window per (job, allowed sender): bounded by the routes, dropped with the job.
        self._windows: dict[tuple[str, str], ReplayWindow] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()  # recently unregistered jobs
        self.stats: dict[str, JobStats] = {NO_JOB: JobStats()}
        # Called with each refusal's reason code (the compnode's ``fusionnet_frames_refused_total``).
        self.on_refusal: Callable[[str], None] | None = None
        # Called when a frame of a job is lost to a failure on our side (``LocalFailureHandler``); without
        # it the loss is only logged, and the job waits for that value until its timeout.
        self.on_local_failure: LocalFailureHandler | None = None
        self.frames_lost = 0  # frames lost so far (not refusals: their senders did nothing wrong)

    def register_job(
        self,
        job_id: str,
        key: bytes | Mapping[str, bytes],
        allowed_senders: Iterable[str],
        on_frame: FrameHandler,
        encryption: str = "auto",
        lanes: Iterable[int] | None = None,
    ) -> None:
        """Accepts frames of ``job_id`` from ``allowed_senders``; registering again replaces the route.

        ``key``: the job's key, or per allowed sender the key of its link to us (``mac.link_key``: then
        a member of the job cannot pass its frames off as another member's).

        ``encryption`` is the job's ``placement.wire_encryption`` (``crypt.py``): on a connection
        from a remote host (``serve(remote_host=...)``) it decides whether plaintext is refused.

        ``lanes``: the only sequence-number lanes accepted (``replay.SEQ_LANES``; None: every lane), so
        that a compnode's daemon and its job's worker, which read frames of one job apart, never both
        accept one frame (``handoff.py``)."""
        check_text(job_id, "job_id", MAX_ID_LEN)
        if job_id == NO_JOB:
            raise WireError(f"job id {NO_JOB!r} is reserved")
        if isinstance(allowed_senders, str):
            raise WireError(
                f"allowed_senders of job {job_id!r} must be a collection of peer ids, not a string"
            )
        senders = frozenset(check_text(s, "allowed sender", MAX_ID_LEN) for s in allowed_senders)
        if isinstance(key, Mapping):
            if set(key) != senders:
                raise WireError(f"job {job_id!r}: one link key per allowed sender")
            key = {s: check_key(k, f"link key of job {job_id!r} from {s}") for s, k in key.items()}
        else:
            key = check_key(key, f"key of job {job_id!r}")
        if not callable(on_frame):
            raise WireError(f"on_frame of job {job_id!r} must be callable")
        kept = None if lanes is None else frozenset(lanes)
        if kept is not None and not kept <= set(range(SEQ_LANES)):
            raise WireError(f"job {job_id!r}: sequence lanes must be in [0, {SEQ_LANES}), got {sorted(kept)}")
        self._routes[job_id] = JobRoute(key, senders, on_frame, check_policy(encryption), kept)
        self._ended.pop(job_id, None)
        self.stats.setdefault(job_id, JobStats())

    def unregister_job(self, job_id: str) -> None:
        """Refuses further frames of ``job_id`` (its counters stay readable)."""
        if self._routes.pop(job_id, None) is not None:
            self._ended[job_id] = None
            while len(self._ended) > MAX_ENDED_JOBS:
                self._ended.popitem(last=False)
        for pair in [p for p in self._windows if p[0] == job_id]:
            del self._windows[pair]

    def job_ended(self, job_id: str) -> bool:
        """A job that ran here and ended: its late frames are skipped, not a reason to close."""
        return job_id in self._ended

    # -- replay guard (``frame_reader.ReplayGuard``) --
    def fresh(self, job_id: str, sender: str, seq: int) -> bool:
        route = self._routes.get(job_id)
        if route is not None and route.lanes is not None and seq % SEQ_LANES not in route.lanes:
            return False  # another reader's lane: a frame replayed from the other path
        window = self._windows.get((job_id, sender))
        return window is None or window.fresh(seq)

    def accept(self, job_id: str, sender: str, seq: int) -> bool:
        if job_id not in self._routes:
            return True  # ended while the frame arrived: _deliver counts it; no window to keep
        return self._windows.setdefault((job_id, sender), ReplayWindow()).accept(seq)

    @property
    def jobs(self) -> list[str]:
        return sorted(self._routes)

    def keyring(self, job_id: str, sender: str) -> bytes | None:
        """The key of ``sender``'s frames of ``job_id``; None for an unknown job, ``b""`` for a sender
        that has no link to us (``read_frame`` refuses it before anything else)."""
        route = self._routes.get(job_id)
        if route is None:
            return None
        if isinstance(route.key, bytes):
            return route.key
        return route.key.get(sender, b"")

    def accept_sender(self, job_id: str, sender: str) -> bool:
        route = self._routes.get(job_id)
        return route is not None and sender in route.allowed_senders

    def _plaintext_policy(self, host: str) -> Callable[[str], bool]:
        def plaintext_allowed(job_id: str) -> bool:
            route = self._routes.get(job_id)
            return route is None or plaintext_ok(route.encryption, host)

        return plaintext_allowed

    def _bare_policy(self, host: str) -> Callable[[str], bool]:
        def bare_allowed(job_id: str) -> bool:
            route = self._routes.get(job_id)
            return route is not None and bare_ok(route.encryption, host)

        return bare_allowed

    def _bucket(self, job_id: str | None) -> JobStats:
        return self.stats[job_id] if job_id is not None and job_id in self.stats else self.stats[NO_JOB]

    def count_refusal(self, e: FrameRefused, peer: str) -> None:
        stats = self._bucket(e.job_id)
        stats.frames_refused[e.reason] = stats.frames_refused.get(e.reason, 0) + 1
        stats.bytes_refused += e.nbytes
        if self.on_refusal is not None:
            self.on_refusal(e.reason)
        log.warning(
            "%s refused a frame from %s (%s): %s%s",
            self.peer_id,
            peer,
            e.reason,
            e,
            "" if e.in_sync else "; closing the connection",
        )

    async def serve(
        self,
        source: ByteSource,
        peer: str,
        *,
        bound_sender: str | None = None,
        remote_host: str | None = None,
    ) -> None:
        """Reads frames until the peer closes the stream, falls out of sync or times out.

        ``remote_host``: the TCP peer's address, for the jobs' encryption policies and bare frames
        (``None``: a transport that encrypts by itself, libp2p, where plaintext frames are fine and
        bare ones are not)."""
        plaintext_allowed = None if remote_host is None else self._plaintext_policy(remote_host)
        bare_allowed = None if remote_host is None else self._bare_policy(remote_host)
        phased = PhasedSource(source, self.timeouts.progress)
        # The handshake's short deadline holds until a frame has passed every check: a peer without the
        # job's key, whose frames are refused and who stays in sync, must not hold the connection (and
        # its slot in the per-host limit) for the idle timeout.
        wait = self.timeouts.handshake
        reading = _Reading(self)
        # Jobs whose frames this connection delivered, with their sender: a frame lost before its header
        # was authentic is charged to them (whose else could it be).
        delivered: dict[str, str] = {}
        while True:
            phased.next_frame(wait)
            reading.next_frame()
            try:
                frame = await read_frame(
                    phased,
                    self.keyring,
                    max_payload=self.max_payload,
                    receiver=self.peer_id,
                    replay=reading,
                    job_ended=self.job_ended,
                    accept_sender=self.accept_sender,
                    bound_sender=bound_sender,
                    plaintext_ok=plaintext_allowed,
                    bare_ok=bare_allowed,
                )
            except StreamEnded:
                return
            except TimeoutError:
                what = "the next frame" if phased.between_frames else "the rest of a frame"
                self.count_refusal(FrameRefused(f"timed out waiting for {what}", reason=R.TIMEOUT), peer)
                return
            except FrameRefused as e:
                self.count_refusal(e, peer)
                if not e.in_sync:
                    return
                continue
            except WireError as e:  # read_frame only raises the two above; stay safe if that changes
                self.count_refusal(FrameRefused(str(e), reason=R.MALFORMED), peer)
                return
            except Exception as e:
                if is_local_failure(e):  # our memory, not the peer's bytes: no refusal, but a lost value
                    known = dict([reading.frame]) if reading.frame is not None else delivered
                    self._lost(known or None, peer, e, closing=True)
                    return
                # A peer's bytes that a check let through and a decoder did not.
                why = f"malformed frame ({type(e).__name__}: {str(e)[:120]})"
                self.count_refusal(FrameRefused(why, reason=R.MALFORMED), peer)
                return
            wait = self.timeouts.idle
            delivered[frame.job_id] = frame.sender
            await self._deliver(frame, peer)

    def _lost(
        self, jobs: Mapping[str, str] | None, peer: str, error: BaseException, *, closing: bool
    ) -> None:
        """A frame from ``peer`` was lost to ``error``, a failure of ours: ``jobs`` (job -> sender; None:
        unknown) can never get the value it carried, so ``on_local_failure`` fails them (those that still
        run here: one that ended meanwhile waits for nothing)."""
        self.frames_lost += 1
        log.error(
            "%s lost a frame from %s (%s; %s) to a failure here: %s: %s%s",
            self.peer_id,
            peer,
            ", ".join(f"job {j!r}" for j in jobs or ()) or "job unknown",
            ", ".join(sorted(set((jobs or {}).values()))) or "sender unknown",
            type(error).__name__,
            str(error)[:300],
            "; closing the connection" if closing else "",
        )
        if self.on_local_failure is None:
            return
        running: list[tuple[str | None, str | None]] = (
            [(None, None)] if jobs is None else [(j, s) for j, s in jobs.items() if j in self._routes]
        )
        for job_id, sender in running:
            try:
                self.on_local_failure(job_id, sender, error)
            except Exception:  # ``serve`` never raises: a bug of the handler is logged, and that is all
                log.exception("%s: failing job %r after a lost frame failed", self.peer_id, job_id)

    async def _deliver(self, frame: TensorFrame, peer: str) -> None:
        route = self._routes.get(frame.job_id)
        nbytes = frame.tensor.numel() * frame.tensor.element_size()
        if route is None:  # unregistered while its payload was arriving
            self.count_refusal(
                FrameRefused(
                    f"job {frame.job_id!r} ended while its frame arrived",
                    reason=R.UNKNOWN_JOB,
                    job_id=frame.job_id,
                    sender=frame.sender,
                    in_sync=True,
                    nbytes=nbytes,
                ),
                peer,
            )
            return
        stats = self.stats[frame.job_id]
        try:
            result = route.on_frame(frame)
            if inspect.isawaitable(result):
                await result
        except Exception as e:
            if is_local_failure(e):  # the handler ran out of memory: the value is lost as in ``serve``
                # (the frame was read whole, so the connection stays usable for the next one)
                self._lost({frame.job_id: frame.sender}, peer, e, closing=False)
                return
            log.error(
                "%s: handler of job %r failed on frame %s/%r from %s",
                self.peer_id,
                frame.job_id,
                frame.kind,
                frame.name,
                frame.sender,
                exc_info=e,
            )
            stats.frames_refused[R.HANDLER_ERROR] = stats.frames_refused.get(R.HANDLER_ERROR, 0) + 1
            stats.bytes_refused += nbytes
            if self.on_refusal is not None:
                self.on_refusal(R.HANDLER_ERROR)
            return
        stats.frames_accepted += 1
        stats.bytes_accepted += nbytes


class ReceivesFrames:
    """What a data path that reads frames with a ``FrameReceiver`` offers its daemon: the receiver's
    routes and statistics (``DataPathServer`` over TCP, ``P2PDataPath`` over libp2p streams)."""

    receiver: FrameReceiver

    @property
    def stats(self) -> dict[str, JobStats]:
        """Per job id (and ``NO_JOB`` for frames no registered job can be charged with)."""
        return self.receiver.stats

    def register_job(
        self,
        job_id: str,
        key: bytes | Mapping[str, bytes],
        allowed_senders: Iterable[str],
        on_frame: FrameHandler,
        encryption: str = "auto",
        lanes: Iterable[int] | None = None,
    ) -> None:
        self.receiver.register_job(job_id, key, allowed_senders, on_frame, encryption, lanes)

    def unregister_job(self, job_id: str) -> None:
        self.receiver.unregister_job(job_id)
