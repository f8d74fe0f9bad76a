"""The broker's view of the compnodes: DHT records merged with ping-pong heartbeats (FusionAI 3.2).

Pure state, no I/O: the broker feeds it DHT lookups, pong/failure observations and the clock, and gets
back ``RegistryEvent``s (joined, state change, unreachable, reachable again, left). Listeners (failover,
the job scheduler) subscribe with ``add_listener``; ``schedulable()`` lists the compnodes a plan may use.

Two independent signals, because each misses something: a record can outlive its peer by up to one TTL
after a SIGKILL (heartbeats catch that within ``heartbeat_timeout``), and a peer can answer pings after
announcing DRAINING/OFFLINE (the record says it is leaving).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fusionnet.dht.announce import Found
from fusionnet.dht.records import CompnodeRecord, NodeState, Role
from fusionnet.errors import PlanError

if TYPE_CHECKING:
    from fusionnet.perfmodel.types import DeviceSpec

log = logging.getLogger("fusionnet.broker.registry")

EventKind = Literal["joined", "state", "unreachable", "reachable", "left"]
_RTT_SMOOTHING = 0.3  # weight of the newest sample in the RTT moving average


@dataclass(frozen=True)
class RegistryEvent:
    peer_id: str
    kind: EventKind
    detail: str = ""


@dataclass
class CompnodeEntry:
    record: CompnodeRecord
    expires_at: float  # DHT time at which the latest record expires
    first_seen: float
    last_seen: float  # last time a lookup returned a live record
    last_heartbeat: float | None = None  # last pong
    rtt: float | None = None  # smoothed round-trip time of pings, seconds
    last_traffic: float | None = None  # last chunk of any call moved to or from it (``record_traffic``)
    failures: int = 0  # consecutive failed pings
    reachable: bool = True  # until a heartbeat timeout says otherwise
    gone: bool = False  # the record expired without an OFFLINE goodbye

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    @property
    def effective_state(self) -> str:
        """What status shows: the announced state, unless the peer is not answering or its record expired
        without a goodbye (a crash): UNREACHABLE, as the metrics count it, never OFFLINE (a graceful
        leave, said only by the OFFLINE record a compnode writes as it stops)."""
        if self.record.state == NodeState.OFFLINE:
            return NodeState.OFFLINE.value
        if self.gone or not self.reachable:
            return "UNREACHABLE"
        return self.record.state.value

    @property
    def schedulable(self) -> bool:
        return self.record.state == NodeState.ONLINE and self.reachable and not self.gone

    def device_spec(self) -> DeviceSpec:
        """This compnode as the performance model's ``DeviceSpec`` (named by its peer id), for the planner."""
        from fusionnet.perfmodel.types import NO_OVERHEADS, DeviceSpec, Overheads

        hw = self.record.hardware
        if hw is None:
            raise PlanError(
                f"compnode {self.peer_id} has not announced its hardware yet (state {self.record.state})"
            )
        try:
            overheads = NO_OVERHEADS if hw.overheads is None else Overheads.from_dict(hw.overheads)
        except PlanError as e:
            raise PlanError(f"compnode {self.peer_id} announced {e}") from None
        return DeviceSpec(
            name=self.peer_id,
            kind="cpu" if hw.device_kind == "cpu" else "gpu",
            peak_flops=hw.peak_flops,
            speed_factor=hw.speed_factor,
            mem_bandwidth=hw.mem_bandwidth,
            d_gpu=hw.d_gpu,
            d_cpu=hw.d_cpu,
            d_disk=hw.d_disk,
            overheads=overheads,
        )

    def to_status(self, now: float) -> dict[str, Any]:
        r = self.record
        return {
            "peer_id": r.peer_id,
            "role": r.role.value,
            "backup": r.backup,
            "state": self.effective_state,
            "announced_state": r.state.value,
            "reachable": self.reachable,
            "hardware": None if r.hardware is None else r.hardware.model_dump(mode="json"),
            "load": r.load,
            "running_tasks": r.running_tasks,
            "data_path_address": r.data_path_address,
            "metrics_address": r.metrics_address,
            "version": r.version,
            "last_heartbeat_age": None
            if self.last_heartbeat is None
            else max(0.0, now - self.last_heartbeat),
            "rtt_ms": None if self.rtt is None else self.rtt * 1000.0,
        }


class CompnodeRegistry:
    def __init__(self, heartbeat_timeout: float, forget_after: float | None = None):
        if heartbeat_timeout <= 0:
            raise ValueError(f"--heartbeat-timeout must be > 0, got {heartbeat_timeout}")
        self.heartbeat_timeout = heartbeat_timeout
        # Entries that left are kept for a while so status can show them, then dropped (bounded memory).
        self.forget_after = forget_after if forget_after is not None else max(600.0, 10 * heartbeat_timeout)
        self._entries: dict[str, CompnodeEntry] = {}
        self._listeners: list[Callable[[RegistryEvent], None]] = []

    # ---- queries ---------------------------------------------------------------------------------
    def entries(self) -> list[CompnodeEntry]:
        return [self._entries[p] for p in sorted(self._entries)]

    def get(self, peer_id: str) -> CompnodeEntry | None:
        return self._entries.get(peer_id)

    def schedulable(self, *, role: Role | None = None, backup: bool | None = None) -> list[CompnodeEntry]:
        """ONLINE, answering pings, record alive; optionally of one role / in or out of the backup pool."""
        return [
            e
            for e in self.entries()
            if e.schedulable
            and (role is None or e.record.role == role)
            and (backup is None or e.record.backup == backup)
        ]

    def to_ping(self) -> list[str]:
        return [e.peer_id for e in self.entries() if not e.gone and e.record.state != NodeState.OFFLINE]

    # ---- listeners -------------------------------------------------------------------------------
    def add_listener(self, listener: Callable[[RegistryEvent], None]) -> None:
        """``listener(event)`` is called synchronously for every event; schedule async work yourself."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[RegistryEvent], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _emit(self, events: list[RegistryEvent]) -> list[RegistryEvent]:
        for event in events:
            log.info(
                "compnode %s %s%s", event.peer_id, event.kind, f": {event.detail}" if event.detail else ""
            )
            for listener in self._listeners:
                try:
                    listener(event)
                except Exception:
                    log.exception("registry listener %r failed on %s", listener, event)
        return events

    # ---- updates ---------------------------------------------------------------------------------
    def update_records(self, found: list[Found[CompnodeRecord]], now: float) -> list[RegistryEvent]:
        """Merges one full DHT lookup. Peers missing from it are marked gone once their last record has
        expired: a lookup that came back short (a DHT peer frozen mid-lookup, the DHT's own timeouts)
        must not make every compnode look gone at once. Assigned compnodes are watched by heartbeats."""
        events: list[RegistryEvent] = []
        seen = set()
        for item in found:
            record = item.record
            seen.add(record.peer_id)
            entry = self._entries.get(record.peer_id)
            if entry is None:
                entry = CompnodeEntry(
                    record=record, expires_at=item.expires_at, first_seen=now, last_seen=now
                )
                self._entries[record.peer_id] = entry
                events.append(
                    RegistryEvent(record.peer_id, "joined", f"{record.state.value} {record.role.value}")
                )
                continue
            if record.updated_at < entry.record.updated_at:
                continue  # an older copy from a slower DHT replica
            previous = entry.record.state
            if entry.gone or previous != record.state:
                detail = f"{'gone' if entry.gone else previous.value} -> {record.state.value}"
                events.append(RegistryEvent(record.peer_id, "state", detail))
                if entry.gone:  # came back (restart with the same identity): judge it afresh
                    entry.first_seen, entry.reachable, entry.failures = now, True, 0
            entry.record, entry.expires_at, entry.last_seen, entry.gone = record, item.expires_at, now, False
        for peer_id, entry in self._entries.items():
            if (
                peer_id not in seen
                and not entry.gone
                and entry.record.state != NodeState.OFFLINE
                and entry.expires_at <= now
            ):
                entry.gone = True
                events.append(
                    RegistryEvent(peer_id, "left", "record expired without an OFFLINE announcement")
                )
        for peer_id in [p for p, e in self._entries.items() if self._forgettable(e, now, seen)]:
            del self._entries[peer_id]
        return self._emit(events)

    def _forgettable(self, entry: CompnodeEntry, now: float, seen: set[str]) -> bool:
        departed = entry.gone or (entry.record.state == NodeState.OFFLINE and entry.peer_id not in seen)
        return departed and now - entry.last_seen > self.forget_after

    def record_pong(self, peer_id: str, rtt: float, now: float) -> list[RegistryEvent]:
        entry = self._entries.get(peer_id)
        if entry is None:
            return []
        entry.last_heartbeat, entry.failures = now, 0
        entry.rtt = rtt if entry.rtt is None else (1 - _RTT_SMOOTHING) * entry.rtt + _RTT_SMOOTHING * rtt
        if not entry.reachable:
            entry.reachable = True
            return self._emit([RegistryEvent(peer_id, "reachable", f"rtt {rtt * 1000:.1f} ms")])
        return []

    def record_traffic(self, peer_id: str, now: float) -> None:
        """Bytes of a call to or from ``peer_id`` moved just now. On a link saturated by bulk transfers
        (weights, checkpoints) pings queue behind the bulk and time out, but the bulk still moves: the
        peer is alive, so this counts as a heartbeat for the timeout (not for the RTT)."""
        entry = self._entries.get(peer_id)
        if entry is not None:
            entry.last_traffic = now if entry.last_traffic is None else max(entry.last_traffic, now)

    def heard_from(self, peer_id: str, now: float, within: float | None = None) -> bool:
        """Whether a pong or call traffic came from ``peer_id`` in the last ``within`` seconds (default:
        the heartbeat timeout)."""
        entry = self._entries.get(peer_id)
        last = None if entry is None else _last_sign_of_life(entry)
        window = self.heartbeat_timeout if within is None else within
        return last is not None and now - last <= window

    def record_failure(self, peer_id: str, now: float) -> list[RegistryEvent]:
        entry = self._entries.get(peer_id)
        if entry is not None:
            entry.failures += 1
        return self.check_timeouts(now)

    def check_timeouts(self, now: float) -> list[RegistryEvent]:
        """Marks unreachable every live compnode that has not answered a ping for ``heartbeat_timeout``."""
        events = []
        for entry in self.entries():
            if entry.gone or entry.record.state == NodeState.OFFLINE or not entry.reachable:
                continue
            last = _last_sign_of_life(entry) or entry.first_seen
            if now - last > self.heartbeat_timeout:
                entry.reachable = False
                events.append(
                    RegistryEvent(
                        entry.peer_id,
                        "unreachable",
                        f"no pong nor traffic for {now - last:.1f} s ({entry.failures} failed pings)",
                    )
                )
        return self._emit(events)


def _last_sign_of_life(entry: CompnodeEntry) -> float | None:
    times = [t for t in (entry.last_heartbeat, entry.last_traffic) if t is not None]
    return max(times) if times else None
