"""Broker and compnode daemons as real processes on loopback: discovery, status, heartbeats, graceful and
forced exits, resilience to bad RPC input, and no process or socket left behind.

One swarm (broker + a supernode + a backup antnode) is shared by the module; tests that stop daemons start
their own extra compnodes. DHT refresh is 1 s, heartbeats every 0.5 s with a 3 s timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from fusionnet.errors import WireError
from fusionnet.rpc.protocol import STREAM_PROTOCOL, decode_response, frame_header
from fusionnet.rpc.streams import read_frame
from fusionnet.runtime.process_swarm import (
    BlockingObserver,
    CompnodeSpec,
    ProcessSwarm,
    print_logs_on_failure,
    running_swarm,
)
from fusionnet.runtime.processes import DaemonProcess, alive, descendants, wait_until
from tests.jobfiles import REPO
from tests.probes import run_status_cli, scrape

pytestmark = pytest.mark.swarm
REFRESH = 1.0
HEARTBEAT_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessSwarm]:
    workdir = tmp_path_factory.mktemp("swarm")
    metrics = {"extra": ["--metrics-port", "0"]}
    with running_swarm(
        workdir,
        [metrics, {"role": "antnode", "backup": True, **metrics}],
        broker_kw={
            "refresh_period": REFRESH,
            "heartbeat_timeout": HEARTBEAT_TIMEOUT,
            "extra": ["--metrics-port", "0"],
        },
    ) as s:
        yield s


@pytest.fixture(scope="module")
def observer(swarm: ProcessSwarm) -> Iterator[BlockingObserver]:
    obs = BlockingObserver(swarm.initial_peers)
    yield obs
    obs.close()


def broker_view(observer: BlockingObserver) -> dict[str, dict]:
    return {c["peer_id"]: c for c in observer.broker_status()["compnodes"]}


def _kill_family(proc: subprocess.Popen[bytes], family: set[int]) -> None:
    """What a test started outside ``ProcessSwarm`` and what it forked (its DHT child, p2pd), if alive."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def assert_left_nothing(daemon: DaemonProcess) -> None:
    daemon.reap()
    assert daemon.family, f"{daemon.name}: its DHT child and p2pd were never seen"
    assert len(daemon.sockets) >= 2, f"{daemon.name}: its p2pd sockets were never seen: {daemon.sockets}"
    assert not daemon.leftovers, f"{daemon.name} left processes behind: {daemon.leftovers}"
    assert not [s for s in daemon.sockets if os.path.exists(s)], (
        f"{daemon.name} left sockets: {daemon.sockets}"
    )


@pytest.mark.timeout(120)
def test_status_shows_both_compnodes_online_with_hardware(
    swarm: ProcessSwarm, observer: BlockingObserver
) -> None:
    with print_logs_on_failure(swarm):
        supernode, antnode = (c.peer_id for c in swarm.compnodes)
        # heartbeats have reached both (the broker measured an RTT for each)
        wait_until(
            lambda: all(
                broker_view(observer).get(p, {}).get("rtt_ms") is not None for p in (supernode, antnode)
            ),
            10 * REFRESH,
            "the broker to ping both compnodes",
        )
        code, doc = run_status_cli(swarm.initial_peers)
        assert code == 0, doc
        assert doc["broker"]["peer_id"] == swarm.broker.peer_id
        rows = {c["peer_id"]: c for c in doc["compnodes"]}
        assert set(rows) >= {supernode, antnode}
        for peer, role, backup in ((supernode, "supernode", False), (antnode, "antnode", True)):
            row = rows[peer]
            assert (row["state"], row["role"], row["backup"], row["reachable"]) == (
                "ONLINE",
                role,
                backup,
                True,
            )
            hw = row["hardware"]
            assert hw["device_kind"] == "cpu" and hw["threads"] == 1
            assert (
                hw["peak_flops"] > 1e8
                and 0 < hw["speed_factor"] <= 10
                and hw["d_cpu"] > 0
                and hw["d_disk"] > 0
            )
            assert row["load"] == 0.0 and row["known_to_broker"] and row["in_dht"]
        assert doc["jobs"] == []
        assert {r["peer_id"] for r in doc["dht_compnodes"]} >= {supernode, antnode}

        # the broker's Prometheus endpoint counts them too, and lists them for service discovery
        broker_url = swarm.broker.metrics_url()
        m = scrape(f"{broker_url}/metrics")
        for role in ("supernode", "antnode"):
            assert m[("fusionnet_swarm_compnodes", (("role", role), ("state", "online")))] == 1
        assert m[("fusionnet_backup_pool_compnodes", ())] == 1
        assert m[("fusionnet_heartbeat_rtt_seconds_count", ())] > 0
        assert m[("fusionnet_node_info", (("peer_id", swarm.broker.peer_id),))] == 1
        assert m[("fusionnet_jobs", (("state", "running"),))] == 0
        with urllib.request.urlopen(f"{broker_url}/sd/compnodes", timeout=10) as response:
            sd = {g["labels"]["peer"]: g for g in json.load(response)}
        assert set(sd) == {supernode, antnode}
        assert (sd[antnode]["labels"]["role"], sd[antnode]["labels"]["backup"]) == ("antnode", "true")
        for daemon in swarm.compnodes:  # each target is that compnode's own endpoint
            [target] = sd[daemon.peer_id]["targets"]
            assert (
                f"http://{target}"
                == daemon.metrics_url()
                == f"http://{rows[daemon.peer_id]['metrics_address']}"
            )
            c = scrape(f"http://{target}/metrics")
            assert c[("fusionnet_compnode_state", (("state", "online"),))] == 1
            assert c[("fusionnet_node_info", (("peer_id", daemon.peer_id),))] == 1
            hw = rows[daemon.peer_id]["hardware"]
            assert c[("fusionnet_compnode_speed_factor", ())] == pytest.approx(hw["speed_factor"])
            assert c[("fusionnet_compnode_peak_flops", ())] == pytest.approx(hw["peak_flops"])


@pytest.mark.timeout(120)
def test_status_pointed_at_a_compnode_says_it_is_not_a_broker(swarm: ProcessSwarm) -> None:
    """A compnode's address where the broker's belongs: the status names the mistake (the compnode's
    records are still listed), not "unknown rpc method 'status'"."""
    compnode = swarm.compnodes[0]
    code, doc = run_status_cli(compnode.maddrs()[:1])
    assert code == 1 and doc["broker"] is None
    assert doc["broker_error"].startswith(f"{compnode.peer_id} is not a broker"), doc["broker_error"]


@pytest.mark.timeout(120)
def test_status_watch_redraws_until_ctrl_c(swarm: ProcessSwarm, tmp_path: Path) -> None:
    with print_logs_on_failure(swarm):
        out_path = tmp_path / "watch.out"
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fusionnet.cli.main", "status", "--watch", "--interval", "0.5",
                 "--initial-peers", *swarm.initial_peers],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                env=dict(os.environ, HIVEMIND_LOGLEVEL="WARNING"), start_new_session=True,
            )  # fmt: skip
        family: set[int] = set()
        try:
            peers = [c.peer_id for c in swarm.compnodes]

            def frames() -> int:
                family.update(descendants(proc.pid))
                if proc.poll() is not None:
                    raise AssertionError(
                        f"status --watch exited with {proc.returncode}:\n{out_path.read_text()}"
                    )
                text = out_path.read_text(errors="replace")
                blocks = [b for b in text.split("fusionnet status  ")[1:] if all(p[-8:] in b for p in peers)]
                return len(blocks)

            wait_until(lambda: frames() >= 3, 60, "three refreshes of status --watch listing both compnodes")
            text = out_path.read_text()
            assert "every 0.5 s" in text and "\x1b" not in text  # into a file: appended blocks, no escapes
            assert "compnodes: " in text and "ONLINE" in text
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
            assert proc.wait(timeout=30) == 0, out_path.read_text()
            assert "Traceback" not in out_path.read_text()
            wait_until(lambda: not any(alive(p) for p in family), 15, "status --watch's DHT child to exit")
        finally:
            _kill_family(proc, family)


@pytest.mark.timeout(120)
def test_late_compnode_appears_and_sigterm_shows_offline(
    swarm: ProcessSwarm, observer: BlockingObserver
) -> None:
    with print_logs_on_failure(swarm):
        # a longer ttl of its own (3 x 3 s) keeps its goodbye readable in the DHT on a loaded machine; what is
        # timed is the broker's refresh (1 s)
        late = swarm.add_compnode("late", CompnodeSpec(refresh_period=3.0))
        wait_until(
            lambda: broker_view(observer).get(late.peer_id, {}).get("state") == "ONLINE",
            3 * REFRESH + 5,
            "the broker to list the late compnode ONLINE",
        )
        late.send(signal.SIGTERM)
        assert late.wait_exit(timeout=30) == 0
        exited = time.monotonic()
        # its goodbye is in the DHT as soon as it has exited ...
        assert observer.records()[late.peer_id].state == "OFFLINE"
        # ... and the broker picks it up at its next refresh (slack for polling and a loaded machine)
        wait_until(
            lambda: broker_view(observer)[late.peer_id]["state"] == "OFFLINE",
            REFRESH + 2.0,
            "the broker to show the stopped compnode OFFLINE",
        )
        assert time.monotonic() - exited < REFRESH + 2.0
        assert "DRAINING" in late.log_text() or "announced OFFLINE" in late.log_text()
        assert_left_nothing(late)


@pytest.mark.timeout(120)
def test_bad_rpc_requests_do_not_kill_daemons(swarm: ProcessSwarm, observer: BlockingObserver) -> None:
    from hivemind.p2p import PeerID

    with print_logs_on_failure(swarm):
        compnode = swarm.compnodes[0].peer_id
        with pytest.raises(WireError, match="unknown rpc method 'steal_weights'"):
            observer.call(compnode, "steal_weights", {})

        async def raw(peer: str, data: bytes) -> tuple[str, str]:
            _, reader, writer = await observer.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer), STREAM_PROTOCOL
            )
            writer.write(data)
            await writer.drain()
            try:
                return decode_response(await read_frame(reader, 1 << 20, 10.0, "answer")).error
            finally:
                writer.close()

        for peer in (compnode, swarm.broker.peer_id):
            assert "bad magic" in observer.run(raw(peer, b"GET / HTTP/1.1\r\n\r\n"))[1]
            assert "exceeds the limit" in observer.run(raw(peer, frame_header(1 << 50)))[1]
            assert "not valid msgpack" in observer.run(raw(peer, frame_header(2) + b"\xc1\xc1"))[1]
            assert "must be a map" in observer.run(raw(peer, frame_header(1) + msgpack.packb(7)))[1]
        # Typed messages: a malformed payload is refused by validation, naming the method and the field.
        with pytest.raises(WireError, match=r"rpc step: malformed message: job_id: "):
            observer.call(compnode, "step", {"job_id": ["x"], "step": 1})
        with pytest.raises(WireError, match=r"rpc job_status: malformed message: since: "):
            observer.call(swarm.broker.peer_id, "job_status", {"job_id": "abc", "since": -1})
        assert observer.call(compnode, "ping", {"nonce": "n1", "newer_field": 1})["nonce"] == "n1"
        assert swarm.broker.peer_id == observer.broker_status()["broker"]["peer_id"]
        assert all(d.proc.poll() is None for d in (swarm.broker, *swarm.compnodes))


@pytest.mark.timeout(120)
def test_second_sigint_forces_exit(swarm: ProcessSwarm, observer: BlockingObserver) -> None:
    from hivemind.p2p import PeerID

    with print_logs_on_failure(swarm):
        node = swarm.add_compnode("stubborn", CompnodeSpec(extra=["--shutdown-grace", "120"]))
        # an upload that stalls half-way keeps one RPC call in flight; a graceful exit waits for it
        _, _, writer = observer.run(
            observer.p2p.call_binary_stream_handler(PeerID.from_base58(node.peer_id), STREAM_PROTOCOL)
        )
        writer.write(frame_header(1000) + b"x" * 10)
        observer.run(writer.drain())
        node.send(signal.SIGINT)
        wait_until(
            lambda: "in-flight RPC call" in node.log_text(), 20, "the graceful exit to wait for the call"
        )
        assert node.proc.poll() is None
        node.send(signal.SIGINT)
        start = time.monotonic()
        assert node.wait_exit(timeout=15) == 130
        assert time.monotonic() - start < 15
        assert "forcing exit" in node.log_text() and "Traceback" not in node.log_text()
        writer.close()
        assert_left_nothing(node)


@pytest.mark.timeout(120)
def test_sigkill_is_survived_and_leaves_no_orphans(swarm: ProcessSwarm, observer: BlockingObserver) -> None:
    with print_logs_on_failure(swarm):
        victim = swarm.add_compnode("victim", CompnodeSpec(role="antnode"))
        wait_until(
            lambda: broker_view(observer).get(victim.peer_id, {}).get("rtt_ms") is not None,
            3 * REFRESH + 5,
            "the broker to ping the victim",
        )
        victim.send(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        # the DHT child notices its parent is gone and shuts down, taking p2pd with it, and removes the dead
        # daemon's p2pd client socket
        wait_until(
            lambda: not any(alive(p) for p in victim.family), 20, "the victim's DHT child and p2pd to exit"
        )
        assert any("p2pclient" in path for path in victim.sockets), victim.sockets
        assert not [path for path in victim.sockets if os.path.exists(path)], victim.sockets
        wait_until(
            lambda: broker_view(observer)[victim.peer_id]["state"] in ("UNREACHABLE", "OFFLINE"),
            HEARTBEAT_TIMEOUT + 3.0,
            "the broker to notice the killed compnode",
        )
        assert swarm.broker.proc.poll() is None
        assert {
            c["state"] for p, c in broker_view(observer).items() if p in {d.peer_id for d in swarm.compnodes}
        } == {"ONLINE"}


@pytest.mark.timeout(120)
def test_graceful_stop_leaves_nothing_behind(swarm: ProcessSwarm, observer: BlockingObserver) -> None:
    with print_logs_on_failure(swarm):
        running = [d for d in swarm.daemons if d.proc.poll() is None]
        assert {d.name for d in running} == {"broker", "compnode0", "compnode1"}
        codes = swarm.stop()
        for daemon in running:
            assert codes[daemon.name] == 0, daemon.name
            assert_left_nothing(daemon)
            assert not daemon.address_file.exists(), f"{daemon.name} left its address file"
        broker_log = swarm.broker.log_text()
        assert "broker stopped" in broker_log and Path(swarm.broker.state_dir, "broker.sqlite3").exists()


@pytest.mark.timeout(180)
def test_a_compnode_without_a_state_dir_joins_on_a_temporary_one(tmp_path: Path) -> None:
    """``--state-dir`` is optional (the interface's command line): without it the compnode's replica
    store was built on a state dir that only exists once the daemon starts, and it died at start-up."""
    from fusionnet.runtime.process_swarm import members_online

    with running_swarm(tmp_path / "swarm", [], broker_kw={"refresh_period": REFRESH}) as swarm:
        address, log_path = tmp_path / "c.addr", tmp_path / "c.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fusionnet.cli.main", "compnode", "--initial-peers",
                 *swarm.initial_peers, "--address-file", str(address)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                env=dict(os.environ, HIVEMIND_LOGLEVEL="WARNING"), start_new_session=True,
            )  # fmt: skip
        family: set[int] = set()
        observer = BlockingObserver(swarm.initial_peers)
        try:

            def joined() -> bool:
                family.update(descendants(proc.pid))
                if proc.poll() is not None:
                    raise AssertionError(
                        f"the compnode exited with {proc.returncode}:\n{log_path.read_text()}"
                    )
                return members_online(observer.broker_status()) == 1

            wait_until(joined, 90, "the compnode without --state-dir to be ONLINE at the broker")
            os.killpg(proc.pid, signal.SIGTERM)  # a graceful leave
            assert proc.wait(timeout=60) == 0, log_path.read_text()
            assert "Traceback" not in log_path.read_text()
        finally:
            observer.close()
            _kill_family(proc, family)
