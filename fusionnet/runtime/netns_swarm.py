"""A swarm across "machines": the broker (and the submitter) in one network namespace, each compnode in
its own, every link shaped (``netns.NetLab``), each daemon started with the flags of the README's "Running a
real swarm" section (``tests/test_netns.py`` checks that the README says the same). Used by the multi-host
test tier and ``benchmarks/links.py``.

Readiness is what the README tells scripts to use: each daemon's address file, then
``fusionnet status --wait-compnodes N`` run from the broker's host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fusionnet.errors import ExecutionError
from fusionnet.runtime.jobcontrol import ready_compnodes
from fusionnet.runtime.netns import NetLab
from fusionnet.runtime.processes import READY_TIMEOUT, DaemonProcess, start_daemon

BROKER_PORT, COMPNODE_PORT, DATA_PORT = 31337, 31338, 31400
BROKER_METRICS_PORT, COMPNODE_METRICS_PORT = 9700, 9701


def broker_argv(ip: str, submitters: Path) -> list[str]:
    """The README's broker command for a machine at ``ip`` taking submissions from the ids in
    ``submitters`` (--state-dir and --address-file added by ``start_daemon``)."""
    return [
        "--host-maddrs", f"/ip4/0.0.0.0/tcp/{BROKER_PORT}",
        "--announce-maddrs", f"/ip4/{ip}/tcp/{BROKER_PORT}",
        "--metrics-host", "0.0.0.0", "--metrics-port", str(BROKER_METRICS_PORT),
        "--submitters", str(submitters),
    ]  # fmt: skip


def compnode_argv(
    broker: Sequence[str], ip: str, *, backup: bool = False, data_host: bool = True
) -> list[str]:
    """The README's compnode command for a machine at ``ip`` (``data_host=False`` leaves ``--data-host``
    out: the compnode must then find its address from ``--announce-maddrs``)."""
    argv = [
        "--initial-peers", *broker,
        "--host-maddrs", f"/ip4/0.0.0.0/tcp/{COMPNODE_PORT}",
        "--announce-maddrs", f"/ip4/{ip}/tcp/{COMPNODE_PORT}",
        "--data-host", ip, "--data-port", str(DATA_PORT),
        "--metrics-host", "0.0.0.0", "--metrics-port", str(COMPNODE_METRICS_PORT),
        "--metrics-announce-host", ip,
        "--role", "supernode", *(["--backup"] if backup else []),
    ]  # fmt: skip
    if not data_host:
        i = argv.index("--data-host")
        del argv[i : i + 2]
    return argv


def fusionnet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fusionnet.cli.main", *args]


@dataclass
class NetnsSwarm:
    """A broker on ``lab.hosts[0]`` and one compnode on each other host (``backups`` of them, the last ones,
    with ``--backup``). ``compnode_extra`` is added to every compnode's flags (``--threads 1``)."""

    lab: NetLab
    workdir: Path
    backups: int = 0
    compnode_extra: Sequence[str] = ("--threads", "1")
    broker_extra: Sequence[str] = ()
    data_host: bool = True  # pass the README's --data-host (False: rely on the default)
    env: dict[str, str] = field(default_factory=dict)
    compnode_env: dict[int, dict[str, str]] = field(default_factory=dict)  # more, for compnode i only
    broker: DaemonProcess | None = None
    compnodes: list[DaemonProcess] = field(default_factory=list)

    @property
    def initial_peers(self) -> list[str]:
        if self.broker is None:
            raise ExecutionError("the swarm is not started")
        return self.broker.maddrs()

    def _env(self) -> dict[str, str]:
        # the submitter's key lives in the swarm's folder, not in the home of whoever runs the tests
        return {"OMP_NUM_THREADS": "1", "FUSIONNET_HOME": str(self.workdir / "submitter"), **self.env}

    def _submitters(self) -> Path:
        """The README's way in for a submitter on a broker that is not on loopback: ``fusionnet key`` on
        the submitting machine (the broker's host here), its id a line of the broker's --submitters."""
        done = self.run_head(["key"], 120)
        if done.returncode != 0:
            raise ExecutionError(f"fusionnet key failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        path = self.workdir / "submitters.txt"
        path.write_text(done.stdout.strip() + "\n")
        return path

    def start(self, timeout: float = READY_TIMEOUT) -> NetnsSwarm:
        deadline = time.monotonic() + timeout
        try:
            head = self.lab.hosts[0]
            argv = [*broker_argv(head.ip, self._submitters()), *self.broker_extra]
            self.broker = start_daemon(
                "broker", self.workdir, "broker", argv,
                extra_env=self._env(), wrap=self.lab.wrap(head),
            )  # fmt: skip
            self.broker.wait_ready(timeout)
            hosts = self.lab.hosts[1:]
            for i, host in enumerate(hosts):
                backup = i >= len(hosts) - self.backups
                argv = compnode_argv(self.initial_peers, host.ip, backup=backup, data_host=self.data_host)
                argv += self.compnode_extra
                self.compnodes.append(
                    start_daemon(
                        "compnode",
                        self.workdir,
                        f"compnode{i}",
                        argv,
                        extra_env={**self._env(), **self.compnode_env.get(i, {})},
                        wrap=self.lab.wrap(host),
                    )
                )
            for daemon in self.compnodes:
                daemon.wait_ready(max(1.0, deadline - time.monotonic()))
            self.wait_compnodes(len(self.compnodes) - self.backups, max(5.0, deadline - time.monotonic()))
            if self.backups:
                self.wait_backups(self.backups, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def run_head(self, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Runs a ``fusionnet`` command on the broker's host (where the README's submitter sits)."""
        env = {**os.environ, **self._env()}
        cmd = [*self.lab.wrap(0), *fusionnet_cmd(*argv)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)

    def wait_compnodes(self, n: int, timeout: float) -> None:
        """``fusionnet status --wait-compnodes N --timeout S``: the README's readiness check."""
        argv = ["status", "--initial-peers", *self.initial_peers, "--wait-compnodes", str(n)]
        done = self.run_head([*argv, "--timeout", str(round(timeout, 1))], timeout + 60)
        if done.returncode != 0:
            raise ExecutionError(
                f"{n} compnodes not ready at the broker:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )

    def wait_backups(self, n: int, deadline: float) -> None:
        """Until the broker lists ``n`` backups ready too (``status --wait-compnodes`` counts the others)."""
        while True:
            left = deadline - time.monotonic()
            done = self.run_head(["status", "--initial-peers", *self.initial_peers, "--json"], 60)
            if done.returncode == 0:
                listed = [c for c in json.loads(done.stdout)["compnodes"] if c.get("known_to_broker")]
                if ready_compnodes(listed)[1] >= n:
                    return
            if left <= 0:
                raise ExecutionError(f"{n} backup compnodes not ready at the broker:\n{done.stdout[-2000:]}")
            time.sleep(1.0)  # a poll of a daemon in another namespace; the deadline bounds it

    def submit(self, job: Path, out: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """The README's ``fusionnet submit JOB --initial-peers ... --output OUT`` from the broker's host."""
        argv = ["submit", str(job), "--initial-peers", *self.initial_peers, "--output", str(out)]
        return self.run_head([*argv, "--timeout", str(int(timeout))], timeout + 60)

    def stop(self) -> dict[str, int]:
        for daemon in self.compnodes:
            daemon.send(signal.SIGTERM)
        codes = {d.name: d.stop() for d in self.compnodes}
        if self.broker is not None:
            codes[self.broker.name] = self.broker.stop()
        return codes

    def dump_logs(self) -> str:
        daemons = [*self.compnodes, *([self.broker] if self.broker else [])]
        return "\n".join(f"===== {d.name} =====\n{d.log_text()}" for d in daemons)

    def __enter__(self) -> NetnsSwarm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
