"""Which addresses a daemon publishes and where a compnode's data path listens (``daemon.addresses``)."""

from __future__ import annotations

import pytest

from fusionnet.compnode.daemon import CompnodeConfig
from fusionnet.daemon.addresses import DataAddress, announced_host, data_address, useful_maddrs
from fusionnet.daemon.config import DaemonConfig
from fusionnet.dht.node import DHTConfig

LO = "/ip4/127.0.0.1/tcp/0"
ANY = "/ip4/0.0.0.0/tcp/31338"
PEER = "/ip4/10.0.0.1/tcp/31337/p2p/QmcEPrat8ShnCph8WjkREzt5CPXF2RwhYxYBALDcLC1iV6"


@pytest.mark.parametrize(
    "data_host,host,announce,peers,want",
    [
        (None, [LO], [], [], DataAddress("127.0.0.1", "127.0.0.1", False)),  # one machine: as before
        (None, [ANY], ["/ip4/10.0.0.2/tcp/31338"], [PEER], DataAddress("0.0.0.0", "10.0.0.2", True)),
        (None, [ANY], ["/dns4/node-b/tcp/31338"], [PEER], DataAddress("0.0.0.0", "node-b", True)),
        (None, ["/ip4/10.0.0.3/tcp/31338"], [], [PEER], DataAddress("10.0.0.3", "10.0.0.3", True)),
        (None, [ANY], [], [PEER], DataAddress("0.0.0.0", None, True)),  # found from libp2p at start-up
        ("10.0.0.2", [ANY], [], [PEER], DataAddress("10.0.0.2", "10.0.0.2", True)),
        ("0.0.0.0", [ANY], ["/ip4/10.0.0.2/tcp/31338"], [PEER], DataAddress("0.0.0.0", "10.0.0.2", True)),
        ("127.0.0.1", [LO], [], [], DataAddress("127.0.0.1", "127.0.0.1", False)),
    ],
)
def test_data_address_defaults_to_one_other_hosts_reach(data_host, host, announce, peers, want) -> None:
    assert data_address(data_host, host, announce, peers) == want


@pytest.mark.parametrize(
    "host,announce,peers",
    [
        ([ANY], [], []),
        (["/ip4/10.0.0.2/tcp/1"], [], []),
        ([LO], ["/ip4/1.2.3.4/tcp/1"], []),
        ([LO], [], [PEER]),
    ],
)
def test_loopback_data_host_in_a_swarm_across_machines_is_refused(host, announce, peers) -> None:
    with pytest.raises(ValueError, match=r"--data-host 127\.0\.0\.1 is a loopback address"):
        data_address("127.0.0.1", host, announce, peers)


def test_compnode_config_refuses_contradictory_flags_at_start_up() -> None:
    dht = DHTConfig(host_maddrs=(ANY,), announce_maddrs=("/ip4/10.0.0.2/tcp/31338",))
    with pytest.raises(ValueError, match="loopback"):
        CompnodeConfig(common=DaemonConfig(dht=dht), data_host="127.0.0.1", data_port=31400)
    config = CompnodeConfig(common=DaemonConfig(dht=dht), data_port=31400)  # the case: no --data-host
    assert config.data_address.announce == "10.0.0.2"


def test_announced_host_from_what_libp2p_sees() -> None:
    seen = ["/ip4/127.0.0.1/tcp/31338/p2p/Qm", "/ip4/192.168.1.7/tcp/31338/p2p/Qm"]
    assert announced_host(DataAddress("0.0.0.0", None, True), seen) == "192.168.1.7"
    assert announced_host(DataAddress("0.0.0.0", None, False), seen[:1]) == "127.0.0.1"
    with pytest.raises(ValueError, match="set --data-host"):
        announced_host(DataAddress("0.0.0.0", None, True), seen[:1])


def test_useful_maddrs_drop_loopback_unless_nothing_else() -> None:
    lo, lan = "/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/10.1.2.3/tcp/1/p2p/Qm"
    assert useful_maddrs([lo, lan]) == [lan]
    assert useful_maddrs([lo]) == [lo]
    assert useful_maddrs(["/ip6/::1/tcp/1/p2p/Qm", "/dns4/a.example/tcp/1/p2p/Qm"]) == [
        "/dns4/a.example/tcp/1/p2p/Qm"
    ]


def test_a_taken_listen_port_is_refused_naming_the_flag() -> None:
    """p2pd binds with SO_REUSEPORT: a second daemon on a taken port would start and share it (the kernel
    splitting the swarm's connections between the two). The port is tried first, as a plain bind."""
    import socket

    from fusionnet.dht.node import check_ports_free

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as p2pd does
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^--host-maddrs /ip4/127.0.0.1/tcp/{port}: cannot listen"):
            check_ports_free([f"/ip4/127.0.0.1/tcp/{port}"])
    check_ports_free([f"/ip4/127.0.0.1/tcp/{port}", "/ip4/127.0.0.1/tcp/0"])  # free again; 0: any port


def test_a_listen_port_freed_soon_after_is_waited_for_then_a_held_one_refused() -> None:
    """A daemon restarted right after a SIGKILL finds its port held by the dead one's p2pd for a second or
    two (until p2pd's parent-watch shuts it down): the start waits for it, within a bound."""
    import asyncio
    import socket
    import time

    from fusionnet.dht.node import wait_for_free_ports

    async def free_soon(holder: socket.socket, port: int) -> float:
        asyncio.get_running_loop().call_later(0.6, holder.close)
        started = time.monotonic()
        await wait_for_free_ports([f"/ip4/127.0.0.1/tcp/{port}"], wait=10.0)
        return time.monotonic() - started

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    waited = asyncio.run(free_soon(holder, holder.getsockname()[1]))
    assert 0.5 <= waited < 5.0

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ValueError, match=rf"^--host-maddrs /ip4/127.0.0.1/tcp/{port}: cannot listen"):
            asyncio.run(wait_for_free_ports([f"/ip4/127.0.0.1/tcp/{port}"], wait=0.5))
        assert time.monotonic() - started >= 0.5
