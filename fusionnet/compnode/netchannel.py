"""The executor's ``Channel`` over the network: values travel as authenticated tensor frames.

A value (a tensor, or a tuple/list of tensors and small constants, e.g. the parts of a ``split``)
whose tensors total at most ``valuepack.PACK_MAX`` bytes travels as one frame (name ``node``)
holding the tensors and their structure (``valuepack.py``). A larger one is sent as one frame per
tensor (name ``node/i``, no copy) followed by one structure frame (name ``node``) whose payload is
a msgpack description with the tensors replaced by their index. Frames from one sender travel in
order over one connection, so when the structure arrives its tensors are there.

With ``placement.wire_compression`` (``fusionnet.wire.compression``), floating-point tensors of
activations and gradients are compressed before they are sent and restored to their dtype on
arrival; the codec of each tensor travels in the structure.

Several values for one receiver from one FP (or BP) go as one packed frame named ``a+b+...``
(``send_values``) when their tensors fit ``PACK_MAX``: each frame costs a fixed amount on both ends
(the worker-daemon hop, a MAC, a write, the receiver's wake-up), and a decoder block's stage sends its
receiver several small values per micro-batch (hidden states, positions, cache slots). The receiver
checks every value of such a frame before it delivers any.

Every received value is checked against the IR's description of that node (dtype, rank, and every
dimension except the micro-batch one; the IR is traced in float32, so under mixed precision a float32
value may also arrive in the job's compute dtype): a peer that sends a wrongly shaped tensor is refused and
logged, and the executor keeps waiting for a correct value (a retry, or a replacement's).

A value lost on its way in to a failure of this compnode (out of memory reading or decoding its frame,
``wire.job_routes.is_local_failure``) is not waited for: its sender will not send it again, so
``fail_receives`` fails every receive of the job, then and later, and the step ends with that error.

Tensors that wait for their structure frame are bounded: a frame for a step the mailbox no longer
(or not yet) expects is refused, at most ``max_pending_bytes`` may wait in all, and waiting tensors
of past steps are dropped when the step moves on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgpack
import torch

from fusionnet.compnode.value_frames import (
    ROUTE_MAX,
    decode_structure,
    encode_structure,
    is_number,
    route_prefix,
    split_route,
)
from fusionnet.compnode.valuepack import PACK_MAX, is_packed, pack_value, unpack_value
from fusionnet.dag.channel import Channel, Mailbox, MessageKey
from fusionnet.errors import ExecutionError, JobError, WireError
from fusionnet.wire.compression import Compressor, decompress
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.header import MAX_NAME_LEN
from fusionnet.wire.job_routes import is_local_failure

log = logging.getLogger("fusionnet.compnode.netchannel")
BUNDLE_SEP = "+"  # a frame named "a+b" carries the values of nodes a and b (FX names hold no "+")
MAX_BUNDLE = 256


MAX_STRUCTURE_BYTES = 1 << 20
DEFAULT_MAX_PENDING_BYTES = 4 << 30  # tensors of unfinished values, all sources and steps together
_Slot = tuple[int, str, int, int, str]  # (source sub-DAG, kind, step, micro-batch, node)


class NetChannel(Channel):
    """One sub-DAG's channel on a compnode.

    ``send_frame(dst_subdag, frame)`` is the transport (direct TCP path, or the P2P fallback);
    ``validate(src, key, value)`` checks a received value before it may reach the executor.
    """

    def __init__(
        self,
        *,
        job_id: str,
        peer_id: str,
        subdag_of_peer: Mapping[str, int],
        send_frame: Callable[[int, TensorFrame], Awaitable[None]],
        validate: Callable[[int, MessageKey, Any], None] | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        compression: str = "none",
        routes: tuple[int, Sequence[str]] | None = None,
    ) -> None:
        """``routes``: (our sub-DAG, the peer id of every sub-DAG) for a job whose compnodes hold several
        sub-DAGs: frames then name their source and destination sub-DAGs (``route_prefix``), checked
        against the sender's peer, and ``subdag_of_peer`` is not used."""
        self.job_id = job_id
        self.peer_id = peer_id
        self.subdag_of_peer = dict(subdag_of_peer)
        self.routes = None if routes is None else (routes[0], list(routes[1]))
        self.send_frame = send_frame
        self.validate = validate
        self.mailbox = Mailbox()
        self._pending: dict[_Slot, dict[int, torch.Tensor]] = {}
        self._pending_bytes = 0
        self._pending_floor: int | None = None
        self.max_pending_bytes = max_pending_bytes
        self.refused = 0
        self.compressor = Compressor(compression)
        self.bytes_sent = 0  # tensor bytes handed to the transport (after compression)

    def _frame(self, key: MessageKey, name: str, tensor: torch.Tensor, dst: int) -> TensorFrame:
        kind, step, mb, _ = key
        self.bytes_sent += _nbytes(tensor)
        if self.routes is not None:
            name = route_prefix(self.routes[0], dst) + name
        return TensorFrame(
            job_id=self.job_id,
            sender=self.peer_id,
            kind=kind,
            step=step,
            microbatch=mb,
            name=name,
            tensor=tensor,
        )

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        kind, _, mb, node = key
        tensors: list[torch.Tensor] = []
        doc = encode_structure(value, tensors)
        codecs: list[dict[str, Any] | None] = []
        for i, t in enumerate(tensors):  # the edge of error feedback: receiver, value, tensor, micro-batch
            tensors[i], info = self.compressor.compress((dst, kind, node, i, mb), t)
            codecs.append(info)
        if sum(_nbytes(t) for t in tensors) <= PACK_MAX:
            await self.send_frame(dst, self._frame(key, node, pack_value(doc, tensors, codecs), dst))
            return
        for i, t in enumerate(tensors):
            await self.send_frame(dst, self._frame(key, f"{node}/{i}", t, dst))
        structure = {"tree": doc, "count": len(tensors), "codecs": codecs}
        payload = torch.frombuffer(bytearray(msgpack.packb(structure)), dtype=torch.uint8)
        await self.send_frame(dst, self._frame(key, node, payload, dst))

    async def send_values(self, dst: int, items: Sequence[tuple[MessageKey, Any]]) -> None:
        """Values of one (kind, step, micro-batch) to ``dst`` in one packed frame named ``a+b+...``
        when they fit (``PACK_MAX`` tensor bytes, the frame name's bound); otherwise one send each."""
        names = [key[3] for key, _ in items]
        bundle = BUNDLE_SEP.join(names)
        tensors: list[torch.Tensor] = []
        docs, spans = [], []
        for (_, _, _, node), value in items:
            start = len(tensors)
            docs.append(encode_structure(value, tensors))
            spans.append((node, start, len(tensors)))
        if (
            not 2 <= len(items) <= MAX_BUNDLE
            or len({key[:3] for key, _ in items}) != 1
            or len(set(names)) != len(names)
            or any(not n or BUNDLE_SEP in n or "/" in n for n in names)
            or len(bundle) > MAX_NAME_LEN - ROUTE_MAX
            or sum(_nbytes(t) for t in tensors) > PACK_MAX
        ):
            for key, value in items:  # decided before compressing: error feedback advances once
                await self.send(dst, key, value)
            return
        kind, _, mb, _ = items[0][0]
        codecs = []
        for node, start, stop in spans:  # error feedback per value and tensor, as ``send`` keys it
            for i in range(start, stop):
                tensors[i], info = self.compressor.compress((dst, kind, node, i - start, mb), tensors[i])
                codecs.append(info)
        tree = {"$seq": docs, "tuple": True}
        await self.send_frame(dst, self._frame(items[0][0], bundle, pack_value(tree, tensors, codecs), dst))

    async def recv(self, src: int, key: MessageKey) -> Any:
        return await self.mailbox.take(src, key)

    def arrived(self, src: int, key: MessageKey) -> bool:
        return self.mailbox.arrived(src, key)

    def on_frame(self, frame: TensorFrame) -> None:
        """Called by the transport for every authenticated frame of this job."""
        try:
            if self.routes is not None:
                src, plain = self._unroute(frame)
                self._on_frame(plain, src)
                return
            self._on_frame(frame)
        except Exception as e:  # whatever a member's bytes make a decoder raise is a refusal, not a crash
            if is_local_failure(e):  # but our memory running out on a good frame loses its value
                self.fail_receives(frame.sender, e)
                return
            if not isinstance(e, WireError):
                e = WireError(f"malformed frame ({type(e).__name__}: {str(e)[:120]})")
            self.refused += 1
            log.warning(
                "job %s: refused %s frame %r from %s: %s",
                self.job_id,
                frame.kind,
                frame.name,
                frame.sender,
                e,
            )
            self._fail_awaited(frame, e)

    def fail_receives(self, sender: str | None, error: BaseException) -> None:
        """A frame of this job from ``sender`` (None: unknown) was lost to ``error``, a failure of this
        compnode (``FrameReceiver.on_local_failure``: out of memory while reading it). Its sender will not
        send it again, and which value it carried is unknown (its header went with it), so every receive,
        waited for now or asked for later, fails with the reason: the step ends with that error and the
        broker fails the job (the compnode's worker names its ``--sandbox-memory-gb`` budget) instead of
        waiting for a value that never comes until the submitter's timeout."""
        # Tensors parked for a structure frame can no longer make a value: free them (memory is short).
        self._pending.clear()
        self._pending_bytes = 0
        if self.mailbox.failed is not None:  # failing already (released): the first reason stands
            return
        what = "ran out of memory" if is_local_failure(error) else "failed"
        why = (
            f"job {self.job_id}: compnode {self.peer_id} {what} while receiving a value from "
            f"{self._who(sender)}: {type(error).__name__}: {str(error)[:300]}"
        )
        log.error("%s", why)
        self.mailbox.fail_all(ExecutionError(why))

    def _who(self, sender: str | None) -> str:
        """``sender`` and the sub-DAG(s) of this job it holds, for an error message."""
        if sender is None:
            return "a peer"
        if self.routes is None:
            held = [self.subdag_of_peer[sender]] if sender in self.subdag_of_peer else []
        else:
            held = [i for i, peer in enumerate(self.routes[1]) if peer == sender and i != self.routes[0]]
        if not held:
            return sender
        return f"{sender} (sub-DAG {', '.join(map(str, held))})"

    def _unroute(self, frame: TensorFrame) -> tuple[int, TensorFrame]:
        """A routed frame's source sub-DAG and the frame under its plain name: the route must be from a
        sub-DAG of the sending compnode to this channel's own."""
        assert self.routes is not None
        ours, peers = self.routes
        src, dst, rest = split_route(frame.name)
        if dst != ours:
            raise WireError(f"frame {frame.name[:80]!r} is for sub-DAG {dst}, not {ours}")
        if src == ours:
            raise WireError(f"frame {frame.name[:80]!r} claims to come from sub-DAG {ours} itself")
        if not 0 <= src < len(peers) or peers[src] != frame.sender:
            who = f"sub-DAG {src} is not held by its sender {frame.sender}"
            raise WireError(f"frame {frame.name[:80]!r}: {who}")
        return src, replace(frame, name=rest)

    def _sender(self, frame: TensorFrame) -> int | None:
        if self.routes is None:
            return self.subdag_of_peer.get(frame.sender)
        try:
            return self._unroute(frame)[0]
        except WireError:
            return None

    def _fail_awaited(self, frame: TensorFrame, error: WireError) -> None:
        """A member's frame for a value this step still awaits was refused: the value can never come, so
        its step fails now with the reason instead of waiting for the broker's timeout."""
        src = self._sender(frame)
        if src is None or frame.kind not in ("act", "grad"):
            return  # not this job's value: dropping it loses nothing
        if self.routes is not None:
            frame = self._unroute(frame)[1]
        why = f"job {self.job_id}: refused a frame from sub-DAG {src}: {error}"
        for node in frame.name.partition("/")[0].split(BUNDLE_SEP)[:MAX_BUNDLE]:
            key: MessageKey = (frame.kind, frame.step, frame.microbatch, node)
            if self.mailbox.expects(key):  # else of a step nobody takes
                self.mailbox.refuse(src, key, JobError(why))

    def _on_frame(self, frame: TensorFrame, src: int | None = None) -> None:
        if src is None:
            src = self.subdag_of_peer.get(frame.sender)
        if src is None:
            raise WireError(f"peer {frame.sender} holds no sub-DAG of this job")
        if frame.kind not in ("act", "grad"):
            raise WireError(f"unexpected frame kind {frame.kind!r}")
        node, sep, index = frame.name.partition("/")
        slot = (src, frame.kind, frame.step, frame.microbatch, node)
        self._drop_stale_pending()
        if not self.mailbox.expects((frame.kind, frame.step, frame.microbatch, node)):
            raise WireError(f"step {frame.step} is not expected now (current {self.mailbox.floor})")
        if BUNDLE_SEP in node:
            self._on_bundle(src, frame, node.split(BUNDLE_SEP))
            return
        if sep:
            if not is_number(index) or int(index) > 4096:
                raise WireError(f"bad tensor index in frame name {frame.name!r}")
            self._park(slot, int(index), frame.tensor)
            return
        if is_packed(frame.tensor):
            if frame.tensor.numel() > PACK_MAX + 2 * MAX_STRUCTURE_BYTES:
                raise WireError(f"packed value of {frame.tensor.numel()} bytes")
            tree, tensors, codecs = unpack_value(frame.tensor)
        else:
            tree, tensors, codecs = self._unpacked(slot, frame.tensor)
        tensors = {i: decompress(t, codecs[i]) for i, t in tensors.items()}
        value = decode_structure(tree, tensors)
        key: MessageKey = (frame.kind, frame.step, frame.microbatch, node)
        if self.validate is not None:
            self.validate(src, key, value)
        self.mailbox.deliver(src, key, value)

    def _on_bundle(self, src: int, frame: TensorFrame, names: list[str]) -> None:
        """A packed frame of several values (``send_values``): each is checked, then all delivered."""
        if not 2 <= len(names) <= MAX_BUNDLE or len(set(names)) != len(names) or not all(names):
            raise WireError(f"frame {frame.name[:80]!r} does not name 2..{MAX_BUNDLE} distinct values")
        if "/" in frame.name or not is_packed(frame.tensor):
            raise WireError(f"frame {frame.name[:80]!r}: several values travel in one packed frame only")
        if frame.tensor.numel() > PACK_MAX + 2 * MAX_STRUCTURE_BYTES:
            raise WireError(f"packed values of {frame.tensor.numel()} bytes")
        tree, tensors, codecs = unpack_value(frame.tensor)
        tensors = {i: decompress(t, codecs[i]) for i, t in tensors.items()}
        values = decode_structure(tree, tensors)
        if not isinstance(values, tuple) or len(values) != len(names):
            raise WireError(f"frame {frame.name[:80]!r} holds no value per name")
        keys: list[MessageKey] = [(frame.kind, frame.step, frame.microbatch, n) for n in names]
        for key, value in zip(keys, values):
            if self.validate is not None:
                self.validate(src, key, value)
        for key, value in zip(keys, values):
            self.mailbox.deliver(src, key, value)

    def _unpacked(self, slot: _Slot, payload: torch.Tensor) -> tuple[Any, dict[int, torch.Tensor], list[Any]]:
        """The structure of a value whose tensors came in frames of their own (parked by ``_park``)."""
        if payload.dtype != torch.uint8 or payload.numel() > MAX_STRUCTURE_BYTES:
            raise WireError("structure frame must be uint8 bytes under 1 MiB")
        tensors = self._pending.pop(slot, {})
        self._pending_bytes -= sum(_nbytes(t) for t in tensors.values())
        try:
            doc = msgpack.unpackb(payload.numpy().tobytes(), raw=False, strict_map_key=True)
        except Exception as e:
            raise WireError(f"structure frame is not msgpack: {type(e).__name__}") from None
        if (
            not isinstance(doc, dict)
            or set(doc) != {"tree", "count", "codecs"}
            or doc["count"] != len(tensors)
        ):
            raise WireError(
                f"structure frame announces {doc.get('count') if isinstance(doc, dict) else '?'} "
                f"tensors, {len(tensors)} arrived"
            )
        codecs = doc["codecs"]
        if set(tensors) != set(range(len(tensors))):
            raise WireError(f"tensor frames {sorted(tensors)[:8]} are not numbered 0..{len(tensors) - 1}")
        if not isinstance(codecs, list) or len(codecs) != len(tensors):
            raise WireError("structure frame codecs must list one entry per tensor")
        return doc["tree"], tensors, codecs

    def _park(self, slot: _Slot, index: int, tensor: torch.Tensor) -> None:
        parts = self._pending.setdefault(slot, {})
        size = _nbytes(tensor) - (_nbytes(parts[index]) if index in parts else 0)
        if self._pending_bytes + size > self.max_pending_bytes:
            if not parts:
                del self._pending[slot]
            raise WireError(
                f"{self._pending_bytes} bytes already wait for their structure frames; "
                f"{_nbytes(tensor)} more would pass the {self.max_pending_bytes} byte limit"
            )
        parts[index] = tensor
        self._pending_bytes += size

    def _drop_stale_pending(self) -> None:
        """Frees tensors of past steps once the mailbox has moved on (their values can never complete)."""
        floor = self.mailbox.floor
        if floor is None or floor == self._pending_floor:
            return
        self._pending_floor = floor
        for slot in [s for s in self._pending if s[2] < floor]:
            self._pending_bytes -= sum(_nbytes(t) for t in self._pending.pop(slot).values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
