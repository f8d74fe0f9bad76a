"""A sandbox worker's values to its peers, sent by the worker itself over the direct data path.

Why: a value the worker handed its daemon crossed the worker-daemon socket (a copy into the kernel and
one out), woke the daemon's loop, and was then MACed and written to TCP by the daemon. On machines whose
cores the stages share, that relay was 14-18 % of a core per compnode and one more wake-up on every
activation's critical path. The worker holds what sending takes: its assignment names the peers' data
path addresses and carries the keys of its own links (``AssignRequest.key_of_link``), so it writes the
frame to its own pooled TCP connection, with the daemon's framing, MAC, encryption policy
(``placement.wire_encryption``) and sender id. Its sequence numbers live in a lane of their own
(``wire.replay.set_seq_lane``), so a receiver's replay window never confuses the two senders.

What the worker cannot send this way goes through its daemon as before (which falls back to P2P
streams): a peer without a data path address, or one to which TCP failed; after a failure every later
value to that peer does, so one sender's values still reach a receiver in order. Failures are shared
with the daemon (``tcp_down``): the worker starts with the peers its daemon found down, learns those it
finds later (``learn``), and reports its own with the value it hands over (``take_failure``), so a bad
address costs one connect timeout, not one per frame, job and process. The bytes and
frames it moved are handed to the daemon with the worker's next answer (``take_tally``), which counts
them in its metrics as its own sends (``fusionnet_data_bytes_total{path="tcp"}``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fusionnet.compnode.tcp_down import Down, DownPeers
from fusionnet.messages.compnode_rpc import AssignRequest
from fusionnet.wire.datapath import DataPathClient
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.refusal import PeerUnreachable

log = logging.getLogger("fusionnet.compnode.sandbox")


class DirectSender:
    def __init__(self, peer_id: str, job_id: str, down: Iterable[Down] = ()) -> None:
        # The job's id in each connection's hello: its receiver may hand it to the job's worker.
        self.client = DataPathClient(peer_id=peer_id, job_hello=job_id)
        self._request: AssignRequest | None = None  # the first chunk's: every chunk has the same peers
        self.down = DownPeers()  # peers TCP failed to: their values go through the daemon
        self.down.learn(down)  # those the daemon knew of when this worker started
        self._unreported: dict[int, str] = {}  # sub-DAG -> why TCP to it failed, for the daemon
        self._bytes = self._frames = 0

    def use(self, request: AssignRequest) -> None:
        """The job's peers and link keys, from its (first) assignment."""
        if self._request is None:  # without its payloads: the state slice must not live on here
            self._request = request.model_copy(update={"state": b"", "optim": None, "data": b"", "ir": b""})

    async def send(self, dst: int, frame: TensorFrame) -> bool:
        """``frame`` to sub-DAG ``dst``'s compnode over TCP; False when the daemon has to carry it."""
        request = self._request
        if request is None or not 0 <= dst < len(request.peers):
            return False
        peer = request.peers[dst]
        if not peer.data_address or self.down.is_down(peer.peer_id, peer.data_address):
            return False
        try:
            await self.client.send(
                peer.data_address, frame, request.key_of_link(dst), request.spec.wire_encryption
            )
        except PeerUnreachable as e:
            if self.down.mark(peer.peer_id, peer.data_address, str(e)):  # frames queued with it: once
                log.warning(
                    "job %s: TCP to %s failed (%s); the daemon carries its values from now on",
                    request.job_id,
                    peer.peer_id,
                    e,
                )
                self._unreported[dst] = str(e)
            return False
        self._bytes += frame.tensor.numel() * frame.tensor.element_size()
        self._frames += 1
        return True

    def learn(self, down: Down) -> None:
        """A peer the daemon found down: its values go through the daemon, no connect tried."""
        self.down.learn([down])

    def take_failure(self, dst: int) -> str | None:
        """Why TCP to sub-DAG ``dst`` failed, once, for the daemon (None: nothing new)."""
        return self._unreported.pop(dst, None)

    def take_tally(self) -> list[int] | None:
        """``[bytes, frames]`` sent since the last call (None: nothing)."""
        if not self._frames:
            return None
        tally = [self._bytes, self._frames]
        self._bytes = self._frames = 0
        return tally

    async def close(self) -> None:
        await self.client.close()
