"""Tensor frames and the authenticated data paths between compnodes.

Activations and gradients travel as frames: a msgpack header of plain fields (naming the receiver
and carrying a sequence number), the tensor's raw bytes, and a per-job MAC. Nothing a peer sends
is unpickled or evaluated. Bulk data goes over direct TCP when the receiver is reachable, over a
hivemind P2P stream otherwise.

Map of the package:

- ``frames.py``    ``TensorFrame``, ``encode_frame``, ``write_frame``: one frame onto a stream.
- ``gather.py``    ``write_buffers``: a large frame's buffers onto a socket with one ``writev``, not joined.
- ``crypt.py``     payload encryption (AES-CTR under the frame MAC) and which frames must be encrypted.
- ``frame_reader.py`` ``read_frame``: one frame off a stream, every check before anything large is allocated.
- ``header.py``    frame prefix and msgpack header: layout, field checks, dtype allowlist (pure).
- ``mac.py``       the frame MAC (HMAC-SHA256 key derivation + chunked AES-GMAC) and key checks (pure).
- ``replay.py``    sequence numbers (``next_seq``) and the per-(job, sender) ``ReplayWindow``.
- ``sources.py``   byte sources for ``read_frame``: ``StreamReader`` adapter, zero-copy ``BufferedSource``,
                   ``PhasedSource`` (handshake / idle / progress timeouts).
- ``refusal.py``   ``FrameRefused`` (reason codes, in-sync flag), ``StreamEnded``, ``PeerUnreachable``.
- ``receiver.py``  ``FrameReceiver``: job registration, replay windows, the per-connection frame loop.
- ``job_routes.py`` a job's route, counters and timeouts, and which errors are our own failure (pure).
- ``pool.py``      outgoing streams: one per destination, ordered whole frames, reconnect once, a timed-out
                   connect remembered for a while (queued frames fail at once).
- ``datapath.py``  ``DataPathServer`` / ``DataPathClient``: the direct TCP path (hello, connection caps).
- ``p2p_path.py``  ``P2PDataPath``: the same frames over hivemind P2P streams (fallback).
- ``compression.py`` ``placement.wire_compression``: the optional, inexact codecs (bf16, fp16, int8-ef).
- ``handoff.py``   connections a compnode daemon hands over to its job's sandbox worker, which then reads
                   its values itself.
"""

from fusionnet.wire.datapath import DataPathClient, DataPathServer, parse_address
from fusionnet.wire.frame_reader import read_frame
from fusionnet.wire.frames import ALLOWED_DTYPES, TensorFrame, encode_frame, write_frame
from fusionnet.wire.job_routes import NO_JOB, JobStats
from fusionnet.wire.refusal import FrameRefused, PeerUnreachable, StreamEnded

__all__ = [
    "ALLOWED_DTYPES",
    "NO_JOB",
    "DataPathClient",
    "DataPathServer",
    "FrameRefused",
    "JobStats",
    "P2PDataPath",
    "PeerUnreachable",
    "StreamEnded",
    "TensorFrame",
    "encode_frame",
    "parse_address",
    "read_frame",
    "write_frame",
]


def __getattr__(name: str) -> object:
    # P2PDataPath imports hivemind (~0.6 s); only pay for it when the fallback is used.
    if name == "P2PDataPath":
        from fusionnet.wire.p2p_path import P2PDataPath

        return P2PDataPath
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
