"""Values between sub-DAGs: packed small values, split large ones, and the inexact wire compression."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest
import torch

from fusionnet.compnode.netchannel import NetChannel
from fusionnet.compnode.valuepack import ALIGN, MAGIC, PACK_MAX, is_packed, pack_value, unpack_value
from fusionnet.errors import WireError
from fusionnet.wire.compression import Compressor, check_codec, decompress
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.header import ALLOWED_DTYPES
from tests.wire_support import frame_bytes, read_bytes

pytestmark = pytest.mark.timeout(120)


def _pair(compression: str = "none") -> tuple[NetChannel, NetChannel, list[TensorFrame]]:
    """A sender and a receiver channel joined through the real frame codec (bytes and MAC)."""
    wire: list[TensorFrame] = []

    async def send_frame(dst: int, frame: TensorFrame) -> None:
        got = await read_bytes(frame_bytes(frame))
        wire.append(got)
        receiver.on_frame(got)

    receiver = NetChannel(job_id="job1", peer_id="B", subdag_of_peer={"A": 0}, send_frame=send_frame)
    sender = NetChannel(
        job_id="job1", peer_id="A", subdag_of_peer={}, send_frame=send_frame, compression=compression
    )
    return sender, receiver, wire


def _roundtrip(value: object, compression: str = "none", key=("act", 0, 0, "n")) -> tuple[object, list]:
    sender, receiver, wire = _pair(compression)

    async def go() -> object:
        await sender.send(1, key, value)
        return await asyncio.wait_for(receiver.recv(0, key), 10)

    return asyncio.run(go()), wire


def test_small_values_travel_as_one_exact_frame() -> None:
    g = torch.Generator().manual_seed(0)
    value = (
        torch.randn(3, 5, generator=g),
        [torch.arange(7), torch.tensor([True, False])],
        None,
        2.5,
        torch.randn(2, 3, generator=g).t(),  # not contiguous
        torch.zeros(0, 4),
    )
    got, wire = _roundtrip(value)
    assert len(wire) == 1 and is_packed(wire[0].tensor)
    assert isinstance(got, tuple) and isinstance(got[1], list) and got[2] is None and got[3] == 2.5
    for a, b in ((value[0], got[0]), (value[1][0], got[1][0]), (value[1][1], got[1][1]), (value[4], got[4])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[5].shape == (0, 4)


def test_packed_parts_take_in_place_ops_like_the_senders_tensors() -> None:
    # torch.export writes ``detach_`` on lifted constants; a part that autograd saw as a view of the
    # payload refused it on the receiving compnode ("Can't detach views in-place").
    value = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])]
    got, wire = _roundtrip(value)
    assert len(wire) == 1 and is_packed(wire[0].tensor)
    first, second = got
    assert not first._is_view() and not second._is_view()
    torch.ops.aten.detach_.default(first)
    first.add_(10)  # in place on one part leaves the other as it was
    assert first.tolist() == [11.0, 12.0] and second.tolist() == [3.0, 4.0, 5.0]


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES.values(), key=str))
def test_every_dtype_and_odd_layouts_pack_exactly(dtype: torch.dtype) -> None:
    # numpy views most dtypes in place; bfloat16 has no numpy dtype and takes torch's way: both exact
    gen = torch.Generator().manual_seed(0)
    numbers = torch.rand(5, 6, generator=gen) * 100 - 50
    base = numbers > 0 if dtype == torch.bool else numbers.to(dtype)
    tensors = [base, base.t(), base[1:4, ::2], base[0, 0], base[:0], base.reshape(2, 15)[:, 3]]
    tree, parts, _ = unpack_value(pack_value(None, tensors, [None] * len(tensors)))
    assert tree is None and len(parts) == len(tensors)
    for i, sent in enumerate(tensors):
        got = parts[i]
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent), i
        assert not got._is_view()
    parts[0].fill_(0)  # parts are spans of their own
    assert torch.equal(parts[1], base.t())


def _send_all(items: list, compression: str = "none", validate=None) -> tuple[list, list, NetChannel]:
    sender, receiver, wire = _pair(compression)
    receiver.validate = validate

    async def go() -> list:
        await sender.send_values(1, items)
        return [await asyncio.wait_for(receiver.recv(0, key), 10) for key, _ in items]

    return asyncio.run(go()), wire, receiver


def test_several_values_for_one_receiver_travel_as_one_frame() -> None:
    g = torch.Generator().manual_seed(2)
    items = [
        (("act", 3, 1, "hidden"), torch.randn(4, 8, generator=g)),
        (("act", 3, 1, "positions"), torch.arange(4)),
        (("act", 3, 1, "pair"), (torch.randn(2, generator=g), None, 1.5)),
    ]
    got, wire, _ = _send_all(items)
    assert len(wire) == 1 and wire[0].name == "hidden+positions+pair" and is_packed(wire[0].tensor)
    assert torch.equal(got[0], items[0][1]) and torch.equal(got[1], items[1][1])
    assert torch.equal(got[2][0], items[2][1][0]) and got[2][1:] == (None, 1.5)
    # int8 error feedback is kept per value and tensor, as one send per value keeps it
    got, wire, _ = _send_all([*items[:1], (("act", 3, 1, "other"), items[0][1] * 2)], "int8-ef")
    assert len(wire) == 1 and got[0].dtype == torch.float32 and (got[0] - items[0][1]).abs().max() < 0.1


def test_values_that_cannot_share_a_frame_go_one_by_one() -> None:
    big = torch.randn(PACK_MAX // 4, generator=torch.Generator().manual_seed(3))
    for items in (
        [(("act", 0, 0, "a"), big), (("act", 0, 0, "b"), torch.ones(8))],  # over PACK_MAX together
        [(("act", 0, 0, "a"), torch.ones(2)), (("act", 0, 1, "b"), torch.ones(2))],  # two micro-batches
        [(("act", 0, 0, "a"), torch.ones(2))],  # one value
    ):
        got, wire, _ = _send_all(items)
        assert "+" not in " ".join(f.name for f in wire) and len(got) == len(items)
        assert all(torch.equal(g, v) for g, (_, v) in zip(got, items))


def test_values_too_big_to_share_a_frame_are_compressed_once() -> None:
    """int8 error feedback advances once per value sent: a bundle that falls back to one send each must
    not have compressed its tensors first."""
    g = torch.Generator().manual_seed(4)
    # int8 makes each 0.6 PACK_MAX: one packed frame each, but not both in one
    items = [(("act", 0, 0, n), torch.randn(PACK_MAX * 3 // 5, generator=g)) for n in ("a", "b")]
    bundled, _, _ = _send_all(items, "int8-ef")
    singles = []
    for key, value in items:
        got, _ = _roundtrip(value, "int8-ef", key)
        singles.append(got)
    assert all(torch.equal(a, b) for a, b in zip(bundled, singles))


def test_a_bundle_with_one_bad_value_delivers_none_and_fails_the_awaited_keys() -> None:
    items = [(("act", 0, 0, "good"), torch.ones(3)), (("act", 0, 0, "bad"), torch.ones(5))]

    def validate(src: int, key: tuple, value: object) -> None:
        if key[3] == "bad":
            raise WireError("bad: shape [5], expected [3]")

    sender, receiver, wire = _pair()
    receiver.validate = validate

    async def go() -> None:
        await sender.send_values(1, items)
        for key, _ in items:  # neither value arrives; whoever takes one learns why
            with pytest.raises(Exception, match="refused a frame from sub-DAG 0: bad: shape"):
                await asyncio.wait_for(receiver.recv(0, key), 10)

    asyncio.run(go())
    assert receiver.refused == 1 and len(wire) == 1


@pytest.mark.parametrize(
    "name",
    ["a+a", "a++b", "a+b/0", "+".join(f"{a}{b}" for a in "abcdefghijklmnopq" for b in "0123456789abcdef")],
    ids=["repeated", "empty", "split-tensor", "too-many"],
)
def test_malformed_bundles_are_refused(name: str) -> None:
    _, receiver, _ = _pair()
    tree = {"$seq": [{"$t": 0}, {"$t": 1}], "tuple": True}
    asyncio.run(_receive(receiver, name, pack_value(tree, [torch.ones(2), torch.ones(2)], [None, None])))
    assert receiver.refused == 1


def test_a_bundle_must_hold_one_value_per_name() -> None:
    _, receiver, _ = _pair()
    asyncio.run(
        _receive(receiver, "a+b", pack_value({"$seq": [{"$t": 0}], "tuple": True}, [torch.ones(2)], [None]))
    )
    asyncio.run(_receive(receiver, "a+b", torch.ones(2)))  # not packed
    assert receiver.refused == 2


async def _receive(receiver: NetChannel, name: str, payload: torch.Tensor) -> None:
    receiver.on_frame(
        TensorFrame(job_id="job1", sender="A", kind="act", step=0, microbatch=0, name=name, tensor=payload)
    )


def test_large_values_travel_as_tensor_frames_and_a_structure() -> None:
    big = torch.randn(PACK_MAX // 4 + 1, generator=torch.Generator().manual_seed(1))
    got, wire = _roundtrip((big, torch.ones(2)))
    assert [f.name for f in wire] == ["n/0", "n/1", "n"] and not is_packed(wire[-1].tensor)
    assert torch.equal(got[0], big) and torch.equal(got[1], torch.ones(2))


def _packed_with(parts: list, data: bytes = b"\0" * 256, codecs: list | None = None) -> torch.Tensor:
    head = msgpack.packb({"tree": {"$t": 0}, "parts": parts, "codecs": codecs or [None] * len(parts)})
    raw = MAGIC + struct.pack(">I", len(head)) + head
    raw += b"\0" * (-len(raw) % ALIGN) + data
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@pytest.mark.parametrize(
    "parts",
    [
        [["complex64", [2], 0]],  # dtype outside the allowlist
        [["float32", [1000], 0]],  # past the payload's end
        [["float32", [2], 4]],  # unaligned
        [["float32", [32], 0], ["float32", [2], 64]],  # overlapping
        [["float32", [-1], 0]],  # negative dim
        [["float32", [2], 0, 9]],  # wrong arity
        [["float32", [2] * 40, 0]],  # rank over the cap
    ],
)
def test_bad_packed_values_are_refused(parts: list) -> None:
    with pytest.raises(WireError):
        unpack_value(_packed_with(parts))


def test_packed_bool_bytes_and_lengths_are_checked() -> None:
    with pytest.raises(WireError, match="0/1"):
        unpack_value(_packed_with([["bool", [4], 0]], data=b"\x00\x01\x02\x00" + b"\0" * 60))
    with pytest.raises(WireError):
        unpack_value(torch.frombuffer(bytearray(MAGIC + struct.pack(">I", 1 << 30)), dtype=torch.uint8))
    with pytest.raises(WireError):  # codecs list of another length
        unpack_value(_packed_with([["float32", [2], 0]], codecs=[None, None]))
    tree, tensors, _ = unpack_value(pack_value({"$t": 0}, [torch.arange(5.0)], [None]))
    assert tree == {"$t": 0} and torch.equal(tensors[0], torch.arange(5.0))


@pytest.mark.parametrize(
    "codec,wire_dtype,tol", [("bf16", torch.bfloat16, 1e-2), ("fp16", torch.float16, 1e-3)]
)
def test_cast_codecs_halve_bytes_and_restore_the_dtype(
    codec: str, wire_dtype: torch.dtype, tol: float
) -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    got, wire = _roundtrip((x, torch.arange(3)), codec)
    _, tensors, _ = unpack_value(wire[0].tensor)
    assert tensors[0].dtype == wire_dtype and tensors[1].dtype == torch.int64  # ints travel as they are
    assert got[0].dtype == torch.float32 and torch.allclose(got[0], x, rtol=tol, atol=tol)
    assert not torch.equal(got[0], x)  # inexact, as documented
    assert torch.equal(got[1], torch.arange(3))


def test_fp16_clamps_instead_of_overflowing() -> None:
    q, info = Compressor("fp16").compress("e", torch.tensor([1e6, -1e6, 1.0]))
    assert torch.isfinite(decompress(q, info)).all()


def test_int8_error_feedback_keeps_the_running_sum_close() -> None:
    """Error feedback: the sum of what arrives over many steps tracks the sum of what was sent."""
    g = torch.Generator().manual_seed(3)
    comp = Compressor("int8-ef")
    sent, arrived = torch.zeros(256), torch.zeros(256)
    for _ in range(50):
        x = torch.randn(256, generator=g)
        q, info = comp.compress(("grad", "n", 0), x)
        assert q.dtype == torch.int8 and info is not None and info["c"] == "int8"
        sent += x
        arrived += decompress(q, info)
    one_step_error = (x.abs().max() / 127).item()
    assert (sent - arrived).abs().max().item() <= one_step_error  # bounded, not growing with steps
    no_feedback = torch.zeros(256)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        x = torch.randn(256, generator=g)
        q, info = Compressor("int8-ef").compress(("grad", "n", 0), x)  # a fresh residual each time
        no_feedback += decompress(q, info)
    assert (sent - no_feedback).abs().max() > (sent - arrived).abs().max()


def test_int8_sends_non_finite_tensors_exactly() -> None:
    x = torch.tensor([1.0, float("inf"), float("nan")])
    q, info = Compressor("int8-ef").compress("e", x)
    back = decompress(q, info)
    assert back[0] == 1.0 and back[1] == float("inf") and back[2].isnan()


@pytest.mark.parametrize(
    "t,info",
    [
        (torch.ones(2, dtype=torch.int8), {"c": "int8", "d": "float32", "s": -1.0}),
        (torch.ones(2, dtype=torch.int8), {"c": "int8", "d": "float32", "s": float("inf")}),
        (torch.ones(2, dtype=torch.int8), {"c": "int8", "d": "float32"}),
        (torch.ones(2, dtype=torch.int8), {"c": "bf16", "d": "float32"}),
        (torch.ones(2, dtype=torch.bfloat16), {"c": "bf16", "d": "int64"}),
        (torch.ones(2), {"c": "zip", "d": "float32"}),
        (torch.ones(2), {"c": "none", "d": "float32", "x": 1}),
        (torch.ones(2), [1]),
    ],
)
def test_bad_codec_infos_are_refused(t: torch.Tensor, info: object) -> None:
    with pytest.raises(WireError):
        decompress(t, info)


def test_codec_names_are_checked() -> None:
    with pytest.raises(WireError):
        check_codec("int4")
    with pytest.raises(WireError):
        Compressor("gzip")
