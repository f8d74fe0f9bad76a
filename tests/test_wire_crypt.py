"""Encrypted frames (``wire/crypt.py``): ciphertext on the wire, the same tensor out, tampering refused,
and each job's policy deciding which plaintext frames a receiver refuses."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fusionnet.errors import WireError
from fusionnet.wire import FrameRefused, TensorFrame, encode_frame
from fusionnet.wire.crypt import PayloadCipher, encrypt_to, is_loopback_host, plaintext_ok
from fusionnet.wire.datapath import DataPathClient, DataPathServer
from fusionnet.wire.frames import SMALL_FRAME, THREAD_MIN
from fusionnet.wire.header import PREFIX_SIZE, parse_header, parse_prefix
from fusionnet.wire.mac import MAC_CHUNK
from fusionnet.wire.receiver import FrameReceiver
from fusionnet.wire.sources import as_source
from tests.wire_support import KEY, frame, read_bytes, reader_of, until

SIZES = {  # elements of float32: one small write, windows written inline, windows sealed in threads
    "small": 1000,
    "inline": (SMALL_FRAME + 3 * MAC_CHUNK) // 4 + 5,
    "threaded": (THREAD_MIN + 2 * MAC_CHUNK) // 4 + 7,
}


def _encrypted_bytes(t: torch.Tensor) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(frame(t), KEY, receiver="S", encrypt=True))


def _payload_of(data: bytes) -> tuple[bytes, bool]:
    header_len, payload_len = parse_prefix(data[:PREFIX_SIZE])
    h = parse_header(data[PREFIX_SIZE : PREFIX_SIZE + header_len], payload_len)
    start = PREFIX_SIZE + header_len + 32
    return data[start : start + payload_len], h.encrypted


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("threaded", [True, False], ids=["threads", "inline"])
def test_encrypted_frames_carry_ciphertext_and_arrive_equal(size: str, threaded: bool) -> None:
    t = torch.randn(SIZES[size], generator=torch.Generator().manual_seed(1))
    data = _encrypted_bytes(t)
    payload, encrypted = _payload_of(data)
    plain = t.numpy().tobytes()
    assert encrypted and len(payload) == len(plain)
    # no 32-byte run of the tensor's bytes is on the wire (ciphertext is not the plaintext)
    assert all(plain[i : i + 32] not in data for i in range(0, len(plain) - 32, max(1, len(plain) // 50)))
    got = asyncio.run(read_bytes(data, threaded_mac=threaded))
    assert torch.equal(got.tensor, t)


def test_frames_of_the_same_tensor_never_share_ciphertext() -> None:
    t = torch.arange(4096.0)
    assert _payload_of(_encrypted_bytes(t))[0] != _payload_of(_encrypted_bytes(t))[0]  # a fresh key per frame


@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
def test_tampered_ciphertext_is_refused_before_anything_is_decrypted(where: str) -> None:
    t = torch.randn(SIZES["inline"], generator=torch.Generator().manual_seed(2))
    data = bytearray(_encrypted_bytes(t))
    header_len, payload_len = parse_prefix(bytes(data[:PREFIX_SIZE]))
    start = PREFIX_SIZE + header_len + 32
    data[start + (5 if where == "first chunk" else payload_len - 5)] ^= 0x01
    with pytest.raises(FrameRefused) as e:
        asyncio.run(read_bytes(bytes(data)))
    assert e.value.reason == "bad_mac"


def test_the_encrypted_flag_is_under_the_head_tag() -> None:
    """Turning an encrypted frame into a 'plaintext' one (so ciphertext would be taken as data) fails."""
    data = _encrypted_bytes(torch.arange(64.0))
    header_len, _ = parse_prefix(data[:PREFIX_SIZE])
    header = data[PREFIX_SIZE : PREFIX_SIZE + header_len]
    forged = header.replace(b"\xa3enc\xc3", b"\xa3enc\xc2")  # msgpack true -> false, same length
    assert forged != header
    with pytest.raises(FrameRefused) as e:
        asyncio.run(read_bytes(data[:PREFIX_SIZE] + forged + data[PREFIX_SIZE + header_len :]))
    assert e.value.reason == "bad_mac"


def test_a_plaintext_frame_is_refused_where_its_job_wants_encryption_and_the_stream_goes_on() -> None:
    plain = b"".join(bytes(p) for p in encode_frame(frame(torch.ones(8)), KEY, receiver="S"))
    sealed = _encrypted_bytes(torch.full((8,), 2.0))

    async def scenario() -> list[TensorFrame]:
        got: list[TensorFrame] = []
        receiver = FrameReceiver(peer_id="S", max_payload=1 << 20)
        receiver.register_job("job1", KEY, {"A"}, got.append, encryption="auto")
        source = as_source(await reader_of(plain + sealed))
        await receiver.serve(source, "10.0.0.7:5000", remote_host="10.0.0.7")
        stats = receiver.stats["job1"]
        assert stats.frames_refused == {"plaintext": 1} and stats.frames_accepted == 1
        return got

    got = asyncio.run(scenario())
    assert len(got) == 1 and torch.equal(got[0].tensor, torch.full((8,), 2.0))


@pytest.mark.parametrize(
    ("policy", "host", "encrypted", "plaintext_taken"),
    [
        ("auto", "127.0.0.1", False, True),
        ("auto", "::1", False, True),
        ("auto", "localhost", False, True),
        ("auto", "10.1.2.3", True, False),
        ("auto", "fe80::1%eth0", True, False),
        ("auto", "compnode-7.example", True, False),
        ("on", "127.0.0.1", True, False),
        ("off", "10.1.2.3", False, True),
    ],
)
def test_policies_decide_by_host(policy: str, host: str, encrypted: bool, plaintext_taken: bool) -> None:
    assert encrypt_to(policy, host) is encrypted
    assert plaintext_ok(policy, host) is plaintext_taken
    assert is_loopback_host(host) is (host in ("127.0.0.1", "::1", "localhost"))


def test_unknown_policy_and_bad_nonce_are_refused() -> None:
    with pytest.raises(WireError, match="wire encryption must be one of"):
        FrameReceiver(peer_id="S", max_payload=1).register_job("j", KEY, {"A"}, print, encryption="maybe")
    with pytest.raises(WireError, match="nonce"):
        PayloadCipher(KEY, b"short")


@pytest.mark.timeout(60)
def test_data_path_encrypts_per_job_policy_over_tcp() -> None:
    """Over a real connection: ``on`` encrypts loopback too and refuses plaintext; ``auto`` on loopback
    sends plaintext; a 20 MiB tensor takes the threaded sealing and decryption path."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(5 << 20, generator=gen)
    small = torch.randn(100, generator=gen)

    async def scenario() -> None:
        strict: list[TensorFrame] = []
        lenient: list[TensorFrame] = []
        async with DataPathServer(peer_id="S") as server, DataPathClient(peer_id="A") as client:
            server.register_job("strict", KEY, ["A"], strict.append, encryption="on")
            server.register_job("lenient", KEY, ["A"], lenient.append, encryption="auto")
            addr = await server.start()
            await client.send(addr, frame(big, job="strict", name="big"), KEY, encryption="on")
            await client.send(addr, frame(small, job="strict", name="plain"), KEY, encryption="off")
            await client.send(addr, frame(small, job="strict", name="small"), KEY, encryption="on")
            await client.send(addr, frame(small, job="lenient", name="auto"), KEY, encryption="auto")
            await until(lambda: len(strict) == 2 and len(lenient) == 1, what="frames")
        assert [f.name for f in strict] == ["big", "small"]
        assert torch.equal(strict[0].tensor, big) and torch.equal(strict[1].tensor, small)
        assert torch.equal(lenient[0].tensor, small)
        assert server.stats["strict"].frames_refused == {"plaintext": 1}

    asyncio.run(scenario())
