"""Starting and stopping real daemon processes (broker, compnodes) on 127.0.0.1 for tests.

Every daemon runs as ``python -m fusionnet.cli.main <kind> ...`` in its own session, with its log captured
to a file and an address file as the readiness signal. Whatever happens in the test, the context managers
stop every process they started (SIGTERM, then SIGKILL after a deadline, then any straggler descendant),
and print the daemons' logs when the test failed.

Also: ``SwarmObserver``-based helpers to read the swarm from the test process (``Observer``), process-tree
inspection through /proc (``descendants``, ``alive``), and ``wait_until`` (a condition with a deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


# ---- waiting and processes ----------------------------------------------------------------------------
def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Polls ``condition`` until it returns something truthy (returned) or ``timeout`` passes (raises)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None if it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (children, grandchildren, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[0] not in ("Z", "X"):
                parents.setdefault(st[1], []).append(int(entry.name))
    found, frontier = set(), [pid]
    while frontier:
        for child in parents.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def unix_sockets_of(pids: set[int]) -> set[str]:
    """Paths of the hivemind unix sockets (p2pd control, p2p client) that ``pids`` have open."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    paths = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/tmp/hivemind-"):
                paths.add(parts[7])
    return paths


# ---- one daemon ---------------------------------------------------------------------------------------
@dataclass
class DaemonProcess:
    name: str
    kind: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    address_file: Path
    state_dir: Path
    family: set[int] = field(default_factory=set)  # every descendant pid ever seen
    sockets: set[str] = field(default_factory=set)  # p2pd socket paths seen on their command lines
    leftovers: set[int] = field(default_factory=set)  # descendants still alive after the daemon exited
    signals_sent: list[signal.Signals] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    _maddrs: list[str] = field(default_factory=list)  # from the address file, kept after it is removed

    def maddrs(self) -> list[str]:
        assert self._maddrs, f"{self.name} is not ready yet"
        return list(self._maddrs)

    @property
    def peer_id(self) -> str:
        return self.maddrs()[0].rsplit("/p2p/", 1)[1]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics_url(self) -> str:
        """``http://host:port`` of the metrics server (``--metrics-port``), read from the daemon's log."""
        found = re.search(r"metrics on (http://[^/\s]+)/metrics", self.log_text())
        assert found is not None, f"{self.name} did not log a metrics endpoint (no --metrics-port?)"
        return found.group(1)

    def track(self) -> None:
        """Remembers the process tree (the DHT child and p2pd), to check later that none is left behind."""
        kids = descendants(self.pid)
        self.family |= kids
        self.sockets |= unix_sockets_of(kids | {self.pid})

    def wait_ready(self, timeout: float = 90.0) -> DaemonProcess:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n{self.log_text()}"
                )
            return self.address_file.exists() and bool(self.address_file.read_text().strip())

        wait_until(ready, timeout, f"{self.name} to write {self.address_file}")
        self._maddrs = [line for line in self.address_file.read_text().splitlines() if line.strip()]
        self.track()
        return self

    def send(self, sig: signal.Signals) -> None:
        self.track()
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
            self.signals_sent.append(sig)

    def wait_exit(self, timeout: float) -> int:
        """Waits for the daemon process itself (call ``reap`` to wait for its children too)."""
        return self.proc.wait(timeout=timeout)

    def reap(self) -> None:
        """After the daemon exited: give its children a moment to follow, then kill and record stragglers."""
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: not any(alive(p) for p in self.family), 15.0, f"{self.name}'s children to exit"
            )
        self.leftovers = {p for p in self.family if alive(p)}
        for pid in self.leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (unless already sent: a second one would force the exit), then SIGKILL after ``timeout``;
        returns the exit code (negative = killed by a signal)."""
        if self.proc.poll() is None:
            if signal.SIGTERM not in self.signals_sent:
                self.send(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.reap()
        return self.proc.returncode


def start_daemon(
    kind: str,
    workdir: Path,
    name: str,
    args: Sequence[str] = (),
    log_level: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> DaemonProcess:
    """Starts ``fusionnet <kind>`` (not waiting for readiness: start several, then ``wait_ready`` each)."""
    log_level = log_level or os.environ.get("FUSIONNET_TEST_LOG_LEVEL", "INFO")
    workdir.mkdir(parents=True, exist_ok=True)
    state_dir, address_file, log_path = (
        workdir / f"{name}.state",
        workdir / f"{name}.addr",
        workdir / f"{name}.log",
    )
    cmd = [
        sys.executable, "-m", "fusionnet.cli.main", "--log-level", log_level, kind,
        "--state-dir", str(state_dir), "--address-file", str(address_file), *args,
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL=os.environ.get("HIVEMIND_LOGLEVEL", "WARNING")
    )
    env.update(extra_env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
    return DaemonProcess(name, kind, proc, log_path, address_file, state_dir)


def broker_args(
    refresh_period: float = 1.0,
    heartbeat_period: float = 0.5,
    heartbeat_timeout: float = 3.0,
    extra: Sequence[str] = (),
) -> list[str]:
    return [
        "--refresh-period", str(refresh_period),
        "--heartbeat-period", str(heartbeat_period),
        "--heartbeat-timeout", str(heartbeat_timeout),
        *extra,
    ]  # fmt: skip


def compnode_args(
    initial_peers: Sequence[str], *, role: str = "supernode", backup: bool = False, threads: int = 1,
    refresh_period: float = 1.0, extra: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    args = ["--initial-peers", *initial_peers, "--role", role, "--threads", str(threads)]
    args += ["--refresh-period", str(refresh_period), *(["--backup"] if backup else []), *extra]
    return args


# ---- a swarm --------------------------------------------------------------------------------------------
@dataclass
class Swarm:
    workdir: Path
    broker: DaemonProcess
    compnodes: list[DaemonProcess] = field(default_factory=list)
    extra: list[DaemonProcess] = field(default_factory=list)  # started later by the test

    @property
    def initial_peers(self) -> list[str]:
        return self.broker.maddrs()

    @property
    def daemons(self) -> list[DaemonProcess]:
        return [*self.compnodes, *self.extra, self.broker]

    def add_compnode(
        self, name: str, wait: bool = True, env: dict[str, str] | None = None, **kwargs: Any
    ) -> DaemonProcess:
        args = compnode_args(self.initial_peers, **kwargs)
        daemon = start_daemon("compnode", self.workdir, name, args, extra_env=env)
        self.extra.append(daemon)
        return daemon.wait_ready() if wait else daemon

    def stop_all(self) -> dict[str, int]:
        """SIGTERM to every compnode at once, then the broker once they are gone; returns exit codes."""
        compnodes = [d for d in self.daemons if d is not self.broker]
        for daemon in compnodes:
            with contextlib.suppress(ProcessLookupError):
                daemon.send(signal.SIGTERM)
        codes = {d.name: d.stop() for d in compnodes}
        codes[self.broker.name] = self.broker.stop()
        return codes

    def dump_logs(self) -> str:
        return "\n".join(
            f"===== {d.name} ({d.kind}, pid {d.pid}) =====\n{d.log_text()}" for d in self.daemons
        )


@contextlib.contextmanager
def print_logs_on_failure(swarm: Swarm) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print(swarm.dump_logs(), file=sys.stderr)
        raise


@contextlib.contextmanager
def running_swarm(
    workdir: Path, compnodes: Sequence[dict[str, Any]] = ({}, {}), *, broker_kw: dict[str, Any] | None = None
) -> Iterator[Swarm]:
    """A broker and one compnode per entry of ``compnodes`` (keyword arguments of ``compnode_args``), all
    ready; everything is stopped on exit, whatever happened."""
    broker = start_daemon("broker", workdir, "broker", broker_args(**(broker_kw or {})))
    swarm = Swarm(workdir, broker)
    try:
        with print_logs_on_failure(swarm):
            broker.wait_ready()
            swarm.compnodes = [
                start_daemon(
                    "compnode",
                    workdir,
                    f"compnode{i}",
                    compnode_args(broker.maddrs(), **{k: v for k, v in kw.items() if k != "env"}),
                    extra_env=kw.get("env"),
                )
                for i, kw in enumerate(compnodes)
            ]
            for daemon in swarm.compnodes:
                daemon.wait_ready()
            yield swarm
    finally:
        swarm.stop_all()


# ---- looking at the swarm from the test process ---------------------------------------------------------
class Observer:
    """A DHT client in the test process (one event loop kept across calls): reads records and the broker's
    status without paying for a new process per look."""

    def __init__(self, initial_peers: Sequence[str]):
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

    def call(self, peer_id: str, method: str, payload: dict | None = None, timeout: float = 10.0) -> dict:
        return self.run(self._observer.call(peer_id, method, payload, timeout=timeout), timeout + 5)

    @property
    def p2p(self) -> Any:
        assert self._observer.peer is not None
        return self._observer.peer.p2p

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._runner.run(self._observer.__aexit__(None, None, None))
        self._runner.close()


def scrape(url: str, timeout: float = 10.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus text endpoint as {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def run_status_cli(initial_peers: Sequence[str], timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """``fusionnet status --json`` as a user runs it: (exit code, parsed document)."""
    out = subprocess.run(
        [sys.executable, "-m", "fusionnet.cli.main", "status", "--initial-peers", *initial_peers, "--json"],
        capture_output=True,
        cwd=REPO,
        timeout=timeout,
        env=dict(os.environ, HIVEMIND_LOGLEVEL="WARNING"),
    )
    try:
        return out.returncode, json.loads(out.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(
            f"status printed no JSON (exit {out.returncode}):\n{out.stdout!r}\n{out.stderr.decode()}"
        ) from e
