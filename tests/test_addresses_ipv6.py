"""An IPv6 compnode's data path (audit x2): with no ``--data-host`` or with ``--data-host ::`` it listened
on 0.0.0.0 while it announced its IPv6 host, so every peer got ConnectionRefused and silently fell back to
the slower libp2p streams. A wildcard listen is now ``::`` (dual-stack) whenever the announced host may be
IPv6, and stays 0.0.0.0 for IPv4."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from fusionnet.daemon.addresses import DataAddress, announced_host, data_address
from fusionnet.wire import DataPathClient, DataPathServer
from fusionnet.wire.datapath import read_hello
from tests.wire_support import KEY, frame, until

ANY6 = "/ip6/::/tcp/31338"
ANY4 = "/ip4/0.0.0.0/tcp/31338"
V6 = "/ip6/fd00:fa::2/tcp/31338"
PEER = "/ip4/10.0.0.1/tcp/31337/p2p/QmcEPrat8ShnCph8WjkREzt5CPXF2RwhYxYBALDcLC1iV6"


@pytest.mark.parametrize(
    "data_host,host,announce,peers,want",
    [
        (None, [ANY6], [V6], [], DataAddress("::", "fd00:fa::2", True)),  # the README's default
        ("::", [ANY6], [V6], [], DataAddress("::", "fd00:fa::2", True)),
        ("::", [ANY4], ["/ip4/10.0.0.2/tcp/1"], [PEER], DataAddress("::", "10.0.0.2", True)),  # asked for
        (None, [ANY4], ["/dns6/node-b/tcp/1"], [PEER], DataAddress("::", "node-b", True)),
        (None, [ANY6, ANY4], [], [PEER], DataAddress("::", None, True)),  # libp2p may find an IPv6 one
        ("::", [ANY4], [], [PEER], DataAddress("::", None, True)),
        ("fd00:fa::2", [ANY6], [V6], [], DataAddress("fd00:fa::2", "fd00:fa::2", True)),
        # IPv4 as before
        (None, [ANY4], ["/ip4/10.0.0.2/tcp/1"], [PEER], DataAddress("0.0.0.0", "10.0.0.2", True)),
        (None, [ANY4], [], [PEER], DataAddress("0.0.0.0", None, True)),
        ("0.0.0.0", [ANY4], [], [PEER], DataAddress("0.0.0.0", None, True)),
    ],
)
def test_a_wildcard_listen_covers_the_family_it_announces(data_host, host, announce, peers, want) -> None:
    assert data_address(data_host, host, announce, peers) == want


def test_an_ipv4_listen_never_announces_an_ipv6_host() -> None:
    seen = ["/ip6/fd00:fa::2/tcp/1/p2p/Qm", "/ip4/192.168.1.7/tcp/1/p2p/Qm"]
    assert announced_host(DataAddress("0.0.0.0", None, True), seen) == "192.168.1.7"
    assert announced_host(DataAddress("::", None, True), seen) == "fd00:fa::2"
    with pytest.raises(ValueError, match="set --data-host"):
        announced_host(DataAddress("0.0.0.0", None, True), seen[:1])


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def _hello(host: str, port: int) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    try:
        return await asyncio.wait_for(read_hello(reader), 10)
    finally:
        writer.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_data_path_listening_on_any6_serves_ipv6_and_ipv4_peers() -> None:
    async def scenario() -> None:
        got: list[str] = []
        async with DataPathServer(peer_id="S") as server:
            server.register_job("job1", KEY, {"A"}, lambda f: got.append(f.name))
            _, port = await server.start(data_address("::", [ANY6], [], []).listen, 0)
            assert await _hello("::1", port) == "S"
            assert await _hello("127.0.0.1", port) == "S"  # dual-stack: IPv4 peers too
            async with DataPathClient(peer_id="A") as client:
                await client.send(f"[::1]:{port}", frame(torch.ones(3), name="v6"), KEY)
                # Over IPv4 the peer is 127.0.0.1, not ::ffff:127.0.0.1: loopback (a bare payload is fine)
                await client.send(("127.0.0.1", port), frame(torch.ones(3), name="v4"), KEY)
                await until(lambda: sorted(got) == ["v4", "v6"], what="both frames")
            assert server.stats["job1"].refused_total == 0

    asyncio.run(scenario())
