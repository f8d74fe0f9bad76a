"""The attacks of issue 12 replayed against a real loopback swarm (a broker and two compnodes, one swarm
for the whole module): each is refused or contained, the daemons keep serving, and a legitimate job
submitted after them succeeds with PyTorch's weights.

The attacker is an ordinary peer of the swarm (its own libp2p identity, its own submitter key): it
assigns itself work on a compnode, fills the compnode's job slots, submits without being allowed,
floods the broker with large RPC requests, announces itself as a broker in the DHT, and asks for the
status, results and cancellation of someone else's job.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.torch import load_file

from fusionnet.broker.assignment_payloads import assignment_payloads
from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.broker.submission import SubmittedJob
from fusionnet.daemon.swarm import SwarmPeer
from fusionnet.dag.codec import encode_ir
from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.dht.node import DHTConfig
from fusionnet.dht.records import BrokerRecord, NodeState
from fusionnet.errors import FusionNetError, JobError, WireError
from fusionnet.job.loader import load_job
from fusionnet.messages.jobwire import run_spec_of
from fusionnet.reference import run_reference
from fusionnet.rpc import as_peer_id
from fusionnet.rpc.protocol import STREAM_PROTOCOL, decode_response, encode_request, frame_header
from fusionnet.rpc.server import RPCContext
from fusionnet.rpc.streams import read_frame
from fusionnet.runtime.prepare import trace_job
from fusionnet.runtime.process_swarm import BlockingObserver, ProcessSwarm, running_swarm
from fusionnet.runtime.submit import signed, submission_payload, submit_and_wait
from fusionnet.runtime.submitter import Signer, load_or_create_key
from tests.jobfiles import REPO, example_job

pytestmark = pytest.mark.swarm

RPC_MAX_MB = 64  # the broker's --rpc-max-mb: per-peer request budget 64 MiB, total 128 MiB
FLOOD = 8  # concurrent requests of FLOOD_MB each from the attacker
FLOOD_MB = 48
TOL = 1e-5


@dataclass
class FakeBroker:
    """What the attacker serves as a broker: it records every call it gets."""

    calls: list[str] = field(default_factory=list)

    async def rpc_submit_job(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        self.calls.append("submit_job")
        return {"job_id": "stolen", "steps": 1}

    async def rpc_status(self, payload: dict[str, Any], context: RPCContext) -> dict[str, Any]:
        self.calls.append("status")
        return {"broker": {}, "compnodes": [], "jobs": []}


class Attacker:
    """A peer of the swarm with an RPC server (to pose as a broker), its own key, on its own loop."""

    def __init__(self, initial_peers: list[str]) -> None:
        self.runner = asyncio.Runner()
        self.fake = FakeBroker()
        self.peer: SwarmPeer = self.run(
            SwarmPeer.start(DHTConfig(initial_peers=tuple(initial_peers)), serve=True)
        )
        assert self.peer.server is not None
        self.peer.server.add_handlers(self.fake)
        self.run(self.peer.server.start())
        self.key = Ed25519PrivateKey.from_private_bytes(b"attacker".ljust(32, b"\0"))

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return self.runner.run(asyncio.wait_for(coro, timeout))

    def call(self, peer: str, method: str, payload: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        return self.run(self.peer.client.call(peer, method, payload, timeout=timeout))

    def signer(self, broker: str) -> Signer:
        return Signer(self.key, broker, self.peer.peer_id)

    def close(self) -> None:
        try:
            self.run(self.peer.stop(rpc_grace=0.0))
        finally:
            self.runner.close()


@dataclass
class Secured:
    swarm: ProcessSwarm
    observer: BlockingObserver
    attacker: Attacker
    workdir: Path
    legit: dict[str, str] = field(default_factory=dict)  # the legitimate job: id, output folder

    @property
    def broker(self) -> str:
        return self.swarm.broker.peer_id  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    workdir = tmp_path_factory.mktemp("security")
    allowed = workdir / "submitters"
    allowed.write_text(Signer(load_or_create_key(), "", "").submitter_id + "  # the session's submitter\n")
    extra = ["--submitters", str(allowed), "--rpc-max-mb", str(RPC_MAX_MB), "--max-steps", "1000"]
    with running_swarm(workdir / "swarm", [{}, {}], broker_kw={"extra": extra}) as sw:
        observer = BlockingObserver(sw.initial_peers)
        attacker = None
        try:
            observer.wait_online(2, 120)
            attacker = Attacker(sw.initial_peers)
            yield Secured(sw, observer, attacker, workdir)
        finally:
            if attacker is not None:
                attacker.close()
            observer.close()


def rogue_assignment(job_id: str, peers: list[str]) -> dict[str, Any]:
    """A well-formed ``assign`` of figure3's sub-DAG 1 (what a broker would send), from the attacker."""
    job = load_job(REPO / "examples" / "figure3" / "job.yaml")
    traced = trace_job(job)
    partition = build_partition(traced.graph, balanced_assignment(traced.graph, len(peers)))
    submitted = SubmittedJob(
        job_id=job_id,
        spec=run_spec_of(job, "mean"),
        ir=encode_ir(traced.graph),
        graph=traced.graph,
        state=dict(traced.state),
        data={"inputs": job.inputs, "labels": job.labels},
        submitter="attacker",
    )
    requests = assignment_payloads(submitted, partition, peers, {}, 1, Checkpoint(0, dict(traced.state)))
    return requests[1].model_dump()


@pytest.mark.timeout(180)
def test_rogue_assignments_and_slot_exhaustion_are_refused(secured: Secured) -> None:
    attacker = secured.attacker
    victim = secured.swarm.compnodes[0].peer_id
    doc = rogue_assignment("rogue0", [attacker.peer.peer_id, victim])
    for i in range(20):  # more than the 16 job slots a compnode has
        with pytest.raises(
            JobError, match=f"peer {attacker.peer.peer_id} is not a broker this compnode trusts"
        ):
            attacker.call(victim, "assign", {**doc, "job_id": f"rogue{i}"})
    for method, payload in (("step", {"job_id": "rogue0", "step": 0}), ("collect", {"job_id": "rogue0"})):
        with pytest.raises(JobError, match="no job 'rogue0' is assigned"):
            attacker.call(victim, method, payload)
    record = secured.observer.call(victim, "info", {})
    assert record["running_tasks"] == 0 and record["state"] == "ONLINE"
    assert "not a trusted broker" in secured.swarm.compnodes[0].log_text()


@pytest.mark.timeout(180)
def test_an_unauthorised_or_unsigned_submission_is_refused(secured: Secured) -> None:
    attacker, broker = secured.attacker, secured.broker
    request = submission_payload(load_job(example_job("mlp", secured.workdir, steps=2)))
    forged = signed(request, attacker.signer(broker))
    with pytest.raises(JobError, match=f"submitter {attacker.signer(broker).submitter_id} may not submit"):
        attacker.call(broker, "submit_job", forged.model_dump(), timeout=60)
    with pytest.raises(JobError, match="not signed by a submitter key"):
        attacker.call(broker, "submit_job", request.model_dump(), timeout=60)
    # The allowed user's signature, lifted and sent from the attacker's peer, is bound to the user's peer.
    lifted = signed(request, Signer(load_or_create_key(), broker, secured.observer.peer_id))
    with pytest.raises(JobError, match="bad submitter signature"):
        attacker.call(broker, "submit_job", lifted.model_dump(), timeout=60)
    assert not [j for j in secured.observer.broker_status()["jobs"]]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _flood_one(attacker: Attacker, broker: str, nbytes: int) -> str:
    """One large, valid ``status`` request over a raw stream; the broker's answer (ok or error kind)."""
    body = encode_request("status", {"job_limit": 0, "pad": b"\0" * nbytes})
    _, reader, writer = await attacker.peer.p2p.call_binary_stream_handler(
        as_peer_id(broker), STREAM_PROTOCOL
    )
    answer = asyncio.ensure_future(read_frame(reader, 1 << 20, 120.0, "answer"))  # a refusal comes early
    try:
        writer.write(frame_header(len(body)))
        for offset in range(0, len(body), 1 << 20):
            if answer.done():
                break
            writer.write(body[offset : offset + (1 << 20)])
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the broker refused and closed the stream: its answer is already in
    try:
        response = decode_response(await answer)
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return "closed"
    finally:
        writer.close()
    return "ok" if response.error is None else response.error[1]


@pytest.mark.timeout(240)
def test_an_rpc_flood_is_refused_over_budget_and_memory_stays_bounded(secured: Secured) -> None:
    broker_pid = secured.swarm.broker.pid  # type: ignore[union-attr]
    baseline = _rss_kib(broker_pid)
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kib(broker_pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:

        async def flood() -> list[Any]:
            calls = [_flood_one(secured.attacker, secured.broker, FLOOD_MB << 20) for _ in range(FLOOD)]
            return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = secured.attacker.run(flood(), timeout=180)
    finally:
        done.set()
        sampler.join()
    growth_mib = (peak[0] - baseline) / 1024
    refused = [o for o in outcomes if isinstance(o, str) and "bytes of requests in flight" in o]
    print(
        f"rpc flood: {FLOOD} x {FLOOD_MB} MiB from one peer in {time.monotonic() - started:.1f} s: "
        f"{sum(o == 'ok' for o in outcomes)} served, {len(refused)} refused over budget; broker RSS "
        f"{baseline / 1024:.0f} MiB -> peak {peak[0] / 1024:.0f} MiB (+{growth_mib:.0f} MiB)"
    )
    assert refused, outcomes
    assert not [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, FusionNetError)]
    # At most one 64 MiB budget of requests in flight from one peer: the body, its decoded copy, slack.
    assert growth_mib < 4 * RPC_MAX_MB, f"broker grew by {growth_mib:.0f} MiB under the flood"
    assert secured.observer.broker_status()["broker"]["peer_id"] == secured.broker  # still serving


@pytest.mark.timeout(300)
def test_a_fake_broker_record_does_not_divert_a_submission_which_succeeds_exactly(secured: Secured) -> None:
    attacker = secured.attacker
    maddrs = attacker.run(attacker.peer.visible_maddrs())
    fake = BrokerRecord(peer_id=attacker.peer.peer_id, state=NodeState.ONLINE, maddrs=maddrs, version="9.9")
    assert attacker.run(attacker.peer.announcer.announce(fake, ttl=120))
    brokers = {f.record.peer_id for f in secured.observer.brokers()}
    assert attacker.peer.peer_id in brokers  # the record is in the DHT: it is its own, validly signed
    job_path = example_job("mlp", secured.workdir, steps=4)
    out = secured.workdir / "legit"
    try:
        outcome = asyncio.run(
            asyncio.wait_for(submit_and_wait(job_path, secured.swarm.initial_peers, out, timeout=240), 280)
        )
        assert outcome.state == "SUCCEEDED"
        ref = run_reference(load_job(job_path))
    finally:
        job_path.unlink()
    got = load_file(out / "weights.safetensors")
    assert sorted(got) == sorted(ref.weights)
    assert max((got[k].double() - ref.weights[k].double()).abs().max().item() for k in got) <= TOL
    assert attacker.fake.calls == []  # nothing ever went to the fake broker
    secured.legit.update(job_id=outcome.job_id, output=str(out))


@pytest.mark.timeout(180)
def test_another_key_cannot_see_fetch_or_cancel_the_job(secured: Secured) -> None:
    job_id = secured.legit.get("job_id")
    assert job_id, "the legitimate job of the test before did not run"
    attacker, broker = secured.attacker, secured.broker
    signer = attacker.signer(broker)
    for method in ("job_status", "job_results", "cancel_job"):
        with pytest.raises(JobError, match=f"no job '{job_id}' submitted with this key"):
            attacker.call(
                broker, method, {"job_id": job_id, "auth": signer.auth(method, job_id).model_dump()}
            )
        with pytest.raises(JobError, match="not signed"):
            attacker.call(broker, method, {"job_id": job_id})
    unsigned = attacker.call(broker, "status", {})["jobs"]
    row = next(j for j in unsigned if j["job_id"] == job_id)
    assert row["state"] == "SUCCEEDED" and row["name"] is None and row["loss"] is None  # no details
    # The submitter still has it all, and the daemons still serve.
    status = secured.observer.as_submitter("job_status", {"job_id": job_id})
    assert status["job"]["state"] == "SUCCEEDED" and status["metrics"]
    files = secured.observer.as_submitter("job_results", {"job_id": job_id}, timeout=60)["files"]
    assert (
        files["weights.safetensors"] == (Path(secured.legit["output"]) / "weights.safetensors").read_bytes()
    )
    secured.observer.wait_online(2, 30)
    with pytest.raises(WireError):  # garbage still gets a clear refusal
        attacker.call(broker, "job_status", {"job_id": "../x"})
