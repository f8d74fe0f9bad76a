"""Deployments on the broker (issue 14): the ``deploy``/``undeploy``/``deployments`` RPCs and the HTTP API.

``deploy`` checks the submission as ``submit_job`` does (IR through the allowlist, state against the IR,
example data against the spec, the per-submitter quotas, where a live deployment counts as a job),
creates a job row (so the deployment shows in ``fusionnet status`` and its placement events are recorded
like a job's), starts a ``DeploymentRun`` and answers once the sub-DAGs are assigned, with the endpoint
URL. Each deployment gets a ``DynamicBatcher`` feeding its run, which the HTTP API
(``fusionnet.serving.http``, on ``--http-port``) looks up by name.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from fusionnet.broker.admission import Admission, Hold
from fusionnet.broker.checkpoints import JobFiles
from fusionnet.broker.context import JobContext
from fusionnet.broker.deployment_run import DeploymentRun
from fusionnet.broker.deployment_windows import cached_window, end_of_text, window_of
from fusionnet.broker.store import DEPLOYMENT_ROW, JobState
from fusionnet.broker.submission import SubmittedJob, check_submission
from fusionnet.dag.codec import decode_ir
from fusionnet.errors import ExecutionError, JobError
from fusionnet.messages.auth import verify_auth
from fusionnet.messages.base import handles
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.serving_rpc import (
    DeploymentsReply,
    DeploymentsRequest,
    DeployReply,
    DeployRequest,
    ServingClient,
    UndeployReply,
    UndeployRequest,
    deploy_subject,
)
from fusionnet.rpc.server import RPCContext
from fusionnet.serving.batching import BatchStats, DynamicBatcher
from fusionnet.serving.http import start_api
from fusionnet.serving.kv_sessions import SlotPool
from fusionnet.serving.served import ServedModel, ServingObserver
from fusionnet.serving.tokenizers import CharTokenizer, load_tokenizer

log = logging.getLogger("fusionnet.broker.deployments")

MAX_DEPLOYMENTS = 8
PLACE_TIMEOUT = 180.0  # ``deploy`` answers once placed, or fails after this long
REMEMBERED_UNDEPLOYS = 64  # names whose undeploy a retried call may repeat


class DeploymentService:
    name = "deployments"

    def __init__(
        self,
        context: JobContext,
        serving: ServingClient,
        *,
        http_host: str = "127.0.0.1",
        http_port: int | None = None,
        observer: ServingObserver | None = None,
        admission: Admission | None = None,
    ) -> None:
        """``admission``: who may deploy (the job service's policy: the same submitters as jobs)."""
        self.ctx = context
        self._admission = admission
        self.serving = serving
        self.http_host, self.http_port = http_host, http_port
        self.observer = observer
        self.served: dict[str, ServedModel] = {}
        self.runs: dict[str, DeploymentRun] = {}
        # names of deployments being accepted: a second deploy of one (a retried call, say) while the
        # first awaits its submission must be refused, not overwrite it and leave its compnodes held
        self._arriving: set[str] = set()
        # name -> its place in its submitter's --max-jobs-per-submitter (counted with its jobs) while it
        # is accepted; then its run task keeps it until it ends
        self._holds: dict[str, Hold] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # name -> who undeployed it, for the last few: a repeated undeploy (the RPC client retries a
        # stream that closed before its answer) gets the first one's answer, not "no deployment"
        self._undeployed: OrderedDict[str, str] = OrderedDict()
        # name -> done when its undeploy has released everything: a retried undeploy waits for it, and
        # a new deploy of the name waits until the old one holds no compnode
        self._undeploying: dict[str, asyncio.Future[None]] = {}
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    # ---- ``Deployments`` for the HTTP API ------------------------------------------------------
    def get(self, name: str) -> ServedModel | None:
        return self._current(self.served.get(name))

    def all(self) -> list[ServedModel]:
        return [self._current(m) for m in self.served.values()]

    def _current(self, model: ServedModel | None) -> ServedModel | None:
        """``model`` with its compnode count as its placement is now (a failover may have moved it to
        fewer; none while no placement can be made), for ``/v1/models`` and ``status``."""
        run = None if model is None else self.runs.get(model.name)
        if model is not None and run is not None:
            model.compnodes = len(run.peers) if run.placed.is_set() else 0
        return model

    def describe(self) -> list[dict[str, object]]:
        """For ``status``: name, kind, job id, compnodes, batches served, queued rows."""
        out = []
        for name, model in self.served.items():
            run = self.runs[name]
            self._current(model)
            placement = run.progress.placement  # per sub-DAG: peer, nodes, predicted seconds per step
            out.append(
                model.describe()
                | {
                    "peers": list(run.peers),
                    "batches": run.batches,
                    "attempt": run.attempt,
                    "placement": placement,
                    "predicted_step_seconds": run.predicted_step,
                    "max_batch": model.batcher.max_batch,
                    "in_flight": model.batcher.in_flight,
                    # why it has no placement now (every compnode gone): requests get 503 until one joins
                    "unplaced": None if run.unplaced is None else str(run.unplaced)[:300],
                    "model": run.model_figures(),
                    **run.timing(),
                }
            )
        return out

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._end_the_last_process_rows()
        await asyncio.to_thread(self._remove_the_last_process_files)
        if self.http_port is None:
            return
        self._runner, self.url = await start_api(self, self.observer, self.http_host, self.http_port)
        log.info("HTTP API on %s", self.url)

    def _end_the_last_process_rows(self) -> None:
        """Deployments do not outlive their broker process (their sessions, caches and batches live in
        it): the rows a crashed one left live end FAILED saying so (``_remove_..._files``: its weights)."""
        for row in self.ctx.store.list_jobs(10_000):
            name = str(row.get("name") or "")
            if name.startswith(DEPLOYMENT_ROW) and not JobState(row["state"]).terminal:
                why = "the broker restarted; a deployment does not survive that: deploy it again"
                self.ctx.store.update_job(row["job_id"], state=JobState.FAILED, error=why)

    def _remove_the_last_process_files(self) -> None:
        if self.folder.is_dir():
            for leftover in self.folder.iterdir():
                JobFiles(leftover).forget()

    async def stop(self) -> None:
        # all at once: each releases its compnodes within the daemon's drain time, not after the others
        await asyncio.gather(*(self._undeploy(name, "the broker stops") for name in list(self.served)))
        if self._runner is not None:
            await self._runner.cleanup()

    def _on_batch(self, name: str) -> Callable[[BatchStats], None]:
        def observe(stats: BatchStats) -> None:
            model = self.served.get(name)
            if self.observer is not None and model is not None:
                slots = None if model.kv is None else model.kv.in_use
                queued = model.batcher.queued_rows
                self.observer.observe_batch(
                    name, stats.rows, stats.seconds, queued, slots, stats.missed, failed=stats.failed
                )

        return observe

    @property
    def folder(self) -> Path:
        return self.ctx.jobs_dir.parent / "deployments"

    # ---- who asks -------------------------------------------------------------------------------
    @property
    def admission(self) -> Admission:
        if self._admission is None:  # a broker without a job service: the same policy, its own
            settings = self.ctx.settings
            self._admission = Admission.create(settings.admission, settings.common.dht.host_maddrs)
        return self._admission

    async def _who_deploys(self, request: DeployRequest, context: RPCContext) -> str:
        """The submitter of a deploy signed by one this broker takes work from, else ``JobError``."""
        sub = request.submission
        self.admission.check_size(len(sub.ir) + len(sub.state) + len(sub.data))  # before hashing it all
        subject = await asyncio.to_thread(deploy_subject, request)  # hashes the state: seconds at GBs
        caller = str(context.remote_peer)
        return self.admission.authorise(
            request.auth, broker=self.ctx.broker_id(), caller=caller, scope="deploy", subject=subject
        )

    def _who_undeploys(self, request: UndeployRequest, context: RPCContext) -> str:
        """The submitter an undeploy is signed by (its deployer's, checked against the job row)."""
        caller = str(context.remote_peer)
        return verify_auth(
            request.auth, broker=self.ctx.broker_id(), caller=caller, scope="undeploy", subject=request.name
        )

    # ---- RPC -----------------------------------------------------------------------------------
    @handles(DeployRequest)
    async def rpc_deploy(self, request: DeployRequest, context: RPCContext) -> DeployReply:
        name = request.name
        submitter = await self._who_deploys(request, context)  # first: a stranger learns no names
        if name in self.served or name in self._arriving:
            raise JobError(f"a deployment named {name!r} exists already; undeploy it first or pick --name")
        if name in self._undeploying:
            raise JobError(f"deployment {name!r} is being undeployed; deploy it again once it is gone")
        if len(self.served.keys() | self._arriving) >= MAX_DEPLOYMENTS:
            raise JobError(
                f"the broker already serves {MAX_DEPLOYMENTS} deployments (its most); undeploy one first"
            )
        # Counted from the check on, with no await between: concurrent deploys and submissions of one
        # submitter each see the others' (its jobs hold theirs in the same ``Admission``).
        hold = self._holds[name] = self.admission.hold(submitter)
        self._arriving.add(name)
        try:
            return await self._deploy(name, request, submitter)
        except BaseException:
            hold.release()
            raise
        finally:
            self._arriving.discard(name)
            self._holds.pop(name, None)

    async def _deploy(self, name: str, request: DeployRequest, submitter: str) -> DeployReply:
        job = await self._accept(request, submitter)
        try:
            run = DeploymentRun(
                self.ctx, job, self.folder / job.job_id, self.serving, cached=request.kv is not None
            )
            window = None
            if request.kind == "generate":
                window = window_of(run) if request.kv is None else cached_window(run, request.kv.window)
            tokenizer = None
            if request.tokenizer:
                tokenizer = await asyncio.to_thread(
                    load_tokenizer, request.tokenizer, self.folder / job.job_id
                )
            elif request.vocab:
                tokenizer = CharTokenizer(request.vocab)
            eos = end_of_text(request.eos_token_ids, tokenizer, window)
        except Exception as e:
            self.ctx.store.update_job(job.job_id, state="FAILED", error=str(e)[:500])
            await asyncio.to_thread(JobFiles(self.folder / job.job_id).forget)
            raise
        batcher = DynamicBatcher(
            run.run_batch,
            max_batch=job.spec.batch_size,
            max_wait=request.settings.max_wait_ms / 1000.0,
            queue_limit=request.settings.queue_limit,
            in_flight=request.settings.in_flight,
            on_batch=self._on_batch(name),
        )
        observer = self.observer
        slots_seen = None if observer is None else lambda in_use: observer.observe_kv_slots(name, in_use)
        model = ServedModel(
            name=name,
            kind=request.kind,
            job_id=job.job_id,
            # /v1/infer on a KV deployment takes token sequences of the window (scored as prefills)
            row_shape=run.row_shape if request.kv is None else (request.kv.window,),
            row_dtype=run.row_dtype,
            batcher=batcher,
            window=window,
            tokenizer=tokenizer,
            eos_token_ids=eos,
            kv=None
            if request.kv is None
            else SlotPool(request.kv.slots, request.settings.queue_limit, slots_seen),
            epoch=lambda: run.attempt,
        )
        task = asyncio.get_running_loop().create_task(run.run(), name=f"deployment-{name}")
        self.runs[name], self._tasks[name], self.served[name] = run, task, model
        if self.observer is not None:
            self.observer.serve_deployment(name)
            self.observer.observe_deployments(len(self.served))
        self.ctx.live_jobs.add(job.job_id)  # until its run ends (undeployed, or failed)
        hold = self._holds.pop(name)  # so is its place in its submitter's quota

        def ended(_t: asyncio.Task[None]) -> None:
            self.ctx.live_jobs.discard(job.job_id)
            hold.release()

        task.add_done_callback(ended)
        placed = asyncio.ensure_future(run.placed.wait())
        await asyncio.wait({placed, task}, timeout=PLACE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        placed.cancel()
        if not run.placed.is_set():
            why = run.failed or f"not placed within {PLACE_TIMEOUT:g} s"
            run.abandon(why)
            await self._undeploy(name, why)
            raise ExecutionError(f"deployment {name}: {why}")
        model.compnodes = len(run.peers)
        batcher.start()
        log.info("deployment %s (%s) on %d compnodes", name, request.kind, len(run.peers))
        return DeployReply(name=name, job_id=job.job_id, compnodes=len(run.peers), url=self.url)

    async def _accept(self, request: DeployRequest, submitter: str) -> SubmittedJob:
        sub = request.submission
        spec = sub.spec
        if spec.task != "infer":
            raise JobError(f"deploy: the submission's task must be infer, got {spec.task!r}")
        graph = await asyncio.to_thread(decode_ir, sub.ir)
        self.admission.check_quota(submitter, running=0, steps=0, nodes=len(graph.nodes), nbytes=0)
        if graph.task != "infer":
            raise JobError(f"deploy: the IR was traced for task {graph.task!r}, not infer")
        job_id = secrets.token_hex(6)
        files = JobFiles(self.folder / job_id)
        data = unpack_tensors(sub.data, "deploy: data")
        try:
            state = await asyncio.to_thread(files.write_submitted_state, sub.state)
            await asyncio.to_thread(check_submission, graph, state, data, spec)
        except BaseException:
            files.forget()
            raise
        self.ctx.store.create_job(job_id, f"{DEPLOYMENT_ROW}{request.name}", steps=0, submitter=submitter)
        return SubmittedJob(job_id, spec, sub.ir, graph, state, data, submitter)

    @handles(UndeployRequest)
    async def rpc_undeploy(self, request: UndeployRequest, context: RPCContext) -> UndeployReply:
        name = request.name
        done = UndeployReply(name=name, undeployed=True, message=f"{name} undeployed")
        who = self._who_undeploys(request, context)
        if name not in self.served:
            if self._undeployed.get(name) == who:  # a retry: the first call's answer, once done
                pending = self._undeploying.get(name)
                if pending is not None:
                    await asyncio.shield(pending)
                return done
            raise JobError(f"no deployment named {name!r}")
        owner = self.ctx.store.get_job(self.served[name].job_id)["submitter"]
        if who != owner:  # said as for an unknown name: a stranger learns nothing of others' deployments
            raise JobError(f"no deployment named {name!r} deployed with this key")
        self._undeployed[name] = who  # before it is done: a retry meanwhile waits for it
        while len(self._undeployed) > REMEMBERED_UNDEPLOYS:
            self._undeployed.popitem(last=False)
        await self._undeploy(name, f"undeployed by submitter {who[:16]}")
        return done

    @handles(DeploymentsRequest)
    async def rpc_deployments(self, request: DeploymentsRequest, context: RPCContext) -> DeploymentsReply:
        return DeploymentsReply(deployments=self.describe(), url=self.url)

    async def _undeploy(self, name: str, why: str) -> None:
        released = asyncio.get_running_loop().create_future()
        self._undeploying[name] = released
        try:
            await self._release(name, why)
        finally:
            if self._undeploying.get(name) is released:
                del self._undeploying[name]
            released.set_result(None)

    async def _release(self, name: str, why: str) -> None:
        model = self.served.pop(name, None)
        run, task = self.runs.pop(name, None), self._tasks.pop(name, None)
        log.info("deployment %s: %s", name, why)
        if model is not None:
            await model.batcher.close()
            if self.observer is not None:
                self.observer.forget_deployment(name)
                self.observer.observe_deployments(len(self.served))
        if run is not None:
            await run.stop()
        if task is not None and run is not None and run.abandoned is not None and not run.placed.is_set():
            task.cancel()  # given up while placing: nothing to wait for; it releases what it holds
        if task is not None:
            try:
                await asyncio.wait_for(task, 30.0)  # its release of the compnodes
            except TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # we are cancelled (the broker's drain time is up): so is the run, by wait_for
                # the run task itself was cancelled: it has ended, as waited for
        if run is not None:  # its submitted weights and tokenizer: nothing reads them any more
            await asyncio.to_thread(JobFiles(self.folder / run.job.job_id).forget)
        self.ctx.refresh_job_metrics()
