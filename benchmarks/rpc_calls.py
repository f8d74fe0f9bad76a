"""What one daemon call costs: kept streams against a new libp2p stream per call and hivemind's unary
calls, between two processes over loopback.

Every daemon call (the broker's step call to each compnode per training step, its serve call per
served batch or token, heartbeats) used to go on a new libp2p stream; now it goes on a stream kept
open between calls (``fusionnet/rpc/kept.py``). The server runs in its own process (its own p2pd) with
an echo handler; the client calls it ``--calls`` times per size, one call at a time and then
``--concurrency`` at a time, three ways in turn:

- ``new stream``   a new stream per call, as FusionNet did before (``RPCClient(kept_streams=False)``)
- ``unary``        hivemind's unary protobuf call over p2pd's control connection (peer: hivemind's own)
- ``kept stream``  FusionNet's kept streams (``RPCClient``, the default)

Median ms per call over ``--rounds`` rounds (the three ways alternate within each round). Prints a
table, then one JSON line.

    python benchmarks/rpc_calls.py [--calls 200] [--rounds 3] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hivemind.p2p import P2P  # noqa: E402

from fusionnet.rpc import RPCClient, RPCServer  # noqa: E402

SIZES = {"100 B": 100, "64 KiB": 64 << 10, "1 MiB": 1 << 20}
WAYS = ("new stream", "unary", "kept stream")


class Echo:
    async def rpc_echo(self, payload: dict[str, Any], context: Any) -> dict[str, Any]:
        return {"n": len(payload["blob"])}


def serve(address_queue: Any, stop_event: Any) -> None:
    async def main() -> None:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        server = RPCServer(p2p)
        server.add_handlers(Echo())
        await server.start()
        address_queue.put([str(m) for m in await p2p.get_visible_maddrs()])
        while not stop_event.is_set():
            await asyncio.sleep(0.1)
        await server.stop(grace=1.0)
        await p2p.shutdown()

    asyncio.run(main())


async def timed(client: RPCClient, peer: Any, blob: bytes, calls: int, concurrency: int) -> float:
    """Wall ms per call: ``calls`` calls, ``concurrency`` at a time."""

    async def one_lane(n: int) -> None:
        for _ in range(n):
            reply = await client.call(peer, "echo", {"blob": blob}, timeout=60)
            assert reply["n"] == len(blob)

    await one_lane(2)  # warm: streams opened, handlers imported
    start = time.perf_counter()
    await asyncio.gather(*(one_lane(calls // concurrency) for _ in range(concurrency)))
    return (time.perf_counter() - start) / (calls // concurrency * concurrency) * 1e3


async def measure(addresses: list[str], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses)
    server_id = addresses[0].rsplit("/p2p/", 1)[1]
    clients = {
        "new stream": RPCClient(p2p, unary_limit=0, kept_streams=False),
        "unary": RPCClient(p2p, unary_limit=2 << 20, kept_streams=False),
        "kept stream": RPCClient(p2p, unary_limit=0),
    }
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for label, size in SIZES.items():
            blob = b"x" * size
            for concurrency in (1, args.concurrency):
                for way in WAYS:
                    ms = await timed(clients[way], server_id, blob, args.calls, concurrency)
                    results.setdefault(f"{label} x{concurrency}", {}).setdefault(way, []).append(ms)
    clients["kept stream"].close()
    await p2p.shutdown()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per size and way (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported (default 3)")
    ap.add_argument("--concurrency", type=int, default=4, help="calls in flight in the second pass")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(queue, stop), daemon=True)
    server.start()
    try:
        addresses = queue.get(timeout=60)
        results = asyncio.run(measure(addresses, args))
    finally:
        stop.set()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
    print(f"{'request, in flight':<20}" + "".join(f"{w + ' ms':>16}" for w in WAYS) + f"{'kept / new':>12}")
    table: dict[str, dict[str, float]] = {}
    for key, by_way in results.items():
        med = {w: statistics.median(v) for w, v in by_way.items()}
        table[key] = med
        row = "".join(f"{med[w]:>16.2f}" for w in WAYS)
        print(f"{key:<20}{row}{med['kept stream'] / med['new stream']:>12.2f}")
    print(
        json.dumps(
            {"benchmark": "rpc_calls", "calls": args.calls, "rounds": args.rounds, "ms_per_call": table}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
