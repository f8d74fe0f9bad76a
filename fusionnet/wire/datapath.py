"""The direct data path: tensor frames over plain TCP between compnodes that can reach each other.

Measured on loopback here, plain TCP moves 1-2 GB/s where a hivemind P2P stream moves 0.1-0.3
GB/s, so bulk activations and gradients take this path whenever the receiver's address is
reachable, and ``p2p_path.P2PDataPath`` otherwise. Peers are authenticated per job: every frame
carries a MAC under the job's key (``mac.py``), and the server only delivers frames of registered
jobs from that job's allowed senders.

``DataPathServer`` receives through ``sources.BufferedSource`` (payloads land straight in their
frame's buffer); ``DataPathClient`` keeps one pooled connection per address (``pool.py``).

Handshake: the server's first bytes on a connection are ``HELLO`` + its peer id, so that a client,
which only knows an address, binds every frame it sends to the peer it reached (a frame names its
receiver under its MAC: no other receiver accepts it, see ``replay.py``). Limits: at most
``max_connections`` connections in all and ``max_per_host`` from one remote host; a connection must
send its first frame within the handshake timeout, the next one within the idle timeout, and keep a
frame's bytes coming (``job_routes.Timeouts``); a frame for a job this server does not run closes it.
A sandbox worker's connection opens with a hello of its own and may change hands (``handoff.py``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from fusionnet.errors import WireError
from fusionnet.wire import refusal as R
from fusionnet.wire.crypt import bare_ok, check_policy, encrypt_to
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import GO, WORKER_HELLO, hello_job, hello_size, worker_hello
from fusionnet.wire.header import MAX_ID_LEN, check_text
from fusionnet.wire.job_routes import Timeouts
from fusionnet.wire.pool import StreamPool
from fusionnet.wire.receiver import FrameReceiver, ReceivesFrames
from fusionnet.wire.refusal import FrameRefused
from fusionnet.wire.sources import BufferedSource

log = logging.getLogger("fusionnet.wire")

Address = tuple[str, int]
# ``DataPathServer.handoff``: (job id a worker's connection names, its socket) -> True: taken (a
# duplicate went to the job's worker), False: refused (closed), None: read here.
Handoff = Callable[[str, Any], bool | None]


def parse_address(address: tuple[str, int] | str) -> Address:
    """``("host", port)`` from a tuple or a ``"host:port"`` / ``"[v6 host]:port"`` string."""
    if isinstance(address, str):
        host, sep, port_text = address.rpartition(":")
        if not sep or not port_text.isdigit():
            raise WireError(f"data path address {address!r} is not HOST:PORT")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        address = (host, int(port_text))
    if (
        not isinstance(address, tuple)
        or len(address) != 2
        or not isinstance(address[0], str)
        or not address[0]
        or isinstance(address[1], bool)
        or not isinstance(address[1], int)
        or not 0 < address[1] < 65536
    ):
        raise WireError(f"data path address {address!r} must be (host, port) with port in 1..65535")
    return address


HELLO = b"FNH1"
DOWN_FOR = 45.0  # seconds a client remembers an address whose connect timed out (``pool.StreamPool``)
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_PER_HOST = 32
MAX_PAYLOAD = 1 << 30  # the largest frame payload a compnode receives (its daemon, and its workers)


ANY6 = "::"


def dual_stack_listener(port: int) -> socket.socket:
    """A TCP socket listening on every IPv6 and, where the system allows, every IPv4 address. asyncio's
    ``create_server("::")`` would set IPV6_V6ONLY (and bind IPv4 apart, on another port when it is 0):
    a compnode that announces an IPv6 host must also serve peers that dial its IPv4 one."""
    return socket.create_server(
        ("::", port), family=socket.AF_INET6, dualstack_ipv6=socket.has_dualstack_ipv6()
    )


def hello_bytes(peer_id: str) -> bytes:
    raw = check_text(peer_id, "peer_id", MAX_ID_LEN).encode()
    return HELLO + len(raw).to_bytes(2, "big") + raw


async def read_hello(reader: asyncio.StreamReader) -> str:
    """The peer id a data path server announces when a connection opens (``WireError`` if none)."""
    try:
        head = await reader.readexactly(len(HELLO) + 2)
        if head[: len(HELLO)] != HELLO:
            raise WireError(f"data path server did not say hello (got {head[:8]!r})")
        size = int.from_bytes(head[len(HELLO) :], "big")
        if not 0 < size <= MAX_ID_LEN:
            raise WireError(f"data path server hello of {size} bytes")
        return check_text((await reader.readexactly(size)).decode("ascii"), "hello", MAX_ID_LEN)
    except (asyncio.IncompleteReadError, UnicodeDecodeError) as e:
        raise WireError(f"data path server closed or garbled its hello ({type(e).__name__})") from None


async def close_connections(sources: Iterable[BufferedSource], tasks: Iterable[asyncio.Task[None]]) -> None:
    """Closes every connection and waits for the tasks that read them (a server's, or a worker's)."""
    for source in list(sources):
        source.close()
    running = list(tasks)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


class DataPathServer(ReceivesFrames):
    """Accepts frame streams on a TCP port and delivers each job's frames to its callback."""

    def __init__(
        self,
        *,
        peer_id: str,
        max_payload: int = MAX_PAYLOAD,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_host: int = DEFAULT_MAX_PER_HOST,
        timeouts: Timeouts | None = None,
    ) -> None:
        if not 0 < max_per_host <= max_connections:
            raise WireError(f"need 0 < max_per_host ({max_per_host}) <= max_connections ({max_connections})")
        self.receiver = FrameReceiver(peer_id=peer_id, max_payload=max_payload, timeouts=timeouts)
        self.peer_id = peer_id
        self.address: Address | None = None
        self.max_connections = max_connections
        self.max_per_host = max_per_host
        self.connections_refused = 0
        self._hello = hello_bytes(peer_id)
        self._server: asyncio.Server | None = None
        self._sources: set[BufferedSource] = set()
        self._per_host: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.handoff: Handoff | None = None  # who reads a sandbox worker's connection (None: we do)
        self.handed_off = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Address:
        """Listens; returns the bound ``(host, port)`` (port 0 picks a free one)."""
        if self._server is not None or self._stopping:
            raise RuntimeError("DataPathServer.start called twice")
        loop = asyncio.get_running_loop()
        factory = partial(BufferedSource, self._on_connect)
        try:
            if host.strip("[]") == ANY6:
                self._server = await loop.create_server(factory, sock=dual_stack_listener(port))
            else:
                self._server = await loop.create_server(factory, host, port)
        except OSError as e:  # taken, or a host that does not resolve: the compnode's flags, one line
            raise ValueError(
                f"--data-port {port}: cannot listen on {host}:{port} ({e.strerror or e})"
            ) from None
        bound = self._server.sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        log.info("%s: data path listening on %s:%d", self.peer_id, *self.address)
        return self.address

    def _on_connect(self, source: BufferedSource) -> None:
        if self._stopping:
            source.close()
            return
        host = source.peername.rpartition(":")[0]
        if len(self._sources) >= self.max_connections or self._per_host.get(host, 0) >= self.max_per_host:
            self.connections_refused += 1
            if self.connections_refused in (1, 10, 100) or self.connections_refused % 1000 == 0:
                log.warning(
                    "%s: refusing data path connections (%d open, %d from %s; %d refused so far)",
                    self.peer_id,
                    len(self._sources),
                    self._per_host.get(host, 0),
                    host,
                    self.connections_refused,
                )
            source.close()
            return
        self._per_host[host] = self._per_host.get(host, 0) + 1
        if source.transport is not None:
            source.transport.write(self._hello)
        self._sources.add(source)
        task = asyncio.get_running_loop().create_task(
            self._serve(source), name=f"wire-conn-{source.peername}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, source: BufferedSource) -> None:
        try:
            host = source.peername.rpartition(":")[0]
            if await self._read_here(source):
                await self.receiver.serve(source, source.peername, remote_host=host)
        except asyncio.CancelledError:
            raise
        except Exception:  # serve() handles peers' errors; this only guards against our own bugs
            log.exception("%s: connection task for %s failed", self.peer_id, source.peername)
        finally:
            source.close()
            self._sources.discard(source)
            host = source.peername.rpartition(":")[0]
            left = self._per_host.get(host, 1) - 1
            if left > 0:
                self._per_host[host] = left
            else:
                self._per_host.pop(host, None)

    async def _read_here(self, source: BufferedSource) -> bool:
        """Whether this server reads the connection's frames: False once a sandbox worker's connection
        went to its worker, or was refused (``handoff.py``); True for every other connection."""
        try:
            async with asyncio.timeout(self.receiver.timeouts.handshake):
                first = await source.readexactly(len(WORKER_HELLO))
                if first != WORKER_HELLO:
                    source.unread(first)  # a frame's prefix: the frame loop reads it
                    return True
                job_id = hello_job(await source.readexactly(hello_size(await source.readexactly(2))))
        except asyncio.IncompleteReadError as e:
            source.unread(e.partial)  # the frame loop sees the stream end, as it would have
            return True
        except TimeoutError:
            what = "timed out waiting for the first frame"
            self.receiver.count_refusal(FrameRefused(what, reason=R.TIMEOUT), source.peername)
            return False
        except WireError as e:
            self.receiver.count_refusal(FrameRefused(str(e), reason=R.MALFORMED), source.peername)
            return False
        transport = source.transport
        if transport is None or source.buffered:
            why = f"job {job_id!r}: a worker's connection sent bytes before it was told to go"
            self.receiver.count_refusal(FrameRefused(why, reason=R.MALFORMED), source.peername)
            return False
        transport.pause_reading()  # from here on the bytes are for whoever reads the connection
        taken = None if self.handoff is None else self.handoff(job_id, transport.get_extra_info("socket"))
        if taken is None:
            transport.resume_reading()
            transport.write(GO)
            return True
        if taken:
            self.handed_off += 1
        else:
            log.info(
                "%s: refused a worker connection for job %r from %s", self.peer_id, job_id, source.peername
            )
        return False

    async def stop(self) -> None:
        """Stops listening, closes every connection and waits for their tasks."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        await close_connections(self._sources, self._tasks)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> DataPathServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


# Linux's SO_MAX_PACING_RATE (bytes/s; ~0 is no cap): TCP then paces itself, whatever the qdisc.
SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
NO_PACING = 0xFFFFFFFF


def set_pacing(writer: asyncio.StreamWriter, rate: int | None) -> bool:
    """Caps ``writer``'s TCP send rate at ``rate`` bytes/s (None: lifts the cap); False where the system
    has no such option (the flow then goes unpaced: slower links may queue behind it, nothing breaks)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    value = NO_PACING if rate is None else min(rate, NO_PACING - 1)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=I", value))  # a u32
    except OSError as e:
        log.debug("no TCP pacing on this system (%s)", e)
        return False
    return True


class DataPathClient:
    """Sends frames to data path servers over pooled TCP connections (one per address).

    ``job_hello``: a sandbox worker's client, whose connections carry that job's frames only and may
    be read by the receiving compnode's worker (``handoff.py``)."""

    def __init__(
        self,
        *,
        peer_id: str,
        connect_timeout: float = 10.0,
        job_hello: str | None = None,
        down_for: float = DOWN_FOR,
    ) -> None:
        self.peer_id = check_text(peer_id, "peer_id", MAX_ID_LEN)
        self.connect_timeout = connect_timeout
        self._job_hello = None if job_hello is None else worker_hello(job_hello)
        # An address whose connect timed out fails every send for ``down_for`` s at once: its caller
        # has a fallback (the P2P path), and each retry would stall a step by ``connect_timeout``.
        self._pool = StreamPool(
            self._open,
            describe=lambda dest: "%s:%d" % dest,  # noqa: UP031
            down_for=down_for,
        )
        self._pacing: dict[Address, int | None] = {}  # bytes/s caps per address (``pace``)

    def pace(self, address: tuple[str, int] | str, bytes_per_second: float | None) -> None:
        """Caps the rate of this client's connection to ``address`` (None: no cap), now and on any later
        reconnection. The kernel paces the TCP flow (``SO_MAX_PACING_RATE``), so a bulk transfer on a
        slow link leaves the bottleneck's queue short: frames of other connections (activations, RPCs)
        do not wait behind seconds of it."""
        dest = parse_address(address)
        rate = None if bytes_per_second is None else max(1, int(bytes_per_second))
        self._pacing[dest] = rate
        writer = self._pool.writer_of(dest)
        if writer is not None:
            set_pacing(writer, rate)

    async def _open(self, dest: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        try:
            return await self._connect(dest)
        except TimeoutError as e:
            if str(e):  # the kernel's own (ETIMEDOUT) says what it is
                raise
            raise TimeoutError(f"timed out after {self.connect_timeout:g} s") from None

    async def _connect(self, dest: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        async with asyncio.timeout(self.connect_timeout):
            reader, writer = await asyncio.open_connection(*dest)
            set_pacing(writer, self._pacing.get(dest))
            try:
                receiver = await read_hello(reader)
                if self._job_hello is not None:
                    writer.write(self._job_hello)
                    if await reader.readexactly(len(GO)) != GO:
                        raise WireError("the data path answered a worker's hello with something else")
            except BaseException as e:
                writer.close()
                if isinstance(e, WireError):
                    raise ConnectionError(f"{dest[0]}:{dest[1]}: {e}") from None
                if isinstance(e, asyncio.IncompleteReadError):
                    raise ConnectionError(f"{dest[0]}:{dest[1]}: refused this worker's connection") from None
                raise
        return reader, writer, receiver

    async def send(
        self,
        address: tuple[str, int] | str,
        frame: TensorFrame,
        key: bytes,
        encryption: str = "auto",
        *,
        payload_mac: bool = False,
    ) -> None:
        """Sends one frame; returns once all of it is in the kernel. ``PeerUnreachable`` if it cannot.

        ``encryption`` is the job's ``placement.wire_encryption``: ``auto`` encrypts the payload
        unless ``address`` is loopback, where the payload goes bare (no MAC) unless it is ``on``
        (``crypt.py``); ``payload_mac`` MACs it there too (what the transport benchmark compares)."""
        if not isinstance(frame, TensorFrame):
            raise WireError(f"expected a TensorFrame, got {type(frame).__name__}")
        if frame.sender != self.peer_id:
            raise WireError(f"frame claims sender {frame.sender!r} but this client is {self.peer_id!r}")
        dest = parse_address(address)
        policy = check_policy(encryption)
        await self._pool.send(
            dest,
            frame,
            key,
            encrypt=encrypt_to(policy, dest[0]),
            bare_ok=bare_ok(policy, dest[0]) and not payload_mac,
        )

    async def close(self) -> None:
        await self._pool.close()

    async def __aenter__(self) -> DataPathClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
