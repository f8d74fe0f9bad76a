"""Noticing that a job lost a compnode, and the record of each recovery (Confidant's Table 7 phases).

``FailureWatch`` runs a job's step, sync or assignment calls "guarded": a failed call, or an alarm from
the broker's registry about one of the job's compnodes (heartbeats unanswered, record expired or
OFFLINE), makes it ping every compnode of the job at once; the ones that do not answer are dead and
the call ends in ``PeerFailure`` naming them. A failed call whose compnodes all answer is a real error
and is re-raised as it is; an alarm about a compnode that answers after all is ignored.

``RecoveryLog`` keeps, per failover, the phases FusionAI and Confidant name: detection (from the start
of the call that failed to knowing who is dead), redistribution (placement and assignment of every
sub-DAG again), replay (the steps since the checkpoint run again); and, for a proactive leave, the time
the job stood still for the hand-over. Each phase is a log line, a job event, a histogram observation
and an entry of ``recoveries`` in the job's status and ``plan.json``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fusionnet.broker.context import JobContext
from fusionnet.broker.registry import RegistryEvent
from fusionnet.dht.records import NodeState
from fusionnet.errors import DeviceMemoryError, ExecutionError, FusionNetError
from fusionnet.messages.broker_rpc import PingRequest

log = logging.getLogger("fusionnet.broker.jobs")

PROBE_TIMEOUT = 1.5
TRAFFIC_RECHECK = 0.25  # seconds between pings to a compnode whose link is busy
# Unanswered pings in a row that make a compnode lost. More than one: a compnode starved of CPU (seven
# daemons on two cores, one of them forking a sandbox worker) can miss a 1.5 s ping and answer the
# next; a dead one fails them all, mostly at once (nothing listens), a frozen one in PROBE_TIMEOUT each.
PROBE_PINGS = 3
MAX_RECOVERIES = 50
STEP_TIMEOUT_FLOOR = 600.0  # a step call is never cut shorter than this
STEP_TIMEOUT_FACTOR = 20.0  # ... nor shorter than this many times the step's expected duration


def step_timeout(predicted: float | None, measured: float | None) -> float:
    """How long a ``step`` call may last. Not a failure detector: compnodes compute off their event loop
    and answer pings while busy, so a dead one is found by heartbeats and ``FailureWatch`` probes
    within seconds whatever the step's length. This bound only ends a call that hangs while its
    compnode still answers; it scales with the predicted and last measured step, so a long sub-task
    (minutes) is never taken for a hung one."""
    expected = max((x for x in (predicted, measured) if x is not None and x > 0), default=0.0)
    return max(STEP_TIMEOUT_FLOOR, STEP_TIMEOUT_FACTOR * expected)


class PeerFailure(Exception):
    """Compnodes of a job are gone: ``dead`` names them, ``started`` is when the failed call began.
    ``unfit``: they are alive but ran out of device memory; the job goes on without them (and releases
    them, unlike dead ones)."""

    def __init__(self, dead: set[str], why: str, started: float, *, unfit: bool = False) -> None:
        super().__init__(why)
        self.dead, self.why, self.started, self.unfit = dead, why, started, unfit


class FailureWatch:
    def __init__(
        self,
        context: JobContext,
        peers: Callable[[], Sequence[str]],
        leaving: set[str],
    ) -> None:
        self.registry = context.registry
        self.compnodes = context.compnodes
        self._peers = peers  # the job's compnodes now (the placement changes)
        self._leaving = leaving  # a compnode that announced its leave going OFFLINE is no alarm
        self._alarm = asyncio.Event()
        self._alarm_peer: str | None = None

    def attach(self) -> None:
        self.registry.add_listener(self._on_registry_event)

    def detach(self) -> None:
        self.registry.remove_listener(self._on_registry_event)

    def _on_registry_event(self, event: RegistryEvent) -> None:
        if event.peer_id not in self._peers():
            return
        if event.kind in ("unreachable", "left"):
            self._raise_alarm(event.peer_id)
        elif event.kind == "state" and event.peer_id not in self._leaving:
            entry = self.registry.get(event.peer_id)
            if entry is not None and entry.effective_state == "OFFLINE":
                self._raise_alarm(event.peer_id)

    def _raise_alarm(self, peer: str) -> None:
        self._alarm_peer = peer
        self._alarm.set()

    async def guarded(self, coro: Awaitable[Any]) -> Any:
        """Runs ``coro``; a lost compnode of the job turns its failure (or an alarm) into ``PeerFailure``."""
        started = time.monotonic()
        work = asyncio.ensure_future(coro)
        while True:
            alarm = asyncio.ensure_future(self._alarm.wait())
            try:
                await asyncio.wait({work, alarm}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                # The job is cancelled (or the broker stops): the work goes too, or it would keep
                # driving the compnodes as an orphan task.
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise
            finally:
                alarm.cancel()
            if work.done():
                error = work.exception()
                if error is None:
                    return work.result()
                if isinstance(error, DeviceMemoryError) and error.peer in self._peers():
                    raise PeerFailure({error.peer}, str(error), started, unfit=True)
                dead = await self.probe()
                if not dead:
                    raise error  # a real error, not a lost compnode
                raise PeerFailure(dead, str(error), started)
            self._alarm.clear()
            dead = await self.probe()
            if dead:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise PeerFailure(dead, f"compnode {self._alarm_peer} stopped answering heartbeats", started)
            # A false alarm (the peer answers now): keep waiting for the work.

    async def probe(self) -> set[str]:
        """The job's compnodes that the registry has given up on or that do not answer a ping now."""
        peers = list(self._peers())

        async def alive(peer: str) -> bool:
            unanswered = 0
            while True:
                entry = self.registry.get(peer)
                # Only a goodbye (or a forgotten record) is final. An expired record or missed
                # heartbeats are what raised the alarm: a compnode starved of CPU for a few seconds
                # (many daemons starting on two cores) shows both and is alive, so it gets a ping.
                if entry is None or entry.record.state == NodeState.OFFLINE:
                    return False
                try:
                    # One retry, for stream resets only (``RPCClient.call``): when a compnode is killed,
                    # p2pd now and then resets a stream to a live one too, which is no reason to drop it.
                    await self.compnodes.call_ping(
                        peer, PingRequest(nonce="probe"), timeout=PROBE_TIMEOUT, retries=1
                    )
                    return True
                except FusionNetError as e:
                    # A saturated link: the ping queued behind bulk bytes that are still moving. Not
                    # dead; ask again until the ping gets through or the bytes stop for a heartbeat
                    # timeout (a dead peer moves none). Unless the registry gave up on it already:
                    # then the unanswered ping settles it (a frozen peer's calls may still take our
                    # bytes into the local p2pd, which looks like traffic and would loop forever).
                    gave_up = entry.effective_state in ("OFFLINE", "UNREACHABLE")
                    if not gave_up and self.registry.heard_from(peer, time.time()):
                        log.info(
                            "compnode %s: ping failed (%s) but its traffic still moves; asking again", peer, e
                        )
                        await asyncio.sleep(TRAFFIC_RECHECK)
                        continue
                    unanswered += 1
                    if unanswered < PROBE_PINGS:
                        log.info("compnode %s: ping %d unanswered (%s); asking again", peer, unanswered, e)
                        continue
                    log.info("compnode %s counts as lost: %s", peer, e)
                    return False

        answers = await asyncio.gather(*(alive(p) for p in peers))
        return {p for p, ok in zip(peers, answers) if not ok}


class RecoveryLog:
    """The phases of every recovery of one job (module docstring); ``entries`` is what status shows."""

    def __init__(self, context: JobContext, job_id: str, entries: list[dict[str, Any]]) -> None:
        self.context, self.job_id, self.entries = context, job_id, entries
        self._replay_started = 0.0
        self._handover_started: float | None = None

    def failed(self, failure: PeerFailure, replay_from: int, failed_step: int, source: str) -> dict[str, Any]:
        """Detection is over: a new recovery (refused after ``MAX_RECOVERIES``), replayed from the
        checkpoint before ``replay_from`` that ``source`` kept (``replicas``: the compnodes' snapshots;
        ``broker``: its own)."""
        if len(self.entries) >= MAX_RECOVERIES:
            raise ExecutionError(f"job {self.job_id}: gave up after {len(self.entries)} recoveries")
        info: dict[str, Any] = {
            "lost": sorted(failure.dead),
            "why": failure.why[:300],
            "detection": time.monotonic() - failure.started,
            "detected_at": time.time(),
            "replay_from": replay_from,
            "failed_step": failed_step,
            "checkpoint": source,
        }
        log.warning(
            "job %s: detection: lost %s (%s) after %.2f s; replaying from step %d (the %s checkpoint)",
            self.job_id,
            ", ".join(info["lost"]),
            failure.why[:200],
            info["detection"],
            replay_from,
            "replicas'" if source == "replicas" else "broker's",
        )
        self.context.metrics.failovers.inc(len(failure.dead))
        self.context.metrics.observe_recovery("detection", info["detection"])
        self.entries.append(info)
        return info

    def handing_over(self, leaving: set[str], step: int) -> None:
        log.info("job %s: hand-over of %s at step %d", self.job_id, ", ".join(sorted(leaving)), step)
        self.context.store.add_job_event(self.job_id, "hand-over", {"leaving": sorted(leaving), "step": step})
        self._handover_started = time.monotonic()

    def placed(
        self, recovering: dict[str, Any] | None, seconds: float, subdags: int, moved: set[str]
    ) -> None:
        """A placement was assigned in ``seconds``: the redistribution of a recovery, the end of a
        hand-over's stall, or neither (a first placement or a re-plan)."""
        if recovering is not None:
            recovering["redistribution"] = seconds
            self.context.metrics.observe_recovery("redistribution", seconds)
            log.info(
                "job %s: redistribution: %d sub-DAGs re-assigned in %.2f s", self.job_id, subdags, seconds
            )
        if self._handover_started is not None:
            stall = time.monotonic() - self._handover_started
            log.info("job %s: hand-over done: the job stalled %.2f s", self.job_id, stall)
            self.context.store.add_job_event(self.job_id, "handed-over", {"stall": stall})
            self.context.metrics.observe_recovery("handover", stall)
            self.entries.append({"handover_stall": stall, "lost": sorted(moved)})
            self._handover_started = None
        self._replay_started = time.monotonic()

    def placed_after_loss(self, info: dict[str, Any], seconds: float) -> None:
        """A compnode lost while its placement was being assigned (``failed``'s ``info``), before it
        ran any step: the next placement (``seconds`` from the first try) is the whole recovery, with
        nothing to replay. Recorded as any other: a ``recoveries`` entry, events, metrics."""
        info["redistribution"] = seconds
        self.context.metrics.observe_recovery("redistribution", seconds)
        info["replay"] = 0.0
        self.context.store.add_job_event(self.job_id, "recovered", info)
        log.info("job %s: placed again without %s in %.2f s", self.job_id, ", ".join(info["lost"]), seconds)

    def replayed(self, info: dict[str, Any]) -> None:
        info["replay"] = time.monotonic() - self._replay_started
        self.context.metrics.observe_recovery("replay", info["replay"])
        self.context.store.add_job_event(self.job_id, "recovered", info)
        log.info(
            "job %s: replay: steps from %d redone in %.2f s; recovered",
            self.job_id,
            info["replay_from"],
            info["replay"],
        )
