"""Links between compnodes: the compnode's prober (round trips over a job's data path, fitted to
alpha + beta * M; refusing what it must), the broker's ``LinkBook`` and what the planner does with
measured links."""

from __future__ import annotations

import asyncio

import pytest

from fusionnet.broker.links import parse_probe_reply, probe_placement
from fusionnet.compnode.linkprobe import MAX_PROBE_BYTES, LinkProber, check_probe_request
from fusionnet.errors import JobError
from fusionnet.perfmodel.types import Link
from fusionnet.planning.links import LinkBook, assumed_link, index_links
from fusionnet.planning.placement import consider_growth, plan_placement, predicted_step
from fusionnet.wire.frames import TensorFrame
from tests.planning_support import cand

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- the broker's book ---------------------------------------------------------------------------
def test_book_blends_measurements_and_assumes_symmetry_for_the_unmeasured_direction() -> None:
    clock = FakeClock()
    book = LinkBook(weight=0.5, clock=clock)
    assert book.get("a", "b") is None and book.needs_probe("a", "b")
    book.record("a", "b", Link(alpha=100e-6, beta=1e-9))
    assert book.get("a", "b") == Link(alpha=100e-6, beta=1e-9)
    assert book.get("b", "a") == Link(alpha=100e-6, beta=1e-9)  # reverse direction: assumed symmetric
    blended = book.record("a", "b", Link(alpha=400e-6, beta=4e-9))
    assert blended.alpha == pytest.approx(200e-6) and blended.beta == pytest.approx(2e-9)  # geometric
    assert not book.needs_probe("a", "b")
    clock.now = 10_000.0
    assert book.needs_probe("a", "b")  # stale: probed again
    assert book.pairs() == {("a", "b"): blended, ("b", "a"): blended}
    [doc] = book.describe(["a", "b"])
    assert doc["from"] == "a" and doc["probes"] == 2
    assert doc["bandwidth_bytes_per_second"] == pytest.approx(5e8)
    book.forget("b")
    assert book.pairs() == {}


def test_book_reports_every_change_of_the_probed_links() -> None:
    seen: list[dict] = []
    book = LinkBook(on_change=seen.append)
    book.record("a", "b", Link(1e-4, 1e-9))
    book.record("b", "c", Link(2e-4, 1e-9))
    assert seen[-1] == {("a", "b"): Link(1e-4, 1e-9), ("b", "c"): Link(2e-4, 1e-9)}  # no symmetric stand-ins
    book.forget("a")
    assert seen[-1] == {("b", "c"): Link(2e-4, 1e-9)} and len(seen) == 3


def test_links_of_compnodes_the_broker_forgot_are_forgotten_too() -> None:
    """Exported as gauges per (src, dst): kept for every compnode ever probed, a swarm whose compnodes
    come and go grew its series without bound."""
    seen: list[dict] = []
    book = LinkBook(on_change=seen.append)
    book.record("a", "b", Link(1e-4, 1e-9))
    book.record("b", "c", Link(2e-4, 1e-9))
    book.record("c", "a", Link(3e-4, 1e-9))
    changes = len(seen)
    book.keep_only({"a", "b", "c"})
    assert len(seen) == changes  # nothing gone, nothing re-exported
    book.keep_only({"a", "b"})
    assert seen[-1] == {("a", "b"): Link(1e-4, 1e-9)} and book.measured() == {("a", "b"): Link(1e-4, 1e-9)}


def test_probe_replies_are_validated_before_they_reach_the_planner() -> None:
    good = {"alpha": 1e-4, "beta": 1e-9, "round_trips": [[1, 2e-4]]}
    reply = {"links": {"1": good, "2": {"alpha": -1, "beta": 0}, "x": good, "3": {"alpha": float("nan")}}}
    assert parse_probe_reply(reply) == {1: Link(1e-4, 1e-9)}
    assert parse_probe_reply("garbage") == {} and parse_probe_reply({"links": [1]}) == {}
    known = {("a", "c"): Link(1, 0), ("x", "a"): Link(2, 0)}
    # unprobed pairs are priced like the slowest probed link, not at loopback figures
    indexed = index_links(["a", "b", "c"], known)
    assert indexed[(0, 2)] == Link(1, 0) and len(indexed) == 6
    assert all(link == Link(2, 0) for pair, link in indexed.items() if pair != (0, 2))
    assert assumed_link([Link(1e-4, 1e-9), Link(5e-4, 8e-8), Link(1e-3, 8e-8)]) == Link(1e-3, 8e-8)
    assert index_links(["a", "b"], {}) == {}  # nothing probed: the planner's loopback default


def test_probe_placement_asks_only_for_links_it_lacks_and_survives_a_failed_compnode() -> None:
    book = LinkBook()
    book.record("p0", "p1", Link(1e-4, 1e-9))
    asked: list[tuple[str, list[int]]] = []

    async def call(peer: str, method: str, payload: dict, timeout: float) -> dict:
        assert method == "probe_links" and payload["job_id"] == "j"
        asked.append((peer, payload["to"]))
        if peer == "p2":
            raise JobError("compnode p2 (probe_links): gone")
        return {"links": {str(t): {"alpha": 2e-4, "beta": 2e-9} for t in payload["to"]}}

    consumers = {0: {1, 2}, 1: {2}, 2: {0}}
    probed = asyncio.run(probe_placement("j", ["p0", "p1", "p2"], consumers, book, call))
    assert probed
    assert asked == [("p0", [2]), ("p1", [2]), ("p2", [0])]  # p0 -> p1 was known already
    assert book.get("p0", "p2") == Link(2e-4, 2e-9) and book.get("p1", "p2") == Link(2e-4, 2e-9)
    assert not asyncio.run(probe_placement("j", ["p0", "p1"], {0: {1}}, book, call))  # nothing new


# ---- the planner -----------------------------------------------------------------------------------
def test_a_measured_slow_link_makes_the_model_predict_slower_and_refuse_to_grow(gpt) -> None:
    alone = [cand("a", 1e11)]
    current = plan_placement(gpt, alone)
    pair = [cand("a", 1e11), cand("b", 1e11)]
    fast = consider_growth(gpt, current, pair, 0.0)
    assert fast is not None and fast.adopt  # loopback-like default links: two nodes pipeline faster
    slow = {("a", "b"): Link(alpha=0.5, beta=1e-6), ("b", "a"): Link(alpha=0.5, beta=1e-6)}
    grown = consider_growth(gpt, current, pair, 0.0, slow)
    assert grown is not None and not grown.adopt  # half a second a message: not worth it
    two = plan_placement(gpt, pair)
    assert predicted_step(gpt, two, pair, slow) > 10 * predicted_step(gpt, two, pair)


# ---- the compnode's prober --------------------------------------------------------------------------
class Wire:
    """Two probers joined by a simulated link: ``alpha + beta * bytes`` seconds per frame."""

    def __init__(self, alpha: float, beta: float) -> None:
        self.alpha, self.beta = alpha, beta
        self.sent: list[tuple[str, int, str, int]] = []
        self.pending: set[asyncio.Task] = set()  # deliveries under way (kept referenced)
        self.a = LinkProber("job", "A", {"B": 1}, self._sender("A"))
        self.b = LinkProber("job", "B", {"A": 0}, self._sender("B"))

    def _sender(self, me: str):
        async def send(dst: int, frame: TensorFrame) -> None:
            nbytes = frame.tensor.numel()
            self.sent.append((me, dst, frame.name, nbytes))
            other = self.b if dst == 1 else self.a
            loop = asyncio.get_running_loop()
            # the simulated link: the frame arrives alpha + beta * bytes seconds later
            arrive = lambda: self.pending.add(loop.create_task(other.on_frame(frame)))
            loop.call_later(self.alpha + self.beta * nbytes, arrive)

        return send


def test_prober_fits_the_simulated_link() -> None:
    # 40 ms, 25 MB/s: far above the event loop's jitter, also on a loaded 2-core machine (at 10 ms and
    # 100 MB/s a load average of 14 skewed the fitted beta by 90 %)
    wire = Wire(alpha=0.04, beta=40e-9)
    measured = asyncio.run(wire.a.measure(1, [1, 1 << 20, 2 << 20], 2))
    link, samples = measured.link, measured.samples
    assert [n for n, _ in samples] == [1, 1 << 20, 2 << 20]
    # round trip = probe there (alpha + beta M) + echo back (alpha + beta)
    assert link.alpha == pytest.approx(0.04, rel=0.3)
    assert link.beta == pytest.approx(40e-9, rel=0.3)
    assert ("B", 0, "echo", 1) in wire.sent and wire.a.refused == wire.b.refused == 0


def frame(sender: str, name: str, nbytes: int, seq: int = 1) -> TensorFrame:
    import torch

    return TensorFrame(
        job_id="job", sender=sender, kind="ctrl", step=seq, microbatch=0, name=name,
        tensor=torch.zeros(nbytes, dtype=torch.uint8),
    )  # fmt: skip


def test_prober_refuses_oversized_probes_strangers_and_unknown_names_and_drops_stray_echoes() -> None:
    wire = Wire(alpha=0.0, beta=0.0)

    async def feed() -> None:
        await wire.b.on_frame(frame("A", "probe", MAX_PROBE_BYTES + 1))
        await wire.b.on_frame(frame("Z", "probe", 1))
        await wire.b.on_frame(frame("A", "reboot", 1))
        await wire.b.on_frame(frame("A", "echo", 1, seq=99))  # nobody waits for it: dropped quietly

    asyncio.run(feed())
    assert wire.b.refused == 3 and wire.sent == []  # no echo for any of them


def test_probe_requests_are_checked() -> None:
    assert check_probe_request(None, None)[1] >= 1
    assert check_probe_request([1, 1024], 2) == ([1, 1024], 2)
    for sizes, repeats, what in (
        ([1], 1, "sizes"),
        ([1, 1], 1, "sizes"),
        ([0, 10], 1, "sizes"),
        ([1, MAX_PROBE_BYTES + 1], 1, "sizes"),
        ("1,2", 1, "sizes"),
        ([1, True], 1, "sizes"),
        ([1, 2], 0, "repeats"),
        ([1, 2], 99, "repeats"),
    ):
        with pytest.raises(JobError, match=what):
            check_probe_request(sizes, repeats)
