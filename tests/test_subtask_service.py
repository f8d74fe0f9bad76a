"""A compnode's sub-task service refusing what it must refuse, in one process: assignments that do
not validate (malformed, or well-formed but meaningless), calls about unknown jobs, calls from a peer
other than the broker that assigned the job. The service keeps nothing of a refused assignment."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fusionnet.broker.assignment_payloads import assignment_payloads
from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.broker.submission import SubmittedJob
from fusionnet.compnode.daemon import CompnodeConfig
from fusionnet.compnode.tasks import MAX_JOBS, SubtaskService
from fusionnet.compnode.trust import FORGOTTEN_GRACE, TrustedBrokers, forgotten_jobs, stale_jobs
from fusionnet.dag.codec import encode_ir
from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.dht.peerids import peer_ids_of_maddrs
from fusionnet.errors import IRError, JobError, PartitionError, WireError
from fusionnet.job.loader import load_job
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.jobwire import run_spec_of
from fusionnet.metrics import CompnodeMetrics
from fusionnet.rpc.server import RPCContext
from fusionnet.runtime.prepare import trace_job
from tests.jobfiles import REPO

PEERS = [f"12D3KooW{c * 44}" for c in "ABC"]
ME = PEERS[1]
BROKER = f"12D3KooW{'Z' * 44}"
STRANGER = f"12D3KooW{'Y' * 44}"


class FakePath:
    """A data path (TCP server or P2P) that only records which jobs it serves."""

    def __init__(self) -> None:
        self.jobs: dict[str, list[str]] = {}
        self.routes: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}

    def register_job(
        self, job_id: str, key: bytes, allowed: list[str], route: Any, encryption: str, lanes: Any = None
    ) -> None:
        self.jobs[job_id] = allowed
        self.routes[job_id] = route
        self.encryption = encryption
        self.lanes = lanes

    def unregister_job(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)


# Every FakeNode's state dir lives under this one, which goes when the test process exits (a
# finaliser of TemporaryDirectory), so the suite leaves no replica folders in /tmp behind.
SCRATCH = tempfile.TemporaryDirectory(prefix="fusionnet-test-nodes-")


class FakeNode:
    """What the service uses of its compnode daemon."""

    def __init__(self, peer_id: str = ME) -> None:
        self.peer_id = peer_id
        self.settings = CompnodeConfig(trusted_brokers=(BROKER,), sandbox=False)
        self.metrics = CompnodeMetrics(process=False)
        self.load = (0.0, 0)
        self.compute = None  # executors compute inline here; packing uses the loop's default pool
        self.device = torch.device("cpu")
        self.state_dir = SimpleNamespace(path=Path(tempfile.mkdtemp(prefix="replicas-", dir=SCRATCH.name)))
        self.ways_made = 0  # assignments that asked a calibration to give way

    def make_way_for_work(self) -> None:
        self.ways_made += 1

    def set_load(self, *, load: float, running_tasks: int) -> None:
        self.load = (load, running_tasks)

    async def call(self, *args: Any, **kw: Any) -> dict:
        raise AssertionError("the service calls nobody in these tests")


@pytest.fixture(scope="module")
def assign_docs() -> list[dict[str, Any]]:
    """The broker's three ``assign`` payloads of figure3 (we are sub-DAG 1), as they go on the wire."""
    return figure3_assign_docs(3)


def figure3_assign_docs(
    pieces: int,
    peers: list[str] | None = None,
    spec: dict[str, Any] | None = None,
    replica_holders: list[int] | None = None,
) -> list[dict[str, Any]]:
    """figure3's ``assign`` payloads for ``pieces`` sub-DAGs, sub-DAG i on ``peers[i]`` (default: PEERS),
    the run spec updated with ``spec``."""
    job = load_job(REPO / "examples" / "figure3" / "job.yaml")
    traced = trace_job(job)
    partition = build_partition(traced.graph, balanced_assignment(traced.graph, pieces))
    submitted = SubmittedJob(
        job_id="j1",
        spec=run_spec_of(job, "mean").model_copy(update=spec or {}),
        ir=encode_ir(traced.graph),
        graph=traced.graph,
        state=dict(traced.state),
        data={"inputs": job.inputs, "labels": job.labels},
        submitter="me",
    )
    ckpt = Checkpoint(0, dict(traced.state))
    where = peers or PEERS[:pieces]
    requests = assignment_payloads(submitted, partition, where, {}, 1, ckpt, replica_holders=replica_holders)
    return [r.model_dump() for r in requests]


def service() -> SubtaskService:
    s = SubtaskService(FakeNode())  # type: ignore[arg-type]
    s.server, s.p2p = FakePath(), FakePath()  # type: ignore[assignment]
    return s


def call(s: SubtaskService, method: str, payload: dict[str, Any], sender: str = BROKER) -> dict[str, Any]:
    handler = getattr(s, f"rpc_{method}")
    return asyncio.run(handler(payload, RPCContext(remote_peer=sender, method=method)))


@pytest.mark.timeout(60)
def test_an_assignment_being_built_counts_as_work(assign_docs: list[dict]) -> None:
    """A calibration that gave way waits for an idle node (``running_tasks`` 0 for 10 s): a job whose
    worker is still being built must count, or the calibration restarts beside it."""
    s = service()
    seen: list[tuple[float, int]] = []
    build = s._build

    async def watched_build(*args: Any) -> Any:
        seen.append(s.node.load)
        return await build(*args)

    s._build = watched_build  # type: ignore[method-assign]
    call(s, "assign", assign_docs[1])
    assert seen == [(1 / MAX_JOBS, 1)] and s.node.load == (1 / MAX_JOBS, 1)
    with pytest.raises(IRError, match="not valid msgpack"):
        call(s, "assign", {**assign_docs[1], "job_id": "j2", "ir": b"garbage"})
    assert s.node.load == (1 / MAX_JOBS, 1) and "j2" not in s.jobs  # a build that failed is no work


@pytest.mark.timeout(60)
def test_a_release_that_comes_while_the_assignment_is_built_drops_it(assign_docs: list[dict]) -> None:
    """A job cancelled while a compnode still builds its sub-DAG (a sandbox worker forking and decoding it
    takes seconds): the broker's release comes before the job is held. The build must be dropped when it
    ends, or the compnode holds a job that is over, which nobody releases (and which its graceful leave
    then waits for). A release from another peer changes nothing; a later attempt builds afresh."""
    s = service()
    started, go = asyncio.Event(), asyncio.Event()
    build = s._build

    async def slow_build(*args: Any) -> Any:
        started.set()
        await go.wait()
        return await build(*args)

    s._build = slow_build  # type: ignore[method-assign]
    context = RPCContext(remote_peer=BROKER, method="assign")

    async def race() -> tuple[BaseException | dict, dict, dict]:
        assigning = asyncio.ensure_future(s.rpc_assign(assign_docs[1], context))  # type: ignore[arg-type]
        await started.wait()
        stranger = await s.rpc_release(
            {"job_id": "j1", "reason": "x"},  # type: ignore[arg-type]
            RPCContext(remote_peer=STRANGER, method="release"),
        )
        mine = await s.rpc_release(
            {"job_id": "j1", "reason": "the job was cancelled"},  # type: ignore[arg-type]
            RPCContext(remote_peer=BROKER, method="release"),
        )
        go.set()
        got = await asyncio.gather(assigning, return_exceptions=True)
        return got[0], stranger, mine

    outcome, stranger, mine = asyncio.run(race())
    assert stranger == {"released": False, "refused": 0} and mine == {"released": True, "refused": 0}
    assert isinstance(outcome, JobError), outcome
    assert "released by its broker (the job was cancelled) while sub-DAG 1 was being built" in str(outcome)
    assert not s.jobs and not s.server.jobs and not s._building  # type: ignore[union-attr]
    assert s.node.load == (0.0, 0)
    s._build = build  # type: ignore[method-assign]
    assert call(s, "assign", {**assign_docs[1], "attempt": assign_docs[1]["attempt"] + 1})["subdag"] == 1
    assert "j1" in s.jobs  # the next attempt is held: the release went with the build it was for


@pytest.mark.timeout(60)
def test_an_assignment_is_held_and_only_its_broker_may_drive_it(assign_docs: list[dict]) -> None:
    s = service()
    doc = assign_docs[1]
    assert call(s, "assign", doc) == {"subdag": 1, "nodes": s.jobs["j1"].nodes, "serves_direct": False}
    assert s.node.ways_made == 1  # a calibration in progress would give way to it
    assert s.server.jobs["j1"] == [PEERS[0], PEERS[2]]  # type: ignore[union-attr]  # only the job's peers
    assert call(s, "assign", doc)["subdag"] == 1  # a repeated request: same answer, same job
    with pytest.raises(JobError, match=f"peer {STRANGER} is not a broker this compnode trusts"):
        call(s, "assign", doc, sender=STRANGER)
    for method, payload in (
        ("step", {"job_id": "j1", "step": 0}),
        ("collect", {"job_id": "j1"}),
        ("release", {"job_id": "j1"}),
        ("probe_links", {"job_id": "j1", "to": [0]}),
    ):
        with pytest.raises(JobError, match=f"assigned by {BROKER}; {STRANGER} may not drive it"):
            call(s, method, payload, sender=STRANGER)
    with pytest.raises(JobError, match="no job 'j2' is assigned to this compnode"):
        call(s, "step", {"job_id": "j2", "step": 0})
    with pytest.raises(JobError, match=r"'to' must list sub-DAGs of other compnodes of the job, got \[1\]"):
        call(s, "probe_links", {"job_id": "j1", "to": [1]})
    assert call(s, "release", {"job_id": "j1", "reason": "done"}) == {"released": True, "refused": 0}
    assert not s.jobs and not s.server.jobs  # type: ignore[union-attr]
    assert call(s, "release", {"job_id": "j1"}) == {"released": False, "refused": 0}  # repeated


@pytest.mark.timeout(60)
def test_collect_comes_in_byte_ranges_under_the_bound(monkeypatch) -> None:
    """A sub-DAG's state leaves in answers of at most the chunk size (64 bytes here: every tensor split
    across several), which put together are the safetensors of exactly what one answer gives; asking
    past the last chunk is refused."""
    from fusionnet.compnode import job_host
    from fusionnet.messages.blobs import unpack_tensors

    monkeypatch.setattr(job_host, "COLLECT_CHUNK_BYTES", 64)
    s = service()
    call(s, "assign", figure3_assign_docs(2)[1])  # the second half: the linear layer's two tensors
    whole = unpack_tensors(call(s, "collect", {"job_id": "j1"})["state"], "all")
    first = call(s, "collect", {"job_id": "j1", "part": "state"})
    pieces = [first["state"]]
    for k in range(1, first["chunks"]):
        reply = call(s, "collect", {"job_id": "j1", "part": "state", "chunk": k})
        assert reply["chunks"] == first["chunks"]
        pieces.append(reply["state"])
    assert first["chunks"] > 10 and all(len(p) == 64 for p in pieces[:-1]) and 0 < len(pieces[-1]) <= 64
    got = unpack_tensors(b"".join(pieces), "joined")
    assert sorted(got) == sorted(whole) and all(torch.equal(got[k], whole[k]) for k in whole)
    assert s.jobs["j1"].host._collected is None  # the stream went with the last chunk
    with pytest.raises(JobError, match="no chunk 99999 of state"):
        call(s, "collect", {"job_id": "j1", "part": "state", "chunk": 99999})
    optim = call(s, "collect", {"job_id": "j1", "part": "optim"})  # plain SGD: an empty file
    pieces = [optim["optim"]] + [
        call(s, "collect", {"job_id": "j1", "part": "optim", "chunk": k})["optim"]
        for k in range(1, optim["chunks"])
    ]
    assert unpack_tensors(b"".join(pieces), "optim") == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("method", "payload", "field"),
    [
        ("step", {"job_id": "j1", "step": -1}, "step"),
        ("step", {"job_id": "j1"}, "step"),
        ("step", {"job_id": "../etc", "step": 0}, "job_id"),
        ("collect", {}, "job_id"),
        ("release", {"job_id": "j1", "reason": 5}, "reason"),
        ("probe_links", {"job_id": "j1", "to": []}, "to"),
        ("assign", {"job_id": "j1"}, "spec"),
    ],
)
def test_malformed_requests_are_refused_by_validation(method: str, payload: dict, field: str) -> None:
    with pytest.raises(WireError, match=rf"^rpc {method}: malformed message: {field}: "):
        call(service(), method, payload)


def _changed(doc: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**doc, **changes}


@pytest.mark.timeout(60)
def test_assignments_that_mean_nothing_are_refused_and_nothing_is_kept(assign_docs: list[dict]) -> None:
    doc = assign_docs[1]
    bad_state = pack_tensors({"not.a.parameter": torch.zeros(1)})
    link = doc["link_keys"][0]
    cases = [
        (_changed(doc, subdag=0, link_keys=[b"", link, link]), JobError, f"sub-DAG 0 is for {PEERS[0]}, not"),
        (_changed(doc, peers=doc["peers"][:2], link_keys=[link, b""]), JobError, "2 peers for 3 sub-DAGs"),
        (_changed(doc, link_keys=[link, link, link]), WireError, "link_keys: one key"),
        (_changed(doc, replica_holders=[1, 1, 0]), WireError, "replica_holders: per sub-DAG, a sub-DAG of"),
        (_changed(doc, ir=b"\x93\x01\x02\x03"), IRError, "IR: top level must be a map"),
        (_changed(doc, assignment={}), PartitionError, "not assigned"),
        (_changed(doc, state=b"not safetensors"), WireError, "assign j1: state: not a valid safetensors"),
        (_changed(doc, state=bad_state), JobError, "assign j1: state lacks"),
        (_changed(doc, data=pack_tensors({"inputs": torch.zeros(3, 1)})), JobError, "data"),
    ]
    s = service()
    for payload, error, needle in cases:
        with pytest.raises(error, match=needle):
            call(s, "assign", payload)
        assert not s.jobs and not s.server.jobs  # type: ignore[union-attr]
    assert call(s, "assign", doc)["subdag"] == 1  # and a good one still goes through


@pytest.mark.timeout(60)
def test_only_trusted_brokers_assign_and_silent_brokers_lose_their_jobs(assign_docs: list[dict]) -> None:
    """A stranger cannot take a slot (compute theft, slot exhaustion); an assignment whose broker goes
    silent past the ttl is released, one with a step running is kept."""
    s = service()
    for i in range(3):
        with pytest.raises(JobError, match="not a broker this compnode trusts"):
            call(s, "assign", {**assign_docs[1], "job_id": f"x{i}"}, sender=STRANGER)
    assert not s.jobs and s.trust.refused == 3
    call(s, "assign", assign_docs[1])
    now = time.monotonic()
    ttl = s.node.settings.assignment_ttl
    assert stale_jobs({"j1": BROKER}, s._heard, [], ttl, now=now + ttl / 2) == []
    s._pinged(STRANGER)  # a stranger's ping keeps nothing alive
    assert STRANGER not in s._heard
    assert stale_jobs({"j1": BROKER}, s._heard, ["j1"], ttl, now=now + 2 * ttl) == []  # a step runs
    assert stale_jobs({"j1": BROKER}, s._heard, [], ttl, now=now + 2 * ttl) == ["j1"]
    s._heard["j1"] -= 2 * ttl
    asyncio.run(s._expire())
    assert not s.jobs and not s.server.jobs  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_a_job_its_brokers_heartbeat_leaves_out_is_dropped_after_the_grace(assign_docs: list[dict]) -> None:
    """A release is best effort: one lost on the way would leave the job held (its worker, its slot) for
    as long as its broker lives, whose pings keep the assignment from expiring. So a broker's heartbeat
    lists the jobs it runs, and a job of that broker's held longer than the grace and not listed goes.
    A heartbeat that says nothing, another peer's list, or a fresh assignment keep it."""
    s = service()
    call(s, "assign", assign_docs[1])

    async def heartbeats() -> None:  # as the daemon's ping handler calls it: on the event loop
        s._pinged(BROKER, [])  # sent before the job existed, arriving after its assignment: too fresh
        s._pinged(BROKER, None)
        s._pinged(STRANGER, [])
        assert "j1" in s.jobs
        s.jobs["j1"].created_at -= FORGOTTEN_GRACE + 1
        s._pinged(BROKER, ["j1", "other"])
        s._pinged(STRANGER, [])
        assert "j1" in s.jobs
        lock = s._locks["j1"]
        async with lock:  # a call in progress: never under it
            s._pinged(BROKER, ["other"])
            assert "j1" in s.jobs
        s._pinged(BROKER, ["other"])
        assert not s.jobs and not s.server.jobs and s.node.load == (0.0, 0)  # type: ignore[union-attr]

    asyncio.run(heartbeats())


def test_forgotten_jobs_are_those_of_that_broker_unlisted_idle_and_old() -> None:
    held = {"a": (BROKER, 940.0), "b": (BROKER, 940.0), "c": (STRANGER, 940.0), "d": (BROKER, 995.0),
            "e": (BROKER, 940.0)}  # fmt: skip
    assert forgotten_jobs(held, BROKER, {"b"}, {"e"}, now=1000.0) == ["a"]
    assert forgotten_jobs(held, STRANGER, set(), set(), now=1000.0) == ["c"]


def test_trusted_brokers_come_from_initial_peers_and_flags() -> None:
    maddrs = [
        "/ip4/10.0.0.1/tcp/31337/p2p/QmBroker",
        "/ip4/10.0.0.2/tcp/1/ipfs/QmOther",
        "/ip4/1.2.3.4/tcp/9",
    ]

    assert peer_ids_of_maddrs(maddrs) == ["QmBroker", "QmOther"]
    trust = TrustedBrokers.from_settings(maddrs, ["QmExtra"])
    assert trust.peers == {"QmBroker", "QmOther", "QmExtra"}
    with pytest.raises(ValueError, match="--trusted-broker"):
        CompnodeConfig(trusted_brokers=("not a peer/id",))


def test_replicas_are_kept_only_from_the_sub_dag_this_node_holds_and_read_only_by_the_broker(
    assign_docs: list[dict],
) -> None:
    """Ring holders [1, 2, 0]: we (sub-DAG 1) keep sub-DAG 0's snapshots, from its compnode only."""
    s = service()
    doc = dict(assign_docs[1], replica_holders=[1, 2, 0])
    call(s, "assign", doc)
    blob = pack_tensors({"w": torch.ones(2)})
    snap = {"job_id": "j1", "attempt": 1, "subdag": 0, "step": 3, "blob": blob}
    refusals = [
        (dict(snap, subdag=2), PEERS[2], "keeps no replica of sub-DAG 2"),
        (snap, PEERS[2], "only the compnode of sub-DAG 0 may replicate it"),
        (dict(snap, attempt=0), PEERS[0], "snapshot of attempt 0, this is 1"),
        (dict(snap, part="all"), PEERS[0], "part must be 'state' or 'optim'"),
    ]
    for payload, sender, why in refusals:
        with pytest.raises(JobError, match=why):
            call(s, "replicate", payload, sender=sender)
    first = dict(snap, part="state", chunk=0, chunks=2)
    assert call(s, "replicate", first, sender=PEERS[0]) == {"complete": False}
    assert call(s, "replicas", {"job_id": "j1"}) == {"held": {}}  # half a snapshot is none
    second = dict(snap, part="optim", chunk=1, chunks=2)
    assert call(s, "replicate", second, sender=PEERS[0]) == {"complete": True}
    assert call(s, "replicas", {"job_id": "j1"}) == {"held": {"0": [3]}}
    got = call(s, "fetch_replica", {"job_id": "j1", "subdag": 0, "step": 3, "chunk": 0})
    assert got == {"part": "state", "chunks": 2, "blob": blob, "size": len(blob)}
    tail = call(s, "fetch_replica", {"job_id": "j1", "subdag": 0, "step": 3, "chunk": 0, "offset": 5})
    assert tail == {"part": "state", "chunks": 2, "blob": blob[5:], "size": len(blob)}
    with pytest.raises(JobError, match=f"{STRANGER} may not drive it"):
        call(s, "fetch_replica", {"job_id": "j1", "subdag": 0, "step": 3}, sender=STRANGER)
    with pytest.raises(JobError, match="no snapshot of sub-DAG 0 at step 2"):
        call(s, "fetch_replica", {"job_id": "j1", "subdag": 0, "step": 2})
    folder = s.replicas.folder / "j1"
    assert folder.is_dir()
    call(s, "release", {"job_id": "j1", "reason": "done"})
    assert not folder.exists()  # released: its snapshots go too


@pytest.mark.timeout(60)
def test_a_staged_slice_comes_only_from_a_trusted_broker_and_becomes_the_assignments_state(
    assign_docs: list[dict],
) -> None:
    s = service()
    doc = assign_docs[1]
    blob = doc["state"]
    staged = {**doc, "state": b"", "staged_state": len(blob)}
    part = {"job_id": "j1", "attempt": doc["attempt"], "subdag": 1, "kind": "state", "total": len(blob)}
    with pytest.raises(JobError, match="not a broker this compnode trusts"):
        call(s, "stage_state", {**part, "offset": 0, "data": blob}, sender=STRANGER)
    with pytest.raises(JobError, match="was to be staged first, but nothing was staged"):
        call(s, "assign", staged)
    half = len(blob) // 2
    assert call(s, "stage_state", {**part, "offset": 0, "data": blob[:half]}) == {"received": half}
    with pytest.raises(JobError, match=f"{half} of {len(blob)} bytes staged"):
        call(s, "assign", staged)
    assert s.staging.staged_bytes == len(blob)  # a refused assign leaves the staging for a retry
    call(s, "stage_state", {**part, "offset": half, "data": blob[half:]})
    assert call(s, "assign", staged)["subdag"] == 1
    inline = service()
    call(inline, "assign", doc)
    got, want = s.jobs["j1"].host.job.executor.state(), inline.jobs["j1"].host.job.executor.state()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert s.staging.staged_bytes == 0


@pytest.mark.timeout(60)
def test_a_new_attempts_staged_slice_survives_the_release_of_the_old_attempt(assign_docs: list[dict]) -> None:
    """A restarted broker (or a failover) stages attempt 2 while attempt 1 is still held: the assign of
    attempt 2 releases attempt 1 first, and must still find its own staged slice."""
    s = service()
    doc = assign_docs[1]
    call(s, "assign", doc)
    blob = doc["state"]
    newer = doc["attempt"] + 1
    part = {"job_id": "j1", "attempt": newer, "subdag": 1, "kind": "state", "total": len(blob)}
    call(s, "stage_state", {**part, "offset": 0, "data": blob})
    staged = {**doc, "attempt": newer, "state": b"", "staged_state": len(blob)}
    assert call(s, "assign", staged)["subdag"] == 1
    assert s.jobs["j1"].attempt == newer and s.staging.staged_bytes == 0
    call(s, "stage_state", {**part, "attempt": newer + 1, "offset": 0, "data": blob[:3]})
    call(s, "stage_state", {**part, "offset": 0, "data": blob[:3]})  # an old attempt's leftover
    call(s, "release", {"job_id": "j1"})
    assert s.staging.staged_bytes == len(blob)  # the newer attempt's staging stays, the old one went
