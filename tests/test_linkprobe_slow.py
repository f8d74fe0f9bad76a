"""Link probes on slow links (audit x3): below ~3.4 Mbit/s the 2 MiB probe missed its 5 s echo timeout,
the whole fit was thrown away, the pair was never recorded and every later placement waited the broker's
20 s probe timeout again. The prober now stops growing the probe size when what it measured predicts the
next size would not fit, fits on the sizes that came back, and answers a pessimistic bound when even the
small ones do not; the broker keeps that bound like a measurement."""

from __future__ import annotations

import asyncio

import pytest

from fusionnet.broker.links import probe_placement
from fusionnet.compnode import linkprobe
from fusionnet.compnode.linkprobe import DEFAULT_SIZES, bound_link, predicted_round_trip
from fusionnet.errors import JobError
from fusionnet.perfmodel.types import Link
from fusionnet.planning.links import RETRY_FAILED_SECONDS, STALE_SECONDS, LinkBook, index_links
from tests.test_links import FakeClock, Wire

pytestmark = pytest.mark.timeout(60)


def test_a_slow_link_is_fitted_on_the_sizes_that_fit_its_timeout(monkeypatch) -> None:
    # 0.83 MB/s against a 2 s echo timeout: 2 Mbit/s against 5 s, about 2.5 times faster. The 2 MiB
    # probe would take 2.5 s: the old prober waited for it and threw the whole measurement away.
    monkeypatch.setattr(linkprobe, "ECHO_TIMEOUT", 2.0)
    wire = Wire(alpha=0.005, beta=1.2e-6)
    measured = asyncio.run(wire.a.measure(1, list(DEFAULT_SIZES), 2, budget=10.0))
    assert not measured.bound
    assert [n for n, _ in measured.samples] == [1, 64 << 10, 512 << 10]  # 2 MiB predicted too slow
    assert measured.link.beta == pytest.approx(1.2e-6, rel=0.3)
    assert all(n < 2 << 20 for _, _, name, n in wire.sent if name == "probe")  # never even sent


def test_when_even_the_small_sizes_time_out_the_answer_is_a_pessimistic_bound(monkeypatch) -> None:
    monkeypatch.setattr(linkprobe, "ECHO_TIMEOUT", 0.5)
    wire = Wire(alpha=0.005, beta=2e-5)  # 50 kB/s: a 64 KiB probe takes 1.3 s
    measured = asyncio.run(wire.a.measure(1, list(DEFAULT_SIZES), 3, budget=5.0))
    assert measured.bound and [n for n, _ in measured.samples] == [1]
    # at least as slow as the bound, and far slower than a loopback link
    assert 1e-6 < measured.link.beta <= 2e-5
    dead = Wire(alpha=1.0, beta=0.0)  # not even one byte echoes in time
    measured = asyncio.run(dead.a.measure(1, list(DEFAULT_SIZES), 3, budget=5.0))
    assert measured.bound and measured.samples == []
    assert measured.link.alpha >= 0.2 and measured.link.beta > 1e-6


def test_the_budget_caps_a_probe_request() -> None:
    wire = Wire(alpha=0.05, beta=0.0)  # 0.1 s a round trip
    loop = asyncio.new_event_loop()
    try:
        started = loop.time()
        measured = loop.run_until_complete(wire.a.measure(1, [1, 1024], 10, budget=0.6))
        assert loop.time() - started < 1.5  # not 21 round trips (2.1 s)
        assert not measured.bound and len(measured.samples) == 2
    finally:
        loop.close()


def test_predictions_and_bounds_are_arithmetic() -> None:
    assert predicted_round_trip([(1, 0.01)], 1 << 20) is None  # one size says nothing of bandwidth
    assert predicted_round_trip([(1, 0.0), (100, 1.0), (200, 2.0)], 400) == pytest.approx(4.0)
    bound = bound_link([(1, 0.01)], 1001, 5.01)
    assert bound.alpha == pytest.approx(0.005) and bound.beta == pytest.approx(5e-3)
    assert bound_link([], 1, 5.0) == Link(alpha=2.5, beta=5.0 / (64 << 10))
    with pytest.raises(JobError, match="two distinct sizes"):
        asyncio.run(Wire(0.0, 0.0).a.measure(1, [8, 8], 1))


# ---- the broker ----------------------------------------------------------------------------------
def test_the_broker_keeps_a_bound_and_prices_the_link_as_slow() -> None:
    clock = FakeClock()
    book = LinkBook(clock=clock)
    asked: list[str] = []

    async def call(peer: str, method: str, payload: dict, timeout: float) -> dict:
        asked.append(peer)
        return {"links": {"1": {"alpha": 0.002, "beta": 4e-6, "bound": True}}}

    assert asyncio.run(probe_placement("j", ["p0", "p1"], {0: {1}}, book, call))
    assert book.get("p0", "p1") == Link(0.002, 4e-6)
    assert index_links(["p0", "p1", "p2"], book.pairs())[(0, 2)] == Link(0.002, 4e-6)  # not loopback
    [doc] = book.describe(["p0", "p1"])
    assert doc["bound"] is True
    assert not asyncio.run(probe_placement("j", ["p0", "p1"], {0: {1}}, book, call))  # not re-probed
    assert asked == ["p0"]
    # A later bound can only make it slower; a measurement replaces it.
    book.record("p0", "p1", Link(0.001, 1e-6), bound=True)
    assert book.get("p0", "p1") == Link(0.002, 4e-6)
    book.record("p0", "p1", Link(0.003, 8e-6))
    assert book.get("p0", "p1") == Link(0.003, 8e-6) and not book.describe(["p0", "p1"])[0]["bound"]
    clock.now += STALE_SECONDS + 1
    assert book.needs_probe("p0", "p1")


def test_a_probe_without_an_answer_is_not_retried_on_every_placement() -> None:
    clock = FakeClock()
    book = LinkBook(clock=clock)
    asked: list[str] = []

    async def call(peer: str, method: str, payload: dict, timeout: float) -> dict:
        asked.append(peer)
        raise JobError(f"compnode {peer} (probe_links): no answer within 20 s")

    assert asyncio.run(probe_placement("j", ["p0", "p1"], {0: {1}}, book, call))
    assert not asyncio.run(probe_placement("j", ["p0", "p1"], {0: {1}}, book, call))
    assert asked == ["p0"] and book.get("p0", "p1") is None  # nothing priced from a failure
    clock.now += RETRY_FAILED_SECONDS + 1
    assert asyncio.run(probe_placement("j", ["p0", "p1"], {0: {1}}, book, call))
    assert asked == ["p0", "p0"]
