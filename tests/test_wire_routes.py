"""Frames of a job whose compnodes hold several sub-DAGs (interleaved-1f1b): each names its source and
destination sub-DAG (``SRC>DST:`` in the authenticated frame name); the receiving channel checks both
against who sent it and who it is, and refuses anything else with the reason."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fusionnet.compnode.netchannel import NetChannel
from fusionnet.compnode.value_frames import route_prefix, split_route
from fusionnet.errors import JobError, WireError
from fusionnet.wire.frames import TensorFrame
from tests.wire_support import frame_bytes, read_bytes

pytestmark = pytest.mark.timeout(60)
# 4 sub-DAGs on 2 compnodes: A holds 0 and 2, B holds 1 and 3
PEERS = ["A", "B", "A", "B"]


def _channel(peer: str, index: int, wire: list[TensorFrame]) -> NetChannel:
    async def send_frame(dst: int, frame: TensorFrame) -> None:
        wire.append(await read_bytes(frame_bytes(frame)))  # through the real codec

    return NetChannel(
        job_id="job1", peer_id=peer, subdag_of_peer={}, send_frame=send_frame, routes=(index, PEERS)
    )


def test_route_names_round_trip_and_bad_ones_are_refused() -> None:
    assert split_route(route_prefix(3, 14) + "linear_1+relu") == (3, 14, "linear_1+relu")
    for bad in ("linear_1", "3:x", ">4:x", "3>:x", "a>4:x", "3>4x", "1" * 20 + ">4:x"):
        with pytest.raises(WireError, match="names no route"):
            split_route(bad)


def test_a_value_goes_from_one_chunk_to_another_compnode_s_chunk() -> None:
    wire: list[TensorFrame] = []
    sender, receiver = _channel("A", 2, wire), _channel("B", 3, [])
    key = ("act", 0, 1, "relu")
    value = torch.arange(6.0).reshape(2, 3)

    async def go() -> torch.Tensor:
        await sender.send_values(3, [(key, value), (("act", 0, 1, "add"), value + 1)])
        assert [f.name for f in wire] == ["2>3:relu+add"]
        receiver.on_frame(wire[0])
        return await asyncio.wait_for(receiver.recv(2, key), 5)

    assert torch.equal(asyncio.run(go()), value)
    assert receiver.refused == 0


@pytest.mark.parametrize(
    ("name", "sender", "why"),
    [
        ("2>1:relu", "A", "is for sub-DAG 1, not 3"),  # for B's other chunk: not this channel's
        ("3>3:relu", "B", "claims to come from sub-DAG 3 itself"),  # never sent: no loop to oneself
        ("0>3:relu", "B", "sub-DAG 0 is not held by its sender B"),  # B claims A's sub-DAG
        ("9>3:relu", "A", "sub-DAG 9 is not held by its sender A"),
        ("relu", "A", "names no route"),
    ],
)
def test_frames_with_a_false_route_are_refused(
    name: str, sender: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A false route says nothing trustworthy about its source: refused and logged, nobody's wait
    fails on its account (the real source may still send)."""
    receiver = _channel("B", 3, [])
    frame = TensorFrame("job1", sender, "act", 0, 0, name, torch.zeros(2))

    async def go() -> None:
        receiver.on_frame(frame)
        assert receiver.refused == 1
        with pytest.raises(TimeoutError):  # nothing was stored for A's sub-DAG 0: its value may still come
            await asyncio.wait_for(receiver.recv(0, ("act", 0, 0, "relu")), 0.2)

    asyncio.run(go())
    assert why in caplog.text


def test_a_bad_value_on_a_true_route_fails_the_step_that_waits_for_it() -> None:
    receiver = _channel("B", 3, [])
    frame = TensorFrame("job1", "A", "act", 0, 0, "2>3:relu", torch.zeros(2))  # not a packed value

    async def go() -> None:
        receiver.on_frame(frame)
        with pytest.raises(JobError, match="refused a frame from sub-DAG 2"):
            await asyncio.wait_for(receiver.recv(2, ("act", 0, 0, "relu")), 5)

    asyncio.run(go())
