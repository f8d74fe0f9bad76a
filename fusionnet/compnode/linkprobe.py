"""Measuring the links between a job's compnodes (FusionAI eq. (1)'s remote R = alpha + beta * M).

When the broker asks (``probe_links``), a compnode times round trips to the compnodes its sub-DAG
sends activations to, over the very path the activations take (direct TCP, or the P2P fallback),
authenticated with the job's key like every other frame: it sends a ``ctrl`` frame named ``probe``
carrying M bytes, the peer answers at once with a one-byte ``echo`` frame, and the round trip is
``alpha_there + beta * M + alpha_back``. Several sizes, each a few times, the fastest round trip per
size (timeit's rule: the machine only ever adds delays), then ``fit_link`` on (M, round trip):
its slope is beta and half its intercept alpha, one direction's latency.

Slow links (issue: every probe failed below ~3.4 Mbit/s, so the pair was never recorded and every
placement paid the broker's 20 s probe timeout again): sizes are visited smallest first, and a size
is skipped once what the smaller ones measured predicts its round trip would not fit in
``ECHO_TIMEOUT / HEADROOM`` or in what is left of the request's ``budget``. A round trip that gets no
echo ends the probe (its bytes still occupy the link: later probes would time its queue, not the
link); the fit then uses the sizes that did come back, two at least. With fewer, the answer is a
pessimistic bound, flagged ``bound``: the timeout that expired says the link is at least that slow,
which the planner prices as slow rather than as the loopback it assumes for a pair never measured,
and which the broker keeps like a measurement (no re-probe on every placement).

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
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from fusionnet.errors import JobError, PlanError, WireError
from fusionnet.messages.base import first_error
from fusionnet.messages.compnode_rpc import MAX_PROBE_BYTES, ProbeSettings
from fusionnet.perfmodel.fitting import fit_link
from fusionnet.perfmodel.types import Link
from fusionnet.wire.frames import TensorFrame

log = logging.getLogger("fusionnet.compnode.linkprobe")

PROBE, ECHO = "probe", "echo"
DEFAULT_SIZES = (1, 64 << 10, 512 << 10, 2 << 20)  # bytes: latency-bound to bandwidth-bound
DEFAULT_REPEATS = 3
ECHO_TIMEOUT = 5.0  # seconds one round trip may take
HEADROOM = 2.0  # a size is probed when its predicted round trip is within 1/HEADROOM of its timeout
# Seconds all of one ``probe_links`` request's probes may take: inside the broker's 20 s
# (``broker.links.PROBE_TIMEOUT``), with room for the call itself.
PROBE_BUDGET = 14.0
BOUND_FLOOR_BYTES = 64 << 10  # a bound's beta when not even the smallest probe came back (``bound_link``)

SendFrame = Callable[[int, TensorFrame], Awaitable[None]]


class NoEcho(JobError):
    """A probe's echo did not come back in time."""

    def __init__(self, message: str, waited: float) -> None:
        super().__init__(message)
        self.waited = waited


@dataclass(frozen=True)
class Measurement:
    link: Link  # one direction: ``alpha`` its latency (s), ``beta`` s/byte
    samples: list[tuple[int, float]]  # the fastest round trip per size that came back
    bound: bool = False  # too few sizes came back to fit: ``link`` is a lower bound on its slowness


def predicted_round_trip(samples: Sequence[tuple[int, float]], nbytes: int) -> float | None:
    """The round trip of ``nbytes`` that ``samples`` (size, seconds) predict; None below two sizes.
    From the two largest sizes measured: the bandwidth-bound end, where the next size lies."""
    if len(samples) < 2:
        return None
    (n1, t1), (n2, t2) = sorted(samples)[-2:]
    slope = max(t2 - t1, 0.0) / (n2 - n1)
    return t2 + slope * max(nbytes - n2, 0)


def fitted_link(samples: Sequence[tuple[int, float]]) -> Link:
    """One direction's link from round trips at two sizes or more: ``fit_link``'s slope is beta and half
    its intercept alpha. Where noise on few sizes makes the intercept negative, the line through the two
    largest sizes gives beta, and the smallest size's remaining time alpha."""
    try:
        fitted = fit_link([(float(n), t) for n, t in samples])
        return Link(alpha=fitted.alpha / 2, beta=fitted.beta)
    except (ValueError, PlanError):
        (n1, t1), (n2, t2) = sorted(samples)[-2:]
        beta = max(t2 - t1, 0.0) / (n2 - n1)
        n0, t0 = min(samples)
        return Link(alpha=max(t0 - beta * n0, 0.0) / 2, beta=beta)


def bound_link(samples: Sequence[tuple[int, float]], failed: int, waited: float) -> Link:
    """A lower bound on the slowness of a link on which a probe of ``failed`` bytes got no echo within
    ``waited`` s, after ``samples`` (fewer than two sizes) came back. Its round trip exceeded ``waited``,
    so ``beta >= (waited - t) / (failed - n)`` from the largest size ``n`` that came back in ``t``. With
    none back, even the latency is unknown: ``alpha`` is taken as half the wait, and ``beta`` as if a
    ``BOUND_FLOOR_BYTES`` probe had taken it all (a link that cannot echo one byte in seconds is unusable
    for bulk data; the bound only has to rank it below every link that answered)."""
    if samples:
        n, t = max(samples)
        beta = max(waited - t, 0.0) / max(failed - n, 1)
        return Link(alpha=t / 2, beta=beta)
    return Link(alpha=waited / 2, beta=waited / max(failed, BOUND_FLOOR_BYTES))


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

    async def round_trip(
        self, dst: int, nbytes: int, timeout: float = ECHO_TIMEOUT, *, send_counts: bool = True
    ) -> float:
        """Seconds from sending ``nbytes`` to ``dst`` until its echo is back; ``NoEcho`` after
        ``timeout`` s. The send counts against it (on a slow link it is most of the wait) unless
        ``send_counts`` is False: the warm-up's send may set up a connection, or find that TCP does not
        connect and fall back to P2P (a connect timeout, 10 s), which must not be cut short."""
        seq = next(self._seq)
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiting[(dst, seq)] = waiter
        frame = self._frame(PROBE, seq, nbytes)
        started = time.perf_counter()
        try:
            if not send_counts:
                await self.send(dst, frame)
            async with asyncio.timeout(timeout):
                if send_counts:
                    await self.send(dst, frame)
                return await waiter - started
        except TimeoutError:
            why = f"job {self.job_id}: no echo from sub-DAG {dst} for {nbytes} bytes within {timeout:.1f} s"
            raise NoEcho(why, time.perf_counter() - started) from None
        finally:
            self._waiting.pop((dst, seq), None)

    async def measure(
        self, dst: int, sizes: Sequence[int], repeats: int, budget: float = PROBE_BUDGET
    ) -> Measurement:
        """The link to ``dst``, within ``budget`` seconds. Sizes are visited smallest first, in turn,
        ``repeats`` times (a slow spell then spoils one round, not one size); a size the link is too
        slow for is left out, and an echo that does not come back ends the probe (module docstring)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        order = sorted(set(sizes))
        best: dict[int, float] = {}

        def timeout() -> float:  # one round trip's: what is left of the budget, at most ECHO_TIMEOUT
            return max(min(ECHO_TIMEOUT, deadline - loop.time()), 0.0)

        trying = order[0]
        try:
            # warm-up: connection set-up, buffers (what it took is not a sample)
            await self.round_trip(dst, trying, ECHO_TIMEOUT, send_counts=False)
            for _ in range(repeats):
                for trying in order:
                    predicted = predicted_round_trip(list(best.items()), trying)
                    if predicted is not None and predicted * HEADROOM > timeout():
                        order = [n for n in order if n < trying]  # no larger sizes in later rounds either
                        break
                    rtt = await self.round_trip(dst, trying, timeout())
                    best[trying] = min(best.get(trying, float("inf")), rtt)
                if not timeout():
                    break
        except NoEcho as e:
            log.info("job %s: link probe to sub-DAG %d: %s", self.job_id, dst, e)
            samples = sorted(best.items())
            if len(samples) < 2:
                return Measurement(bound_link(samples, trying, e.waited), samples, bound=True)
        samples = sorted(best.items())
        if len(samples) < 2:
            raise JobError(f"job {self.job_id}: a link probe needs two distinct sizes, got {sizes!r}"[:300])
        return Measurement(fitted_link(samples), samples)
