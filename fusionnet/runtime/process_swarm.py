"""A whole swarm on this machine: a broker and compnodes, each its own ``fusionnet`` process on loopback
with a real DHT. The one harness of ``fusionnet demo``, the benchmarks and the tests.

(Not to be confused with ``local.InMemorySwarm``: executors in one process over an in-memory channel.)

Readiness is the address file each daemon writes once it is fully up; membership is the broker's own
``status`` (compnodes ONLINE with a data path). Stopping sends SIGTERM (graceful leave) to every compnode
at once, then to the broker, and kills whatever outlives the deadline, so nothing is left behind.
``BlockingObserver`` reads the swarm from a synchronous caller (a test) without a process per look.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusionnet.errors import ExecutionError
from fusionnet.runtime.processes import READY_TIMEOUT, DaemonProcess, start_daemon, wait_until

if TYPE_CHECKING:
    from fusionnet.daemon.observer import SwarmObserver


def broker_args(
    refresh_period: float = 1.0,
    heartbeat_period: float = 0.5,
    heartbeat_timeout: float = 3.0,
    extra: Sequence[str] = (),
    stage_part_mb: float = 0.1,
) -> list[str]:
    """Broker flags with quick refreshes and heartbeats (tests see failures in seconds), and slices
    staged in parts from 100 KB on, so that test-sized models take the path large ones take."""
    return [
        "--refresh-period", str(refresh_period),
        "--heartbeat-period", str(heartbeat_period),
        "--heartbeat-timeout", str(heartbeat_timeout),
        "--stage-part-mb", str(stage_part_mb),
        *extra,
    ]  # fmt: skip


def members_online(broker_status: Mapping[str, Any]) -> int:
    """Compnodes the broker lists ONLINE with a data path: ready for work (the DHT alone can be ahead)."""
    return sum(1 for c in broker_status["compnodes"] if c["state"] == "ONLINE" and c["data_path_address"])


@dataclass(frozen=True)
class CompnodeSpec:
    """How to start one compnode of a swarm."""

    role: str = "supernode"
    backup: bool = False
    threads: int | None = 1  # None: torch's choice
    refresh_period: float = 1.0
    extra: Sequence[str] = ()  # more flags (--slowdown 2, --metrics-port 0, ...)
    env: Mapping[str, str] = field(default_factory=dict)  # more environment (FUSIONNET_FAULT=...)

    def args(self, initial_peers: Sequence[str]) -> list[str]:
        args = ["--initial-peers", *initial_peers, "--role", self.role]
        args += ["--threads", str(self.threads)] if self.threads is not None else []
        args += ["--refresh-period", str(self.refresh_period), *(["--backup"] if self.backup else [])]
        return [*args, *self.extra]


@dataclass
class ProcessSwarm:
    """A broker and one compnode per spec, started by ``start()`` (or ``with``), all stopped by ``stop()``."""

    workdir: Path
    specs: Sequence[CompnodeSpec] = (CompnodeSpec(), CompnodeSpec())
    broker_argv: Sequence[str] = field(default_factory=broker_args)
    log_level: str | None = None
    broker: DaemonProcess | None = None
    compnodes: list[DaemonProcess] = field(default_factory=list)  # one per spec, started with the swarm
    extra: list[DaemonProcess] = field(default_factory=list)  # added later (``add_compnode``)

    @property
    def initial_peers(self) -> list[str]:
        if self.broker is None:
            raise ExecutionError("the swarm is not started")
        return self.broker.maddrs()

    @property
    def daemons(self) -> list[DaemonProcess]:
        return [*self.compnodes, *self.extra, *([self.broker] if self.broker else [])]

    def _start_compnode(self, name: str, spec: CompnodeSpec) -> DaemonProcess:
        args = spec.args(self.initial_peers)
        return start_daemon("compnode", self.workdir, name, args, self.log_level, dict(spec.env))

    def start(self, timeout: float = READY_TIMEOUT) -> ProcessSwarm:
        """Starts the broker, then every compnode at once; returns once all wrote their address files."""
        deadline = time.monotonic() + timeout
        try:
            self.broker = start_daemon("broker", self.workdir, "broker", self.broker_argv, self.log_level)
            self.broker.wait_ready(timeout)
            self.compnodes = [self._start_compnode(f"compnode{i}", s) for i, s in enumerate(self.specs)]
            for daemon in self.compnodes:
                daemon.wait_ready(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def add_compnode(self, name: str, spec: CompnodeSpec | None = None, wait: bool = True) -> DaemonProcess:
        daemon = self._start_compnode(name, spec or CompnodeSpec())
        self.extra.append(daemon)
        return daemon.wait_ready() if wait else daemon

    async def wait_members(self, observer: SwarmObserver, timeout: float = READY_TIMEOUT) -> None:
        """Until the broker lists every compnode ONLINE with a data path (its registry, not just the DHT)."""
        deadline = time.monotonic() + timeout
        wanted = len(self.compnodes) + len(self.extra)
        while True:
            online = members_online(await observer.broker_status())
            if online >= wanted:
                return
            if time.monotonic() > deadline:
                raise ExecutionError(
                    f"only {online} of {wanted} compnodes joined within {timeout:.0f} s; "
                    f"logs in {self.workdir}"
                )
            await asyncio.sleep(0.2)

    def stop(self) -> dict[str, int]:
        """SIGTERM to every compnode at once, then the broker once they are gone; returns exit codes.
        Their children (DHT child, p2pd, torch's shared-memory manager, which lingers 2 s after its last
        client by design) are waited for together at the end, not daemon after daemon."""
        compnodes = [d for d in self.daemons if d is not self.broker]
        for daemon in compnodes:
            daemon.send(signal.SIGTERM)
        codes = {d.name: d.stop(reap=False) for d in compnodes}
        if self.broker is not None:
            codes[self.broker.name] = self.broker.stop(reap=False)
        for daemon in self.daemons:
            daemon.reap()
        return codes

    def dump_logs(self) -> str:
        return "\n".join(
            f"===== {d.name} ({d.kind}, pid {d.pid}) =====\n{d.log_text()}" for d in self.daemons
        )

    def __enter__(self) -> ProcessSwarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_swarm(
    workdir: Path,
    compnodes: Sequence[CompnodeSpec | Mapping[str, Any]] = ({}, {}),
    *,
    broker_kw: Mapping[str, Any] | None = None,
) -> Iterator[ProcessSwarm]:
    """A ready broker (``broker_args(**broker_kw)``) and one compnode per entry (a ``CompnodeSpec`` or its
    keywords); everything is stopped on exit, and the daemons' logs go to stderr if the body failed."""
    specs = [s if isinstance(s, CompnodeSpec) else CompnodeSpec(**s) for s in compnodes]
    swarm = ProcessSwarm(workdir, specs, broker_args(**(broker_kw or {})))
    try:
        with print_logs_on_failure(swarm):
            swarm.start()
            yield swarm
    finally:
        swarm.stop()


@contextlib.contextmanager
def print_logs_on_failure(swarm: ProcessSwarm) -> Iterator[None]:
    """Every daemon's log to stderr if the body raises (a failed test shows what the daemons saw)."""
    try:
        yield
    except BaseException:
        print(swarm.dump_logs(), file=sys.stderr)
        raise


class BlockingObserver:
    """A ``SwarmObserver`` for synchronous callers: one event loop kept across calls, so reading records
    and the broker's status costs no new DHT peer per look. ``close()`` when done."""

    def __init__(self, initial_peers: Sequence[str]) -> None:
        from fusionnet.daemon.observer import SwarmObserver

        self._runner = asyncio.Runner()
        self._observer = SwarmObserver(initial_peers)
        self._runner.run(self._observer.__aenter__())

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return self._runner.run(asyncio.wait_for(coro, timeout))

    def records(self) -> dict[str, Any]:
        """peer id -> CompnodeRecord, straight from the DHT."""
        return {f.record.peer_id: f.record for f in self.run(self._observer.compnodes())}

    def broker_status(self) -> dict[str, Any]:
        return self.run(self._observer.broker_status())

    def brokers(self) -> list[Any]:
        """The broker records in the DHT (``Found[BrokerRecord]``), whoever announced them."""
        return self.run(self._observer.brokers())

    @property
    def peer_id(self) -> str:
        return self._observer.peer_id

    def call(self, peer_id: str, method: str, payload: dict | None = None, timeout: float = 10.0) -> dict:
        return self.run(self._observer.call(peer_id, method, payload, timeout=timeout), timeout + 5)

    def as_submitter(
        self, method: str, payload: dict, timeout: float = 10.0, key: Path | None = None
    ) -> dict:
        """``call`` of a job method on the pinned broker, signed with the submitter key (default: this
        user's, ``runtime.submitter``) as ``fusionnet submit``, ``cancel`` and ``results`` sign theirs."""
        from fusionnet.messages.broker_rpc import SubmitJobRequest
        from fusionnet.runtime.submit import signed
        from fusionnet.runtime.submitter import Signer, load_or_create_key

        broker = self.run(self._observer.find_broker())
        signer = Signer(load_or_create_key(key), broker, self._observer.peer_id)
        if method == "submit_job":
            payload = signed(SubmitJobRequest.model_validate(payload), signer).model_dump()
        else:
            payload = {**payload, "auth": signer.auth(method, payload.get("job_id", "")).model_dump()}
        return self.call(broker, method, payload, timeout)

    def wait_online(self, n: int, timeout: float = 90.0) -> None:
        """Until the broker lists ``n`` compnodes ONLINE with a data path."""
        what = f"{n} compnodes ONLINE at the broker"
        wait_until(lambda: members_online(self.broker_status()) >= n, timeout, what)

    @property
    def p2p(self) -> Any:
        assert self._observer.peer is not None
        return self._observer.peer.p2p

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._runner.run(self._observer.__aexit__(None, None, None))
        self._runner.close()
