"""The daemons' pure parts and in-process lifecycle: SQLite store, compnode registry, status merging,
configuration checks, state dir lock, address file, profile cache, and ``Daemon.serve`` with services."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusionnet.broker.churn import PRIOR_MTBF
from fusionnet.broker.config import BrokerConfig
from fusionnet.broker.daemon import BrokerDaemon
from fusionnet.broker.registry import CompnodeRegistry, RegistryEvent
from fusionnet.broker.store import MIGRATIONS, SCHEMA_VERSION, BrokerStore, CompnodeRow, JobState
from fusionnet.cli.cmd_status import CLEAR_BELOW, CLEAR_HOME, format_tables, merge_status, render_frame
from fusionnet.compnode.daemon import CompnodeConfig, _maddr_host
from fusionnet.daemon.base import Daemon
from fusionnet.daemon.config import DaemonConfig
from fusionnet.daemon.files import StateDir, read_address_file, write_address_file
from fusionnet.dht.announce import Found
from fusionnet.dht.node import DHTConfig
from fusionnet.dht.records import CompnodeRecord, HardwareInfo, NodeState, Role
from fusionnet.errors import JobError, StoreError
from fusionnet.metrics import BrokerMetrics
from fusionnet.rpc.server import RPCContext

PEERS = [f"Qm{c * 44}" for c in "ABCD"]
HW = HardwareInfo(device_kind="cpu", device_name="cpu", peak_flops=1e11, speed_factor=0.5, d_cpu=2**33)


# ---- store --------------------------------------------------------------------------------------------
def test_store_jobs_events_and_compnodes(tmp_path: Path) -> None:
    store = BrokerStore(tmp_path / "b.sqlite3")
    assert store.schema_version == SCHEMA_VERSION
    job = store.create_job("j1", "figure3", steps=10, submitter=PEERS[0])
    assert (job["state"], job["step"], job["loss"]) == ("QUEUED", 0, None)
    with pytest.raises(JobError, match="already exists"):
        store.create_job("j1", "again")
    store.update_job("j1", state=JobState.RUNNING)
    store.update_job("j1", step=3, loss=0.5)
    store.add_job_event("j1", "assigned", {"compnode": PEERS[1]})
    store.update_job("j1", state="FAILED", error="compnode lost")
    store.create_job("j2", "other")
    assert store.count_jobs_by_state() == {"FAILED": 1, "QUEUED": 1}
    with pytest.raises(JobError, match="already FAILED"):
        store.update_job("j1", state=JobState.RUNNING)
    with pytest.raises(JobError, match="no job with id 'nope'"):
        store.add_job_event("nope", "x")
    events = store.job_events("j1")
    assert [e["kind"] for e in events] == ["created", "state", "assigned", "state"]
    assert events[-1]["detail"] == {"from": "RUNNING", "to": "FAILED", "error": "compnode lost"}
    assert store.job_events("j1", after_id=events[1]["id"])[0]["kind"] == "assigned"
    row = CompnodeRow(
        PEERS[0], "supernode", False, "ONLINE", True, HW.model_dump(mode="json"), 1.0, 2.0, 2.0, 0.01
    )
    store.upsert_compnodes([row])
    store.upsert_compnodes([row.__class__(**{**row.__dict__, "state": "OFFLINE", "last_seen": 3.0})])
    store.close()

    reopened = BrokerStore(tmp_path / "b.sqlite3")  # data and version survive a restart
    job = reopened.get_job("j1")
    assert (job["state"], job["step"], job["loss"], job["error"]) == ("FAILED", 3, 0.5, "compnode lost")
    [node] = reopened.list_compnodes()
    assert (node.state, node.first_seen, node.last_seen, node.hardware) == (
        "OFFLINE",
        1.0,
        3.0,
        HW.model_dump(mode="json"),
    )
    reopened.close()


def test_a_full_database_still_ends_the_job_with_its_reason(tmp_path: Path) -> None:
    """A write the database refuses (here its page limit; on a CI machine once a full disk) raises
    ``StoreError`` naming the file; a job's end is kept in memory and written once the disk has room."""
    store = BrokerStore(tmp_path / "b.sqlite3")
    store.create_job("j1", "full", steps=3)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    for size in (4096, 1024, 256, 64, 16, 1):  # fill every page, down to the last free bytes
        with contextlib.suppress(StoreError):
            for _ in range(1000):
                store.add_job_event("j1", "padding", {"x": "x" * size})
    refused = r"b\.sqlite3: the broker database refused a write \(database or disk is full\)"
    with pytest.raises(StoreError, match=refused):
        store.update_job("j1", state=JobState.RUNNING)
    assert store.get_job("j1")["state"] == "RUNNING"  # as the run believes it, from memory
    ended = store.update_job("j1", state=JobState.FAILED, error="the disk is full")  # no raise: it ended
    assert (ended["state"], ended["error"]) == ("FAILED", "the disk is full")
    assert store.list_jobs()[0]["state"] == "FAILED"
    with pytest.raises(JobError, match="already FAILED"):
        store.update_job("j1", state=JobState.RUNNING)
    store._db.execute("PRAGMA max_page_count = 1000000")  # room again: the next update writes it all
    store.update_job("j1", loss=0.25)
    store.close()
    job = BrokerStore(tmp_path / "b.sqlite3").get_job("j1")
    assert (job["state"], job["error"], job["loss"]) == ("FAILED", "the disk is full", 0.25)


def test_store_refuses_a_newer_schema(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "b.sqlite3")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(ValueError, match=f"schema version {SCHEMA_VERSION + 1} is newer"):
        BrokerStore(tmp_path / "b.sqlite3")


def test_store_keeps_the_churn_history_and_upgrades_an_older_database(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "b.sqlite3"
    old = sqlite3.connect(path)  # a database of the schema before the churn table (version 1)
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            old.execute(statement)
    old.execute("INSERT INTO jobs VALUES ('j0', 'old', 'SUCCEEDED', 5, 5, 0.1, NULL, NULL, 1.0, 2.0)")
    old.execute("PRAGMA user_version = 1")
    old.commit()
    old.close()
    store = BrokerStore(path)
    assert store.schema_version == SCHEMA_VERSION and store.get_job("j0")["state"] == "SUCCEEDED"
    assert store.get_job("j0")["error_kind"] is None  # a row from before the column: no kind
    assert store.churn() == (0, 0.0)  # nothing watched yet
    store.save_churn(2, 7200.5)
    store.save_churn(3, 9000.0)  # replaces, not adds: the book saves its totals
    store.close()
    store = BrokerStore(path)
    assert store.churn() == (3, 9000.0)
    with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint"):  # the book never sends one
        store.save_churn(-1, 5.0)
    store._db.execute("UPDATE churn SET watched = 'soon' WHERE id = 1")  # a hand edit: ignored, said so
    with caplog.at_level(logging.WARNING, logger="fusionnet.broker.store"):
        assert store.churn() == (0, 0.0)
    assert "churn history 3/'soon' is not a count and seconds" in caplog.text
    store.close()


def test_a_restarted_broker_resumes_how_often_compnodes_failed(tmp_path: Path) -> None:
    """The churn estimate is of the swarm, not of one run of the broker: a loss and the compnode-seconds
    watched survive a restart (``broker.churn``), so failover rounds stay spaced for what was seen."""
    config = BrokerConfig(common=DaemonConfig(state_dir=tmp_path / "state"), heartbeat_timeout=3)
    first = BrokerDaemon(config)
    first.state_dir.acquire()
    first.store = first._open_store()
    first.churn.resume(0, 7000.0)  # as if it had watched two compnodes for almost an hour
    first.registry.update_records([found(PEERS[0], NodeState.ONLINE, 1)], now=10)
    first.registry.check_timeouts(now=14)  # never answered: a loss, saved at once
    losses, watched = first.store.churn()
    assert losses == 1 and watched >= 7000.0
    first.store.close()  # a SIGKILL would leave the database just so
    first.state_dir.release()

    second = BrokerDaemon(config)
    assert second.churn.compnode_mtbf(time.time()) == PRIOR_MTBF  # before it opens its state
    second.state_dir.acquire()
    try:
        second.store = second._open_store()
        assert second.churn.losses == 1
        assert second.churn.compnode_mtbf(time.time()) == pytest.approx((watched + PRIOR_MTBF) / 2, rel=1e-3)
        second.store.close()
    finally:
        second.state_dir.release()


# ---- registry -------------------------------------------------------------------------------------------
def found(
    peer: str, state: NodeState, updated: float, role: Role = Role.SUPERNODE, backup: bool = False
) -> Found:
    record = CompnodeRecord(
        peer_id=peer, state=state, role=role, backup=backup, hardware=HW, updated_at=updated
    )
    return Found(record=record, expires_at=updated + 30, owner=b"[owner:x]")


def test_registry_merges_records_and_heartbeats() -> None:
    reg = CompnodeRegistry(heartbeat_timeout=3.0, forget_after=100.0)
    seen: list[RegistryEvent] = []
    reg.add_listener(seen.append)
    reg.add_listener(lambda e: 1 / 0)  # a broken listener must not break the registry
    events = reg.update_records(
        [found(PEERS[0], NodeState.JOINING, 1), found(PEERS[1], NodeState.ONLINE, 1, Role.ANTNODE, True)],
        now=10,
    )
    assert [(e.peer_id, e.kind) for e in events] == [
        (PEERS[0], "joined"),
        (PEERS[1], "joined"),
    ] and seen == events
    reg.update_records([found(PEERS[0], NodeState.ONLINE, 2), found(PEERS[1], NodeState.ONLINE, 0.5)], now=11)
    assert reg.get(PEERS[0]).record.state == NodeState.ONLINE and seen[-1].detail == "JOINING -> ONLINE"
    assert reg.get(PEERS[1]).record.updated_at == 1  # the older copy was ignored
    assert [e.peer_id for e in reg.schedulable()] == PEERS[:2]
    assert [e.peer_id for e in reg.schedulable(role=Role.ANTNODE)] == [PEERS[1]]
    assert [e.peer_id for e in reg.schedulable(backup=False)] == [PEERS[0]]

    reg.record_pong(PEERS[0], 0.010, now=12)
    reg.record_pong(PEERS[0], 0.020, now=12.5)
    assert reg.get(PEERS[0]).rtt == pytest.approx(0.7 * 0.010 + 0.3 * 0.020)
    # PEERS[1] was first seen at 10 and never answered: at 13.5 it is past the 3 s timeout
    assert [(e.peer_id, e.kind) for e in reg.record_failure(PEERS[1], now=13.5)] == [
        (PEERS[1], "unreachable")
    ]
    assert reg.get(PEERS[1]).failures == 1
    # PEERS[0] last answered at 12.5
    assert [(e.peer_id, e.kind) for e in reg.check_timeouts(now=15.4)] == []
    assert [(e.peer_id, e.kind) for e in reg.check_timeouts(now=15.6)] == [(PEERS[0], "unreachable")]
    assert reg.schedulable() == [] and reg.get(PEERS[1]).effective_state == "UNREACHABLE"
    assert [e.kind for e in reg.record_pong(PEERS[0], 0.01, now=16)] == ["reachable"]

    # PEERS[0] says goodbye; PEERS[1] is missing from a lookup while its record (until 31) has not
    # expired: a short lookup (a frozen DHT peer) must not make it gone
    events = reg.update_records([found(PEERS[0], NodeState.OFFLINE, 20)], now=20)
    assert {(e.peer_id, e.kind) for e in events} == {(PEERS[0], "state")}
    # still missing once its record expired (SIGKILL + expiry): gone
    events = reg.update_records([found(PEERS[0], NodeState.OFFLINE, 20)], now=32)
    assert {(e.peer_id, e.kind) for e in events} == {(PEERS[1], "left")}
    assert reg.to_ping() == []
    # the goodbye reads OFFLINE; the crash UNREACHABLE (as the metrics say), never a graceful leave
    assert {e.peer_id: e.effective_state for e in reg.entries()} == {
        PEERS[0]: "OFFLINE",
        PEERS[1]: "UNREACHABLE",
    }
    # it comes back with the same identity: judged afresh
    reg.update_records([found(PEERS[1], NodeState.JOINING, 35)], now=35)
    assert reg.get(PEERS[1]).reachable and not reg.get(PEERS[1]).gone and reg.to_ping() == [PEERS[1]]
    reg.update_records([found(PEERS[1], NodeState.JOINING, 200)], now=200)
    assert [e.peer_id for e in reg.entries()] == [PEERS[1]]  # the departed one is forgotten eventually


def test_registry_marks_silent_compnodes_unreachable_exactly_after_the_timeout() -> None:
    reg = CompnodeRegistry(heartbeat_timeout=3.0)
    reg.update_records([found(PEERS[2], NodeState.ONLINE, 1)], now=100)
    assert reg.check_timeouts(now=103.0) == []
    assert [e.kind for e in reg.check_timeouts(now=103.1)] == ["unreachable"]
    assert reg.check_timeouts(now=200) == []  # reported once


# ---- broker metrics and service discovery --------------------------------------------------------------
def test_broker_metrics_and_scrape_targets_follow_registry_and_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd_file = tmp_path / "compnodes.json"
    broker = BrokerDaemon(BrokerConfig(heartbeat_period=1, heartbeat_timeout=3, sd_file=sd_file))
    assert isinstance(broker.metrics, BrokerMetrics)

    def with_metrics(item: Found, address: str | None) -> Found:
        return Found(item.record.model_copy(update={"metrics_address": address}), item.expires_at, item.owner)

    broker.registry.update_records(
        [
            with_metrics(found(PEERS[0], NodeState.ONLINE, 1), "127.0.0.1:9701"),
            with_metrics(found(PEERS[1], NodeState.ONLINE, 1, Role.ANTNODE, True), "compnode-1:9700"),
            with_metrics(found(PEERS[2], NodeState.ONLINE, 1, backup=True), "0.0.0.0:9702"),
            with_metrics(found(PEERS[3], NodeState.OFFLINE, 1), "127.0.0.1:9703"),
        ],
        now=10,
    )
    broker.registry.record_pong(PEERS[0], 0.01, now=12)
    broker.registry.record_pong(PEERS[2], 0.01, now=12)
    broker.registry.check_timeouts(now=14)  # PEERS[1] never answered
    broker._update_swarm_metrics()
    sample = broker.metrics.registry.get_sample_value
    swarm = "fusionnet_swarm_compnodes"
    assert sample(swarm, {"role": "supernode", "state": "online"}) == 2
    assert sample(swarm, {"role": "antnode", "state": "unreachable"}) == 1
    assert sample(swarm, {"role": "supernode", "state": "offline"}) == 1
    assert sample(swarm, {"role": "antnode", "state": "online"}) == 0
    assert sample("fusionnet_backup_pool_compnodes") == 1  # PEERS[2]; PEERS[1] is not answering
    # PEERS[1] joined and turned unreachable: one loss beside the prior's one (``broker.churn``)
    assert sample("fusionnet_compnode_mtbf_seconds") == pytest.approx(PRIOR_MTBF / 2, rel=0.01)

    with caplog.at_level(logging.WARNING, logger="fusionnet.broker"):
        asyncio.run(broker._update_scrape_targets())
        asyncio.run(broker._update_scrape_targets())
    # unreachable stays a target (up == 0 shows it); OFFLINE, no address and bind-all do not
    expected = [
        ("127.0.0.1", 9701, "supernode", False, PEERS[0]),
        ("compnode-1", 9700, "antnode", True, PEERS[1]),
    ]
    assert [tuple(t) for t in broker.metrics_sd_source()()] == expected
    doc = json.loads(sd_file.read_text())
    assert [g["targets"] for g in doc] == [["127.0.0.1:9701"], ["compnode-1:9700"]]
    assert doc[1]["labels"] == {"role": "antnode", "backup": "true", "peer": PEERS[1]}
    assert len([r for r in caplog.records if "bind-all" in r.getMessage()]) == 1  # once, not per refresh

    broker.store = BrokerStore(tmp_path / "b.sqlite3")
    try:
        for job_id, state in (("j1", None), ("j2", JobState.RUNNING), ("j3", JobState.FAILED)):
            broker.store.create_job(job_id, "x")
            if state is not None:
                broker.store.update_job(job_id, state=state)
        broker.refresh_job_metrics()
        jobs = {
            s: sample("fusionnet_jobs", {"state": s}) for s in ("queued", "running", "failed", "succeeded")
        }
        assert jobs == {"queued": 1, "running": 1, "failed": 1, "succeeded": 0}
    finally:
        broker.store.close()


def test_a_crashed_compnode_stays_a_scrape_target_and_unreachable_until_forgotten(tmp_path: Path) -> None:
    """Its record expires 30 s after a SIGKILL, with no OFFLINE goodbye. Dropped from service discovery
    and counted offline then, neither compnode alert (``for: 2m`` on ``up == 0``, ``for: 1m`` on the
    unreachable count) could ever fire for the failure they exist for."""
    broker = BrokerDaemon(BrokerConfig(heartbeat_period=1, heartbeat_timeout=3, sd_file=tmp_path / "sd.json"))
    crashed = found(PEERS[0], NodeState.ONLINE, 1)
    crashed = Found(
        crashed.record.model_copy(update={"metrics_address": "127.0.0.1:9701"}), 15, crashed.owner
    )
    broker.registry.update_records([crashed], now=10)
    broker.registry.update_records([], now=20)  # its record expired at 15 without a goodbye
    assert broker.registry.get(PEERS[0]).gone
    broker._update_swarm_metrics()
    sample = broker.metrics.registry.get_sample_value
    assert sample("fusionnet_swarm_compnodes", {"role": "supernode", "state": "unreachable"}) == 1
    assert sample("fusionnet_swarm_compnodes", {"role": "supernode", "state": "offline"}) == 0
    asyncio.run(broker._update_scrape_targets())
    assert [t[4] for t in broker.metrics_sd_source()()] == [PEERS[0]]
    broker.registry.update_records([], now=20 + broker.registry.forget_after + 1)  # forgotten
    asyncio.run(broker._update_scrape_targets())
    assert list(broker.metrics_sd_source()()) == []


def test_compnode_metrics_host_from_multiaddrs() -> None:
    assert _maddr_host(["/ip4/127.0.0.1/tcp/1/p2p/x", "/ip4/10.0.0.5/tcp/1/p2p/x"]) == "10.0.0.5"
    assert _maddr_host(["/dns4/compnode-1/tcp/31337"]) == "compnode-1"
    assert _maddr_host(["/ip4/0.0.0.0/tcp/1", "/ip4/127.0.0.1/tcp/1"]) == "127.0.0.1"
    assert _maddr_host(["/ip6/::/tcp/1"]) is None and _maddr_host([]) is None


# ---- status ---------------------------------------------------------------------------------------------
def test_status_merge_prefers_the_broker_unless_the_node_said_goodbye() -> None:
    records = [
        found(PEERS[0], NodeState.ONLINE, 1),
        found(PEERS[1], NodeState.OFFLINE, 1),
        found(PEERS[3], NodeState.JOINING, 1),
    ]
    reg = CompnodeRegistry(heartbeat_timeout=3.0)
    reg.update_records(
        [
            found(PEERS[0], NodeState.ONLINE, 1),
            found(PEERS[1], NodeState.ONLINE, 1),
            found(PEERS[2], NodeState.ONLINE, 1),
        ],
        now=5,
    )
    reg.record_pong(PEERS[0], 0.004, now=5)
    reg.check_timeouts(now=9)  # PEERS[1] and PEERS[2] never answered
    broker = {"compnodes": [e.to_status(10) for e in reg.entries()], "jobs": []}
    rows = {r["peer_id"]: r for r in merge_status(broker, records, now=10)}
    assert rows[PEERS[0]]["state"] == "UNREACHABLE" and rows[PEERS[0]]["rtt_ms"] == pytest.approx(4.0)
    assert rows[PEERS[1]]["state"] == "OFFLINE"  # the DHT goodbye beats the broker's stale view
    assert rows[PEERS[2]]["state"] == "UNREACHABLE" and not rows[PEERS[2]]["in_dht"]
    assert rows[PEERS[3]]["state"] == "JOINING" and not rows[PEERS[3]]["known_to_broker"]
    job = {
        "job_id": "j1",
        "name": "fig3",
        "state": "RUNNING",
        "step": 3,
        "steps": 10,
        "loss": 0.25,
        "updated_at": time.time(),
    }
    text = format_tables(
        {
            "broker": {"peer_id": "QmB", "uptime": 5, "version": "0"},
            "compnodes": list(rows.values()),
            "jobs": [job],
        }
    )
    assert (
        "UNREACHABLE" in text and "3/10" in text and "0.250000" in text and "50.0" in text
    )  # S = 1e11 * 0.5
    assert "broker: no broker" in format_tables(
        {"broker": None, "broker_error": "no broker", "compnodes": [], "jobs": []}
    )
    deployments = [
        {"id": "gpt", "kind": "generate", "job_id": "j2", "compnodes": 0, "batches": 7, "queued_rows": 0,
         "unplaced": "no compnode can take sub-DAG 0"},
        {"id": "mlp", "kind": "infer", "job_id": "j3", "compnodes": 2, "batches": 1, "unplaced": None},
    ]  # fmt: skip
    text = format_tables({"broker": None, "compnodes": [], "jobs": [], "deployments": deployments})
    assert "gpt: no placement: no compnode can take sub-DAG 0" in text and "mlp: no placement" not in text


def test_status_watch_frames() -> None:
    doc = {
        "broker": {"peer_id": "QmB", "uptime": 5, "version": "0"},
        "compnodes": [{"peer_id": PEERS[0], "role": "supernode", "backup": False, "state": "ONLINE"}],
        "jobs": [{"job_id": "j1", "name": "n", "state": "RUNNING", "step": 1}],
    }
    tty = render_frame(doc, None, interval=2, tty=True)
    assert tty.startswith(CLEAR_HOME) and tty.endswith(CLEAR_BELOW)  # redrawn in place, leftovers cleared
    assert "every 2 s" in tty and "compnodes: 1 online; jobs running: 1" in tty and PEERS[0][:4] in tty
    piped = render_frame(None, "TimeoutError: slow", interval=0.5, tty=False)
    assert "\x1b" not in piped and "refresh failed: TimeoutError: slow" in piped and piped.endswith("\n\n")


# ---- configuration and files ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: DaemonConfig(refresh_period=0), "--refresh-period"),
        (lambda: DaemonConfig(refresh_period=5, record_ttl=5), "must exceed the refresh period"),
        (lambda: DaemonConfig(metrics_port=70000), "--metrics-port"),
        (lambda: DHTConfig(initial_peers=("/ip4/1.2.3.4/tcp/x",)), "--initial-peers"),
        (lambda: BrokerConfig(heartbeat_period=5, heartbeat_timeout=5), "must exceed --heartbeat-period"),
        (lambda: CompnodeConfig(threads=0), "--threads"),
        (lambda: CompnodeConfig(role="queen"), "queen"),
        (lambda: CompnodeConfig(metrics_announce_host="0.0.0.0"), "--metrics-announce-host"),
        (lambda: CompnodeConfig(metrics_announce_host="a b"), "--metrics-announce-host"),
        (lambda: BrokerConfig(sd_file=Path("/nonexistent-dir/sd.json")), "--sd-file"),
    ],
)
def test_config_errors_name_the_flag(make: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make()


def test_light_flag_defaults_match_the_real_ones() -> None:
    from fusionnet.daemon import flags
    from fusionnet.dht.node import DEFAULT_HOST_MADDRS
    from fusionnet.rpc.protocol import DEFAULT_MAX_MESSAGE_BYTES

    assert flags.DEFAULT_HOST_MADDRS == DEFAULT_HOST_MADDRS
    assert flags.DEFAULT_MAX_MESSAGE_MB * 2**20 == DEFAULT_MAX_MESSAGE_BYTES


def test_state_dir_lock_and_address_file(tmp_path: Path) -> None:
    first, second = StateDir(tmp_path / "s", "broker"), StateDir(tmp_path / "s", "broker")
    first.acquire()
    with pytest.raises(ValueError, match="in use by another daemon"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()
    temp = StateDir(None, "compnode")
    temp.acquire()
    assert temp.path.is_dir()
    temp.release()
    assert not temp.path.exists()
    addr = tmp_path / "x" / "addr"
    write_address_file(addr, ["/ip4/127.0.0.1/tcp/1/p2p/QmA", "/ip4/127.0.0.1/tcp/2/p2p/QmA"])
    assert read_address_file(addr) == ["/ip4/127.0.0.1/tcp/1/p2p/QmA", "/ip4/127.0.0.1/tcp/2/p2p/QmA"]
    assert [p.name for p in addr.parent.iterdir()] == ["addr"]  # no temporary left behind


@pytest.mark.timeout(60)
def test_profile_is_cached_per_setup(tmp_path: Path) -> None:
    from fusionnet.profiling.node import CACHE_FILE, profile_hardware

    hw = profile_hardware(tmp_path, threads=1)
    assert hw.device_kind == "cpu" and hw.threads == 1 and hw.peak_flops > 0 and 0 < hw.speed_factor <= 10
    assert hw.mem_bandwidth > 0 and hw.d_cpu > 0 and hw.d_disk > 0
    cached = profile_hardware(tmp_path, threads=1)
    assert (cached.peak_flops, cached.speed_factor) == (hw.peak_flops, hw.speed_factor)
    (tmp_path / CACHE_FILE).write_text("{not json")
    assert profile_hardware(tmp_path, threads=1).threads == 1  # unreadable cache: measured again


# ---- Daemon lifecycle in-process ------------------------------------------------------------------------
class RecordingService:
    name = "recorder"

    def __init__(self, log: list[str]):
        self.log = log

    async def start(self) -> None:
        self.log.append("start")

    async def stop(self) -> None:
        self.log.append("stop")

    async def rpc_hello(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        return {"hello": payload.get("name")}


class ToyDaemon(Daemon):
    role = "toy"

    def __init__(self, config: DaemonConfig, log: list[str], fail_in_background: bool = False):
        super().__init__(config)
        self.log, self.fail_in_background = log, fail_in_background

    async def on_startup(self) -> None:
        await self.start_services()
        if self.fail_in_background:

            async def broken() -> None:
                raise RuntimeError("loop died")

            self.spawn(broken(), "broken")

    async def on_draining(self) -> None:
        self.log.append("draining")

    async def on_stopped(self) -> None:
        self.log.append("stopped")


@pytest.mark.swarm  # real hivemind processes (p2pd, DHT)
@pytest.mark.timeout(60)
def test_daemon_lifecycle_with_a_service(tmp_path: Path) -> None:
    async def scenario() -> None:
        log: list[str] = []
        config = DaemonConfig(state_dir=tmp_path / "state", address_file=tmp_path / "addr", shutdown_grace=1)
        daemon = ToyDaemon(config, log)
        daemon.add_service(RecordingService(log))
        serving = asyncio.create_task(daemon.serve_async(install_signals=False))
        await asyncio.wait_for(daemon.ready.wait(), 30)
        maddrs = read_address_file(tmp_path / "addr")
        assert maddrs and all(m.endswith(f"/p2p/{daemon.peer_id}") for m in maddrs)
        assert sorted(daemon.peer.server.methods) == ["hello"]
        with pytest.raises(RuntimeError, match="before serve"):
            daemon.add_service(RecordingService(log))
        daemon.should_exit.set()
        assert await asyncio.wait_for(serving, 30) == 0
        assert log == ["start", "draining", "stop", "stopped"]
        assert not (tmp_path / "addr").exists() and not daemon.peer.dht.is_alive()

        failing = ToyDaemon(DaemonConfig(state_dir=tmp_path / "state2"), [], fail_in_background=True)
        assert await asyncio.wait_for(failing.serve_async(install_signals=False), 30) == 1
        assert isinstance(failing._fatal, RuntimeError)

    asyncio.run(scenario())


def test_add_service_checks_the_protocol() -> None:
    daemon = ToyDaemon(DaemonConfig(), [])
    with pytest.raises(TypeError, match="lacks name/start"):
        daemon.add_service(SimpleNamespace(name="x"))  # type: ignore[arg-type]
