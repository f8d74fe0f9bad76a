"""A job run's re-planning and failover decisions, in one process: a real ``JobRun`` (store, registry,
checkpoints, result files) driving fake compnodes behind a ``CompnodeClient``. No daemon, no network:
what the multi-process recovery tests reach only through a swarm is checked here in a second."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fusionnet.broker import replanning
from fusionnet.broker.config import BrokerConfig
from fusionnet.broker.context import JobContext
from fusionnet.broker.jobrun import JobRun
from fusionnet.broker.registry import CompnodeRegistry
from fusionnet.broker.store import BrokerStore
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.codec import encode_ir
from fusionnet.dht.announce import Found
from fusionnet.dht.records import CompnodeRecord, NodeState
from fusionnet.errors import DeviceMemoryError, JobError, StoreError
from fusionnet.job.loader import load_job
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.compnode_rpc import AssignRequest, CompnodeClient
from fusionnet.messages.jobwire import run_spec_of
from fusionnet.metrics import BrokerMetrics
from fusionnet.planning.links import LinkBook
from fusionnet.planning.placement import BALANCED, Candidate, JobShape, Placement
from fusionnet.planning.speeds import SpeedBook
from fusionnet.rpc.protocol import RPCError
from fusionnet.runtime.prepare import trace_job
from tests.jobfiles import REPO

PEERS = [f"12D3KooW{c * 44}" for c in "ABCDE"]  # A, B, C regular; D, E backups
BACKUPS = set(PEERS[3:])
STEPS = 4


class FakeCompnodes:
    """Answers like compnodes would: keeps each assignment, hands its state back on ``collect``, keeps
    the snapshots a step asks for with itself and with the sub-DAG's replica holder; a peer in ``dead``
    answers nothing (not even pings); ``on_step`` may change the world mid-step."""

    def __init__(self) -> None:
        self.held: dict[str, AssignRequest] = {}
        self.dead: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.on_step: Callable[[str, int], None] = lambda peer, step: None
        self.on_collect: Callable[[str], None] = lambda peer: None
        self.snapshots: dict[str, dict[str, list[int]]] = {}  # peer -> sub-DAG -> steps
        self.confirmed: dict[str, int] = {}

    def _snapshot(self, peer: str, held: AssignRequest, step: int) -> None:
        assert held.replica_holders is not None
        holder = held.peers[held.replica_holders[held.subdag]].peer_id
        for keeper in (peer, holder):
            if keeper not in self.dead:
                self.snapshots.setdefault(keeper, {}).setdefault(str(held.subdag), []).append(step)
        self.confirmed[peer] = step

    async def call(self, peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        payload = payload or {}
        self.calls.append((peer, method))
        if method == "step":
            self.on_step(peer, payload["step"])
        if method == "collect":
            self.on_collect(peer)
        if peer in self.dead:
            why = f"rpc {method} on peer {peer}: no answer"
            raise RPCError(why, peer=peer, method=method, kind="Timeout")
        if method == "ping":
            return {"nonce": payload["nonce"], "peer_id": peer, "state": "ONLINE"}
        if method == "assign":
            request = AssignRequest.model_validate(payload)
            self.held[peer] = request
            self.snapshots.pop(peer, None)  # a new attempt: the old one's snapshots are gone
            self.confirmed.pop(peer, None)
            return {"subdag": request.subdag, "nodes": 1}
        held = self.held[peer]
        if method == "step":
            if payload.get("snapshot"):
                self._snapshot(peer, held, payload["step"] + 1)
            last = held.subdag == len(held.peers) - 1  # the loss lives on the last sub-DAG
            loss = 1.0 / (1 + payload["step"]) if last else None
            return {"step": payload["step"], "loss": loss, "replicated": self.confirmed.get(peer)}
        if method == "replicas":
            return {"held": self.snapshots.get(peer, {})}
        if method == "fetch_replica":  # two chunks, the state then the optimizer state, in 100 B ranges
            assert payload["step"] in self.snapshots[peer][str(payload["subdag"])]
            source = next(h for h in self.held.values() if h.subdag == payload["subdag"])
            first = payload.get("chunk", 0) == 0
            blob = source.state if first else source.optim or pack_tensors({})
            offset = payload.get("offset", 0)
            piece = blob[offset : offset + 100]
            return {"part": "state" if first else "optim", "chunks": 2, "blob": piece, "size": len(blob)}
        if method == "collect":
            return {"state": held.state, "optim": held.optim}
        if method == "release":
            return {"released": True}
        if method == "probe_links":
            return {"links": {}}
        raise AssertionError(method)


@pytest.fixture(scope="module")
def submitted() -> SubmittedJob:
    job = load_job(REPO / "examples" / "figure3" / "job.yaml")
    traced = trace_job(job)
    spec = run_spec_of(job, "mean").model_copy(update={"steps": STEPS})
    return SubmittedJob(
        job_id="j1",
        spec=spec,
        ir=encode_ir(traced.graph),
        graph=traced.graph,
        state=dict(traced.state),
        data={"inputs": job.inputs, "labels": job.labels},
        submitter="me",
    )


def make_context(tmp_path: Path, fake: FakeCompnodes) -> JobContext:
    """A broker's job context from in-memory parts: five ONLINE compnodes, a fresh store."""
    registry = CompnodeRegistry(heartbeat_timeout=3.0)
    now = time.time()
    records = [
        CompnodeRecord(
            peer_id=p,
            state=NodeState.ONLINE,
            backup=p in BACKUPS,
            data_path_address=f"127.0.0.1:{9000 + i}",
        )
        for i, p in enumerate(PEERS)
    ]
    registry.update_records([Found(r, now + 3600, b"") for r in records], now)
    store = BrokerStore(tmp_path / "broker.sqlite3")
    refreshed: list[int] = []
    return JobContext(
        open_store=lambda: store,
        registry=registry,
        settings=BrokerConfig(placement_policy=BALANCED),
        metrics=BrokerMetrics(process=False),
        speeds=SpeedBook(),
        links=LinkBook(),
        compnodes=CompnodeClient(fake.call),
        refresh_job_metrics=lambda: refreshed.append(1),
        jobs_folder=lambda: tmp_path / "jobs",
    )


def make_run(tmp_path: Path, job: SubmittedJob, fake: FakeCompnodes) -> tuple[JobRun, JobContext]:
    context = make_context(tmp_path, fake)
    context.store.create_job(job.job_id, job.spec.name, steps=job.spec.step_count, submitter=job.submitter)
    return JobRun(context, job, tmp_path / "jobs" / job.job_id), context


def events(context: JobContext, kind: str) -> list[dict[str, Any]]:
    return [e for e in context.store.job_events("j1") if e["kind"] == kind]


@pytest.mark.timeout(120)
def test_a_compnode_lost_in_the_last_sync_is_a_recovery_that_ends(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    """A compnode dies while the broker collects the state after the last step: the job recovers (the
    steps since the newest replica round run again) and the recovery is recorded as over, replay
    included, instead of staying open because no step after the failed one was left to run."""
    fake = FakeCompnodes()
    victim = PEERS[1]
    last_step = {"n": -1}

    def count(peer: str, step: int) -> None:
        last_step["n"] = max(last_step["n"], step)

    def die(peer: str) -> None:
        if peer == victim and last_step["n"] == STEPS - 1:
            fake.dead.add(victim)

    fake.on_step, fake.on_collect = count, die
    run, context = make_run(tmp_path, submitted, fake)
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    (recovery,) = run.progress.recoveries
    assert recovery["lost"] == [victim] and recovery["failed_step"] == STEPS - 1
    assert "replay" in recovery and "redistribution" in recovery
    assert [r["step"] for r in run.progress.metrics] == list(range(STEPS))  # each step recorded once
    assert len(events(context, "recovered")) == 1


@pytest.mark.timeout(120)
def test_a_dead_compnode_is_replaced_by_a_backup_and_the_steps_replayed(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    fake = FakeCompnodes()
    victim = PEERS[1]

    def die(peer: str, step: int) -> None:
        if step == 2 and peer == victim:
            fake.dead.add(victim)

    fake.on_step = die
    run, context = make_run(tmp_path, submitted, fake)
    assert run.pending == replanning.FIRST
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    assert run.pending is None and run.dead == {victim} and run.attempt == 2
    assert victim not in run.peers and PEERS[0] in run.peers and PEERS[2] in run.peers
    assert set(run.peers) & BACKUPS  # the backup pool took over, not a free regular compnode
    (recovery,) = run.progress.recoveries
    # replicas are paced (broker.replicas.PACE): the round after step 0 is the newest when step 2 fails
    assert recovery["lost"] == [victim] and recovery["replay_from"] == 1 and recovery["failed_step"] == 2
    assert recovery["checkpoint"] == "replicas"
    assert "replay" in recovery and "redistribution" in recovery
    assert [r["step"] for r in run.progress.metrics] == list(range(STEPS))  # each step recorded once
    assert len(events(context, "planned")) == 2 and len(events(context, "recovered")) == 1
    # a compnode declared lost is told so once (it may be alive behind a stalled link: it must drop its
    # sub-DAG at once), and not called again
    assert fake.calls.count((victim, "release")) == 1
    assert [m for p, m in fake.calls if p == victim].count("step") == 3  # steps 0, 1 and the failed 2
    assert (run.out_dir / "weights.safetensors").is_file()
    # The broker took no state per step: the checkpoint came from the replicas (the victim's from its
    # holder), and the state was collected once, for the results (state + optimizer state per peer).
    fetched = [p for p, m in fake.calls if m == "fetch_replica"]
    assert len(fetched) > 2 * 3 and victim not in fetched  # 2 chunks a sub-DAG, each in 100 B ranges
    assert [m for _, m in fake.calls].count("collect") == 2 * 3


@pytest.mark.timeout(120)
def test_a_leaving_compnode_hands_over_at_the_step_boundary_without_replay(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    fake = FakeCompnodes()
    run, context = make_run(tmp_path, submitted, fake)
    leaver = PEERS[0]

    def leave(peer: str, step: int) -> None:
        if step == 1 and peer == leaver:
            run.leaving.add(leaver)  # what rpc_leaving does

    fake.on_step = leave
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED"
    assert leaver not in run.peers and run.attempt == 2 and not run.dead
    (handover,) = run.progress.recoveries
    assert handover["lost"] == [leaver] and "handover_stall" in handover and "replay_from" not in handover
    assert [r["step"] for r in run.progress.metrics] == list(range(STEPS))
    assert fake.calls.count((leaver, "release")) == 1  # its signal that the hand-over is done
    assert events(context, "hand-over")[0]["detail"] == {"leaving": [leaver], "step": 2}


@pytest.mark.timeout(120)
def test_an_error_from_a_compnode_that_still_answers_fails_the_job_without_failover(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    fake = FakeCompnodes()
    real = fake.call

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        if method == "step" and payload and payload["step"] == 1 and peer == PEERS[2]:
            raise JobError("boom in the executor")
        return await real(peer, method, payload, **kw)

    fake.call = call  # type: ignore[method-assign]
    run, context = make_run(tmp_path, submitted, fake)
    asyncio.run(run.run())
    row = context.store.get_job("j1")
    assert row["state"] == "FAILED" and not run.progress.recoveries and run.attempt == 1
    assert row["error"] == f"compnode {PEERS[2]} (step): boom in the executor"
    assert row["error_kind"] == "input"  # the job's own fault: its submitter exits 2, not 1
    assert {p for p, m in fake.calls if m == "release"} == set(run.peers)  # all released at the end


@pytest.mark.timeout(120)
def test_a_device_oom_places_the_job_again_without_that_compnode(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    fake = FakeCompnodes()
    real = fake.call
    small = PEERS[1]

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        if method == "step" and peer == small:
            raise DeviceMemoryError("sub-DAG 1: FP of step 1 micro-batch 0 ran out of memory on cuda:0")
        return await real(peer, method, payload, **kw)

    fake.call = call  # type: ignore[method-assign]
    run, context = make_run(tmp_path, submitted, fake)
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    assert small not in run.peers and run.unfit == {small} and not run.dead and run.attempt == 2
    assert (small, "release") in fake.calls  # alive: released, unlike a dead compnode
    (recovery,) = run.progress.recoveries
    assert recovery["lost"] == [small] and "out of memory" in recovery["why"]


def _candidates() -> list[Candidate]:
    return [Candidate(p, p in BACKUPS, None) for p in PEERS]


def test_next_placement_moves_only_what_was_lost(submitted: SubmittedJob) -> None:
    shape = JobShape(submitted.graph, wanted=3, microbatches=2, batch_size=16, optimizer=None)
    first = replanning.next_placement(shape, replanning.FIRST, [], _candidates(), policy=BALANCED, links=None)
    assert first.peers == tuple(PEERS[:3])  # regular compnodes first, backups kept in reserve
    lost = replanning.next_placement(
        shape, replanning.failure({PEERS[1]}), PEERS[:3], _candidates(), policy=BALANCED, links=None
    )
    assert len(lost.peers) == 3 and PEERS[1] not in lost.peers and lost.peers[:2] == (PEERS[0], PEERS[2])
    assert lost.peers[2] in BACKUPS
    proposed = Placement(tuple(PEERS[:2]), first.assignment, BALANCED)
    growth = replanning.Replan("growth", proposed=proposed)
    assert replanning.next_placement(shape, growth, PEERS[:3], [], policy=BALANCED, links=None) is proposed


def test_replan_values_say_why() -> None:
    assert replanning.failure(["x"]) == replanning.Replan("failure", frozenset({"x"}))
    assert replanning.hand_over({"y"}).reason == "hand-over"
    with pytest.raises(AssertionError):
        replanning.Replan("growth")  # a growth must carry its placement
    with pytest.raises(AssertionError):
        replanning.Replan("first", frozenset({"x"}))
    assert replanning.sync_due(4, 10, 2, leaving=False) and not replanning.sync_due(3, 10, 2, leaving=False)
    assert replanning.sync_due(3, 10, 2, leaving=True) and replanning.sync_due(10, 10, 4, leaving=False)
    assert not replanning.sync_due(4, 10, 0, leaving=False) and replanning.sync_due(10, 10, 0, leaving=False)


def test_a_lone_compnodes_collections_are_paced_to_a_share_of_the_time() -> None:
    # issue 16: 100 MB of state over 100 Mbit/s took 8.8 s after every 1.3 s step
    assert replanning.next_sync(5, 8.8, 1.3) == 5 + 14  # collecting holds the link <= 1/3 of the time
    assert replanning.next_sync(5, 0.01, 1.0) == 6  # cheap: every step, as before
    assert replanning.next_sync(5, 0.0, 0.0) == 6


def test_no_growth_replan_under_the_balanced_policy(submitted: SubmittedJob) -> None:
    shape = JobShape(submitted.graph, wanted=3, microbatches=2, batch_size=16, optimizer=None)
    pool = _candidates()
    current = replanning.next_placement(shape, replanning.FIRST, [], pool, policy=BALANCED, links=None)
    assert replanning.growth_replan("j1", shape, current, _candidates(), 0.1, None) is None


def test_a_candidate_not_calibrated_yet_is_priced_with_a_calibrated_twins_overheads() -> None:
    """Overheads counted as zero would make an uncalibrated compnode look faster than its calibrated
    twin (and every split of a small model pure communication): it borrows those of the calibrated
    candidate of its kind nearest in peak speed; with nobody calibrated, nobody has any."""
    from types import SimpleNamespace

    from fusionnet.perfmodel.types import NO_OVERHEADS, ClassCost, DeviceSpec, Overheads

    slow = Overheads(elementwise=ClassCost(fp=4e-5, bp=6e-5))
    fast = Overheads(elementwise=ClassCost(fp=2e-5, bp=3e-5))

    def entry(peer: str, overheads: Overheads, flops: float = 1e11, kind: str = "cpu") -> Any:
        spec = DeviceSpec(
            name=peer,
            kind=kind,
            peak_flops=flops,
            mem_bandwidth=1e10,
            d_gpu=1 << 30 if kind == "gpu" else 0,
            d_cpu=8 << 30,
            d_disk=1 << 40,
            overheads=overheads,
        )
        record = SimpleNamespace(data_path_address="127.0.0.1:1", backup=False)
        return SimpleNamespace(peer_id=peer, record=record, device_spec=lambda: spec)

    def overheads_of(entries: list[Any]) -> list[Overheads]:
        registry = SimpleNamespace(schedulable=lambda: entries)
        pool = replanning.candidates(registry, SpeedBook(), excluded=())  # type: ignore[arg-type]
        return [c.device.overheads for c in pool if c.device is not None]

    pool = [entry("a", slow, 1e11), entry("b", fast, 1e12), entry("c", NO_OVERHEADS, 9e11)]
    assert overheads_of(pool) == [slow, fast, fast]  # c borrows from b, nearest in peak speed
    assert overheads_of([entry("a", slow), entry("g", NO_OVERHEADS, kind="gpu")]) == [slow, NO_OVERHEADS]
    assert overheads_of([entry("a", NO_OVERHEADS), entry("b", NO_OVERHEADS)]) == [NO_OVERHEADS] * 2


@pytest.mark.timeout(120)
def test_with_steps_sent_ahead_a_failover_still_replays_each_step_once(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    """``--steps-ahead``: every step after the first goes out while the one before runs (``after``
    names it); a compnode dying in step 2 loses the step sent ahead too, and the job still ends with
    each step recorded once, replayed from the replicas."""
    fake = FakeCompnodes()
    victim = PEERS[1]
    afters: list[tuple[int, int | None]] = []

    def die(peer: str, step: int) -> None:
        if step == 2 and peer == victim:
            fake.dead.add(victim)

    real = fake.call

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        if method == "step" and payload and peer == PEERS[0]:
            afters.append((payload["step"], payload.get("after")))
        return await real(peer, method, payload, **kw)

    fake.on_step = die
    fake.call = call  # type: ignore[method-assign]
    run, context = make_run(tmp_path, submitted, fake)
    context.settings.steps_ahead = True
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    assert [r["step"] for r in run.progress.metrics] == list(range(STEPS))
    assert afters[:3] == [(0, None), (1, 0), (2, 1)]  # each sent while the one before it ran
    assert [m for p, m in fake.calls if p == victim].count("step") == 4  # 0, 1, the failed 2, and 3


@pytest.mark.timeout(120)
def test_a_full_disk_fails_the_job_saying_so_and_releases_its_compnodes(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    """A checkpoint the broker cannot write (ENOSPC) ends the job FAILED with the reason, not as an
    internal error; a database that refuses the job's step record does the same (a CI machine's disk
    once filled and left a job RUNNING until its submitter's timeout)."""
    fake = FakeCompnodes()
    run, context = make_run(tmp_path, submitted, fake)

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(run.files.folder / "checkpoint"))

    run.files.save_checkpoint = full  # type: ignore[method-assign]
    asyncio.run(run.run())
    row = context.store.get_job("j1")
    assert row["state"] == "FAILED"
    assert row["error"].startswith("the broker could not write or read its files: [Errno 28]"), row["error"]
    assert row["error_kind"] == "work"  # not the job's fault: its submitter exits 1
    assert {p for p, m in fake.calls if m == "release"} == set(run.peers)

    fake = FakeCompnodes()
    (tmp_path / "second").mkdir()
    run, context = make_run(tmp_path / "second", submitted, fake)
    refused = StoreError("b.sqlite3: the broker database refused a write (database or disk is full)")
    real_update = context.store.update_job

    def update(job_id: str, **fields: Any) -> dict[str, Any]:
        if "loss" in fields:  # a step's record
            raise refused
        return real_update(job_id, **fields)

    context.store.update_job = update  # type: ignore[method-assign]
    asyncio.run(run.run())
    row = context.store.get_job("j1")
    assert (row["state"], row["error"], row["error_kind"]) == ("FAILED", str(refused), "work")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inline_actions", [128, 0])  # simulated on the loop, and in a thread
def test_each_step_row_carries_its_schedule_run_on_its_measured_compute(
    tmp_path: Path, submitted: SubmittedJob, monkeypatch: pytest.MonkeyPatch, inline_actions: int
) -> None:
    """metrics.jsonl's ``compute_path_seconds``: the step's schedule simulated on the FP, BP and Update
    seconds its sub-DAGs reported, with free messages, over the partition's real edges."""
    from fusionnet.broker import job_steps
    from fusionnet.perfmodel.simulator import compute_path

    monkeypatch.setattr(job_steps, "INLINE_PATH_ACTIONS", inline_actions)
    fake = FakeCompnodes()
    real = fake.call

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        reply = await real(peer, method, payload, **kw)
        if method == "step":  # sub-DAG s computes (s + 1) x 0.1 s of FP, twice that of BP
            s = fake.held[peer].subdag
            reply |= {"fp_seconds": 0.1 * (s + 1), "bp_seconds": 0.2 * (s + 1), "update_seconds": 0.01}
        return reply

    fake.call = call  # type: ignore[method-assign]
    run, context = make_run(tmp_path, submitted, fake)
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    assert run.partition is not None and run._placement is not None
    n = len(run.partition.subdags)
    want = compute_path(
        [(0.1 * (s + 1), 0.2 * (s + 1), 0.01) for s in range(n)],
        [s.compnode_users for s in run.partition.subdags],
        len(submitted.spec.microbatch_sizes(0)),
        schedule=run._placement.schedule.name if run._placement.schedule else submitted.spec.schedule,
        task="train",
    )
    rows = run.progress.metrics
    assert [r["compute_path_seconds"] for r in rows] == [pytest.approx(want)] * STEPS
    assert all(r["compute_path_seconds"] >= max(r["compute_seconds"]) for r in rows)


@pytest.mark.timeout(120)
def test_a_misprediction_look_times_the_jobs_links_again_however_recent(
    tmp_path: Path, submitted: SubmittedJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link that slows down mid-job showed as steps far slower than planned, and the look that
    followed probed only links older than 10 minutes: the job's own, measured at its placement, kept
    their old figure. Every look now times them again."""
    fake = FakeCompnodes()
    answer = fake.call

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        if method == "probe_links":
            fake.calls.append((peer, method))
            to = (payload or {})["to"]
            return {"links": {str(c): {"alpha": 0.001, "beta": 1e-8} for c in to}}
        return await answer(peer, method, payload, **kw)

    fake.call = call  # type: ignore[method-assign]  # what make_context's client calls
    run, context = make_run(tmp_path, submitted, fake)
    looks: list[float] = []
    monkeypatch.setattr(run.prediction, "observe", lambda measured: looks.append(measured) or True)
    monkeypatch.setattr(run.prediction, "min_seconds", 0.0)
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    probes = [c for c in fake.calls if c[1] == "probe_links"]
    assert looks and len(probes) >= len(looks), (len(probes), len(looks))


@pytest.mark.timeout(120)
def test_a_compnode_lost_while_the_job_is_placed_is_a_recorded_recovery(
    tmp_path: Path, submitted: SubmittedJob
) -> None:
    """A compnode that dies before it got its sub-DAG: placed again without it, and recorded like any
    recovery (a ``recoveries`` entry, the events, ``fusionnet_failovers_total``), with nothing to replay.
    It used to be left out of all of them."""
    fake = FakeCompnodes()
    answer = fake.call
    victims: list[str] = []

    async def call(peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        if method == "assign" and not victims:
            victims.append(peer)
            fake.dead.add(peer)
        return await answer(peer, method, payload, **kw)

    fake.call = call  # type: ignore[method-assign]  # what make_context's client calls
    run, context = make_run(tmp_path, submitted, fake)
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    (recovery,) = run.progress.recoveries
    assert recovery["lost"] == victims and recovery["replay"] == 0.0 and "redistribution" in recovery
    assert recovery["replay_from"] == 0 and "detection" in recovery
    assert len(events(context, "recovered")) == 1
    assert context.metrics.registry.get_sample_value("fusionnet_failovers_total") == 1
    assert victims[0] not in run.peers
