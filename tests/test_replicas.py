"""Failover state replicated between compnodes (``broker.replicas``, ``compnode.replicas``): the
broker's book of snapshot rounds, the choice of the step to recover from, the pointer a restarted broker
reads, the compnode's snapshot files, and an owner's snapshots reaching their holder in step order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from fusionnet.broker.replicas import (
    PACE,
    REPLICA_LINK_SHARE,
    REPLICA_TIME_SHARE,
    ROUND_RETRY,
    ReplicaBook,
    ReplicaPointer,
    best_step,
    replicas_apart,
    ring_holders,
    round_cost,
)
from fusionnet.compnode.replicas import ReplicaStore, Replicator, pack_chunks
from fusionnet.errors import JobError
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.compnode_rpc import StepReply

pytestmark = pytest.mark.timeout(60)


def test_holders_form_a_ring_and_a_single_sub_dag_has_none() -> None:
    assert ring_holders(3) == [1, 2, 0] and ring_holders(2) == [1, 0] and ring_holders(1) is None
    book = ReplicaBook()
    book.reset(1, enabled=True)
    assert not book.enabled and book.request(0) == (False, None) and book.holders() is None


def test_interleaved_chunks_keep_their_replicas_on_another_compnode_but_one_compnode_cannot() -> None:
    """Sub-DAG s of an interleaved job runs on compnode s mod p, so each ring holder is on the next
    compnode; with one compnode (or a placement that puts neighbours together) a copy would die with
    its sub-DAG."""
    assert replicas_apart(["A", "B", "A", "B"]) and replicas_apart(["A", "B", "C", "A", "B", "C"])
    assert replicas_apart(["A", "B"]) and replicas_apart(["A", "B", "C"])
    assert not replicas_apart(["A", "A"]) and not replicas_apart(["A", "A", "B", "B"])
    assert not replicas_apart(["A"]) and not replicas_apart([])


def test_one_round_in_flight_committed_when_every_sub_dag_confirmed() -> None:
    book = ReplicaBook(interval=0.0)
    book.reset(3, enabled=True)
    assert book.request(0) == (True, None)  # snapshot after step 0: checkpoint step 1
    assert book.request(1) == (False, None)  # the round is still in flight
    assert not book.observe([1, None, 1])  # sub-DAG 1 has not confirmed yet
    assert book.observe([1, 1, 1], step=1) and book.committed == 1
    assert book.request(2) == (False, 1)  # paced: the round held the links 1 step, so 2 steps off
    assert book.request(3) == (True, 1)  # the next round; snapshots before step 1 may go
    assert not book.observe([4, 1, 4], step=4)
    for step in range(4, 3 + ROUND_RETRY):
        assert book.request(step) == (False, 1)
    assert book.request(3 + ROUND_RETRY)[0]  # a round that never completed is asked for again
    assert book.observe([4, 4, 4], step=7) and book.committed == 4  # the older round completed meanwhile
    book.reset(3, enabled=False)  # grad / infer jobs
    assert book.request(0) == (False, None) and book.holders() is None


def test_rounds_on_a_slow_link_are_paced_to_a_share_of_the_steps() -> None:
    book = ReplicaBook(interval=0.0)
    book.reset(2, enabled=True)
    assert book.request(0) == (True, None)
    for step in range(1, 3):  # the snapshots take 3 steps to reach their holders
        assert book.request(step) == (False, None) and not book.observe([None, None], step=step)
    assert book.observe([1, 1], step=3) and book.committed == 1
    asked = [step for step in range(4, 20) if book.request(step)[0]]
    assert asked[0] == 3 + (PACE - 1) * 3  # idle twice as long as the round took


def test_rounds_of_fast_steps_start_at_most_once_per_interval() -> None:
    now = [100.0]
    book = ReplicaBook(interval=2.0, clock=lambda: now[0])
    book.reset(2, enabled=True)
    asked = []
    for step in range(160):  # steps of 62.5 ms (exact in binary); each round completes within its step
        if book.request(step)[0]:
            asked.append(step)
            assert book.observe([step + 1, step + 1], step=step + 1)
        now[0] += 0.0625
    # the first round at once, then one every 32 steps (2 s), not every PACE steps
    assert asked == [0, 32, 64, 96, 128]
    book.reset(2, enabled=True)  # a new placement (a failover's) has no replica: its first round at once
    assert book.request(0)[0] is True


def test_a_slow_round_of_fast_steps_is_asked_again_only_after_a_growing_wait() -> None:
    """A round still on its way after ``ROUND_RETRY`` steps of 50 ms is not asked for again until the
    interval has passed, then twice that, and so on: snapshots never queue up behind a slow one."""
    now = [0.0]
    book = ReplicaBook(interval=2.0, clock=lambda: now[0])
    book.reset(2, enabled=True)
    asked = []
    for step in range(320):  # 20 s of steps of 62.5 ms (exact in binary); the holders never confirm
        if book.request(step)[0]:
            asked.append((step, now[0]))
        now[0] += 0.0625
    assert [t for _, t in asked] == [0.0, 2.0, 6.0, 14.0]
    last = asked[-1][0] + 1  # the checkpoint step of the round asked for last
    assert book.observe([last, last], step=320) and book.committed == last and book.retries == 3
    now[0] += 10.0  # paced as usual after a completed round, then a fresh round without backoff
    assert book.request(320 + 2 * 96)[0] and book.retries == 0


def spaced_rounds(book: ReplicaBook, now: list[float], steps: int) -> list[int]:
    """The steps ``book`` asks a round at, for steps of 0.5 s that take 1.5 s while a round is on its way
    (the step it is asked at and the next, which confirms it): each round costs 2.0 s over the clean
    steps' median. ``now`` is the book's clock, advanced step by step."""
    asked: list[int] = []
    for step in range(steps):
        if book.request(step)[0]:
            asked.append(step)
        in_flight = bool(asked) and step - asked[-1] <= 1
        seconds = 1.5 if in_flight else 0.5
        now[0] += seconds
        done = asked[-1] + 1 if in_flight and step > asked[-1] else None
        book.observe([done, done], step=step, seconds=seconds)
    return asked


def test_costly_rounds_are_spaced_to_a_share_of_the_time() -> None:
    """Steps of 0.5 s, and 1.5 s while a round is on its way (the step it is asked at and the next,
    which confirms it): a round costs 2 x 1.0 s over the clean steps' median, so the next starts no
    sooner than 2.0 / ``REPLICA_TIME_SHARE`` seconds after it, however short the interval. The first
    round, asked at once, is priced at the first request after a clean step; a new placement starts
    over at once."""
    now = [0.0]
    book = ReplicaBook(interval=2.0, clock=lambda: now[0])
    book.reset(2, enabled=True)
    asked = spaced_rounds(book, now, 60)
    # round 1 at once (steps 0-1), priced at step 3 after the clean step 2: round 2 20 s after round 1
    # started: step 2 starts at 3.0 s, so step 2 + (20 - 3.0) / 0.5 = 36; round 3 would be at 40 s
    assert asked == [0, 36]
    assert round_cost([1.5, 1.5], baseline=0.5) == 2.0 and round_cost([0.4], baseline=0.5) == 0.0
    assert book.not_before == pytest.approx(20.0 + 2.0 / REPLICA_TIME_SHARE)  # round 2's own price
    book.reset(2, enabled=True)
    assert book.request(100)[0] and book.not_before is None


def test_each_snapshot_is_paced_to_a_share_of_its_holder_link_as_measured() -> None:
    """The broker's ``replica_pace`` per sub-DAG: ``REPLICA_LINK_SHARE`` of the measured bandwidth of the
    link to its holder (a reverse measurement stands in), none where nothing was measured; the step
    calls carry each its own."""
    from types import SimpleNamespace

    from fusionnet.broker.job_calls import JobCalls
    from fusionnet.broker.job_steps import JobSteps
    from fusionnet.perfmodel.types import Link
    from fusionnet.planning.links import LinkBook

    links = LinkBook()
    links.record("a", "b", Link.from_bandwidth(1e-3, 12.5e6))  # 100 Mbit/s
    links.record("a", "c", Link.from_bandwidth(1e-3, 125e6))  # measured a -> c: stands in for c -> a
    book = ReplicaBook()
    book.reset(3, enabled=True)
    fake = SimpleNamespace(replicas=book, ctx=SimpleNamespace(links=links), peers=["a", "b", "c"])
    paces = JobSteps._replica_paces(fake)  # type: ignore[arg-type]
    assert paces == [
        pytest.approx(REPLICA_LINK_SHARE * 12.5e6),
        None,
        pytest.approx(REPLICA_LINK_SHARE * 125e6),
    ]

    sent = {}

    class Client:
        async def call_step(self, peer, request, timeout):
            sent[peer] = request
            return StepReply(step=request.step)

    calls = JobCalls.__new__(JobCalls)
    calls.job_id, calls.client = "j", Client()
    calls._named = lambda peer, what, call: call
    asyncio.run(calls.step(["a", "b", "c"], 4, timeout=5.0, snapshot=True, paces=paces))
    assert [sent[p].replica_pace for p in "abc"] == paces and all(sent[p].snapshot for p in "abc")


def test_the_newest_step_every_sub_dag_has_on_a_live_peer_is_chosen() -> None:
    held = {
        "a": {0: [2, 3]},  # sub-DAG 0's own snapshots
        "c": {2: [2, 3], 1: [2]},  # sub-DAG 2's own, and the replica of sub-DAG 1 (whose compnode died)
    }
    assert best_step(held, 3, after=0) == (2, ["a", "c", "c"])  # step 3 lacks sub-DAG 1
    assert best_step(held, 3, after=2) is None  # nothing newer than the broker's own checkpoint
    assert best_step({}, 2, after=0) is None


def test_the_pointer_survives_a_restart_and_a_torn_file_reads_as_none(tmp_path: Path) -> None:
    from fusionnet.broker.checkpoints import JobFiles

    rows = [{"step": s, "seconds": 0.1} for s in range(5)]
    pointer = ReplicaPointer(2, ["a", "b"], 5, rows)
    pointer.save(JobFiles(tmp_path))
    assert ReplicaPointer.load(JobFiles(tmp_path)) == pointer  # a restarted broker's files
    assert len(ReplicaPointer.path(tmp_path).read_bytes()) < 200  # the rows are not in it
    ReplicaPointer.path(tmp_path).write_text('{"attempt": 2, "peers": ["a"], "step": 1, "metrics": []}')
    assert ReplicaPointer.load(JobFiles(tmp_path)) == ReplicaPointer(2, ["a"], 1, [])  # an older broker's
    ReplicaPointer.path(tmp_path).write_text('{"attempt": 2')
    assert ReplicaPointer.load(JobFiles(tmp_path)) is None


def test_snapshot_files_complete_listed_pruned_and_dropped(tmp_path: Path) -> None:
    store = ReplicaStore(tmp_path)
    assert not store.put("j", 1, 0, 4, (0, 2, "state"), b"s4")
    assert store.held("j", 1) == {}  # half a snapshot is none
    assert store.put("j", 1, 0, 4, (1, 2, "optim"), b"o4")
    for subdag, step in ((0, 6), (2, 6)):
        store.put("j", 1, subdag, step, (0, 1, "state"), b"s6")
    store.put("j", 0, 1, 9, (0, 1, "state"), b"old attempt")
    assert store.held("j", 1) == {0: [4, 6], 2: [6]} and store.held("j", 0) == {1: [9]}
    assert store.read("j", 1, 0, 4, 1) == ("optim", 2, b"o4", 2)
    assert store.read("j", 1, 0, 4, 1, offset=1) == ("optim", 2, b"4", 2)  # answers are byte ranges
    with pytest.raises(JobError, match="offset 3 past the 2 bytes of chunk 1"):
        store.read("j", 1, 0, 4, 1, offset=3)
    with pytest.raises(JobError, match="chunk 3 of 2"):
        store.put("j", 1, 0, 4, (3, 2, "state"), b"")
    with pytest.raises(JobError, match="no snapshot of sub-DAG 0 at step 5"):
        store.read("j", 1, 0, 5, 0)
    store.prune("j", 6)
    assert store.held("j", 1) == {0: [6], 2: [6]}
    store.drop("j")
    assert store.held("j", 1) == {} and not (tmp_path / "j").exists()


def test_what_an_earlier_process_left_is_dropped_at_start(tmp_path: Path) -> None:
    """A compnode SIGKILLed mid-job and restarted on its state dir holds no job: the snapshots its last
    run kept can never be asked for again, and go (``SubtaskService.start`` calls this)."""
    assert ReplicaStore(tmp_path / "none").drop_leftovers() == []
    old = ReplicaStore(tmp_path)
    old.put("crashed", 1, 0, 4, (0, 1, "state"), b"s4")
    old.put("other", 2, 1, 6, (0, 1, "state"), b"s6")
    (tmp_path / "stray.tmp").write_bytes(b"x")
    assert ReplicaStore(tmp_path).drop_leftovers() == ["crashed", "other", "stray.tmp"]
    assert list(tmp_path.iterdir()) == []


def test_a_snapshot_is_cut_into_chunks_that_load_back_to_it() -> None:
    tensors = {f"w{i}": torch.full((1000,), float(i)) for i in range(10)}  # 4000 bytes each
    chunks = pack_chunks("state", tensors, limit=9000)
    assert [part for part, _ in chunks] == ["state"] * 5  # two tensors per chunk
    back = {k: v for _, blob in chunks for k, v in unpack_tensors(blob, "chunk").items()}
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert len(pack_chunks("state", tensors, limit=1)) == 10  # a bigger tensor goes alone
    assert pack_chunks("optim", {}) == [] and len(pack_chunks("state", {})) == 1  # never an empty snapshot


def test_an_owner_sends_its_snapshots_in_step_order_and_counts_the_confirmed(tmp_path: Path) -> None:
    sent: list[tuple[int, int, int, str]] = []

    async def send(step: int, index: int, count: int, chunk: tuple[str, bytes]) -> bool:
        if step == 2:
            await asyncio.sleep(0.05)  # the first snapshot travels slowly: the second waits for it
        sent.append((step, index, count, chunk[0]))
        return index == count - 1

    async def run() -> Replicator:
        loop = asyncio.get_running_loop()
        r = Replicator(ReplicaStore(tmp_path), "j", 1, 0, send, lambda: None)
        for step in (2, 3):
            pack = loop.create_future()
            pack.set_result(([("state", b"s"), ("optim", b"o")], 0.25))
            r.start(step, pack)
        await r.wait()
        return r

    r = asyncio.run(run())
    assert sent == [(2, 0, 2, "state"), (2, 1, 2, "optim"), (3, 0, 2, "state"), (3, 1, 2, "optim")]
    assert r.confirmed == 3 and r.take_seconds() == 0.25 and r.take_seconds() == 0.0
    assert ReplicaStore(tmp_path).held("j", 1) == {0: [2, 3]}  # the owner keeps its own copies


def test_a_snapshot_still_waiting_behind_a_slow_one_gives_way_to_a_newer_one(tmp_path: Path) -> None:
    """On a slow (paced) link the broker asks again before a round is through: the snapshots asked for
    meanwhile do not queue up (each a full copy of the state); only the newest waits, then leaves."""
    sent: list[int] = []

    async def run() -> Replicator:
        loop = asyncio.get_running_loop()
        first_left, release = asyncio.Event(), asyncio.Event()

        async def send(step: int, index: int, count: int, chunk: tuple[str, bytes]) -> bool:
            if step == 2:
                first_left.set()
                await release.wait()  # the first snapshot is on a slow link
            sent.append(step)
            return True

        r = Replicator(ReplicaStore(tmp_path), "j", 1, 0, send, lambda: None)
        for step in (2, 3, 4, 5):
            pack = loop.create_future()
            pack.set_result(([("state", b"s")], 0.1))
            r.start(step, pack)
            if step == 2:
                await first_left.wait()
        release.set()
        await r.wait()
        return r

    r = asyncio.run(run())
    assert sent == [2, 5] and r.superseded == 2 and r.confirmed == 5
    assert ReplicaStore(tmp_path).held("j", 1) == {0: [2, 5]}


def test_a_snapshot_chunk_bigger_than_an_answer_is_read_in_bounded_ranges(
    tmp_path: Path, monkeypatch
) -> None:
    from fusionnet.compnode import replicas as replicas_module

    monkeypatch.setattr(replicas_module, "FETCH_BYTES", 4)
    store = ReplicaStore(tmp_path)
    store.put("j", 1, 0, 2, (0, 1, "state"), b"0123456789")
    pieces, offset = [], 0
    while offset < 10:
        part, count, data, size = store.read("j", 1, 0, 2, 0, offset=offset)
        assert (part, count, size) == ("state", 1, 10) and 0 < len(data) <= 4
        pieces.append(data)
        offset += len(data)
    assert b"".join(pieces) == b"0123456789" and len(pieces) == 3
