"""A real Prometheus server scraping FusionNet metrics endpoints on 127.0.0.1.

Prometheus runs with a configuration generated from deploy/prometheus.yml (1 s intervals, targets
rewritten to loopback, the deploy alert rules loaded) and is queried through its HTTP API with
deadline-polling loops. Two tests:

- ``test_http_sd_discovers_compnodes``: metrics servers of this package in the test process (one broker
  registry serving http_sd, compnode registries); a compnode that joins mid-way is discovered through
  the broker's ``/sd/compnodes``, one that leaves is dropped; scraped values equal the values set.
- ``test_real_swarm_is_scraped``: the real broker and compnode daemons (tests/swarm_utils.py), compnodes
  found through file_sd, one joining mid-way; asserts the daemons' series through Prometheus.

Skipped only when prometheus is missing and FUSIONNET_REQUIRE_PROMETHEUS is unset.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusionnet.metrics import (
    SD_PATH,
    BrokerMetrics,
    CompnodeMetrics,
    start_metrics_server,
    stop_metrics_server,
    write_file_sd,
)
from tests.swarm_utils import REPO, running_swarm, wait_until

DEPLOY = REPO / "deploy"
PEERS = [f"12D3KooW{c * 44}" for c in "ABC"]


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("FUSIONNET_REQUIRE_PROMETHEUS"):
            pytest.fail(
                "prometheus not found but FUSIONNET_REQUIRE_PROMETHEUS is set: scripts/install-prometheus.sh"
            )
        pytest.skip("prometheus not installed (scripts/install-prometheus.sh)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_config(broker_target: str, compnode_sd: dict[str, Any]) -> dict[str, Any]:
    """deploy/prometheus.yml on loopback with 1 s intervals; compnode SD replaced by ``compnode_sd``."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    jobs["fusionnet-broker"]["static_configs"][0]["targets"] = [broker_target]
    compnodes = jobs["fusionnet-compnodes"]
    assert "http_sd_configs" in compnodes, "deploy/prometheus.yml discovers compnodes through the broker"
    del compnodes["http_sd_configs"]
    compnodes.update(compnode_sd)
    return config


class Prometheus:
    """A Prometheus server in its own session, queried over /api/v1."""

    def __init__(self, workdir: Path, config: dict[str, Any]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read()
        return json.loads(body) if path.startswith("/api/") else body

    def wait_ready(self, timeout: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}"
                )
            with contextlib.suppress(OSError):
                return self.get("/-/ready").startswith(b"Prometheus")
            return False

        wait_until(ready, timeout, "prometheus to be ready", interval=0.2)

    def query(self, expr: str) -> list[dict[str, Any]]:
        doc = self.get("/api/v1/query", query=expr)
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def wait_for(
        self, expr: str, check: Callable[[list[dict[str, Any]]], bool], what: str, timeout: float = 45.0
    ):
        """Polls an instant query until ``check(result)`` holds; the timeout message shows the last result."""
        last: list[list[dict[str, Any]]] = [[]]

        def condition() -> list[dict[str, Any]] | None:
            last[0] = self.query(expr)
            return last[0] if check(last[0]) else None

        try:
            return wait_until(condition, timeout, what, interval=0.5)
        except TimeoutError as e:
            raise AssertionError(f"{e}; last result of {expr!r}: {last[0]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def running_prometheus(workdir: Path, config: dict[str, Any]) -> Iterator[Prometheus]:
    prometheus_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    server = Prometheus(workdir, config)
    try:
        server.wait_ready()
        yield server
    except BaseException:
        print(server.log_path.read_text(errors="replace"))
        raise
    finally:
        server.stop()


def values_by(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


# ---- package endpoints + http_sd ---------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_http_sd_discovers_compnodes(tmp_path: Path) -> None:
    broker = BrokerMetrics(process=False)
    broker.set_jobs({"running": 1})
    broker.observe_step("job-7", step=3, seconds=0.25, samples=8, loss=1.5, predicted_seconds=0.2)
    compnodes: dict[str, CompnodeMetrics] = {}
    endpoints: dict[str, tuple[str, int]] = {}
    roles = {PEERS[0]: ("supernode", False), PEERS[1]: ("antnode", True), PEERS[2]: ("supernode", True)}
    listed: list[str] = []  # the broker's current view; http_sd reads it per request

    def sd_source() -> list[tuple[str, int, str, bool, str]]:
        return [("127.0.0.1", endpoints[p][1], *roles[p], p) for p in listed]

    def join(peer: str, speed_factor: float) -> None:
        metrics = CompnodeMetrics(process=False)
        metrics.set_state("online")
        metrics.set_hardware(speed_factor=speed_factor, peak_flops=1e11)
        metrics.count_data("tcp", "sent", 1000 * (len(compnodes) + 1))
        compnodes[peer] = metrics
        endpoints[peer] = start_metrics_server(metrics.registry, 0, "127.0.0.1")
        listed.append(peer)
        broker.set_swarm(
            [(roles[p][0], "online") for p in listed], backup_pool=sum(roles[p][1] for p in listed)
        )

    broker_endpoint = start_metrics_server(broker.registry, 0, "127.0.0.1", sd_source=sd_source)
    try:
        join(PEERS[0], 0.5)
        join(PEERS[1], 0.25)
        sd = {
            "http_sd_configs": [
                {"url": f"http://127.0.0.1:{broker_endpoint.port}{SD_PATH}", "refresh_interval": "1s"}
            ]
        }
        config = live_config(f"127.0.0.1:{broker_endpoint.port}", sd)
        with running_prometheus(tmp_path / "prom", config) as prom:
            prom.wait_for(
                'up{job="fusionnet-broker"} == 1', lambda r: len(r) == 1, "the broker to be scraped"
            )
            up = 'up{job="fusionnet-compnodes"} == 1'
            prom.wait_for(up, lambda r: len(r) == 2, "both compnodes discovered via http_sd and scraped")
            # Target labels from SD, instance relabelled to the peer id.
            labels = {r["metric"]["peer"]: r["metric"] for r in prom.query(up)}
            assert labels[PEERS[1]]["role"] == "antnode" and labels[PEERS[1]]["backup"] == "true"
            assert labels[PEERS[0]]["instance"] == PEERS[0]
            # Scraped values equal the values the endpoints were given.
            speed = values_by(prom.query("fusionnet_compnode_speed_factor"), "peer")
            assert speed == {PEERS[0]: 0.5, PEERS[1]: 0.25}
            sent = values_by(prom.query('fusionnet_data_bytes_total{path="tcp",direction="sent"}'), "peer")
            assert sent == {PEERS[0]: 1000.0, PEERS[1]: 2000.0}
            assert values_by(prom.query("fusionnet_job_loss"), "job_id") == {"job-7": 1.5}
            assert values_by(prom.query("fusionnet_job_prediction_error_ratio"), "job_id")[
                "job-7"
            ] == pytest.approx(0.25)
            assert values_by(prom.query("sum(fusionnet_swarm_compnodes)"), "") == {"": 2.0}

            # A compnode joins mid-way: the broker lists it, Prometheus finds it through http_sd.
            join(PEERS[2], 1.0)
            prom.wait_for(up, lambda r: len(r) == 3, "the joining compnode to be discovered")
            prom.wait_for(
                "fusionnet_backup_pool_compnodes",
                lambda r: r and float(r[0]["value"][1]) == 2,
                "backup pool of 2",
            )
            # One leaves: dropped from SD, its target disappears (no stale 'up' series).
            listed.remove(PEERS[0])
            prom.wait_for(
                'count(up{job="fusionnet-compnodes"})',
                lambda r: r and float(r[0]["value"][1]) == 2,
                "the leaving compnode's target to go away",
            )
            targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
            assert sorted(t["labels"]["peer"] for t in targets if "peer" in t["labels"]) == sorted(PEERS[1:])
            # The deploy alert rules are loaded and evaluated against these series.
            rules = prom.get("/api/v1/rules")["data"]["groups"]
            loaded = {r["name"] for g in rules for r in g["rules"]}
            assert {"FusionNetCompnodeDown", "FusionNetJobStalled", "FusionNetBackupPoolEmpty"} <= loaded
            assert all(r["health"] == "ok" for g in rules for r in g["rules"] if r.get("lastEvaluation"))
    finally:
        for endpoint in [*endpoints.values(), broker_endpoint]:
            stop_metrics_server(endpoint)


# ---- the real daemons ------------------------------------------------------------------------------------
def sd_entry(daemon: Any, port: int, role: str, backup: bool) -> tuple[str, int, str, bool, str]:
    return ("127.0.0.1", port, role, backup, daemon.peer_id)


@pytest.mark.timeout(300)
def test_real_swarm_is_scraped(tmp_path: Path) -> None:
    prometheus_binary()
    ports = {name: free_port() for name in ("broker", "compnode0", "compnode1", "late")}
    specs = [
        {"role": "supernode", "extra": ["--metrics-port", str(ports["compnode0"])]},
        {"role": "antnode", "extra": ["--metrics-port", str(ports["compnode1"])]},
    ]
    broker_kw = {"extra": ["--metrics-port", str(ports["broker"])]}
    sd_file = tmp_path / "compnodes.json"
    write_file_sd(sd_file, [])
    sd = {"file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]}
    with running_swarm(tmp_path / "swarm", specs, broker_kw=broker_kw) as swarm:
        entries = [
            sd_entry(swarm.compnodes[0], ports["compnode0"], "supernode", False),
            sd_entry(swarm.compnodes[1], ports["compnode1"], "antnode", False),
        ]
        write_file_sd(sd_file, entries)
        config = live_config(f"127.0.0.1:{ports['broker']}", sd)
        with running_prometheus(tmp_path / "prom", config) as prom:
            prom.wait_for(
                'up{job="fusionnet-broker"} == 1', lambda r: len(r) == 1, "the broker to be scraped"
            )
            up = 'up{job="fusionnet-compnodes"} == 1'
            prom.wait_for(up, lambda r: len(r) == 2, "both compnodes to be scraped")

            late = swarm.add_compnode(
                "late", role="supernode", backup=True, extra=["--metrics-port", str(ports["late"])]
            )
            write_file_sd(sd_file, [*entries, sd_entry(late, ports["late"], "supernode", True)])
            found = prom.wait_for(up, lambda r: len(r) == 3, "the late compnode to be discovered")
            assert {r["metric"]["peer"] for r in found} == {d.peer_id for d in [*swarm.compnodes, late]}

            # The daemons export the fusionnet.metrics set (names are the contract of deploy/).
            for role in ("broker", "compnode"):
                prom.wait_for(
                    f'fusionnet_build_info{{role="{role}"}}',
                    lambda r: len(r) >= 1,
                    f"build info of the {role}",
                )
            prom.wait_for(
                'sum(fusionnet_swarm_compnodes{state="online"})',
                lambda r: r and float(r[0]["value"][1]) == 3,
                "the broker to count 3 online compnodes",
            )
            prom.wait_for(
                "fusionnet_backup_pool_compnodes",
                lambda r: r and float(r[0]["value"][1]) == 1,
                "the broker's backup pool to hold the late backup compnode",
            )
            online = prom.wait_for(
                'fusionnet_compnode_state{state="online"} == 1',
                lambda r: len(r) == 3,
                "every compnode online",
            )
            assert {r["metric"]["peer"] for r in online} == {d.peer_id for d in [*swarm.compnodes, late]}
            speed = prom.query("fusionnet_compnode_speed_factor")
            assert len(speed) == 3 and all(0 < float(r["value"][1]) <= 10 for r in speed), speed
            rtt = prom.wait_for(
                "fusionnet_heartbeat_rtt_seconds_count",
                lambda r: r and float(r[0]["value"][1]) > 0,
                "heartbeats",
            )
            assert rtt[0]["metric"]["job"] == "fusionnet-broker"
