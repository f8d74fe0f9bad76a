"""The multi-host tier: every daemon in its own network namespace with its own IP on a bridge, links shaped
with ``tbf`` on both ends (``fusionnet.runtime.netns``), the daemons started with the README's flags
(``fusionnet.runtime.netns_swarm``, checked against the README here). Needs root and iproute2; skips with
the reason elsewhere. Every namespace, veth and bridge is removed afterwards, also on failure.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime import netns
from fusionnet.runtime.netns import NetLab, clean_leftovers, lab_resources
from fusionnet.runtime.netns_swarm import COMPNODE_METRICS_PORT, NetnsSwarm, broker_argv, compnode_argv
from tests.jobfiles import REPO, example_job

UNAVAILABLE = netns.unavailable()
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"multi-host tier skipped: {UNAVAILABLE}")
TOL = 1e-5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ---- the harness itself ----------------------------------------------------------------------------------
@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_lab_shapes_links_and_removes_everything_even_on_failure() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetLab(2, "20mbit") as lab:
        token = lab.token
        assert len(lab_resources(token)) == 5  # 2 namespaces, a bridge, 2 host-side veths
        qdisc = subprocess.run(
            ["tc", "qdisc", "show", "dev", lab.hosts[0].veth_host], capture_output=True, text=True
        )
        assert "tbf" in qdisc.stdout and "20Mbit" in qdisc.stdout, qdisc.stdout
        inside = lab.run(1, ["ip", "-o", "-4", "addr", "show"]).stdout
        assert lab.hosts[1].ip in inside and "127.0.0.1" in inside
        raise RuntimeError("boom")
    assert lab_resources(token) == []


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(60)
def test_leftovers_of_a_killed_run_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    name = f"{netns.NS_PREFIX}-{dead.pid}-abcdef-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "link", "add", "fbabcdef", "type", "bridge"], check=True)
    subprocess.run(
        ["ip", "link", "set", "dev", "fbabcdef", "alias", f"{netns.NS_PREFIX}-{dead.pid}-abcdef"], check=True
    )
    try:
        removed = clean_leftovers()
        assert name in removed and "fbabcdef" in removed
        assert lab_resources("abcdef") == []
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        subprocess.run(["ip", "link", "delete", "fbabcdef"], capture_output=True)


# ---- the README's commands -------------------------------------------------------------------------------
def _readme_commands() -> dict[str, list[str]]:
    """The commands of the README's "Start it" block, continuation lines joined: kind -> argv."""
    text = (REPO / "README.md").read_text()
    block = text.split("### Start it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    cmds: dict[str, list[str]] = {}
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("fusionnet "):
            argv = shlex.split(line)
            cmds.setdefault(argv[1], argv[2:])
    return cmds


def _flags(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = ""
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []
        else:
            out[key].append(a)
    return out


def test_netns_swarm_runs_the_readme_commands() -> None:
    """The namespace swarm starts daemons with exactly the README's flags (addresses substituted; the state
    dir and address file are the harness's own)."""
    cmds = _readme_commands()
    broker = _flags(cmds["broker"])
    assert broker.pop("--state-dir") and broker.pop("--address-file")
    assert broker == _flags(broker_argv("10.0.0.1", Path("submitters.txt")))
    assert cmds["key"] == []  # the submitter's id, for the broker's --submitters
    compnode = _flags(cmds["compnode"])
    compnode.pop("--state-dir")
    compnode.pop("--address-file", None)
    peers = compnode["--initial-peers"]
    assert compnode == _flags(compnode_argv(peers, "10.0.0.2"))
    status = _flags(cmds["status"])
    assert "--wait-compnodes" in status, "the README tells scripts how to wait for compnodes"


# ---- jobs across namespaces ------------------------------------------------------------------------------
def _run_job(tmp_path: Path, rate: str, job: Path, compnodes: int = 2, **kw: Any) -> tuple[Path, str]:
    with NetLab(compnodes + 1, rate) as lab:
        swarm = NetnsSwarm(lab, tmp_path / "swarm", **kw)
        try:
            swarm.start()
            done = swarm.submit(job, tmp_path / "out", timeout=400)
            logs = swarm.dump_logs()
            assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{logs[-6000:]}"
            # any placement of the job (a re-plan may end on one compnode) that used several compnodes
            split = any(int(n) > 1 for n in re.findall(r"attempt \d+: (\d+) sub-DAG", logs))
            _scrape_data_bytes(lab, swarm, split)
        finally:
            swarm.stop()
        logs = swarm.dump_logs()
    assert lab_resources(lab.token) == []
    return tmp_path / "out", logs


SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def _scrape_data_bytes(lab: NetLab, swarm: NetnsSwarm, split: bool) -> None:
    """Every tensor byte one compnode sent over TCP, another counted as received (issue 16: the received
    counter was never incremented). ``split``: a placement used more than one compnode, so bytes moved; on
    a slow link the performance model may rightly keep a small model on one compnode, and none move."""
    sent = received = 0.0
    for host in lab.hosts[1:]:
        url = f"http://{host.ip}:{COMPNODE_METRICS_PORT}/metrics"
        text = lab.run(0, [sys.executable, "-c", SCRAPE, url]).stdout
        for line in text.splitlines():
            if line.startswith("fusionnet_data_bytes_total{") and 'path="tcp"' in line:
                value = float(line.rsplit(" ", 1)[1])
                if 'direction="sent"' in line:
                    sent += value
                else:
                    received += value
    assert (sent > 0) == split and received == sent, (split, sent, received)


def _check_exact(job_path: Path, out: Path) -> None:
    ref = run_reference(load_job(job_path))
    assert _max_diff(load_file(out / "weights.safetensors"), ref.weights) <= TOL
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(r["loss"] - want) <= 1e-5 for r, want in zip(rows, ref.losses, strict=True))


@needs_netns
@pytest.mark.netns
@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_two_compnodes_at_1gbit_are_exact(tmp_path: Path) -> None:
    # cut where the job says: at 1 Gbit/s the model may rightly keep this small MLP on one compnode
    # (it did on a loaded CI machine), and this test is about values crossing the shaped link
    job = example_job("mlp", tmp_path, steps=6, cuts=["linear_1"])
    try:
        out, logs = _run_job(tmp_path, "1gbit", job)
        _check_exact(job, out)
    finally:
        job.unlink()
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["subdags"]) == 2
    for link in plan["links"]:  # probed over the shaped veths, not loopback
        assert link["bandwidth_bytes_per_second"] < 1.3e9 / 8, link
    assert "127.0.0.1" not in logs.split("===== broker")[0].split("data path listening on")[-1].split("\n")[0]


@needs_netns
@pytest.mark.netns
@pytest.mark.swarm
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_20mbit_keeps_live_compnodes(tmp_path: Path) -> None:
    """~8 MB of weights and checkpoints over 20 Mbit/s links (several seconds each way, longer than the
    heartbeat timeout): no live compnode may be declared lost, and the result stays exact. The compnodes
    have no --data-host (the issue's case): they must announce their --announce-maddrs host."""
    job = example_job(
        "mlp",
        tmp_path,
        steps=3,
        model={"entrypoint": "model.py:build", "kwargs": {"features": 16, "hidden": 1400, "classes": 4}},
    )
    try:
        out, logs = _run_job(tmp_path, "20mbit", job, data_host=False)
        _check_exact(job, out)
    finally:
        job.unlink()
    broker_log = logs.split("===== broker =====")[1]
    job_part = broker_log.split("succeeded;")[0]  # after the job, stopping compnodes do go silent
    assert "unreachable" not in job_part and "lost" not in job_part, job_part[-4000:]
    assert "data path announced as 10." in logs and "data path announced as 127." not in logs
