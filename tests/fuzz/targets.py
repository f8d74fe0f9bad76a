"""The fuzz targets: every decoder that bytes from a peer (or a job file) reach, with its seeds.

Each target maps bytes to a call of one decoder; ``allowed`` is the project's own error for that
decoder: anything else it raises is a crash. ``ir_execute`` is the exception: it runs whatever IR
decodes, where torch may refuse arguments with its own errors; what it looks for is a dead process
(a segfault ends the test run) or a hang, and an allocation over the element cap.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import torch
import torch.nn.functional as F

from fusionnet.dag.allowlist import F_FUNCS, TENSOR_METHODS, TORCH_FUNCS
from fusionnet.dag.codec import decode_ir, encode_ir
from fusionnet.dag.rebuild import run_whole_graph
from fusionnet.dag.trace import trace_model
from fusionnet.dht.records import (
    BrokerRecord,
    CompnodeRecord,
    HardwareInfo,
    NodeState,
    decode_record,
    encode_record,
)
from fusionnet.errors import FusionNetError, IRError, JobError, WireError
from fusionnet.job.parse import parse_yaml_text, spec_from_document
from fusionnet.wire.frame_reader import read_frame
from fusionnet.wire.frames import TensorFrame, encode_frame
from fusionnet.wire.header import PREFIX_SIZE, parse_header, parse_prefix
from fusionnet.wire.refusal import FrameRefused, StreamEnded
from tests.dag_models import SkipEverywhere, SplitMerge, make_data

try:  # the rpc branch moves the blob codec into fusionnet.messages
    from fusionnet.messages.blobs import pack_tensors, unpack_tensors  # type: ignore[import-not-found]
except ImportError:
    from fusionnet.runtime.blobs import pack_tensors, unpack_tensors

KEY = b"k" * 32
PEER = "QmQVtDxdhZn2jLtHpMTB971nNXR2rcbXEwAbf8oJYRTxfU"


@dataclass
class Target:
    name: str
    call: Callable[[bytes], object]
    seeds: list[bytes]
    allowed: tuple[type[BaseException], ...]


def _traced() -> list[tuple[bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    out = []
    for cls, kind in ((SkipEverywhere, "skip"), (SplitMerge, "split")):
        torch.manual_seed(0)
        x, y = make_data(kind, n=4)
        traced = trace_model(cls(), x, y, F.cross_entropy, "train")
        out.append((encode_ir(traced.graph), traced.state, {"inputs": x, "labels": y}))
    return out


def ir_target(traced) -> Target:
    return Target("ir_decode", decode_ir, [ir for ir, _, _ in traced], (IRError,))


def _op_swaps(ir: bytes, rng: random.Random, count: int) -> list[bytes]:
    """IR variants with one op swapped for another allowlisted one, or an int argument changed: they
    decode, so execution (not just decoding) meets every kind of op and odd sizes."""
    names = (
        [f"torch.{n}" for n in sorted(TORCH_FUNCS)]
        + [f"F.{n}" for n in sorted(F_FUNCS)]
        + [f"method:{n}" for n in sorted(TENSOR_METHODS)]
    )
    out = []
    for _ in range(count):
        doc = msgpack.unpackb(ir, raw=False)
        ops = [n for n in doc["nodes"] if n["kind"] in ("parametric", "non_parametric", "loss")]
        node = rng.choice(ops)
        if rng.random() < 0.7:
            node["op"] = rng.choice(names)
        else:
            node["args"] = node["args"] + [rng.choice([0, -1, 2, 3, 1 << 20, 1 << 40, 2.5, True])]
        out.append(msgpack.packb(doc, use_bin_type=True))
    return out


def ir_execute_target(traced) -> Target:
    rng = random.Random(1)
    by_ir = {ir: (state, data) for ir, state, data in traced}
    seeds = [v for ir, _, _ in traced for v in _op_swaps(ir, rng, 40)]
    states = list(by_ir.values())

    def call(data: bytes) -> object:
        graph = decode_ir(data)
        state, inputs = next(
            ((s, d) for s, d in states if set(graph.params) <= set(s) and set(graph.buffers) <= set(s)),
            states[0],
        )
        return run_whole_graph(graph, state, inputs)

    # torch refuses bad arguments with its own errors; what matters here is no crash, hang or huge
    # allocation. KeyError/AttributeError: state/data of the test model that a mutant asks for.
    allowed = (FusionNetError, RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError)
    return Target("ir_execute", call, seeds, allowed)


def _frames() -> list[bytes]:
    frames = []
    for i, t in enumerate(
        [torch.arange(12.0).reshape(3, 4), torch.tensor([True, False]), torch.zeros(0), torch.ones(300, 5)]
    ):
        f = TensorFrame(job_id="job1", sender="A", kind="act", step=i, microbatch=0, name=f"n{i}", tensor=t)
        # odd frames encrypted (``wire/crypt.py``): the fuzzer mutates ciphertext and the ``enc`` flag too
        frames.append(b"".join(bytes(p) for p in encode_frame(f, KEY, receiver="S", encrypt=i % 2 == 1)))
    return frames


def frame_header_target() -> Target:
    def call(data: bytes) -> object:
        if len(data) < PREFIX_SIZE:
            raise FrameRefused("short", reason="truncated")
        header_len, payload_len = parse_prefix(data[:PREFIX_SIZE])
        return parse_header(data[PREFIX_SIZE : PREFIX_SIZE + header_len], payload_len)

    return Target("frame_header", call, _frames(), (FrameRefused,))


def frame_reader_target() -> Target:
    loop = asyncio.new_event_loop()

    async def read_all(data: bytes) -> int:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        n = 0
        while True:
            try:
                await read_frame(
                    reader,
                    lambda job, sender: KEY if job == "job1" else None,
                    max_payload=1 << 20,
                    receiver="S",
                    plaintext_ok=lambda job, k=n: k % 2 == 0,  # alternately refuse plaintext frames
                )
            except StreamEnded:  # a clean end between frames: everything before it was accepted
                return n
            n += 1

    def call(data: bytes) -> object:
        return loop.run_until_complete(read_all(data))

    seeds = _frames()
    return Target("frame_reader", call, [*seeds, b"".join(seeds)], (WireError,))


def tensor_blob_target() -> Target:
    seeds = [
        pack_tensors({"w": torch.randn(3, 4), "b": torch.zeros(4, dtype=torch.int64)}),
        pack_tensors({"x": torch.tensor([True]), "y": torch.ones(2, 2, dtype=torch.bfloat16)}),
    ]
    return Target("tensor_blob", lambda d: unpack_tensors(d, "fuzz"), seeds, (WireError,))


def dht_record_target() -> Target:
    hw = HardwareInfo(device_kind="cpu", device_name="x", peak_flops=1e11, speed_factor=0.5)
    seeds = [
        encode_record(
            CompnodeRecord(peer_id=PEER, state=NodeState.ONLINE, hardware=hw, data_path_address="h:1")
        ),
        encode_record(BrokerRecord(peer_id=PEER, maddrs=["/ip4/127.0.0.1/tcp/1"])),
    ]

    def call(data: bytes) -> object:
        try:
            return decode_record(CompnodeRecord, data, "fuzz")
        except WireError:
            return decode_record(BrokerRecord, data, "fuzz")

    return Target("dht_record", call, seeds, (WireError,))


def job_file_target(examples: list[bytes]) -> Target:
    def call(data: bytes) -> object:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JobError(str(e)) from None
        return spec_from_document(parse_yaml_text(text, "fuzz.yaml"), "fuzz.yaml")

    return Target("job_file", call, examples, (JobError,))


def value_structure_target() -> Target:
    from fusionnet.compnode.netchannel import NetChannel

    loop = asyncio.new_event_loop()

    def call(data: bytes) -> object:
        async def go() -> None:
            ch = NetChannel(job_id="j", peer_id="B", subdag_of_peer={"A": 0}, send_frame=None)  # type: ignore[arg-type]
            t = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if data
                else torch.zeros(0, dtype=torch.uint8)
            )
            ch._on_frame(TensorFrame(job_id="j", sender="A", kind="act", step=0, microbatch=0, name="v/0",
                                     tensor=torch.ones(2)))  # fmt: skip
            ch._on_frame(TensorFrame(job_id="j", sender="A", kind="act", step=0, microbatch=0, name="v",
                                     tensor=t))  # fmt: skip

        return loop.run_until_complete(go())

    seeds = [
        msgpack.packb({"tree": {"$t": 0}, "count": 1}),
        msgpack.packb({"tree": {"$seq": [{"$t": 0}, None, 1.5, [1, 2]], "tuple": True}, "count": 1}),
    ]
    return Target("value_structure", call, seeds, (WireError,))


def replica_frame_target() -> Target:
    """A snapshot chunk frame as a holder checks it (``compnode.replica_frames``): the name, the chunk
    index and the payload's shape all come from the input."""
    from fusionnet.compnode.replica_frames import check_replica_frame

    def call(data: bytes) -> object:
        index, rows, name = data[0] if data else 0, data[1] if len(data) > 1 else 1, data[2:]
        tensor = torch.zeros(max(rows, 1), dtype=torch.uint8)
        if rows % 3 == 1:
            tensor = tensor.view(1, -1)
        elif rows % 3 == 2:
            tensor = tensor.float()
        frame = TensorFrame(job_id="j", sender="A", kind="param", step=3, microbatch=index,
                            name=name.decode("utf-8", "replace"), tensor=tensor)  # fmt: skip
        return check_replica_frame(frame, 1, [1], ["A", "B", "C"], [1, 2, 0])

    seeds = [b"\x00\x03replica/1/0/state/2", b"\x01\x00replica/1/0/optim/2", b"\x05\x09replica/0/2/state/9"]
    return Target("replica_frame", call, seeds, (WireError,))


def sandbox_ipc_target() -> Target:
    """What a compnode daemon reads from a job's sandbox worker (``compnode.sandbox_ipc``): a worker
    the job took over may send anything, so messages are decoded and their frames rebuilt under bounds."""
    import socket

    from fusionnet.compnode.sandbox_ipc import IPCChannel, IPCError, frame_message, frame_of

    loop = asyncio.new_event_loop()

    async def read_all(data: bytes) -> int:
        ours, theirs = socket.socketpair()
        try:
            theirs.sendall(data)
            theirs.shutdown(socket.SHUT_WR)
            channel = IPCChannel(ours, max_message=1 << 20)
            n = 0
            while True:
                try:
                    header, blobs = await channel.recv()
                except EOFError:
                    return n
                if header["op"] == "send":
                    frame_of(header, blobs)
                n += 1
        finally:
            ours.close()
            theirs.close()

    def message(header: dict, blobs: list[bytes]) -> bytes:
        import struct

        head = msgpack.packb({**header, "blobs": [len(b) for b in blobs]}, use_bin_type=True)
        return struct.pack("<IQ", len(head), sum(len(b) for b in blobs)) + head + b"".join(blobs)

    seeds = []
    for i, t in enumerate([torch.arange(6.0).reshape(2, 3), torch.tensor([True, False]), torch.zeros(0)]):
        f = TensorFrame(job_id="job1", sender="A", kind="act", step=i, microbatch=0, name=f"n{i}", tensor=t)
        header, views = frame_message(f)
        seeds.append(message({"op": "send", "id": i, "dst": 1, **header}, [bytes(v) for v in views]))
    seeds.append(message({"op": "reply", "id": 3, "loss": 0.5, "refused": 0}, [b"abc"]))

    def call(data: bytes) -> object:
        return loop.run_until_complete(asyncio.wait_for(read_all(data), 10))

    return Target("sandbox_ipc", call, [*seeds, b"".join(seeds)], (IPCError, WireError))
