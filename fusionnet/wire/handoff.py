"""Connections a compnode daemon hands over to its job's sandbox worker, which then reads its values itself.

Why: a value that reached a compnode over TCP was read, authenticated and then relayed by the
daemon to the job's sandbox worker over their socket pair: one more copy through the kernel, one
more wake-up of a process that shares the cores with the workers, on every activation's critical
path. The sending side stopped relaying already (``compnode.worker_sends``); this is the receiving
side.

Protocol. A sandbox worker's data path client (``DataPathClient(job_hello=...)``) starts each
connection, after the server's hello, with ``WORKER_HELLO | u16 length | job id`` and then waits for
one byte, ``GO``, before it writes its first frame. So nothing of a frame sits in the daemon's buffers
when the connection changes hands. The server asks its ``handoff`` callback about the job:

- the callback took the socket (a duplicate of it went to the job's worker, ``pass_socket``): the
  server forgets the connection; the worker says ``GO`` once it reads from it;
- it answers None: no worker reads for that job (``--sandbox off``), the server says ``GO`` and
  reads the frames itself;
- it refuses: the server closes; the sending worker then leaves its values to its daemon.

The claim in the hello is not authenticated and need not be: whoever ends up reading the connection
checks every frame (the link key's MAC, the sender, the replay window) as the daemon would. What the
two readers must not do is accept the same frame twice: a frame captured on the worker's connection
and replayed to the daemon would pass the daemon's window, which never saw it. So they split the
sequence-number lanes (``replay.set_seq_lane``): a worker reads only lane ``WORKER_LANE``, what sending
workers number in, and the daemon refuses that lane for a job whose worker reads it.
"""

from __future__ import annotations

import os
import socket

from fusionnet.errors import WireError
from fusionnet.wire.header import MAX_ID_LEN, check_text
from fusionnet.wire.replay import SEQ_LANES

WORKER_HELLO = b"FNWH"  # not a frame's ``header.MAGIC``: the first 4 bytes tell the two apart
GO = b"G"
WORKER_LANE = 1  # the lane sandbox workers number their frames in (``sandbox_worker.main``)
OTHER_LANES = frozenset(range(SEQ_LANES)) - {WORKER_LANE}
_PASS_MESSAGE = b"C"


def worker_hello(job_id: str) -> bytes:
    raw = check_text(job_id, "job_id", MAX_ID_LEN).encode()
    return WORKER_HELLO + len(raw).to_bytes(2, "big") + raw


def hello_job(raw: bytes) -> str:
    """The job id of a worker hello, from its bytes (after ``WORKER_HELLO`` and the length)."""
    try:
        return check_text(raw.decode("ascii"), "worker hello's job id", MAX_ID_LEN)
    except UnicodeDecodeError:
        raise WireError("worker hello: the job id is not ASCII") from None


def hello_size(size_bytes: bytes) -> int:
    size = int.from_bytes(size_bytes, "big")
    if not 0 < size <= MAX_ID_LEN:
        raise WireError(f"worker hello names a job id of {size} bytes")
    return size


def pass_socket(channel: socket.socket, connection: socket.socket) -> bool:
    """Sends a duplicate of ``connection`` down ``channel`` (a non-blocking Unix socket: the daemon never
    waits on a worker); False when the worker's queue is full or the worker is gone. The caller closes
    its own copy: the connection lives on in the receiving process (closing a duplicate sends no FIN).

    Each message carries one descriptor, so the kernel hands them over one per ``recvmsg``."""
    fd = os.dup(connection.fileno())
    try:
        socket.send_fds(channel, [_PASS_MESSAGE], [fd])
        return True
    except OSError:  # a full queue (BlockingIOError), the worker gone
        return False
    finally:
        os.close(fd)


def take_sockets(channel: socket.socket, most: int = 16) -> list[socket.socket] | None:
    """The connections waiting in ``channel`` (non-blocking), [] when none right now, None once the
    daemon's end is closed."""
    try:
        message, fds, _, _ = socket.recv_fds(channel, 64, most)
    except (BlockingIOError, InterruptedError):
        return []
    except OSError:
        return None
    if not message and not fds:
        return None
    taken = []
    for fd in fds:
        try:
            taken.append(socket.socket(fileno=fd))
        except OSError:  # not a socket: our daemon never sends one, but never leak the descriptor
            os.close(fd)
    return taken
