"""A real Prometheus server scraping FusionNet metrics endpoints on 127.0.0.1.

Prometheus runs with a configuration generated from deploy/prometheus.yml (1 s intervals, the broker
target and its http_sd URL rewritten to loopback, the deploy alert rules loaded) and is queried through
its HTTP API with deadline-polling loops. Two tests:

- ``test_http_sd_discovers_compnodes``: metrics servers of this package in the test process (one broker
  registry serving http_sd, compnode registries); a compnode that joins mid-way is discovered through
  the broker's ``/sd/compnodes``, one that leaves is dropped; scraped values equal the values set.
- ``test_real_swarm_is_scraped``: the real broker and compnode daemons (``ProcessSwarm``). Compnodes
  announce their metrics endpoints in the DHT and Prometheus finds them exactly as deploy/prometheus.yml
  says, through the broker's http_sd (the broker's ``--sd-file`` is checked too): one joins mid-way,
  one leaves; the daemons' series are asserted through Prometheus with plausible values. Job series
  (steps, loss) come in through ``submit_job_for_metrics`` / ``assert_job_series`` once job submission
  is part of the swarm tests.

Skipped only when prometheus is missing and FUSIONNET_REQUIRE_PROMETHEUS is unset.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
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
    referenced_metrics,
    start_metrics_server,
    stop_metrics_server,
)
from fusionnet.metrics.common import JOB_STATES
from fusionnet.runtime.process_swarm import CompnodeSpec, ProcessSwarm, running_swarm
from fusionnet.runtime.processes import DaemonProcess, wait_until
from tests.deploy_support import alert_rules, dashboard_exprs
from tests.jobfiles import REPO

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


def live_config(broker_target: str) -> dict[str, Any]:
    """deploy/prometheus.yml on loopback with 1 s intervals; compnodes are discovered as deploy says, through
    the broker's http_sd, whose URL moves to ``broker_target`` with the broker's scrape target."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / f) for f in config["rule_files"]]
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    [broker_static] = jobs["fusionnet-broker"]["static_configs"]
    [deploy_broker] = broker_static["targets"]
    broker_static["targets"] = [broker_target]
    compnodes = jobs["fusionnet-compnodes"]
    assert "http_sd_configs" in compnodes, "deploy/prometheus.yml discovers compnodes through the broker"
    [sd] = compnodes["http_sd_configs"]
    url = urllib.parse.urlsplit(sd["url"])
    # deploy asks the broker it scrapes, at the path the broker serves: only the address changes here
    assert (url.netloc, url.path) == (deploy_broker, SD_PATH), sd["url"]
    sd.update(url=url._replace(netloc=broker_target).geturl(), refresh_interval="1s")
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
@pytest.mark.slow  # waits on a real Prometheus' scrape and discovery intervals
@pytest.mark.timeout(180)
def test_http_sd_discovers_compnodes(tmp_path: Path) -> None:
    broker = BrokerMetrics(process=False)
    broker.set_jobs({"running": 1})
    broker.observe_step(
        "job-7", step=3, seconds=0.25, samples=8, loss=1.5, predicted_seconds=0.2, compute_path_seconds=0.2
    )
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
        config = live_config(f"127.0.0.1:{broker_endpoint.port}")
        [sd] = config["scrape_configs"][1]["http_sd_configs"]
        assert sd["url"] == f"http://127.0.0.1:{broker_endpoint.port}{SD_PATH}"
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
            beyond = values_by(prom.query("fusionnet_job_step_beyond_compute_ratio"), "job_id")
            assert beyond == {"job-7": pytest.approx(0.2)}
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
def exposed_families(text: str) -> set[str]:
    """Sample names a scrape of this exposition can hold, from its TYPE lines (families without series
    yet, e.g. per-job gauges before any job, count as defined)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.update(
                [f"{name}_bucket", f"{name}_sum", f"{name}_count"] if kind == "histogram" else [name]
            )
    return names


def check_real_expositions(urls: list[str]) -> None:
    """The daemons' own /metrics (not a test registry) pass ``promtool check metrics`` and together define
    every metric the alert rules and the dashboard query."""
    promtool = shutil.which("promtool")
    exposed: set[str] = set()
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        exposed |= exposed_families(text)
        if promtool is not None:
            out = subprocess.run(
                [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), (
                f"{url}: {out.stdout}{out.stderr}"
            )
    used = referenced_metrics([r["expr"] for r in alert_rules()] + dashboard_exprs())
    assert used and not used - exposed, f"queried but not exported by the daemons: {sorted(used - exposed)}"


def frames_refused(url: str) -> float:
    """``fusionnet_frames_refused_total`` of one daemon, all reasons, from its own /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("fusionnet_frames_refused_total{")
    )


def record_finished_job_in_store(broker: DaemonProcess, job_id: str) -> None:
    """Writes a finished job straight into the running broker's SQLite store (WAL: a second connection is
    safe), to check that ``fusionnet_jobs{state}`` follows the store without submitting a job."""
    from fusionnet.broker.store import BrokerStore, JobState

    store = BrokerStore(broker.state_dir / "broker.sqlite3")
    try:
        store.create_job(job_id, "metrics-probe", steps=0)
        store.update_job(job_id, state=JobState.RUNNING)
        store.update_job(job_id, state=JobState.SUCCEEDED)
    finally:
        store.close()


def submit_job_for_metrics(swarm: ProcessSwarm, workdir: Path) -> tuple[str, int] | None:
    """JOB PART of ``test_real_swarm_is_scraped``: run a small job on ``swarm`` to completion (``fusionnet
    submit``) and return (job id, steps completed), or None while job submission is not wired into these
    tests; the test then checks the job series with ``assert_job_series``."""
    import asyncio

    from fusionnet.runtime.submit import submit_and_wait
    from tests.jobfiles import example_job

    job_path = example_job("mlp", workdir, steps=6, placement={"compnodes": 2})
    try:
        outcome = asyncio.run(
            submit_and_wait(job_path, swarm.initial_peers, workdir / "job-out", timeout=240)
        )
    finally:
        job_path.unlink()
    return outcome.job_id, len(outcome.metrics)


def assert_job_series(prom: Prometheus, job_id: str, steps: int) -> None:
    """What a finished job leaves in Prometheus. Per-job gauges exist only while the job runs (removed by
    ``forget_job``), so they are looked up over the last minutes; the all-jobs counters stay."""
    prom.wait_for(
        "fusionnet_steps_total", lambda r: r and float(r[0]["value"][1]) >= steps, f"{steps} steps counted"
    )
    prom.wait_for(
        'fusionnet_jobs{state="succeeded"}', lambda r: r and float(r[0]["value"][1]) >= 1, "a succeeded job"
    )
    durations = prom.query("fusionnet_step_duration_seconds_sum / fusionnet_step_duration_seconds_count")
    assert durations and 0 < float(durations[0]["value"][1]) < 600, durations
    step = prom.query(f'max_over_time(fusionnet_job_step{{job_id="{job_id}"}}[10m])')
    if step:  # scraped while running (a job shorter than one scrape interval may never be)
        assert float(step[0]["value"][1]) <= steps
        loss = prom.query(f'last_over_time(fusionnet_job_loss{{job_id="{job_id}"}}[10m])')
        assert loss and math.isfinite(float(loss[0]["value"][1])), loss
    # The compnodes are scraped on their own schedule: the broker's count of steps can be ahead of
    # what Prometheus has of theirs, so these wait (within a few scrape intervals) instead of one look.
    prom.wait_for(
        'sum(fusionnet_compute_duration_seconds_count{phase="forward"})',
        lambda r: bool(r) and float(r[0]["value"][1]) >= steps,
        f"the compnodes' forward passes of {steps} steps scraped",
    )
    prom.wait_for(
        "sum(fusionnet_data_bytes_total)", lambda r: bool(r) and float(r[0]["value"][1]) > 0, "bytes moved"
    )
    prom.wait_for(  # the sub-DAGs computed in sandbox workers: their CPU, not the daemons'
        "sum(fusionnet_sandbox_cpu_seconds_total)",
        lambda r: bool(r) and float(r[0]["value"][1]) > 0,
        "the sandbox workers' CPU",
    )
    prom.wait_for(
        'sum(fusionnet_compnode_subtasks_total{outcome="succeeded"})',
        lambda r: bool(r) and float(r[0]["value"][1]) >= steps,
        f"{steps} succeeded sub-tasks scraped",
    )
    # the job ran on two compnodes: the broker probed the link between them and exports it
    prom.wait_for(
        "fusionnet_link_bandwidth_bytes_per_second",
        lambda r: bool(r) and all(float(x["value"][1]) > 1e6 for x in r),
        "the probed link between the job's compnodes",
    )
    latency = prom.query("fusionnet_link_latency_seconds")
    assert latency and all(0 < float(x["value"][1]) < 1 for x in latency), latency


def single(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def assert_swarm_gauges(prom: Any, everyone: set[str], started: float) -> None:
    """The broker's and compnodes' gauges describe the 3-compnode swarm (one backup) as it is."""
    # The daemons export the fusionnet.metrics set (names are the contract of deploy/).
    for daemon, count in (("broker", 1), ("compnode", 3)):
        build = prom.query(f'fusionnet_build_info{{daemon="{daemon}"}}')
        assert len(build) == count, build
    # No scraped label collided with a target label (Prometheus would have renamed it exported_*).
    series = prom.query('{__name__=~"fusionnet_.+"}')
    clashes = {k for r in series for k in r["metric"] if k.startswith("exported_")}
    assert series and not clashes, clashes
    prom.wait_for(
        'sum(fusionnet_swarm_compnodes{state="online"})',
        lambda r: r and float(r[0]["value"][1]) == 3,
        "the broker to count 3 online compnodes",
    )
    by_role = prom.query('fusionnet_swarm_compnodes{state="online"}')
    assert values_by(by_role, "role") == {"supernode": 2.0, "antnode": 1.0}
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
    assert {r["metric"]["peer"] for r in online} == everyone
    speed = prom.query("fusionnet_compnode_speed_factor")
    assert len(speed) == 3 and all(0 < float(r["value"][1]) <= 10 for r in speed), speed
    peak = prom.query("fusionnet_compnode_peak_flops")
    assert len(peak) == 3 and all(1e8 < float(r["value"][1]) < 1e16 for r in peak), peak
    assert values_by(prom.query("fusionnet_compnode_load"), "peer") == dict.fromkeys(everyone, 0.0)
    pings = prom.wait_for(
        "fusionnet_heartbeat_rtt_seconds_count",
        lambda r: r and float(r[0]["value"][1]) >= 3,
        "heartbeats",
    )
    assert pings[0]["metric"]["job"] == "fusionnet-broker"
    mean_rtt = single(
        prom.query("fusionnet_heartbeat_rtt_seconds_sum / fusionnet_heartbeat_rtt_seconds_count")
    )
    assert 0 < mean_rtt < 1.0, mean_rtt  # loopback pings: milliseconds
    for r in prom.query("fusionnet_start_time_seconds"):
        assert started - 1 <= float(r["value"][1]) <= time.time(), r
    for r in prom.query("process_resident_memory_bytes"):
        assert 10e6 < float(r["value"][1]) < 16e9, r


@pytest.mark.swarm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_swarm_is_scraped(tmp_path: Path) -> None:
    prometheus_binary()
    started = time.time()
    broker_port = free_port()
    sd_file = tmp_path / "compnodes.json"
    metrics = ["--metrics-port", "0"]  # compnodes announce the port they got; discovery does the rest
    specs = [{"role": "supernode", "extra": metrics}, {"role": "antnode", "extra": metrics}]
    broker_kw = {"extra": ["--metrics-port", str(broker_port), "--sd-file", str(sd_file)]}
    with running_swarm(tmp_path / "swarm", specs, broker_kw=broker_kw) as swarm:
        config = live_config(f"127.0.0.1:{broker_port}")
        with running_prometheus(tmp_path / "prom", config) as prom:  # running_swarm prints logs on failure
            prom.wait_for(
                'up{job="fusionnet-broker"} == 1', lambda r: len(r) == 1, "the broker to be scraped"
            )
            up = 'up{job="fusionnet-compnodes"} == 1'
            first = prom.wait_for(up, lambda r: len(r) == 2, "both compnodes discovered through the broker")
            assert {r["metric"]["peer"] for r in first} == {d.peer_id for d in swarm.compnodes}

            # A compnode joins mid-way: nothing but its DHT record tells Prometheus about it.
            late = swarm.add_compnode("late", CompnodeSpec(role="supernode", backup=True, extra=metrics))
            everyone = {d.peer_id for d in [*swarm.compnodes, late]}
            found = prom.wait_for(up, lambda r: len(r) == 3, "the late compnode to be discovered")
            assert {r["metric"]["peer"] for r in found} == everyone
            labels = {r["metric"]["peer"]: r["metric"] for r in found}
            assert (labels[late.peer_id]["role"], labels[late.peer_id]["backup"]) == ("supernode", "true")
            assert labels[late.peer_id]["instance"] == late.peer_id  # deploy relabels instance to the peer
            # ... and the broker's --sd-file says the same (file_sd alternative)
            wait_until(
                lambda: {g["labels"]["peer"] for g in json.loads(sd_file.read_text())} == everyone,
                10,
                "the broker's --sd-file to list all three compnodes",
            )

            assert_swarm_gauges(prom, everyone, started)
            jobs = values_by(prom.query("fusionnet_jobs"), "state")
            assert set(jobs) == set(JOB_STATES)
            record_finished_job_in_store(swarm.broker, "probe-1")
            prom.wait_for(
                'fusionnet_jobs{state="succeeded"}',
                lambda r: r and float(r[0]["value"][1]) == jobs["succeeded"] + 1,
                "the jobs gauge to follow the broker's store",
            )
            check_real_expositions([d.metrics_url() for d in [swarm.broker, *swarm.compnodes, late]])
            # Garbage on a compnode's data path is refused and counted where the alert rule looks.
            target = swarm.compnodes[0]
            listening = re.search(r"data path listening on ([\d.]+):(\d+)", target.log_text())
            assert listening, "the compnode did not log its data path address"
            with socket.create_connection((listening[1], int(listening[2])), timeout=5) as s:
                s.sendall(b"GARBAGE" * 100)
            wait_until(
                lambda: frames_refused(target.metrics_url()) >= 1, 30, "the refused frame to be counted"
            )

            job = submit_job_for_metrics(swarm, tmp_path)
            if job is not None:
                assert_job_series(prom, *job)

            # A graceful leave (OFFLINE) removes the target: no 'up == 0' alert for a node that said goodbye.
            late.stop()
            prom.wait_for(
                'count(up{job="fusionnet-compnodes"})',
                lambda r: r and float(r[0]["value"][1]) == 2,
                "the departed compnode's target to go away",
            )
            rules = prom.get("/api/v1/rules")["data"]["groups"]
            assert all(r["health"] == "ok" for g in rules for r in g["rules"] if r.get("lastEvaluation"))
