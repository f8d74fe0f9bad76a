"""Refusals that came too late or said too much: ``demo`` checks --output and the job file before it starts
the swarm (a bad --output ran the whole job, then lost its results with the broker that kept them);
``section4`` refuses a bad --output or a size below 1 in one line, writing nothing; a daemon's
--address-file in a folder it cannot write is refused when its config is built, not after it started;
and ``undeploy`` of a name with no deployment exits 2 (bad input), as the README's table now says.
All in one process; no swarm starts."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import fusionnet.daemon.observer as observer_module
import fusionnet.runtime.process_swarm as process_swarm
from fusionnet.cli.main import BAD_INPUT, EXIT_BAD_INPUT, main
from fusionnet.daemon.config import DaemonConfig
from fusionnet.errors import JobError
from fusionnet.rpc.server import RPCContext
from tests.jobfiles import REPO
from tests.test_deployment_lifecycle import _service, _undeploy

pytestmark = pytest.mark.timeout(60)

MLP = REPO / "examples" / "mlp"
PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmWip7R2pWskGRpMQjNA1qc4Xr169CqMTAtuZn1EC93Zzh"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def no_swarm(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the swarm was started")

    monkeypatch.setattr(process_swarm, "ProcessSwarm", refuse)


def test_demo_checks_output_before_the_swarm_starts(
    no_swarm: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    assert main(["demo", "--compnodes", "1", "--output", "/proc/zz"]) == EXIT_BAD_INPUT
    line = _one_line(capsys)
    assert line.startswith("fusionnet demo: error: --output: /proc/zz: cannot create the directory"), line
    (a_file := tmp_path / "results").write_text("")
    assert main(["demo", "--output", str(a_file)]) == EXIT_BAD_INPUT
    assert "exists and is not a directory" in _one_line(capsys)
    assert time.monotonic() - started < 10


def test_demo_checks_the_job_file_before_the_swarm_starts(
    no_swarm: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_dir = tmp_path / "job"
    shutil.copytree(MLP, job_dir, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
    doc = yaml.safe_load((job_dir / "job.yaml").read_text())
    (job_dir / "bad.yaml").write_text(yaml.safe_dump({**doc, "no_such_key": 1}))
    out = tmp_path / "out"
    assert main(["demo", "--job", str(job_dir / "bad.yaml"), "--output", str(out)]) == EXIT_BAD_INPUT
    assert "no_such_key" in _one_line(capsys)
    assert not out.exists()  # the --output check made nothing that stays


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--output", "/proc/zz"], "--output: /proc/zz: cannot create the directory"),
        (["--n-batches", "0"], "--n-batches: must be >= 1, got 0"),
        (["--batch-size", "-2"], "--batch-size: must be >= 1, got -2"),
        (["--gpt-seq", "0"], "--gpt-seq: must be >= 1, got 0"),
    ],
)
def test_section4_refuses_in_one_line_and_writes_nothing(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s4"
    argv = ["section4", "--no-plot", "--no-simulate", *flags]
    assert main(argv if "--output" in flags else [*argv, "--output", str(out)]) == EXIT_BAD_INPUT
    line = _one_line(capsys)
    assert line.startswith(f"fusionnet section4: error: {says}"), line
    assert "--plot" not in line and not out.exists()


@pytest.mark.parametrize("command", ["broker", "compnode"])
def test_an_address_file_in_a_folder_that_cannot_be_made_is_refused_before_the_daemon_starts(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    argv = [
        command,
        "--address-file",
        "/proc/nope/addr",
        *(["--initial-peers", PEER] * (command == "compnode")),
    ]
    assert main(argv) == EXIT_BAD_INPUT
    line = _one_line(capsys)
    assert line.startswith(f"fusionnet {command}: error: --address-file /proc/nope/addr: cannot write"), line
    assert time.monotonic() - started < 10


def test_the_address_file_check_leaves_no_folder_behind(tmp_path: Path) -> None:
    DaemonConfig(address_file=tmp_path / "a" / "b" / "broker.addr")
    assert list(tmp_path.iterdir()) == []  # the daemon makes them when it writes the file


def test_undeploy_of_an_unknown_name_exits_2_as_the_readme_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's convention: 2 for bad input (an unknown name), 1 when the work failed; its undeploy row
    said 1. Through the command, with the broker's deployment service answering in this process."""
    service, _ = _service(tmp_path, monkeypatch)
    with pytest.raises(JobError, match="no deployment named 'nosuch'") as refused:
        asyncio.run(_undeploy(service, "nosuch"))
    assert isinstance(refused.value, BAD_INPUT)

    class Peer:
        peer_id = "12D3KooWClientClientClientClientClientClientClient"

        def __init__(self) -> None:
            async def call(peer: str, method: str, payload: Any = None, **kw: Any) -> dict:
                rpc = getattr(service, f"rpc_{method}")
                return await rpc(payload, RPCContext(remote_peer=self.peer_id, method=method))

            self.client = SimpleNamespace(call=call)

        async def stop(self, rpc_grace: float = 0.0) -> None:
            pass

    async def start(config: Any, serve: bool = True) -> Peer:
        return Peer()

    monkeypatch.setattr(observer_module.SwarmPeer, "start", start)
    monkeypatch.setenv("FUSIONNET_HOME", str(tmp_path / "home"))
    assert main(["undeploy", "nosuch", "--initial-peers", PEER]) == EXIT_BAD_INPUT
    assert _one_line(capsys) == "fusionnet undeploy: error: no deployment named 'nosuch'"
    row = next(
        line for line in (REPO / "README.md").read_text().splitlines() if "| `fusionnet undeploy " in line
    )
    assert "exit 2 when this key has no deployment of that name" in row, row


def test_demo_without_the_bundled_example_says_to_pass_a_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A non-editable install (``pip install .``, the Docker image) has no ``examples/``: the demo says
    so and names ``--job``, instead of 'no such file' under site-packages."""
    from fusionnet.cli import cmd_demo

    missing = tmp_path / "site-packages" / "examples" / "gpt" / "job.yaml"
    monkeypatch.setattr(cmd_demo, "BUNDLED_JOB", missing)
    args = argparse.Namespace(compnodes=1, output=tmp_path / "out", job=missing, workdir=None)
    with pytest.raises(JobError, match=r"not installed with the package .* pass --job JOB.yaml"):
        cmd_demo.run(args)
