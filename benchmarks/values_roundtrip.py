"""The round trip of a small value between two stages: FusionNet's executor channel against raw asyncio.

What a pipeline stage hands its neighbour per micro-batch is often small: a decoder's hidden states for a
batch of 16 rows at one position (16 KiB), with its positions, cache slots and mask beside them. At that
size a hop costs what the software around it costs, not what its bytes do. Two processes play
ping-pong on loopback, each echoing what it receives; the round trip's median is the figure. Rows:

- ``raw asyncio``  the same bytes as one message through asyncio streams (``readexactly`` of a length
                   prefix and the payload): the floor of any asyncio transport on this machine.
- ``fusionnet``    ``NetChannel.send_values`` to ``recv`` over ``DataPathServer``/``DataPathClient``: the
                   values packed into one frame (``compnode/valuepack.py``), framed, the head MACed,
                   read, unpacked and checked into the receiver's mailbox, what a sandbox worker does
                   (loopback frames go ``bare``: no payload MAC).

Values: ``decoder``, the four values a GPT-2 stage of the serving benchmark's small size sends per
decode batch (hidden ``[16, 1, 256]`` float32, positions ``[16, 1]`` and slots ``[16]`` int64, a mask
``[16, 1, 1, 65]`` bool); ``64 KiB`` and ``1 MiB``, one float32 tensor each. Both sides of a round run in
turn in alternating rounds (``--rounds``), so a shared machine slows them alike. Prints a table, then
one JSON line.

    python benchmarks/values_roundtrip.py [--trips 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import struct
import time
from multiprocessing.connection import Connection

import torch

KEY = b"values-roundtrip-key-0123456789ab"
LENGTH = struct.Struct("<Q")
Values = list[tuple[str, torch.Tensor]]


def values_of(kind: str) -> Values:
    gen = torch.Generator().manual_seed(0)
    if kind == "decoder":
        rows = 16
        return [
            ("hidden", torch.randn(rows, 1, 256, generator=gen)),
            ("positions", torch.arange(rows).view(rows, 1)),
            ("slots", torch.arange(rows)),
            ("mask", torch.ones(rows, 1, 1, 65, dtype=torch.bool)),
        ]
    size = {"64 KiB": 64 << 10, "1 MiB": 1 << 20}[kind]
    return [("x", torch.randn(size // 4, generator=gen))]


def nbytes(values: Values) -> int:
    return sum(t.numel() * t.element_size() for _, t in values)


# ---- raw asyncio streams -------------------------------------------------------------------------------
async def _raw_side(conn: Connection, starter: bool, size: int, trips: int) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(trips + 1):
            n = LENGTH.unpack(await reader.readexactly(LENGTH.size))[0]
            writer.write(LENGTH.pack(n) + await reader.readexactly(n))
            await writer.drain()
        writer.close()

    if not starter:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        async with server:
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until the parent says done
        return
    reader, writer = await asyncio.open_connection("127.0.0.1", conn.recv())
    payload = bytes(size)
    times = []
    for _ in range(trips + 1):
        t = time.perf_counter()
        writer.write(LENGTH.pack(size) + payload)
        await writer.drain()
        n = LENGTH.unpack(await reader.readexactly(LENGTH.size))[0]
        await reader.readexactly(n)
        times.append(time.perf_counter() - t)
    writer.close()
    conn.send(times[1:])


# ---- FusionNet's channel --------------------------------------------------------------------------------
async def _fusionnet_side(conn: Connection, starter: bool, kind: str, trips: int) -> None:
    from fusionnet.compnode.netchannel import NetChannel
    from fusionnet.wire.datapath import DataPathClient, DataPathServer

    me, other = ("A", "B") if starter else ("B", "A")
    server = DataPathServer(peer_id=me)
    conn.send(await server.start())
    address = conn.recv()
    client = DataPathClient(peer_id=me)
    src = 1 if starter else 0
    channel = NetChannel(
        job_id="bench",
        peer_id=me,
        subdag_of_peer={other: src},
        send_frame=lambda _dst, frame: client.send(address, frame, KEY),
    )
    server.register_job("bench", KEY, [other], channel.on_frame)
    values = values_of(kind)
    times = []
    try:
        for step in range(trips + 1):
            channel.mailbox.forget_step(step)
            items = [(("act", step, 0, name), t) for name, t in values]
            t0 = time.perf_counter()
            if starter:
                await channel.send_values(src, items)
            got = [await channel.recv(src, key) for key, _ in items]
            if not starter:
                await channel.send_values(src, list(zip([k for k, _ in items], got)))
            times.append(time.perf_counter() - t0)
        await asyncio.sleep(0.1)  # the last echo's bytes leave before the connection closes
    finally:
        await client.close()
        await server.stop()
    conn.send(times[1:] if starter else None)  # the echo side: done


def side_main(way: str, conn: Connection, starter: bool, kind: str, trips: int) -> None:
    torch.set_num_threads(1)
    if way == "raw asyncio":
        asyncio.run(_raw_side(conn, starter, nbytes(values_of(kind)), trips))
    else:
        asyncio.run(_fusionnet_side(conn, starter, kind, trips))


def round_trip(way: str, kind: str, trips: int) -> float:
    """Median seconds of ``trips`` round trips between two fresh processes (the parent passes their
    addresses between them)."""
    ctx = mp.get_context("spawn")
    to_echo, echo_end = ctx.Pipe()
    to_starter, starter_end = ctx.Pipe()
    sides = [
        ctx.Process(target=side_main, args=(way, echo_end, False, kind, trips)),
        ctx.Process(target=side_main, args=(way, starter_end, True, kind, trips)),
    ]
    for p in sides:
        p.start()
    try:
        if way == "raw asyncio":
            to_starter.send(to_echo.recv())
            times = to_starter.recv()
            to_echo.send("done")
        else:
            echo_address, starter_address = to_echo.recv(), to_starter.recv()
            to_echo.send(starter_address)
            to_starter.send(echo_address)
            times = to_starter.recv()
            to_echo.recv()
    finally:
        for p in sides:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return statistics.median(times)


WAYS = ("raw asyncio", "fusionnet")
KINDS = ("decoder", "64 KiB", "1 MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=2000, help="round trips per measurement (default 2000)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is shown (3)")
    args = ap.parse_args()
    seen: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for kind in KINDS:
            trips = args.trips if kind != "1 MiB" else max(1, args.trips // 4)
            for way in WAYS:
                seen.setdefault((kind, way), []).append(round_trip(way, kind, trips))
    rows = []
    print(f"{'value':>8} {'bytes':>9} {'raw asyncio us':>15} {'fusionnet us':>13} {'fusionnet / raw':>16}")
    for kind in KINDS:
        raw = statistics.median(seen[(kind, "raw asyncio")]) * 1e6
        ours = statistics.median(seen[(kind, "fusionnet")]) * 1e6
        size = nbytes(values_of(kind))
        print(f"{kind:>8} {size:>9} {raw:>15.0f} {ours:>13.0f} {ours / raw:>16.2f}")
        rows.append({"value": kind, "bytes": size, "raw_asyncio_us": raw, "fusionnet_us": ours})
    print(
        json.dumps(
            {"benchmark": "values_roundtrip", "trips": args.trips, "rounds": args.rounds, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
