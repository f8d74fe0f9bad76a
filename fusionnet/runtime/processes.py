"""One ``fusionnet`` daemon as a child process on this machine, and the process-tree helpers to be sure
nothing it started outlives it.

A daemon runs as ``python -m fusionnet.cli.main <kind> ...`` in its own session (so its process group
holds its DHT child and p2pd too), with its log in a file and an address file as the readiness signal.
Stopping sends SIGTERM (graceful leave), SIGKILLs the group after a deadline, then waits for the
descendants seen while it ran and kills (and records) any straggler. Process trees are read from /proc.
Used through ``process_swarm.py`` by ``fusionnet demo``, the benchmarks and the tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from fusionnet.errors import ExecutionError
from fusionnet.rpc.protocol import RPCError

READY_TIMEOUT = 120.0  # start-up of a daemon: a DHT, p2pd and (compnode) hardware profiling
STOP_TIMEOUT = 30.0
CHILDREN_TIMEOUT = 15.0  # after the daemon exited, for its DHT child and p2pd to follow it
LOG_LEVEL_ENV = "FUSIONNET_SWARM_LOG_LEVEL"  # the daemons' --log-level when the caller gives none
T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    interval: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (RPCError,),
) -> T:
    """Polls ``condition`` until it returns something truthy (returned) or ``timeout`` passes (raises).

    A poll that raises one of ``retry_on`` counts as "not yet": a status call whose stream p2pd closed
    early on a busy machine says nothing about what is awaited. The last such error is in the timeout's
    message."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = condition()
        except retry_on as e:
            value, last = None, e
        if value:
            return value
        if time.monotonic() > deadline:
            why = f" (last poll: {type(last).__name__}: {last})" if last is not None else ""
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}{why}")
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


@dataclass
class DaemonProcess:
    """A started daemon: its process, files, and every descendant seen, to stop them all."""

    name: str
    kind: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    address_file: Path
    state_dir: Path
    family: set[int] = field(default_factory=set)  # every descendant pid ever seen
    sockets: set[str] = field(default_factory=set)  # hivemind unix sockets its tree had open
    leftovers: set[int] = field(default_factory=set)  # descendants still alive after the daemon exited
    signals_sent: list[signal.Signals] = field(default_factory=list)
    _maddrs: list[str] = field(default_factory=list)  # from the address file, kept after it is removed

    @property
    def pid(self) -> int:
        return self.proc.pid

    def maddrs(self) -> list[str]:
        if not self._maddrs:
            raise ExecutionError(f"{self.name} is not ready yet")
        return list(self._maddrs)

    @property
    def peer_id(self) -> str:
        """The daemon's libp2p peer id (from its address file; it must be ready)."""
        return self.maddrs()[0].rsplit("/p2p/", 1)[1]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def metrics_url(self) -> str:
        """``http://host:port`` of the metrics server (``--metrics-port``), read from the daemon's log."""
        found = re.search(r"metrics on (http://[^/\s]+)/metrics", self.log_text())
        if found is None:
            raise ExecutionError(f"{self.name} did not log a metrics endpoint (no --metrics-port?)")
        return found.group(1)

    def track(self) -> None:
        """Remembers the process tree (the DHT child and p2pd), to check later that none is left behind."""
        kids = descendants(self.pid)
        self.family |= kids
        self.sockets |= unix_sockets_of(kids | {self.pid})

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> DaemonProcess:
        """Until the daemon wrote its address file; raises if it exits first or ``timeout`` passes."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise ExecutionError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready; see "
                    f"{self.log_path}:\n{self.log_text()[-4000:]}"
                )
            return self.address_file.exists() and bool(self.address_file.read_text().strip())

        try:
            wait_until(ready, timeout, f"{self.name} to write {self.address_file}")
        except TimeoutError as e:
            raise ExecutionError(f"{e}; see {self.log_path}") from e
        self._maddrs = [line for line in self.address_file.read_text().splitlines() if line.strip()]
        self.track()
        return self

    def send(self, sig: signal.Signals) -> None:
        self.track()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
            self.signals_sent.append(sig)

    def wait_exit(self, timeout: float) -> int:
        """Waits for the daemon process itself (``reap`` waits for its children too)."""
        return self.proc.wait(timeout=timeout)

    def reap(self) -> None:
        """After the daemon exited: give its children a moment to follow, then kill and record stragglers,
        and whatever else is left in its process group (a daemon SIGKILLed by fault injection leaves its
        DHT child and p2pd there)."""
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda: not any(alive(p) for p in self.family),
                CHILDREN_TIMEOUT,
                f"{self.name}'s children to exit",
            )
        self.leftovers = {p for p in self.family if alive(p)}
        for pid in self.leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def stop(self, timeout: float = STOP_TIMEOUT, *, reap: bool = True) -> int:
        """SIGTERM (unless already sent: a second one would force the exit), then SIGKILL to the process
        group after ``timeout``; returns the exit code (negative = killed by a signal). ``reap=False``
        leaves waiting for the children to the caller (``reap()``), who may stop other daemons first."""
        if self.proc.poll() is None:
            if signal.SIGTERM not in self.signals_sent:
                self.send(signal.SIGTERM)
            try:
                self.proc.wait(timeout=max(0.1, timeout))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if reap:
            self.reap()
        return self.proc.returncode


def start_daemon(
    kind: str,
    workdir: Path,
    name: str,
    args: Sequence[str] = (),
    log_level: str | None = None,
    extra_env: dict[str, str] | None = None,
    wrap: Sequence[str] = (),
) -> DaemonProcess:
    """Starts ``fusionnet <kind>`` (not waiting for readiness: start several, then ``wait_ready`` each).
    State, address file and log go to ``workdir/<name>.{state,addr,log}``. ``wrap`` prefixes the command
    with a launcher that execs it in place (``ip netns exec NS``: same pid, so stopping works unchanged)."""
    log_level = log_level or os.environ.get(LOG_LEVEL_ENV, "INFO")
    workdir.mkdir(parents=True, exist_ok=True)
    state_dir, address_file, log_path = (
        workdir / f"{name}.state",
        workdir / f"{name}.addr",
        workdir / f"{name}.log",
    )
    address_file.unlink(missing_ok=True)  # a stale one would read as ready
    cmd = [
        *wrap, sys.executable, "-m", "fusionnet.cli.main", "--log-level", log_level, kind,
        "--state-dir", str(state_dir), "--address-file", str(address_file), *args,
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL=os.environ.get("HIVEMIND_LOGLEVEL", "WARNING")
    )
    env.update(extra_env or {})
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: stop() can kill the whole tree
        )
    return DaemonProcess(name, kind, proc, log_path, address_file, state_dir)
