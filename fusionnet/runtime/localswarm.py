"""A whole swarm on this machine: a broker and N compnodes, each its own ``fusionnet`` process on loopback
with a real DHT. Used by ``fusionnet demo`` and the benchmarks.

Readiness is the address file each daemon writes once it is fully up; membership is the broker's own
``status`` (compnodes ONLINE with a data path). Stopping sends SIGTERM (graceful leave) to compnodes,
then to the broker, and SIGKILLs whatever outlives the deadline, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fusionnet.errors import ExecutionError

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


@dataclass
class LocalDaemon:
    name: str
    proc: subprocess.Popen[bytes]
    address_file: Path
    log_path: Path
    log: IO[bytes]

    def maddrs(self) -> list[str]:
        text = self.address_file.read_text() if self.address_file.exists() else ""
        return [line for line in text.splitlines() if line.strip()]

    def wait_ready(self, deadline: float) -> None:
        while not self.maddrs():
            if self.proc.poll() is not None:
                raise ExecutionError(
                    f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                    f"see {self.log_path}"
                )
            if time.monotonic() > deadline:
                raise ExecutionError(
                    f"{self.name} was not ready within {READY_TIMEOUT:.0f} s; see {self.log_path}"
                )
            time.sleep(0.05)

    def stop(self, deadline: float, *, signalled: bool = False) -> None:
        """SIGTERM (unless ``signalled``: a second one would force the exit), SIGKILL after ``deadline``."""
        if self.proc.poll() is None:
            if not signalled:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # A daemon that died the hard way (SIGKILL in fault injection) leaves its DHT and p2pd children
        # behind in its process group: they go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()

    @property
    def peer_id(self) -> str:
        """The daemon's libp2p peer id (from its address file; it must be ready)."""
        return self.maddrs()[0].rsplit("/p2p/", 1)[1]


@dataclass
class LocalSwarm:
    workdir: Path
    compnodes: int = 3
    threads: int | None = 1
    log_level: str = "INFO"
    extra_compnode_args: list[str] = field(default_factory=list)
    node_args: dict[int, list[str]] = field(default_factory=dict)  # compnode index -> more args (--backup)
    node_env: dict[int, dict[str, str]] = field(default_factory=dict)  # compnode index -> more env vars
    broker_args: list[str] = field(default_factory=list)  # more broker args (--placement balanced)
    broker: LocalDaemon | None = None
    nodes: list[LocalDaemon] = field(default_factory=list)

    @property
    def initial_peers(self) -> list[str]:
        assert self.broker is not None
        return self.broker.maddrs()

    def _start(self, name: str, kind: str, args: list[str], env: dict[str, str] | None = None) -> LocalDaemon:
        self.workdir.mkdir(parents=True, exist_ok=True)
        address_file = self.workdir / f"{name}.addr"
        address_file.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed by LocalDaemon.stop
        cmd = [
            sys.executable, "-m", "fusionnet.cli.main", "--log-level", self.log_level, kind,
            "--state-dir", str(self.workdir / f"{name}.state"), "--address-file", str(address_file), *args,
        ]  # fmt: skip
        env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return LocalDaemon(name, proc, address_file, log_path, log)

    def start(self) -> LocalSwarm:
        deadline = time.monotonic() + READY_TIMEOUT
        try:
            self.broker = self._start("broker", "broker", ["--refresh-period", "2", *self.broker_args])
            self.broker.wait_ready(deadline)
            for i in range(self.compnodes):
                args = ["--initial-peers", *self.initial_peers, "--refresh-period", "2"]
                if self.threads is not None:
                    args += ["--threads", str(self.threads)]
                args += self.extra_compnode_args + self.node_args.get(i, [])
                self.nodes.append(self._start(f"compnode{i}", "compnode", args, self.node_env.get(i)))
            for node in self.nodes:
                node.wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_members(self, observer: object, timeout: float = READY_TIMEOUT) -> None:
        """Until the broker lists every compnode ONLINE with a data path (its registry, not just the DHT)."""
        import asyncio

        deadline = time.monotonic() + timeout
        while True:
            status = await observer.broker_status()  # type: ignore[attr-defined]
            online = [c for c in status["compnodes"] if c["state"] == "ONLINE" and c["data_path_address"]]
            if len(online) >= self.compnodes:
                return
            if time.monotonic() > deadline:
                raise ExecutionError(
                    f"only {len(online)} of {self.compnodes} compnodes joined within {timeout:.0f} s; "
                    f"logs in {self.workdir}"
                )
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT
        for node in self.nodes:  # SIGTERM to all compnodes at once, then wait for each
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop(deadline, signalled=True)
        if self.broker is not None:
            self.broker.stop(deadline + STOP_TIMEOUT)

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
