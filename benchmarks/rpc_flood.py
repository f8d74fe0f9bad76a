"""A broker's memory under an RPC flood (issue 12): one peer sends N concurrent large, valid requests.

Starts a broker (its own process, no compnodes), then an attacking peer opens ``--requests`` streams
at once, each carrying a ``status`` request padded to ``--mb`` MiB, and reads the answers. Samples the
broker's resident memory (``/proc/PID/status`` VmRSS) every 20 ms and reports the baseline, the peak,
how many requests were served and how many refused over a budget, and whether the broker still answers
``status`` afterwards. The daemons run the code on ``PYTHONPATH`` (e.g. ``PYTHONPATH=/path/to/old/tree``
for a before/after comparison; the attacker is this tree's, the wire format is the same).

Prints a table, then one JSON line.

    python benchmarks/rpc_flood.py [--requests 8] [--mb 48] [--rpc-max-mb 512] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fusionnet.daemon.observer import SwarmObserver  # noqa: E402
from fusionnet.daemon.swarm import SwarmPeer  # noqa: E402
from fusionnet.dht.node import DHTConfig  # noqa: E402
from fusionnet.rpc import as_peer_id  # noqa: E402
from fusionnet.rpc.protocol import STREAM_PROTOCOL, decode_response, encode_request, frame_header  # noqa: E402
from fusionnet.rpc.streams import read_frame  # noqa: E402
from fusionnet.runtime.process_swarm import ProcessSwarm, broker_args  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def one_request(peer: SwarmPeer, broker: str, nbytes: int) -> str:
    """One padded ``status`` request over a raw stream: "ok", the refusal's message, or "closed"."""
    body = encode_request("status", {"job_limit": 0, "pad": b"\0" * nbytes})
    _, reader, writer = await peer.p2p.call_binary_stream_handler(as_peer_id(broker), STREAM_PROTOCOL)
    answer = asyncio.ensure_future(read_frame(reader, 1 << 20, 300.0, "answer"))
    try:
        writer.write(frame_header(len(body)))
        for offset in range(0, len(body), 1 << 20):
            if answer.done():
                break
            writer.write(body[offset : offset + (1 << 20)])
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    try:
        response = decode_response(await answer)
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return "closed"
    finally:
        writer.close()
    return "ok" if response.error is None else response.error[1]


async def flood(initial_peers: list[str], broker: str, requests: int, nbytes: int) -> tuple[list[Any], bool]:
    peer = await SwarmPeer.start(DHTConfig(initial_peers=tuple(initial_peers)), serve=False)
    try:
        outcomes = await asyncio.gather(
            *(one_request(peer, broker, nbytes) for _ in range(requests)), return_exceptions=True
        )
    finally:
        await peer.stop(rpc_grace=0.0)
    async with SwarmObserver(initial_peers) as observer:
        alive = (await observer.broker_status(timeout=30))["broker"]["peer_id"] == broker
    return outcomes, alive


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--mb", type=int, default=48, help="MiB per request")
    p.add_argument("--rpc-max-mb", type=float, default=512.0, help="the broker's --rpc-max-mb")
    p.add_argument("--workdir", type=Path)
    args = p.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rpc-flood-"))
    extra = ["--rpc-max-mb", str(args.rpc_max_mb)]
    with ProcessSwarm(workdir, specs=(), broker_argv=broker_args(extra=extra)) as swarm:
        assert swarm.broker is not None
        pid, broker = swarm.broker.pid, swarm.broker.peer_id
        time.sleep(2.0)  # let start-up allocations settle before the baseline
        baseline = rss_mib(pid)
        peak = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mib(pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        try:
            outcomes, alive = asyncio.run(flood(swarm.initial_peers, broker, args.requests, args.mb << 20))
        finally:
            done.set()
            sampler.join()
        seconds = time.monotonic() - started
    served = sum(o == "ok" for o in outcomes)
    refused = sum(isinstance(o, str) and o not in ("ok", "closed") for o in outcomes)
    other = len(outcomes) - served - refused
    print(f"{'requests':>10} {'MiB each':>9} {'served':>7} {'refused':>8} {'other':>6} "
          f"{'RSS base':>9} {'RSS peak':>9} {'growth':>8} {'alive':>6} {'s':>6}")  # fmt: skip
    print(f"{args.requests:>10} {args.mb:>9} {served:>7} {refused:>8} {other:>6} {baseline:>9.0f} "
          f"{peak[0]:>9.0f} {peak[0] - baseline:>8.0f} {alive!s:>6} {seconds:>6.1f}")  # fmt: skip
    print(json.dumps({
        "benchmark": "rpc_flood", "requests": args.requests, "mib_each": args.mb,
        "rpc_max_mb": args.rpc_max_mb, "served": served, "refused": refused, "other": other,
        "rss_baseline_mib": round(baseline, 1), "rss_peak_mib": round(peak[0], 1),
        "rss_growth_mib": round(peak[0] - baseline, 1), "broker_alive": alive, "seconds": round(seconds, 1),
        "refusals": sorted({o[:80] for o in outcomes if isinstance(o, str) and o not in ("ok", "closed")}),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
