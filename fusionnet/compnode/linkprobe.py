"""Measuring the links between a job's compnodes (FusionAI eq. (1)'s remote R = alpha + beta * M).

When the broker asks (``probe_links``), a compnode times round trips to the compnodes its sub-DAG
sends activations to, over the very path the activations take (direct TCP, or the P2P fallback),
authenticated with the job's key like every other frame: it sends a ``ctrl`` frame named ``probe``
carrying M bytes, the peer answers at once with a one-byte ``echo`` frame, and the round trip is
``alpha_there + beta * M + alpha_back``. Several sizes, each a few times, the fastest round trip per
size (timeit's rule: the machine only ever adds delays), then ``fit_link`` on (M, round trip):
its slope is beta and half its intercept alpha, one direction's latency.

A peer may only probe within a job it shares with us (the data path already refuses anyone else),
and a probe larger than ``MAX_PROBE_BYTES`` is refused without an echo; an echo nobody waits for
is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import torch
from pydantic import ValidationError

from fusionnet.errors import JobError, WireError
from fusionnet.messages.base import first_error
from fusionnet.messages.compnode_rpc import MAX_PROBE_BYTES, ProbeSettings
from fusionnet.perfmodel.fitting import fit_link
from fusionnet.perfmodel.types import Link
from fusionnet.wire.frames import TensorFrame

log = logging.getLogger("fusionnet.compnode.linkprobe")

PROBE, ECHO = "probe", "echo"
DEFAULT_SIZES = (1, 64 << 10, 512 << 10, 2 << 20)  # bytes: latency-bound to bandwidth-bound
DEFAULT_REPEATS = 3
ECHO_TIMEOUT = 5.0

SendFrame = Callable[[int, TensorFrame], Awaitable[None]]


def check_probe_request(sizes: object, repeats: object) -> tuple[list[int], int]:
    """The sizes and repeat count of a ``probe_links`` request (defaults for None), or a ``JobError``
    saying what is wrong (the limits are ``messages.compnode_rpc.ProbeSettings``'s)."""
    try:
        settings = ProbeSettings.model_validate({"sizes": sizes, "repeats": repeats})
    except ValidationError as e:
        raise JobError(f"probe {first_error(e)}"[:300]) from None
    chosen = list(DEFAULT_SIZES) if settings.sizes is None else settings.sizes
    return chosen, DEFAULT_REPEATS if settings.repeats is None else settings.repeats


class LinkProber:
    """One job's probes on one compnode: answers the peers' probes and times its own."""

    def __init__(self, job_id: str, peer_id: str, subdag_of_peer: dict[str, int], send: SendFrame) -> None:
        self.job_id = job_id
        self.peer_id = peer_id
        self.subdag_of_peer = dict(subdag_of_peer)
        self.send = send
        self._seq = itertools.count(1)
        self._waiting: dict[tuple[int, int], asyncio.Future[float]] = {}
        self.refused = 0

    def _frame(self, name: str, seq: int, nbytes: int) -> TensorFrame:
        return TensorFrame(
            job_id=self.job_id,
            sender=self.peer_id,
            kind="ctrl",
            step=seq,
            microbatch=0,
            name=name,
            tensor=torch.zeros(nbytes, dtype=torch.uint8),
        )

    async def on_frame(self, frame: TensorFrame) -> None:
        """A ``ctrl`` frame of this job: answer a probe, or resolve the wait for an echo."""
        try:
            src = self.subdag_of_peer.get(frame.sender)
            if src is None:
                raise WireError(f"peer {frame.sender} holds no sub-DAG of this job")
            if frame.name == PROBE:
                nbytes = frame.tensor.numel() * frame.tensor.element_size()
                if nbytes > MAX_PROBE_BYTES:
                    raise WireError(f"probe of {nbytes} bytes exceeds {MAX_PROBE_BYTES}")
                await self.send(src, self._frame(ECHO, frame.step, 1))
            elif frame.name == ECHO:
                waiter = self._waiting.pop((src, frame.step), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(time.perf_counter())
            else:
                raise WireError(f"unknown control frame {frame.name!r}")
        except WireError as e:
            self.refused += 1
            log.warning(
                "job %s: refused control frame %r from %s: %s", self.job_id, frame.name, frame.sender, e
            )

    async def round_trip(self, dst: int, nbytes: int) -> float:
        """Seconds from sending ``nbytes`` to ``dst`` until its echo is back."""
        seq = next(self._seq)
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting[(dst, seq)] = waiter
        frame = self._frame(PROBE, seq, nbytes)
        try:
            started = time.perf_counter()
            await self.send(dst, frame)
            return await asyncio.wait_for(waiter, ECHO_TIMEOUT) - started
        except TimeoutError:
            why = f"job {self.job_id}: no echo from sub-DAG {dst} within {ECHO_TIMEOUT:.0f} s"
            raise JobError(why) from None
        finally:
            self._waiting.pop((dst, seq), None)

    async def measure(
        self, dst: int, sizes: Sequence[int], repeats: int
    ) -> tuple[Link, list[tuple[int, float]]]:
        """The link to ``dst``: ``alpha`` one direction's latency, ``beta`` seconds per byte. Sizes
        are visited in turn ``repeats`` times (a slow spell then spoils one round, not one size)."""
        await self.round_trip(dst, min(sizes))  # warm-up: connection set-up, buffers
        best: dict[int, float] = {}
        for _ in range(repeats):
            for nbytes in sizes:
                rtt = await self.round_trip(dst, nbytes)
                best[nbytes] = min(best.get(nbytes, float("inf")), rtt)
        samples = sorted(best.items())
        fitted = fit_link([(float(n), t) for n, t in samples])
        return Link(alpha=fitted.alpha / 2, beta=fitted.beta), samples
