"""``--initial-peers`` of the client commands is the broker's address: their help says so (it said "any
peer of the swarm", while clients pin the first peer as their broker); a compnode's or a plain DHT peer's
address gives every command the one line ``status`` gives ("X is not a broker ..."), not a compnode's
method list or a libp2p failure; and an address without ``/p2p/PEERID`` is refused at once (exit 2, one
line naming the flag) by clients and daemons alike, instead of a Go log line 7-10 s later.

In one process: the swarm client's libp2p peer is a fake whose calls fail as a compnode's (or a plain
DHT peer's) do."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fusionnet.daemon.observer as observer_module
from fusionnet.cli.main import EXIT_BAD_INPUT, EXIT_FAILED, build_parser, main
from fusionnet.errors import JobError, WireError
from fusionnet.rpc.protocol import RPCError
from tests.jobfiles import REPO

pytestmark = pytest.mark.timeout(120)

NOT_BROKER = "QmWip7R2pWskGRpMQjNA1qc4Xr169CqMTAtuZn1EC93Zzh"
PEER = f"/ip4/127.0.0.1/tcp/9/p2p/{NOT_BROKER}"
MLP = REPO / "examples" / "mlp"
COMPNODE_METHODS = "assign, collect, fetch_replica, info, ping, probe_links, release, serve_step, step"


def _compnode_answer(method: str) -> Exception:
    return WireError(f"unknown rpc method {method!r}; this peer serves: {COMPNODE_METHODS}")


def _dht_peer_answer(method: str) -> Exception:
    return RPCError(
        f"rpc {method} on peer {NOT_BROKER} failed: ControlFailure: Connect failed. msg=failed to negotiate "
        "protocol: protocols not supported: [/fusionnet/rpc-stream/1]",
        peer=NOT_BROKER,
        method=method,
        kind="ControlFailure",
    )


class _FakePeer:
    """The swarm client's peer: joins nothing; every call fails as ``answer`` says."""

    def __init__(self, answer: Any) -> None:
        self.peer_id = "12D3KooWClientClientClientClientClientClientClient"
        self.calls: list[str] = []

        async def call(peer: str, method: str, payload: Any = None, **kw: Any) -> dict:
            self.calls.append(method)
            raise answer(method)

        async def lookup(record_type: Any) -> list:
            return []

        self.client = SimpleNamespace(call=call)
        self.announcer = SimpleNamespace(lookup=lookup)

    async def stop(self, rpc_grace: float = 0.0) -> None:
        pass


@pytest.fixture(params=[_compnode_answer, _dht_peer_answer], ids=["compnode", "dht-peer"])
def not_a_broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setenv("FUSIONNET_HOME", str(tmp_path / "home"))
    peer = _FakePeer(request.param)

    async def start(config: Any, serve: bool = True) -> _FakePeer:
        return peer

    monkeypatch.setattr(observer_module.SwarmPeer, "start", start)
    return peer


@pytest.mark.parametrize(
    "argv",
    [
        ["cancel", "0123456789ab"],
        ["results", "0123456789ab", "--output", "OUT"],
        ["undeploy", "mlp"],
        ["submit", str(MLP / "job.yaml"), "--output", "OUT", "--wait-compnodes", "0"],
        ["deploy", str(MLP / "infer.yaml"), "--name", "mlp", "--wait-compnodes", "0"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_client_command_says_the_peer_given_is_not_a_broker(
    not_a_broker: _FakePeer, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    code = main([*argv, "--initial-peers", PEER])
    err = capsys.readouterr().err.strip().splitlines()
    assert not_a_broker.calls, "the command never called the peer"
    method = not_a_broker.calls[-1]
    said = (
        f"fusionnet {argv[0]}: error: {NOT_BROKER} is not a broker (it answers no {method} call): give "
        "--initial-peers the broker's address (its --address-file lines)"
    )
    assert code == EXIT_FAILED and err[-1:] == [said], err


def test_status_says_it_the_same_way(not_a_broker: _FakePeer) -> None:
    from fusionnet.cli.cmd_status import gather

    doc = asyncio.run(gather([PEER], timeout=5.0))
    assert doc["broker_error"] == (
        f"{NOT_BROKER} is not a broker (it answers no status call): give --initial-peers the broker's "
        "address (its --address-file lines)"
    ), doc


def test_a_broker_lacking_one_method_is_still_a_broker() -> None:
    """Only a peer that serves no ``status`` (every broker does) or no FusionNet RPC is called no broker:
    a broker of another version that lacks one method says so as it is."""
    lacks = WireError("unknown rpc method 'upload_state'; this peer serves: cancel_job, ping, status")
    assert not observer_module.serves_no_broker(lacks)
    assert observer_module.serves_no_broker(_compnode_answer("cancel_job"))  # type: ignore[arg-type]
    assert observer_module.serves_no_broker(_dht_peer_answer("cancel_job"))  # type: ignore[arg-type]
    assert not observer_module.serves_no_broker(RPCError("rpc status on peer X: no answer within 10 s"))


@pytest.mark.parametrize("command", ["submit", "cancel", "results", "status", "deploy", "undeploy"])
def test_the_help_says_initial_peers_is_the_brokers_address(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    said = sub.choices[command]._option_string_actions["--initial-peers"].help
    assert "broker's multiaddr" in said and "--address-file" in said and "any" not in said, said


@pytest.mark.parametrize(
    "argv",
    [
        ["cancel", "0123456789ab"],
        ["results", "0123456789ab", "--output", "OUT"],
        ["submit", str(MLP / "job.yaml"), "--output", "OUT"],
        ["deploy", str(MLP / "infer.yaml"), "--name", "mlp"],
        ["undeploy", "mlp"],
        ["status"],
        ["broker"],
        ["compnode"],
    ],
    ids=lambda argv: argv[0],
)
def test_an_address_without_a_peer_id_is_refused_at_once(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    started = time.monotonic()
    code = main([*argv, "--initial-peers", PEER, "/ip4/127.0.0.1/tcp/5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and len(err) == 1, err
    assert err[0] == (
        f"fusionnet {argv[0]}: error: --initial-peers: '/ip4/127.0.0.1/tcp/5' names no peer id: give the "
        "whole address, /ip4/HOST/tcp/PORT/p2p/PEERID (a line of the peer's --address-file)"
    ), err
    assert time.monotonic() - started < 5 and not (tmp_path / "out").exists()


def test_the_check_takes_the_addresses_daemons_and_clients_are_given() -> None:
    from fusionnet.dht.node import check_initial_peers

    check_initial_peers([PEER, f"/ip6/::1/tcp/1/p2p/{NOT_BROKER}", f"/dns4/broker/tcp/1/p2p/{NOT_BROKER}"])
    with pytest.raises(JobError, match="names no peer id"):
        check_initial_peers(["/dns4/broker/tcp/31337"])
