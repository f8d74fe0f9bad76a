"""Tensor frames: round trips of every dtype and odd shape, and refusal of anything malformed or forged."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionnet.errors import WireError
from fusionnet.wire import ALLOWED_DTYPES, FrameRefused, StreamEnded, TensorFrame, encode_frame, read_frame
from fusionnet.wire.frame_reader import allocate_tensor
from fusionnet.wire.frames import THREAD_MIN, prepare_frame
from fusionnet.wire.header import MAX_HEADER, PREFIX_SIZE, parse_header, parse_prefix
from fusionnet.wire.mac import MAC_CHUNK
from tests.wire_support import KEY, OTHER_KEY, craft, frame, frame_bytes, read_bytes, reader_of

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 5)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen, dtype=dtype)


def _roundtrip(t: torch.Tensor, **kw) -> TensorFrame:
    return asyncio.run(read_bytes(frame_bytes(frame(t)), **kw))


@pytest.mark.parametrize("dtype_name", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(dtype_name: str, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(hash((dtype_name, shape)) % 2**31)
    t = _random(ALLOWED_DTYPES[dtype_name], shape, gen)
    got = _roundtrip(t)
    assert got.tensor.dtype == t.dtype and got.tensor.shape == t.shape
    assert torch.equal(got.tensor, t)
    assert (got.job_id, got.sender, got.kind, got.step, got.microbatch, got.name) == (
        "job1",
        "A",
        "act",
        0,
        1,
        "x",
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(24.0).reshape(4, 6).t(),
        lambda: torch.arange(40, dtype=torch.int64)[::3],
        lambda: torch.tensor([1.5, -2.0]).expand(3, 2),
        lambda: torch.arange(10.0, requires_grad=True) * 2,
        lambda: torch.arange(6, dtype=torch.int16).reshape(2, 3)[:, 1],
    ],
    ids=["transposed", "strided", "expanded", "requires_grad", "column"],
)
def test_non_contiguous_input_arrives_equal(make) -> None:
    t = make()
    got = _roundtrip(t)
    assert got.tensor.is_contiguous()
    assert torch.equal(got.tensor, t.detach())


def test_large_payload_uses_chunked_threaded_mac_and_round_trips() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(THREAD_MIN // 4 + 1000, generator=gen)  # above THREAD_MIN, a partial last chunk
    assert t.numel() * 4 > THREAD_MIN and t.numel() * 4 % MAC_CHUNK
    assert torch.equal(_roundtrip(t).tensor, t)
    assert torch.equal(_roundtrip(t, threaded_mac=False).tensor, t)


def test_payload_is_a_view_of_the_tensor_memory() -> None:
    t = torch.zeros(1000)
    _, payload, _ = encode_frame(frame(t), KEY, receiver="S")
    assert isinstance(payload, memoryview) and len(payload) == 4000
    t[0] = 1.0  # the view sees the change: no copy was made
    assert bytes(payload[:4]) == torch.tensor([1.0]).numpy().tobytes()
    assert prepare_frame(frame(t), KEY, "S").tensor.data_ptr() == t.data_ptr()


def test_payload_is_received_into_the_memory_of_the_delivered_tensor() -> None:
    raw = craft(bytes(24), dtype="int32", shape=[2, 3])
    h = parse_header(raw[PREFIX_SIZE : -(32 + 24 + 32)], 24)
    t, view = allocate_tensor(h)
    view[:] = torch.arange(6, dtype=torch.int32).numpy().tobytes()
    assert t.shape == (2, 3) and torch.equal(t, torch.arange(6, dtype=torch.int32).reshape(2, 3))
    scalar, scalar_view = allocate_tensor(parse_header(craft(bytes(8), dtype="float64", shape=[])[16:-72], 8))
    scalar_view[:] = torch.tensor(2.5, dtype=torch.float64).numpy().tobytes()
    assert scalar.shape == () and scalar.item() == 2.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tensor": torch.zeros(2, dtype=torch.complex64)}, "complex64"),
        ({"tensor": torch.zeros(2, dtype=torch.uint16)}, "uint16"),
        ({"tensor": [1.0, 2.0]}, "torch.Tensor"),
        ({"tensor": torch.zeros(3, 3).to_sparse()}, "dense"),
        ({"kind": "weights"}, "kind"),
        ({"step": -1}, "step"),
        ({"microbatch": True}, "microbatch"),
        ({"job_id": ""}, "job_id"),
        ({"sender": "a\nb"}, "sender"),
        ({"name": "n" * 2000}, "name"),
    ],
)
def test_bad_local_frames_are_refused_on_construction(kwargs: dict, match: str) -> None:
    fields = {"job_id": "j", "sender": "A", "kind": "act", "step": 0, "microbatch": 0, "name": "x"}
    fields["tensor"] = torch.zeros(2)
    fields.update(kwargs)
    with pytest.raises(WireError, match=match):
        TensorFrame(**fields)


@pytest.mark.parametrize("key", [b"short", "k" * 32, None, b"x" * 2000])
def test_bad_keys_are_refused_before_anything_is_encoded(key) -> None:
    with pytest.raises(WireError, match="key"):
        encode_frame(frame(torch.zeros(2)), key, receiver="S")


def _refusal(data: bytes, **kw) -> FrameRefused:
    with pytest.raises(FrameRefused) as info:
        asyncio.run(read_bytes(data, **kw))
    return info.value


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"XXXX" + bytes(12), "bad_magic"),
        (b"FNW1" + (MAX_HEADER + 1).to_bytes(4, "big") + bytes(8), "header_size"),
        (b"FNW1" + (0).to_bytes(4, "big") + bytes(8), "header_size"),
        (b"FNW1" + (3).to_bytes(4, "big") + bytes(8) + b"\xc1\xc1\xc1", "malformed_header"),
        (craft(b"abc", v=1), "malformed_header"),  # version 1 had no receiver / sequence number
        (craft(b"abc", to=None), "malformed_header"),
        (craft(b"abc", seq=-1), "malformed_header"),
        (craft(b"abc", kind=None), "malformed_header"),
        (craft(b"abc", step="0"), "malformed_header"),
        (craft(b"abc", nonce=b"short"), "malformed_header"),
        (craft(b"abc", job=["j"]), "malformed_header"),
        (craft(b"abcd", dtype="complex64", shape=[1]), "bad_dtype"),
        (craft(b"abcd", dtype=None), "bad_dtype"),
        (craft(b"abc", shape=[-3]), "bad_shape"),
        (craft(b"abc", shape=[3.0]), "bad_shape"),
        (craft(b"abc", shape=[1] * 40), "malformed_header"),  # over msgpack's array bound
        (craft(b"abc", shape=[4]), "size_mismatch"),
        (craft(b"abcd", dtype="float32", shape=[2]), "size_mismatch"),
        (craft(b"abc", key=OTHER_KEY), "bad_mac"),
        (craft(bytes([0, 1, 2]), dtype="bool"), "bad_value"),
    ],
)
def test_malformed_frames_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    e = _refusal(data)
    assert e.reason == reason, e
    assert isinstance(e, WireError)


def test_refusal_messages_name_the_job_and_sender() -> None:
    e = _refusal(craft(b"abc", shape=[4], job="jobX", **{"from": "peerY"}))
    assert "jobX" in str(e) and "peerY" in str(e)
    assert (e.job_id, e.sender) == ("jobX", "peerY")


def test_oversized_payload_is_refused_before_it_is_read() -> None:
    data = frame_bytes(frame(torch.zeros(100)))
    # Only the head is available: the refusal must come without waiting for the 400 payload bytes.
    head_only = data[: len(data) - 400 - 32]

    async def go() -> FrameRefused:
        with pytest.raises(FrameRefused) as info:
            await read_frame(
                await reader_of(head_only, eof=False), lambda j, s: KEY, receiver="S", max_payload=399
            )
        return info.value

    e = asyncio.run(asyncio.wait_for(go(), 5))
    assert e.reason == "oversized" and not e.in_sync and e.nbytes == 400


def test_a_header_forged_without_the_key_is_refused_before_any_payload_buffer() -> None:
    # A 512 MiB claim from a peer without the key: refused on the head tag, with no payload sent at
    # all, so the receiver neither waits for nor allocates the claimed bytes.
    n = 512 << 20
    forged = craft(b"", key=OTHER_KEY, payload_len=n, shape=[n])[:-32]

    async def go() -> FrameRefused:
        with pytest.raises(FrameRefused) as info:
            await read_frame(
                await reader_of(forged, eof=False), lambda j, s: KEY, receiver="S", max_payload=1 << 30
            )
        return info.value

    e = asyncio.run(asyncio.wait_for(go(), 5))
    assert e.reason == "bad_mac" and "header" in str(e) and not e.in_sync


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"accept_sender": lambda job, sender: sender == "B"}, "sender_not_allowed"),
        ({"bound_sender": "B"}, "sender_mismatch"),
    ],
)
def test_policy_refusals_keep_the_stream_in_sync(kw: dict, reason: str) -> None:
    refused = frame_bytes(frame(torch.arange(5.0), sender="A"))
    good = frame_bytes(frame(torch.arange(3.0), sender="B", name="next"))

    async def go() -> tuple[FrameRefused, TensorFrame]:
        r = await reader_of(refused + good)
        with pytest.raises(FrameRefused) as info:
            await read_frame(
                r,
                kw.get("keyring", lambda job, sender: KEY),
                receiver="S",
                max_payload=1 << 20,
                **{k: v for k, v in kw.items() if k != "keyring"},
            )
        nxt = await read_frame(
            r, lambda job, sender: KEY, receiver="S", max_payload=1 << 20, bound_sender="B"
        )
        return info.value, nxt

    e, nxt = asyncio.run(go())
    assert e.reason == reason and e.in_sync
    assert nxt.name == "next" and torch.equal(nxt.tensor, torch.arange(3.0))


def test_truncation_anywhere_is_refused_and_clean_eof_ends_the_stream() -> None:
    data = frame_bytes(frame(torch.arange(20.0)))
    with pytest.raises(StreamEnded):
        asyncio.run(read_bytes(b""))
    for cut in sorted({1, PREFIX_SIZE - 1, PREFIX_SIZE, PREFIX_SIZE + 5, len(data) - 100, len(data) - 1}):
        assert _refusal(data[:cut]).reason == "truncated", cut


def test_reordered_mac_chunks_are_refused() -> None:
    n = MAC_CHUNK * 2
    t = torch.cat([torch.zeros(n // 2, dtype=torch.uint8), torch.ones(n // 2, dtype=torch.uint8)])
    data = bytearray(frame_bytes(frame(t)))
    start = len(data) - 32 - n
    first, second = bytes(data[start : start + MAC_CHUNK]), bytes(data[start + MAC_CHUNK : start + n])
    data[start : start + n] = second + first
    assert _refusal(bytes(data)).reason == "bad_mac"


def test_prefix_and_header_parsers_are_pure_and_strict() -> None:
    data = frame_bytes(frame(torch.zeros(2, 2)))
    header_len, payload_len = parse_prefix(data[:PREFIX_SIZE])
    assert payload_len == 16
    h = parse_header(data[PREFIX_SIZE : PREFIX_SIZE + header_len], payload_len)
    assert h.shape == (2, 2) and h.dtype == torch.float32
    with pytest.raises(FrameRefused, match="16"):
        parse_header(data[PREFIX_SIZE : PREFIX_SIZE + header_len], 17)


# --- properties: nothing a peer sends escapes as anything but a WireError --------------------------

VALID = frame_bytes(frame(torch.arange(12.0).reshape(3, 4), job="job1"))


def _only_wire_errors(data: bytes, keyring) -> TensorFrame | None:
    try:
        return asyncio.run(read_bytes(data, keyring=keyring, max_payload=1 << 16))
    except WireError:
        return None


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=400), known=st.booleans())
def test_random_bytes_only_raise_wire_errors(data: bytes, known: bool) -> None:
    assert _only_wire_errors(data, (lambda job, sender: KEY) if known else (lambda job, sender: None)) is None


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, len(VALID)),
    prefix_junk=st.binary(max_size=3),
)
def test_any_change_to_a_valid_frame_is_refused(flips, cut: int | None, prefix_junk: bytes) -> None:
    data = bytearray(VALID)
    for pos, xor in flips:
        data[pos] ^= xor
    mutated = prefix_junk + bytes(data if cut is None else data[:cut])
    got = _only_wire_errors(mutated, lambda job, sender: KEY)
    if mutated != VALID:
        assert got is None, "a modified frame was accepted"
    else:
        assert got is not None and torch.equal(got.tensor, torch.arange(12.0).reshape(3, 4))


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    header=st.dictionaries(
        st.sampled_from(["v", "job", "from", "kind", "step", "mb", "name", "dtype", "shape", "nonce", "x"]),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**64), 2**64 - 1),
            st.floats(allow_nan=True),
            st.text(max_size=20),
            st.binary(max_size=20),
            st.lists(st.integers(-5, 2**50), max_size=5),
            st.sampled_from(["float32", "bool", "act", "job1", "A", 1]),
        ),
    ),
    payload=st.binary(max_size=64),
)
def test_structured_garbage_headers_only_raise_wire_errors(header: dict, payload: bytes) -> None:
    fields = {
        k: header.get(k)
        for k in ["v", "job", "from", "kind", "step", "mb", "name", "dtype", "shape", "nonce"]
    }
    try:
        data = craft(payload, **fields)
    except (TypeError, ValueError, OverflowError):
        return  # msgpack cannot pack that combination; nothing to send
    _only_wire_errors(data, lambda job, sender: KEY)
