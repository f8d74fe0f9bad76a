"""A deployment's life on the broker off the happy path: a client leaving at the wrong moment never stops
its batcher or strands the requests batched with it; a compnode out of device memory is left out of the
next placement; a retried undeploy waits for the first; a deploy that times out ends FAILED; the
broker's stop releases every deployment at once and keeps its drain bound; and a restarted broker ends
the deployments its crashed process left, removing their weights. One process; the compnodes are fakes
(``test_jobrun_decisions``), the run, the service and the batcher are real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import fusionnet.broker.deployments as deployments_module
from fusionnet.broker.checkpoints import JobFiles
from fusionnet.broker.deployment_run import DeploymentRun
from fusionnet.broker.deployments import DeploymentService
from fusionnet.broker.jobs import JobService
from fusionnet.broker.serve_links import ServeLinks
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.codec import decode_ir
from fusionnet.errors import DeviceMemoryError
from fusionnet.job.loader import load_job
from fusionnet.messages.blobs import pack_tensors, unpack_tensors
from fusionnet.messages.serving_rpc import ServingClient
from fusionnet.runtime.submit import submission_payload
from fusionnet.serving.answers import RowsFailed
from fusionnet.serving.batching import DynamicBatcher
from tests.test_jobrun_decisions import FakeCompnodes, make_context

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_client_leaving_while_the_collector_waits_for_a_slot_does_not_stop_the_batcher() -> None:
    """The collector waited for a pipeline slot with one request queued; that client left, and the
    queue was purged (the broker's batch observer reads its depth) before the collector woke: it read
    the first of no requests and died, and the deployment answered nobody again."""

    async def scenario() -> None:
        gate, entered = asyncio.Event(), asyncio.Event()

        async def run_batch(rows: torch.Tensor, pick: Any) -> torch.Tensor:
            entered.set()
            await gate.wait()
            return rows.float()

        batcher: DynamicBatcher
        batcher = DynamicBatcher(
            run_batch, max_batch=4, max_wait=0.0, queue_limit=8, in_flight=1,
            on_batch=lambda stats: batcher.queued_rows,  # as the broker's metrics read it
        )  # fmt: skip
        batcher.start()
        try:
            first = batcher.enqueue(torch.ones(1, 2))
            await asyncio.wait_for(entered.wait(), 10)  # it holds the only slot
            gone = batcher.enqueue(torch.ones(1, 2))
            await _turns()  # the collector waits for the slot
            gone.cancel()
            gate.set()
            assert (await asyncio.wait_for(first, 10)).shape == (1, 2)
            later = batcher.enqueue(torch.ones(1, 2))
            assert (await asyncio.wait_for(later, 10)).shape == (1, 2)
        finally:
            await batcher.close()

    asyncio.run(scenario())


def test_a_client_leaving_while_its_request_runs_alone_leaves_the_others_answered() -> None:
    """A batch failed on its rows, so its requests run one by one; the first one's client left during
    its run: setting its answer raised, the batch's task died and the other request waited forever."""

    async def scenario() -> None:
        alone, go_on = asyncio.Event(), asyncio.Event()
        calls = 0

        async def run_batch(rows: torch.Tensor, pick: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RowsFailed("a row the model fails on")
            if calls == 2:  # the first request, alone: its client leaves while it runs
                alone.set()
                await go_on.wait()
            return rows.float()

        batcher = DynamicBatcher(run_batch, max_batch=8, max_wait=0.0, queue_limit=8, in_flight=1)
        batcher.start()
        try:
            first, second = batcher.enqueue(torch.ones(1, 2)), batcher.enqueue(torch.ones(1, 2))
            await asyncio.wait_for(alone.wait(), 10)
            first.cancel()
            go_on.set()
            assert (await asyncio.wait_for(second, 10)).shape == (1, 2)
        finally:
            await batcher.close()

    asyncio.run(scenario())


def test_a_compnode_out_of_device_memory_is_left_out_of_the_next_placement(tmp_path: Path) -> None:
    """serve_step's error did not name its compnode, so the deployment placed itself again on the same
    ones and failed there, attempt after attempt."""
    payload = submission_payload(load_job(REPO / "examples/mlp/infer.yaml", deployment=True), deployment=True)
    fake = FakeCompnodes()
    answered_by_fake = fake.call
    run: DeploymentRun
    small: list[str] = []

    async def call(peer: str, method: str, body: Any = None, **kw: Any) -> Any:
        if method != "serve_step":
            return await answered_by_fake(peer, method, body, **kw)
        if peer in small:
            raise DeviceMemoryError("sub-DAG 0: FP of step 0 micro-batch 0 ran out of memory on cuda:0")
        if run.peers.index(peer) < len(run.peers) - 1:
            return {"step": body["step"], "fp_seconds": 0.001}
        rows = sum(body["sizes"])
        return {
            "step": body["step"],
            "fp_seconds": 0.001,
            "outputs": pack_tensors({"0/0": torch.zeros(rows, 4)}),
        }

    fake.call = call  # type: ignore[method-assign]
    ctx = make_context(tmp_path, fake)
    state = JobFiles(tmp_path / "deployments" / "d1").write_submitted_state(payload.state)
    data = unpack_tensors(payload.data, "data")
    job = SubmittedJob("d1", payload.spec, payload.ir, decode_ir(payload.ir), state, data, "me")
    ctx.store.create_job("d1", "deploy:mlp", steps=0, submitter="me")
    run = DeploymentRun(ctx, job, tmp_path / "deployments" / "d1", ServingClient(call), cached=False)

    async def scenario() -> None:
        task = asyncio.ensure_future(run.run())
        try:
            await asyncio.wait_for(run.placed.wait(), 30)
            small.append(run.peers[0])
            out = await run.run_batch(torch.zeros(3, 16), None)
            assert out.shape == (3, 4)
            assert run.unfit == {small[0]} and small[0] not in run.peers and not run.dead
        finally:
            await run.stop()
            await task

    asyncio.run(scenario())


class _Run(DeploymentRun):
    """A deployment run whose placement and release take as long as told (the rest is ``run()``'s)."""

    place_seconds = 0.0
    release_seconds = 0.0
    released: list[str] = []

    def __init__(self, ctx: Any, job: Any, folder: Path, serving: Any, *, cached: bool = False) -> None:
        self.ctx, self.job, self.serving, self.cached = ctx, job, serving, cached
        self.placed, self.stopping = asyncio.Event(), asyncio.Event()
        self.failed = self.abandoned = self.unplaced = self._placement = None
        self.batches = self.attempt = self.batch_rows = 0
        self.batch_seconds, self.stage_seconds, self.peers = 0.0, [], []
        self.progress = SimpleNamespace(placement=None)
        self.watch = SimpleNamespace(detach=lambda: None)
        self.row_shape, self.row_dtype, self.mb_rows = (2,), torch.float32, 1
        self.links = ServeLinks()

    async def _place(self, replan: Any) -> None:
        await asyncio.sleep(self.place_seconds)
        self.peers, self.attempt = ["A", "B"], self.attempt + 1
        self.placed.set()

    async def _release_all(self, why: str, only: Any = None) -> None:
        await asyncio.sleep(self.release_seconds)
        _Run.released.append(self.job.job_id)

    def _update_job_gauges(self) -> None:
        pass


def _service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[DeploymentService, Any]:
    ctx = make_context(tmp_path, FakeCompnodes())
    service = DeploymentService(ctx, serving=None)  # type: ignore[arg-type]
    count = [0]

    async def accept(request: Any, submitter: str) -> Any:
        count[0] += 1
        job_id = f"job{count[0]}"
        ctx.store.create_job(job_id, f"deploy:{request.name}", steps=0, submitter=submitter)
        return SimpleNamespace(job_id=job_id, spec=SimpleNamespace(batch_size=4, name=request.name))

    async def signed_by_p(request: Any, context: Any) -> str:  # signatures: tests/test_deploy_auth.py
        return "P"

    monkeypatch.setattr(service, "_accept", accept)
    monkeypatch.setattr(service, "_who_deploys", signed_by_p)
    monkeypatch.setattr(service, "_who_undeploys", lambda request, context: "P")
    monkeypatch.setattr(deployments_module, "DeploymentRun", _Run)
    _Run.released, _Run.place_seconds, _Run.release_seconds = [], 0.0, 0.0
    return service, ctx


def _deploy(service: DeploymentService, name: str) -> Any:
    settings = SimpleNamespace(max_wait_ms=1, queue_limit=8, in_flight=1)
    request = SimpleNamespace(
        name=name, kind="infer", kv=None, tokenizer=None, vocab=None, eos_token_ids=[], settings=settings
    )
    return DeploymentService.rpc_deploy.__wrapped__(service, request, SimpleNamespace(remote_peer="P"))  # type: ignore[attr-defined]


def _undeploy(service: DeploymentService, name: str) -> Any:
    request = SimpleNamespace(name=name)
    return DeploymentService.rpc_undeploy.__wrapped__(service, request, SimpleNamespace(remote_peer="P"))  # type: ignore[attr-defined]


def test_a_retried_undeploy_waits_for_the_first_and_the_name_stays_taken_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = _service(tmp_path, monkeypatch)

    async def scenario() -> None:
        await _deploy(service, "m")
        _Run.release_seconds = 0.5
        first = asyncio.ensure_future(_undeploy(service, "m"))
        await _turns()
        with pytest.raises(Exception, match="is being undeployed"):
            await _deploy(service, "m")
        again = await _undeploy(service, "m")  # the RPC client's retry of a call whose stream closed
        assert again.undeployed and _Run.released == ["job1"]
        assert (await first).undeployed
        await _deploy(service, "m")  # free again
        await service.stop()

    asyncio.run(scenario())


def test_a_deploy_that_is_not_placed_in_time_ends_failed_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, ctx = _service(tmp_path, monkeypatch)
    monkeypatch.setattr(deployments_module, "PLACE_TIMEOUT", 0.2)
    _Run.place_seconds = 60.0  # far beyond the undeploy's 30 s grace: the run is not waited for

    async def scenario() -> None:
        with pytest.raises(Exception, match=r"not placed within 0\.2 s"):
            await asyncio.wait_for(_deploy(service, "m"), 20)
        row = ctx.store.get_job("job1")
        assert (row["state"], row["error"]) == ("FAILED", "not placed within 0.2 s")
        assert _Run.released == ["job1"]

    asyncio.run(scenario())


def test_stop_releases_every_deployment_at_once_and_a_cancelled_stop_stays_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, _ = _service(tmp_path, monkeypatch)

    async def scenario() -> None:
        for name in ("a", "b", "c"):
            await _deploy(service, name)
        _Run.release_seconds = 0.3
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(service.stop(), 10)
        assert sorted(_Run.released) == ["job1", "job2", "job3"] and loop.time() - started < 0.8
        for name in ("d", "e"):
            await _deploy(service, name)
        _Run.release_seconds = 5.0
        stopping = asyncio.ensure_future(service.stop())
        async with asyncio.timeout(10):
            while service.served:  # both are being released
                await asyncio.sleep(0)
        stopping.cancel()  # the daemon's drain time is up
        with pytest.raises(asyncio.CancelledError):
            await stopping

    asyncio.run(scenario())


def test_a_restarted_broker_ends_the_deployments_its_last_process_left_and_removes_their_files(
    tmp_path: Path,
) -> None:
    ctx = make_context(tmp_path, FakeCompnodes())
    ctx.store.create_job("dep1", "deploy:m", steps=0, submitter="P")
    ctx.store.update_job("dep1", state="RUNNING")
    service = DeploymentService(ctx, serving=None)  # type: ignore[arg-type]
    weights = JobFiles(service.folder / "dep1").submission / "state.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"x" * 100)

    async def scenario() -> None:
        jobs = JobService(ctx)
        await jobs.start()  # a deployment's row is not a job to resume
        await service.start()
        await jobs.stop()

    asyncio.run(scenario())
    row = ctx.store.get_job("dep1")
    assert row["state"] == "FAILED" and "broker restarted" in row["error"]
    assert not (service.folder / "dep1").exists()
