"""The links between compnodes as measured, kept per broker (FusionAI eq. (1): remote R = alpha + beta M).

After a placement is assigned, the broker asks every compnode that sends activations to time its links
to the receivers (``broker.links.probe_placement`` -> ``compnode.linkprobe``: round trips over the
job's own data path). ``LinkBook`` (pure data, no I/O) keeps the fitted alpha-beta per directed pair of
compnodes, blended with what earlier jobs measured (geometric means: one congested probe moves an
estimate only part of the way), and gives the planner the links of any pool of compnodes: a pair
measured in one direction only is assumed symmetric, and a pair never measured falls back to the
planner's default (loopback figures). Pairs it already knows are not probed again until
``STALE_SECONDS`` have passed, so a failover does not pay for probes it needs not.

A link too slow for its probes to fit is recorded as a bound (``bound=True``: at least that slow,
``compnode.linkprobe.bound_link``): a later bound can only make the estimate slower, a later
measurement replaces it. A pair whose probe failed outright (no answer from the compnode) is not probed
again for ``RETRY_FAILED_SECONDS``: each try costs the placement the broker's probe timeout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from fusionnet.perfmodel.types import Link

WEIGHT = 0.5  # share of a new measurement in the blended estimate
STALE_SECONDS = 600.0  # a link measured longer ago than this is probed again
RETRY_FAILED_SECONDS = 120.0  # a pair whose probe got no answer is not probed again sooner


@dataclass(frozen=True)
class MeasuredLink:
    link: Link
    measured_at: float  # the book's clock
    probes: int  # how many measurements the estimate blends
    bound: bool = False  # a lower bound on the link's slowness: its probes were too slow to fit


class LinkBook:
    """``on_change`` (optional) gets the probed links after every change (the broker's metrics)."""

    def __init__(
        self,
        weight: float = WEIGHT,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[dict[tuple[str, str], Link]], None] | None = None,
    ) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.clock = clock
        self.on_change = on_change
        self._links: dict[tuple[str, str], MeasuredLink] = {}
        self._failed: dict[tuple[str, str], float] = {}  # pair -> when its probe last failed (the clock)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.measured())

    def record(self, src: str, dst: str, link: Link, bound: bool = False) -> Link:
        """A new measurement of ``src -> dst`` (``bound``: a lower bound on its slowness); returns the
        estimate it gives."""
        old = self._links.get((src, dst))
        self._failed.pop((src, dst), None)
        if old is not None and bound:
            # At least that slow: never faster for it, and an estimate it does not contradict stays.
            merged = Link(alpha=max(old.link.alpha, link.alpha), beta=max(old.link.beta, link.beta))
            bound = old.bound or merged != old.link
            link = merged
        elif old is not None and not old.bound:
            w = self.weight
            link = Link(
                alpha=_blend(old.link.alpha, link.alpha, w),
                beta=_blend(old.link.beta, link.beta, w),
            )
        # (a measurement after a bound replaces it: the bound only said "slower than this")
        self._links[(src, dst)] = MeasuredLink(
            link, self.clock(), 1 if old is None else old.probes + 1, bound
        )
        self._changed()
        return link

    def probe_failed(self, src: str, dst: str) -> None:
        """The probe of ``src -> dst`` got no answer: not asked again for ``RETRY_FAILED_SECONDS``."""
        self._failed[(src, dst)] = self.clock()

    def get(self, src: str, dst: str) -> Link | None:
        """The ``src -> dst`` estimate, the reverse direction's when only that was measured, or None."""
        entry = self._links.get((src, dst)) or self._links.get((dst, src))
        return None if entry is None else entry.link

    def needs_probe(self, src: str, dst: str, *, fresh: bool = False) -> bool:
        """Whether ``src -> dst`` is worth a probe: never measured, measured too long ago, or, with
        ``fresh``, measured at all (the caller has reason to doubt the estimate) — unless a probe of it
        just got no answer."""
        now = self.clock()
        failed = self._failed.get((src, dst))
        if failed is not None and now - failed <= RETRY_FAILED_SECONDS:
            return False
        entry = self._links.get((src, dst))
        return fresh or entry is None or now - entry.measured_at > STALE_SECONDS

    def pairs(self) -> dict[tuple[str, str], Link]:
        """Every directed pair with an estimate (both directions of a pair measured one way)."""
        out = {(b, a): m.link for (a, b), m in self._links.items()}
        out.update({pair: m.link for pair, m in self._links.items()})
        return out

    def measured(self) -> dict[tuple[str, str], Link]:
        """The directed pairs actually probed (no symmetric stand-ins)."""
        return {pair: m.link for pair, m in self._links.items()}

    def forget(self, peer: str) -> None:
        for pair in [p for p in self._links if peer in p]:
            del self._links[pair]
        self._failed = {pair: t for pair, t in self._failed.items() if peer not in pair}
        self._changed()

    def keep_only(self, peers: set[str]) -> None:
        """Forgets every link that has an end outside ``peers`` (compnodes the broker no longer knows):
        a swarm whose compnodes come and go would otherwise hold, and export, pairs without bound."""
        gone = [pair for pair in self._links if not set(pair) <= peers]
        for pair in gone:
            del self._links[pair]
        self._failed = {pair: t for pair, t in self._failed.items() if set(pair) <= peers}
        if gone:
            self._changed()

    def describe(self, peers: Sequence[str]) -> list[dict[str, object]]:
        """The estimates between ``peers`` for ``plan.json``: from, to, alpha (s), bandwidth (B/s)."""
        out = []
        for a in peers:
            for b in peers:
                entry = self._links.get((a, b))
                if a != b and entry is not None:
                    out.append(
                        {
                            "from": a,
                            "to": b,
                            "alpha_seconds": entry.link.alpha,
                            "bandwidth_bytes_per_second": entry.link.bandwidth,
                            "probes": entry.probes,
                            "bound": entry.bound,  # at least this slow: its probes did not fit
                        }
                    )
        return out


def _blend(old: float, new: float, weight: float) -> float:
    if old <= 0 or new <= 0:
        return (1 - weight) * old + weight * new
    return math.exp((1 - weight) * math.log(old) + weight * math.log(new))


def index_links(
    peers: Iterable[str], links: Mapping[tuple[str, str], Link] | None
) -> dict[tuple[int, int], Link]:
    """Peer-keyed links as the planner's device-index keys for a pool listed as ``peers``.

    A pair never probed is priced like the slowest pair that was (``assumed_link``), not at loopback
    figures: on a swarm whose links are alike that is what a probe will find, and a re-plan priced with
    loopback for the unprobed pairs kept moving the job to pairs it had not probed yet, each found as
    slow as the last (issue 16). With nothing probed at all, the planner's default (loopback) stays."""
    if not links:
        return {}
    order = list(peers)
    assumed = assumed_link(links.values())
    # Two sub-DAGs on one compnode (interleaved) share no link: the planner's default link prices the pair
    # (loopback on the swarm, ``planner.make_swarm``), though their values never leave the process.
    return {
        (i, j): links.get((a, b), assumed)
        for i, a in enumerate(order)
        for j, b in enumerate(order)
        if i != j and a != b
    }


def assumed_link(measured: Iterable[Link]) -> Link:
    """The link assumed for an unprobed pair: the slowest measured one (least bandwidth, then most
    latency)."""
    return max(measured, key=lambda link: (link.beta, link.alpha))
