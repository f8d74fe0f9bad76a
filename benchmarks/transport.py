"""Throughput of the ways a tensor can travel between two compnodes, side by side in one run.

Rows (all over loopback; each moves tensors of 64 KiB, 1, 16 and 64 MiB):

- ``raw socket``   plain blocking TCP sockets, ``sendall`` / ``recv_into`` a fresh buffer per message:
                   the ceiling for bytes over loopback here.
- ``raw asyncio``  the same bytes through an event loop (stream writer; ``BufferedProtocol`` receiver
                   into a fresh buffer per message): the ceiling for any asyncio transport.
- ``datapath``     ``fusionnet.wire`` DataPathServer/DataPathClient: framed, the head authenticated
                   with the job's MAC, delivered as a tensor to the job's callback; over loopback the
                   payload goes ``bare`` (no MAC: the kernel keeps it intact, ``wire/crypt.py``).
- ``datapath+mac`` the same with the payload MACed too (``payload_mac``): what a plaintext frame costs
                   between hosts (``placement.wire_encryption: off``), and every frame before bare ones.
- ``datapath+enc`` the same, with the payload encrypted (``placement.wire_encryption: on``, AES-CTR
                   under the same MAC, ``fusionnet/wire/crypt.py``): what a frame costs between hosts.
- ``p2p``          ``fusionnet.wire`` P2PDataPath: the same frames over hivemind P2P streams.

The receiver of every row runs in its own process (spawned, one per row), as a peer would: in one
process, sender and receiver share one event loop (or fight over the GIL from two threads), which
measures Python scheduling rather than the transport. All senders run in this process. A round
sends ``max(1, 64 MiB / size)`` messages back to back and ends when the receiver reports the last
one delivered; throughput is bytes / round time, median over ``--rounds`` rounds after a warm-up
round. Rows take turns round by round, so a machine shared with other work slows them alike.
A second table divides the same bytes by the CPU seconds of the busier side (sender or receiver
process, user + system, all threads): on a machine shared with other work, wall time measures the
neighbours as much as the transport, while CPU time per byte is what the transport costs; with a
core per side that is the throughput it would reach.

The MAC rows time the authenticators alone on one core: HMAC-SHA256 (what the frames would use
naively) and the chunked AES-GMAC frame MAC they use (``fusionnet/wire/mac.py``).
Prints a table, then one JSON line.

    python benchmarks/transport.py [--rounds 5] [--loop uvloop|asyncio] [--no-p2p]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection

import torch
import uvloop

from fusionnet.wire import DataPathClient, DataPathServer, TensorFrame
from fusionnet.wire.frames import WRITE_CHUNK
from fusionnet.wire.mac import FrameMac

SIZES = (64 << 10, 1 << 20, 16 << 20, 64 << 20)


def size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def size_key(n: int) -> str:
    return f"{n >> 20}mb" if n >= 1 << 20 else f"{n >> 10}kb"


ROUND_BYTES = 64 << 20
KINDS = ("raw socket", "raw asyncio", "datapath", "datapath+mac", "datapath+enc", "p2p")
LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
KEY = b"benchmark-job-key-0123456789abcdef"  # both processes need it; a real job key is random


# --- receivers (child processes) -------------------------------------------------------------------


class _Counter:
    """Counts delivered messages of the current round; tells the sender when the round is complete."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.expected = 0
        self.seen = 0
        self.cpu = 0.0

    def expect(self, count: int) -> None:
        self.expected, self.seen, self.cpu = count, 0, time.process_time()

    def delivered(self) -> None:
        self.seen += 1
        if self.seen == self.expected:
            self.conn.send(("done", time.process_time() - self.cpu))


def _raw_socket_receiver(conn: Connection) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[:2])
        peer, _ = listener.accept()
        with peer:
            while (cmd := conn.recv()) != "stop":
                size, count = cmd
                conn.send("ready")
                cpu = time.process_time()
                for _ in range(count):
                    buf = memoryview(bytearray(size))
                    got = 0
                    while got < size:
                        got += peer.recv_into(buf[got:], size - got)
                conn.send(("done", time.process_time() - cpu))


class _RawProtocol(asyncio.BufferedProtocol):
    def __init__(self, counter: _Counter, sizes: dict[str, int]) -> None:
        self.counter, self.sizes = counter, sizes
        self.buf = memoryview(bytearray(0))
        self.filled = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.filled == len(self.buf):
            self.buf, self.filled = memoryview(bytearray(self.sizes["size"])), 0
        return self.buf[self.filled :]

    def buffer_updated(self, n: int) -> None:
        self.filled += n
        if self.filled == len(self.buf):
            self.counter.delivered()


async def _async_receiver(kind: str, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    counter = _Counter(conn)
    stop: Callable[[], Awaitable[None]]
    if kind == "raw asyncio":
        sizes = {"size": 0}
        server = await loop.create_server(lambda: _RawProtocol(counter, sizes), "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[:2])

        async def stop() -> None:
            server.close()

    elif kind.startswith("datapath"):
        sizes = {}
        dp = DataPathServer(peer_id="receiver")
        policy = "on" if kind == "datapath+enc" else "auto"
        dp.register_job("bench", KEY, {"sender"}, lambda f: counter.delivered(), encryption=policy)
        conn.send(await dp.start())
        stop = dp.stop
    else:
        from hivemind.p2p import P2P

        from fusionnet.wire import P2PDataPath

        sizes = {}
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        path = P2PDataPath(p2p)
        await path.start()
        conn.send((path.peer_id, [str(m) for m in await p2p.get_visible_maddrs()]))
        sender_id = await loop.run_in_executor(None, conn.recv)
        path.register_job("bench", KEY, {sender_id}, lambda f: counter.delivered())

        async def stop() -> None:
            await path.stop()
            await p2p.shutdown()

    try:
        while (cmd := await loop.run_in_executor(None, conn.recv)) != "stop":
            sizes["size"], count = cmd
            counter.expect(count)
            conn.send("ready")
    finally:
        await stop()


def receiver_main(kind: str, loop_name: str, conn: Connection) -> None:
    """Entry point of a receiver process."""
    if kind == "raw socket":
        _raw_socket_receiver(conn)
        return
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(_async_receiver(kind, conn))


# --- senders (this process) -------------------------------------------------------------------------


def _frame(sender: str, step: int, tensor: torch.Tensor) -> TensorFrame:
    return TensorFrame(
        job_id="bench", sender=sender, kind="act", step=step, microbatch=0, name="x", tensor=tensor
    )


class Sender:
    """The sending side of one row, talking to its receiver process over ``conn``."""

    def __init__(self, kind: str, conn: Connection) -> None:
        self.kind, self.conn = kind, conn
        self._payloads: dict[int, memoryview] = {}
        self._tensors: dict[int, torch.Tensor] = {}

    async def open(self) -> None:
        info = self.conn.recv()
        if self.kind == "raw socket":
            self.sock = socket.create_connection(info)
        elif self.kind == "raw asyncio":
            _, self.writer = await asyncio.open_connection(*info)
            self.writer.transport.set_write_buffer_limits(high=0)  # as the data path does
        elif self.kind.startswith("datapath"):
            self.address = info
            self.client = DataPathClient(peer_id="sender")
        else:
            from hivemind.p2p import P2P

            from fusionnet.wire import P2PDataPath

            self.peer_id, maddrs = info
            self.p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
            self.path = P2PDataPath(self.p2p)
            self.conn.send(self.path.peer_id)

    async def send_all(self, size: int, count: int) -> None:
        if self.kind.startswith("raw"):
            if size not in self._payloads:
                self._payloads[size] = memoryview(os.urandom(size))
            payload = self._payloads[size]
            for _ in range(count):
                if self.kind == "raw socket":
                    self.sock.sendall(payload)  # blocking on purpose: the plain-socket baseline
                    continue
                for off in range(0, size, WRITE_CHUNK):
                    self.writer.write(payload[off : off + WRITE_CHUNK])
                    await self.writer.drain()
            return
        if size not in self._tensors:
            self._tensors[size] = torch.randn(size // 4)
        tensor = self._tensors[size]
        for i in range(count):
            if self.kind.startswith("datapath"):
                policy = "on" if self.kind == "datapath+enc" else "auto"
                await self.client.send(
                    self.address,
                    _frame("sender", i, tensor),
                    KEY,
                    encryption=policy,
                    payload_mac=self.kind == "datapath+mac",
                )
            else:
                await self.path.send(self.peer_id, _frame(self.path.peer_id, i, tensor), KEY)

    async def round(self, size: int) -> tuple[float, float]:
        """Wall seconds for ``ROUND_BYTES`` of messages until the receiver reports them all delivered,
        and the CPU seconds of the busier side (sender or receiver process, all threads)."""
        loop = asyncio.get_running_loop()
        count = max(1, ROUND_BYTES // size)
        self.conn.send((size, count))
        assert await loop.run_in_executor(None, self.conn.recv) == "ready"
        start, cpu = time.perf_counter(), time.process_time()
        await self.send_all(size, count)
        sent_cpu = time.process_time() - cpu
        done, receiver_cpu = await loop.run_in_executor(None, self.conn.recv)
        assert done == "done"
        return time.perf_counter() - start, max(sent_cpu, receiver_cpu)

    async def close(self) -> None:
        if hasattr(self, "sock"):
            self.sock.close()
        if hasattr(self, "writer"):
            self.writer.close()
        if hasattr(self, "client"):
            await self.client.close()
        if hasattr(self, "path"):
            await self.path.stop()
            await self.p2p.shutdown()


async def run_rows(
    kinds: list[str], loop_name: str, sizes: list[int], rounds: int
) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """MB/s per row and size, by wall time and by the busier side's CPU time. Rows take turns round
    by round, so load changes hit them alike."""
    ctx = mp.get_context("spawn")  # never fork a process that has started torch's threads
    procs, senders = [], []
    try:
        for kind in kinds:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=receiver_main, args=(kind, loop_name, child), daemon=True)
            proc.start()
            procs.append(proc)
            senders.append(Sender(kind, parent))
            await senders[-1].open()
        times: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in sizes} for kind in kinds}
        cpus: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in sizes} for kind in kinds}
        for size in sizes:
            for r in range(rounds + 1):  # round 0 warms up connections and allocators
                order = senders[r % len(senders) :] + senders[: r % len(senders)]
                for sender in order:
                    seconds, cpu = await sender.round(size)
                    if r:
                        times[sender.kind][size].append(seconds)
                        cpus[sender.kind][size].append(cpu)

        def rate(samples: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, float]]:
            return {
                kind: {
                    n: n * max(1, ROUND_BYTES // n) / statistics.median(t) / 1e6 for n, t in by_size.items()
                }
                for kind, by_size in samples.items()
            }

        return rate(times), rate(cpus)
    finally:
        for sender in senders:
            with contextlib.suppress(Exception):
                await sender.close()
            with contextlib.suppress(OSError):
                sender.conn.send("stop")
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)


def bench_macs(nbytes: int, reps: int) -> dict[str, float]:
    data = memoryview(os.urandom(nbytes))

    def hmac_sha256() -> None:
        hmac.new(KEY, data, hashlib.sha256).digest()

    def frame_mac() -> None:
        mac = FrameMac(KEY, b"n" * 16)
        mac.finish(b"head", mac.chunk_tags(data))

    out = {}
    for name, fn in (("hmac_sha256", hmac_sha256), ("frame_mac", frame_mac)):
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = nbytes / statistics.median(times[1:]) / 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=sorted(LOOPS), default="uvloop")
    parser.add_argument("--no-p2p", action="store_true", help="skip the hivemind row (no p2pd daemons)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    sizes = list(SIZES)
    kinds = [k for k in KINDS if not (args.no_p2p and k == "p2p")]
    with asyncio.Runner(loop_factory=LOOPS[args.loop]) as runner:
        mbps, cpu_mbps = runner.run(asyncio.wait_for(run_rows(kinds, args.loop, sizes, args.rounds), 1200))
    macs = bench_macs(sizes[-1], args.rounds)

    for title, table in (("wall time", mbps), ("CPU time of the busier side", cpu_mbps)):
        base = table["raw socket"]
        where = f"median of {args.rounds} rounds; loop={args.loop}; {os.cpu_count()} CPUs"
        print(f"MB/s (1e6 B/s) by {title}, {where}")
        print(f"{'path':<14}" + "".join(f"{size_label(n):>12}{'vs raw':>8}" for n in sizes))
        for name, row in table.items():
            print(f"{name:<14}" + "".join(f"{row[n]:>12.0f}{row[n] / base[n]:>8.2f}" for n in sizes))
    print(
        f"MAC alone, one core, {size_label(sizes[-1])}: "
        + ", ".join(f"{k} {v:.0f} MB/s" for k, v in macs.items())
    )

    result: dict[str, object] = {"loop": args.loop, "rounds": args.rounds, "cpus": os.cpu_count()}
    keys = {
        "raw socket": "raw",
        "raw asyncio": "raw_asyncio",
        "datapath": "datapath",
        "datapath+mac": "datapath_mac",
        "datapath+enc": "datapath_enc",
        "p2p": "p2p",
    }
    base, cpu_base = mbps["raw socket"], cpu_mbps["raw socket"]
    for name, row in mbps.items():
        for n in sizes:
            result[f"{keys[name]}_mbps_{size_key(n)}"] = round(row[n], 1)
            if name != "raw socket":
                result[f"{keys[name]}_vs_raw_{size_key(n)}"] = round(row[n] / base[n], 3)
                result[f"{keys[name]}_cpu_vs_raw_{size_key(n)}"] = round(cpu_mbps[name][n] / cpu_base[n], 3)
    for n in sizes:
        result[f"datapath_vs_raw_asyncio_{size_key(n)}"] = round(
            mbps["datapath"][n] / mbps["raw asyncio"][n], 3
        )
    result.update({f"{k}_mbps": round(v, 1) for k, v in macs.items()})
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
