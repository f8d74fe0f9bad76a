"""Bare frames (``wire/crypt.py``, ``bare_ok``): over a loopback connection a plaintext frame's payload
goes without its MAC; the header stays authenticated, the flag is under the head tag, and a receiver
takes a bare frame only from a loopback peer of a job that does not encrypt loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fusionnet.errors import WireError
from fusionnet.wire import FrameRefused, TensorFrame, encode_frame
from fusionnet.wire.crypt import bare_ok
from fusionnet.wire.datapath import DataPathClient, DataPathServer, hello_bytes
from fusionnet.wire.frames import SMALL_FRAME, THREAD_MIN
from fusionnet.wire.header import PREFIX_SIZE, FrameHeader, parse_header, parse_prefix
from fusionnet.wire.mac import MAC_CHUNK, TAG_SIZE, FrameMac
from fusionnet.wire.receiver import FrameReceiver
from fusionnet.wire.sources import as_source
from tests.wire_support import KEY, RECEIVER, craft, frame, read_bytes, reader_of, until

SIZES = {  # float32 elements: one small write, 1 MiB chunk writes, the size MACs would use threads for
    "small": 1000,
    "chunked": (SMALL_FRAME + 3 * MAC_CHUNK) // 4 + 5,
    "large": (THREAD_MIN + 2 * MAC_CHUNK) // 4 + 7,
}


def _bare_bytes(t: torch.Tensor, **kw: object) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(frame(t, **kw), KEY, receiver=RECEIVER, bare=True))


def _header_of(data: bytes) -> tuple[FrameHeader, int]:
    header_len, payload_len = parse_prefix(data[:PREFIX_SIZE])
    return parse_header(data[PREFIX_SIZE : PREFIX_SIZE + header_len], payload_len), header_len


@pytest.mark.parametrize("size", sorted(SIZES))
def test_a_bare_frame_carries_its_payload_as_is_and_a_tag_over_its_head(size: str) -> None:
    t = torch.randn(SIZES[size], generator=torch.Generator().manual_seed(1))
    data = _bare_bytes(t)
    h, header_len = _header_of(data)
    start = PREFIX_SIZE + header_len + TAG_SIZE
    assert h.bare and not h.encrypted
    assert data[start : start + h.payload_len] == t.numpy().tobytes()
    mac = FrameMac(KEY, h.nonce)
    assert data[-TAG_SIZE:] == mac.finish(data[: PREFIX_SIZE + header_len], [])  # no chunk tags
    got = asyncio.run(read_bytes(data, bare_ok=lambda job: True))
    assert torch.equal(got.tensor, t)


def test_the_bare_flag_is_under_the_head_tag() -> None:
    """Neither way can the flag be flipped: a MACed frame made bare (to skip its payload's check), or a
    bare frame made MACed."""
    for data, old, new in (
        (_bare_bytes(torch.arange(64.0)), b"\xa4bare\xc3", b"\xa4bare\xc2"),
        (
            b"".join(bytes(p) for p in encode_frame(frame(torch.arange(64.0)), KEY, receiver=RECEIVER)),
            b"\xa4bare\xc2",
            b"\xa4bare\xc3",
        ),
    ):
        _, header_len = _header_of(data)
        header = data[PREFIX_SIZE : PREFIX_SIZE + header_len]
        forged = header.replace(old, new)  # msgpack true <-> false, same length
        assert forged != header
        with pytest.raises(FrameRefused) as e:
            asyncio.run(
                read_bytes(data[:PREFIX_SIZE] + forged + data[PREFIX_SIZE + header_len :], bare_ok=bool)
            )
        assert e.value.reason == "bad_mac"


def test_bare_and_encrypted_cannot_go_together() -> None:
    with pytest.raises(WireError, match="bare and encrypt"):
        encode_frame(frame(torch.ones(4)), KEY, receiver=RECEIVER, bare=True, encrypt=True)
    with pytest.raises(FrameRefused, match="bare must be"):
        asyncio.run(read_bytes(craft(b"abcd", enc=True, bare=True), bare_ok=bool))
    with pytest.raises(FrameRefused, match="bare must be"):
        asyncio.run(read_bytes(craft(b"abcd", bare="yes"), bare_ok=bool))


@pytest.mark.parametrize(
    ("policy", "host", "taken"),
    [
        ("auto", "127.0.0.1", True),
        ("auto", "::1", True),
        ("off", "127.0.0.5", True),
        ("auto", "10.1.2.3", False),
        ("off", "10.1.2.3", False),  # plaintext from anywhere, but a payload off the host keeps its MAC
        ("on", "127.0.0.1", False),
    ],
)
def test_bare_frames_are_for_loopback_peers_of_jobs_that_do_not_encrypt_it(
    policy: str, host: str, taken: bool
) -> None:
    assert bare_ok(policy, host) is taken


def test_a_bare_frame_from_another_host_is_refused_and_the_stream_goes_on() -> None:
    """Refused by reason ``bare`` (``plaintext`` first where the job wants encryption), in sync: the
    MACed frame after it is delivered; from a loopback peer both are taken."""
    bare = _bare_bytes(torch.ones(8))
    maced = b"".join(bytes(p) for p in encode_frame(frame(torch.full((8,), 2.0)), KEY, receiver=RECEIVER))

    async def serve(host: str, policy: str) -> tuple[list[TensorFrame], dict[str, int]]:
        got: list[TensorFrame] = []
        receiver = FrameReceiver(peer_id=RECEIVER, max_payload=1 << 20)
        receiver.register_job("job1", KEY, {"A"}, got.append, encryption=policy)
        await receiver.serve(as_source(await reader_of(bare + maced)), f"{host}:5000", remote_host=host)
        return got, receiver.stats["job1"].frames_refused

    got, refused = asyncio.run(serve("10.0.0.7", "off"))
    assert refused == {"bare": 1} and [float(f.tensor[0]) for f in got] == [2.0]
    got, refused = asyncio.run(serve("127.0.0.1", "on"))
    assert refused == {"plaintext": 2} and not got  # the MACed frame is plaintext too
    got, refused = asyncio.run(serve("127.0.0.1", "auto"))
    assert refused == {} and [float(f.tensor[0]) for f in got] == [1.0, 2.0]
    # a P2P stream (no TCP peer address) never takes a bare frame: libp2p may relay through others
    with pytest.raises(FrameRefused) as e:
        asyncio.run(read_bytes(bare))
    assert e.value.reason == "bare"


@pytest.mark.timeout(60)
def test_the_data_path_sends_bare_frames_over_loopback_unless_the_job_encrypts_it() -> None:
    """What goes on a real loopback connection, read by a bare socket server: ``auto`` and ``off`` jobs'
    frames are bare, ``on`` jobs' encrypted and MACed, and ``payload_mac`` MACs a plaintext one; a real
    server takes the bare ones, 20 MiB too."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(5 << 20, generator=gen)
    small = torch.randn(100, generator=gen)

    async def wire_headers() -> list[FrameHeader]:
        heads: list[FrameHeader] = []
        done = asyncio.Event()

        async def sniff(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(hello_bytes(RECEIVER))
            for _ in range(4):
                prefix = await reader.readexactly(PREFIX_SIZE)
                header_len, payload_len = parse_prefix(prefix)
                heads.append(parse_header(await reader.readexactly(header_len), payload_len))
                await reader.readexactly(TAG_SIZE + payload_len + TAG_SIZE)
            done.set()
            writer.close()

        server = await asyncio.start_server(sniff, "127.0.0.1", 0)
        addr = server.sockets[0].getsockname()[:2]
        async with server, DataPathClient(peer_id="A") as client:
            for policy in ("auto", "off", "on"):
                await client.send(addr, frame(small, name=policy), KEY, encryption=policy)
            await client.send(addr, frame(small, name="mac"), KEY, encryption="auto", payload_mac=True)
            await asyncio.wait_for(done.wait(), 10)
        return heads

    heads = asyncio.run(wire_headers())
    assert [(h.name, h.bare, h.encrypted) for h in heads] == [
        ("auto", True, False),
        ("off", True, False),
        ("on", False, True),
        ("mac", False, False),
    ]

    async def delivered() -> list[TensorFrame]:
        got: list[TensorFrame] = []
        async with DataPathServer(peer_id=RECEIVER) as server, DataPathClient(peer_id="A") as client:
            server.register_job("job1", KEY, ["A"], got.append, encryption="auto")
            addr = await server.start()
            await client.send(addr, frame(big, name="big"), KEY, encryption="auto")
            await client.send(addr, frame(small, name="small"), KEY, encryption="auto")
            await until(lambda: len(got) == 2, what="frames")
        assert server.stats["job1"].frames_refused == {}
        return got

    got = asyncio.run(delivered())
    assert torch.equal(got[0].tensor, big) and torch.equal(got[1].tensor, small)
