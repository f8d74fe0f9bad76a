"""fusionnet.metrics: the metric sets, their label discipline, the HTTP endpoint and service discovery."""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusionnet.metrics import (
    BROKER_REGISTRY,
    COMPNODE_REGISTRY,
    SD_PATH,
    BrokerMetrics,
    CompnodeMetrics,
    exposed_names,
    file_sd_targets,
    referenced_metrics,
    start_metrics_server,
    stop_metrics_server,
    write_file_sd,
)
from fusionnet.metrics.common import JOB_STATES, NODE_STATES, ROLES
from fusionnet.wire.refusal import REASONS

PEER_A = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
PEER_B = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"


def samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, from the registry's text exposition (what Prometheus reads)."""
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(registry, name: str, **labels: str) -> float:
    return samples(registry)[(name, tuple(sorted(labels.items())))]


def test_module_level_registries_are_separate_and_prefixed() -> None:
    broker, compnode = exposed_names(BROKER_REGISTRY), exposed_names(COMPNODE_REGISTRY)
    assert "fusionnet_swarm_compnodes" in broker and "fusionnet_swarm_compnodes" not in compnode
    assert "fusionnet_compute_duration_seconds_bucket" in compnode
    assert "fusionnet_compute_duration_seconds_bucket" not in broker
    for name in broker | compnode:
        assert name.startswith(("fusionnet_", "process_")), name
    # Prometheus naming: counters end in _total, durations are in seconds.
    for name in broker | compnode:
        if "duration" in name or "rtt" in name:
            assert "_seconds" in name, name


def test_swarm_and_job_state_gauges_write_every_state() -> None:
    m = BrokerMetrics(process=False)
    m.set_swarm([("supernode", "ONLINE"), ("supernode", "ONLINE"), ("antnode", "unreachable")], backup_pool=1)
    assert value(m.registry, "fusionnet_swarm_compnodes", role="supernode", state="online") == 2
    assert value(m.registry, "fusionnet_swarm_compnodes", role="antnode", state="unreachable") == 1
    assert value(m.registry, "fusionnet_backup_pool_compnodes") == 1
    # The last unreachable node went away: its series must read 0, not keep its old value.
    m.set_swarm([("supernode", "online")], backup_pool=0)
    assert value(m.registry, "fusionnet_swarm_compnodes", role="antnode", state="unreachable") == 0
    assert sum(1 for (n, _) in samples(m.registry) if n == "fusionnet_swarm_compnodes") == len(ROLES) * len(
        NODE_STATES
    )
    m.set_jobs({"RUNNING": 2, "queued": 1})
    assert value(m.registry, "fusionnet_jobs", state="running") == 2
    assert value(m.registry, "fusionnet_jobs", state="succeeded") == 0
    assert sum(1 for (n, _) in samples(m.registry) if n == "fusionnet_jobs") == len(JOB_STATES)


def test_unknown_label_values_are_refused() -> None:
    m, c = BrokerMetrics(process=False), CompnodeMetrics(process=False)
    with pytest.raises(ValueError, match="state='lost'"):
        m.set_swarm([("supernode", "lost")], backup_pool=0)
    with pytest.raises(ValueError, match="role='gpu'"):
        m.set_swarm([("gpu", "online")], backup_pool=0)
    with pytest.raises(ValueError, match="phase='optimizer'"):
        c.observe_compute("optimizer", 0.1)
    with pytest.raises(ValueError, match="path='udp'"):
        c.count_data("udp", "sent", 10)
    with pytest.raises(ValueError, match="reason='nope'"):
        c.count_refusal("nope")
    with pytest.raises(ValueError, match="phase='cleanup'"):
        m.observe_recovery("cleanup", 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        c.observe_compute("forward", -1.0)
    with pytest.raises(ValueError, match="not a job id"):
        m.observe_step("", step=0, seconds=1.0, samples=1)


def test_step_series_exist_only_while_the_job_runs() -> None:
    m = BrokerMetrics(process=False)
    m.observe_step(
        "job-1",
        step=4,
        seconds=0.5,
        samples=16,
        loss=0.25,
        predicted_seconds=0.4,
        compnodes=3,
        compute_path_seconds=0.45,
        now=100.0,
    )
    m.observe_step("job-2", step=0, seconds=2.0, samples=8, loss=float("inf"))
    m.observe_subtask_prediction(measured_seconds=1.5, predicted_seconds=1.0)  # a sub-DAG's step
    r = m.registry
    assert value(r, "fusionnet_subtask_prediction_error_ratio_sum") == pytest.approx(0.5)
    assert value(r, "fusionnet_job_loss", job_id="job-1") == 0.25
    assert math.isnan(value(r, "fusionnet_job_loss", job_id="job-2"))
    assert value(r, "fusionnet_job_step", job_id="job-1") == 4
    assert value(r, "fusionnet_job_last_step_timestamp_seconds", job_id="job-1") == 100.0
    assert value(r, "fusionnet_job_samples_per_second", job_id="job-1") == pytest.approx(32.0)
    assert value(r, "fusionnet_job_prediction_error_ratio", job_id="job-1") == pytest.approx(0.25)
    assert value(r, "fusionnet_job_compnodes", job_id="job-1") == 3
    assert value(r, "fusionnet_job_step_beyond_compute_ratio", job_id="job-1") == pytest.approx(0.1)
    assert ("fusionnet_job_step_beyond_compute_ratio", (("job_id", "job-2"),)) not in samples(r)  # unmeasured
    assert value(r, "fusionnet_steps_total") == 2
    assert value(r, "fusionnet_samples_total") == 24
    assert value(r, "fusionnet_step_duration_seconds_count") == 2
    assert value(r, "fusionnet_step_duration_seconds_sum") == pytest.approx(2.5)
    assert value(r, "fusionnet_step_duration_seconds_bucket", le="0.5") == 1
    assert value(r, "fusionnet_step_prediction_error_ratio_count") == 1  # job-2 had no prediction
    m.forget_job("job-1")
    m.forget_job("job-2")
    m.forget_job("never-ran")
    assert not [key for key in samples(r) if ("job_id", "job-1") in key[1] or ("job_id", "job-2") in key[1]]
    assert value(r, "fusionnet_steps_total") == 2  # the all-jobs counters keep counting


def test_link_gauges_are_replaced_as_a_whole_and_refuse_bad_values() -> None:
    m = BrokerMetrics(process=False)
    r = m.registry
    m.set_links({("a", "b"): (2e-4, 2.5e9), ("b", "c"): (3e-4, 1e9)})
    assert value(r, "fusionnet_link_latency_seconds", src="a", dst="b") == pytest.approx(2e-4)
    assert value(r, "fusionnet_link_bandwidth_bytes_per_second", src="b", dst="c") == pytest.approx(1e9)
    m.set_links({("a", "b"): (1e-4, 3e9)})  # a forgotten pair disappears, it does not go stale
    assert value(r, "fusionnet_link_latency_seconds", src="a", dst="b") == pytest.approx(1e-4)
    assert not [key for key in samples(r) if ("src", "b") in key[1]]
    for bad in ({("a", "b"): (-1.0, 1e9)}, {("a", "b"): (1e-4, 0.0)}, {("", "b"): (1e-4, 1e9)}):
        with pytest.raises(ValueError):
            m.set_links(bad)
    assert value(r, "fusionnet_link_latency_seconds", src="a", dst="b") == pytest.approx(1e-4)  # kept


def test_compnode_metrics_count_what_happens() -> None:
    c = CompnodeMetrics(process=False)
    r = c.registry
    assert value(r, "fusionnet_compnode_state", state="joining") == 1
    c.set_state("ONLINE")
    assert value(r, "fusionnet_compnode_state", state="online") == 1
    assert value(r, "fusionnet_compnode_state", state="joining") == 0
    c.set_hardware(speed_factor=0.4, peak_flops=2e11)
    assert value(r, "fusionnet_compnode_speed_factor") == 0.4
    c.set_load(0.5, 2)
    assert value(r, "fusionnet_compnode_running_subtasks") == 2
    c.set_activation_peak(3 << 20)
    assert value(r, "fusionnet_compnode_activation_peak_bytes") == 3 << 20
    with pytest.raises(ValueError):
        c.set_activation_peak(-1)
    for seconds in (0.002, 0.003):
        c.observe_compute("forward", seconds)
    c.observe_compute("BACKWARD", 0.01)
    c.observe_compute("fp", 0.001)  # the paper's FP / BP names are accepted
    c.observe_compute("bp", 0.02)
    assert value(r, "fusionnet_compute_duration_seconds_count", phase="forward") == 3
    assert value(r, "fusionnet_compute_duration_seconds_count", phase="backward") == 2
    assert value(r, "fusionnet_compute_duration_seconds_sum", phase="forward") == pytest.approx(0.006)
    assert value(r, "fusionnet_compute_duration_seconds_count", phase="update") == 0
    c.count_data("tcp", "sent", 1000, frames=2)
    c.count_data("p2p", "received", 24)
    assert value(r, "fusionnet_data_bytes_total", path="tcp", direction="sent") == 1000
    assert value(r, "fusionnet_data_frames_total", path="tcp", direction="sent") == 2
    assert value(r, "fusionnet_data_bytes_total", path="p2p", direction="received") == 24
    for reason in sorted(REASONS):
        assert value(r, "fusionnet_frames_refused_total", reason=reason) == 0  # pre-declared: rate() works
    c.count_refusal("bad_mac")
    assert value(r, "fusionnet_frames_refused_total", reason="bad_mac") == 1
    c.count_subtask("failed")
    assert value(r, "fusionnet_compnode_subtasks_total", outcome="failed") == 1


def test_build_and_node_info() -> None:
    m = BrokerMetrics(process=False)
    build = [k for k in samples(m.registry) if k[0] == "fusionnet_build_info"]
    assert len(build) == 1 and ("daemon", "broker") in build[0][1]
    m.set_peer(PEER_A, started_at=123.0)
    m.set_peer(PEER_B, started_at=124.0)  # a restarted identity replaces, never adds, a series
    assert [k[1] for k in samples(m.registry) if k[0] == "fusionnet_node_info"] == [(("peer_id", PEER_B),)]
    assert value(m.registry, "fusionnet_start_time_seconds") == 124.0


def test_referenced_metrics_finds_identifiers() -> None:
    exprs = ["sum by (le) (rate(fusionnet_step_duration_seconds_bucket[5m]))", "up == 0 and fusionnet_jobs"]
    assert referenced_metrics(exprs) == {"fusionnet_step_duration_seconds_bucket", "fusionnet_jobs"}


# ---- service discovery --------------------------------------------------------------------------------
def test_file_sd_targets_document() -> None:
    groups = file_sd_targets(
        [("10.0.0.2", 9701, "antnode", True, PEER_B), ("::1", 9702, "SUPERNODE", False, PEER_A)]
    )
    assert groups == [
        {"targets": ["[::1]:9702"], "labels": {"role": "supernode", "backup": "false", "peer": PEER_A}},
        {"targets": ["10.0.0.2:9701"], "labels": {"role": "antnode", "backup": "true", "peer": PEER_B}},
    ]
    assert file_sd_targets([]) == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (("0.0.0.0", 9701, "supernode", False, PEER_A), "bind-all"),
        (("host", 0, "supernode", False, PEER_A), "not in 1..65535"),
        (("host", 70000, "supernode", False, PEER_A), "not in 1..65535"),
        (("", 9701, "supernode", False, PEER_A), "not a host"),
        (("host", 9701, "gpu", False, PEER_A), "role='gpu'"),
        (("host", 9701, "supernode", "yes", PEER_A), "backup must be"),
        (("host", 9701, "supernode", False, "peer/../x"), "not a base58 peer id"),
        (("host", 9701), "expected"),
    ],
)
def test_file_sd_targets_refuses_bad_entries(entry: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        file_sd_targets([entry])


def test_file_sd_targets_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        file_sd_targets([("a", 1, "supernode", False, PEER_A), ("b", 2, "supernode", False, PEER_A)])


def test_write_file_sd_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "compnodes.json"
    assert write_file_sd(path, [("127.0.0.1", 9701, "supernode", False, PEER_A)])
    first = json.loads(path.read_text())
    assert first[0]["targets"] == ["127.0.0.1:9701"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    inode = path.stat().st_ino
    assert not write_file_sd(path, [("127.0.0.1", 9701, "supernode", False, PEER_A)])  # unchanged: no rewrite
    assert path.stat().st_ino == inode
    assert write_file_sd(path, [])
    assert json.loads(path.read_text()) == []
    assert path.stat().st_ino != inode  # replaced by rename, never truncated in place
    with pytest.raises(ValueError):
        write_file_sd(path, [("0.0.0.0", 1, "supernode", False, PEER_A)])
    assert json.loads(path.read_text()) == []  # a refused document leaves the old file alone
    assert sorted(os.listdir(tmp_path)) == ["compnodes.json"]  # no temporary file left behind


# ---- the HTTP endpoint ----------------------------------------------------------------------------------
def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


@pytest.mark.timeout(30)
def test_metrics_server_serves_registry_and_http_sd() -> None:
    m = BrokerMetrics(process=False)
    m.set_jobs({"running": 1})
    targets = [("127.0.0.1", 9701, "supernode", True, PEER_A)]
    endpoint = start_metrics_server(m.registry, 0, "127.0.0.1", sd_source=lambda: targets)
    try:
        host, port = endpoint
        assert host == "127.0.0.1" and port > 0
        status, ctype, body = _get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert 'fusionnet_jobs{state="running"} 1.0' in body.decode()
        status, ctype, body = _get(f"http://127.0.0.1:{port}{SD_PATH}")
        assert status == 200 and ctype == "application/json"
        assert json.loads(body) == file_sd_targets(targets)
        targets.append(("127.0.0.1", 9702, "antnode", False, PEER_B))  # the source is read per request
        assert len(json.loads(_get(f"http://127.0.0.1:{port}{SD_PATH}")[2])) == 2
        targets.append(("0.0.0.0", 9703, "antnode", False, "12D3KooWC"))
        status, _, body = _get(f"http://127.0.0.1:{port}{SD_PATH}")
        assert status == 500 and b"bind-all" in body  # Prometheus keeps its last good list
        assert _get(f"http://127.0.0.1:{port}/nothing")[0] == 404
        with pytest.raises(ValueError, match="cannot listen"):
            start_metrics_server(m.registry, port, "127.0.0.1")
    finally:
        stop_metrics_server(endpoint)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    stop_metrics_server(endpoint)  # stopping twice is harmless


@pytest.mark.timeout(30)
def test_metrics_server_without_sd_and_bad_port() -> None:
    c = CompnodeMetrics(process=False)
    endpoint = start_metrics_server(c.registry, 0, "127.0.0.1")
    try:
        assert _get(f"http://127.0.0.1:{endpoint.port}{SD_PATH}")[0] == 404
        assert b"fusionnet_compnode_state" in _get(f"http://127.0.0.1:{endpoint.port}/")[2]
    finally:
        stop_metrics_server(endpoint)
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        start_metrics_server(c.registry, 70000, "127.0.0.1")


@pytest.mark.timeout(30)
def test_metrics_server_drops_silent_clients_and_caps_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half-sent requests neither hold a thread for ever nor pile threads up: a silent client is dropped
    after the request timeout, connections past the cap are closed at once, and scrapes work after."""
    import socket

    from fusionnet.metrics import server

    monkeypatch.setattr(server, "MAX_CONCURRENT", 2)
    monkeypatch.setattr(server._QuietHandler, "timeout", 0.5)
    c = CompnodeMetrics(process=False)
    endpoint = start_metrics_server(c.registry, 0, "127.0.0.1")
    silent = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(2)]
    try:
        for sock in silent:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        extra = socket.create_connection(("127.0.0.1", endpoint.port))
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once: both slots are taken
        extra.close()
        for sock in silent:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # dropped after the timeout
        assert b"fusionnet_compnode_state" in _get(f"http://127.0.0.1:{endpoint.port}/metrics")[2]
    finally:
        for sock in silent:
            sock.close()
        stop_metrics_server(endpoint)


def test_serving_metrics_count_by_deployment_and_go_with_it() -> None:
    """Requests (chat too, under its own endpoint) and tokens by deployment, the number of deployments;
    undeploying one removes every series of it, and leaves the others'."""
    from prometheus_client import CollectorRegistry

    from fusionnet.metrics.serving import ServingMetrics

    r = CollectorRegistry()
    m = ServingMetrics(r)
    m.observe_deployments(2)
    for name in ("a", "b"):
        m.observe_request(name, "/v1/chat/completions", 200)
        m.observe_request(name, "/v1/completions", 499)
        m.observe_tokens(name, prompt=5, completion=3)
        m.observe_batch(name, rows=2, seconds=0.1, queued_rows=1, kv_slots=1)
    labels = {"deployment": "a", "endpoint": "/v1/chat/completions", "code": "200"}
    assert r.get_sample_value("fusionnet_serving_requests_total", labels) == 1.0
    assert r.get_sample_value("fusionnet_serving_deployments") == 2.0
    # a failed batch is counted, and kept out of the served batches' histograms
    m.observe_batch("a", rows=4, seconds=9.0, queued_rows=0, failed=True)
    assert r.get_sample_value("fusionnet_serving_batches_failed_total", {"deployment": "a"}) == 1.0
    assert r.get_sample_value("fusionnet_serving_batch_duration_seconds_count", {"deployment": "a"}) == 1.0
    assert r.get_sample_value("fusionnet_serving_batch_duration_seconds_sum", {"deployment": "a"}) == 0.1
    m.forget_deployment("a")
    m.observe_deployments(1)
    left = {s.labels.get("deployment") for metric in r.collect() for s in metric.samples}
    assert "a" not in left and "b" in left
    completion = {"deployment": "b", "kind": "completion"}
    assert r.get_sample_value("fusionnet_serving_tokens_total", completion) == 3
    assert r.get_sample_value("fusionnet_serving_deployments") == 1.0
