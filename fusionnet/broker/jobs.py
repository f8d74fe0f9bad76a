"""Job intake on the broker: ``submit_job``, ``job_status``, ``job_results`` (used by ``fusionnet submit``
and ``fusionnet results``) and ``cancel_job`` (``fusionnet cancel``, and ``submit`` on Ctrl-C or --timeout).

A submission is validated completely before it is accepted (run spec, IR through the codec's
allowlist, state against the IR, data against the spec), so a bad job is refused with one clear
message and nothing runs. An accepted job gets an id, a row in SQLite, a folder for its results under
``STATE_DIR/broker/jobs/<id>`` and a ``JobRun`` task the service owns. The broker daemon's command
builds the service explicitly: ``JobService(broker.job_context())``.

A job does not depend on its submitter staying connected: it runs to its end and its result files
stay in its folder until the state dir is removed, for ``job_results`` at any later time. A
cancelled job stops at once (its run task is cancelled, its compnodes released) and has no results.
Who may cancel a job is not checked yet: knowing its id is enough (authorisation is issue 12's).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from functools import partial
from pathlib import Path

from fusionnet.broker.admission import Admission, Hold, check_owner
from fusionnet.broker.checkpoints import JobFiles
from fusionnet.broker.context import JobContext
from fusionnet.broker.jobrun import JobRun, mark_cancelled
from fusionnet.broker.store import DEPLOYMENT_ROW, JobState
from fusionnet.broker.submission import SubmittedJob, check_submission
from fusionnet.broker.uploads import StateUploads
from fusionnet.dag.codec import decode_ir
from fusionnet.errors import ExecutionError, JobError
from fusionnet.messages.auth import SubmitterAuth, submission_digest
from fusionnet.messages.base import handles
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.broker_rpc import (
    RESULTS_CHUNK_BYTES,
    CancelJobReply,
    CancelJobRequest,
    JobRequest,
    JobResultsReply,
    JobResultsRequest,
    JobStatusReply,
    JobStatusRequest,
    LeavingReply,
    SubmitJobReply,
    SubmitJobRequest,
    UploadStateReply,
    UploadStateRequest,
)
from fusionnet.messages.jobwire import RunSpec
from fusionnet.results.files import RESULT_FILES, TENSOR_FILES
from fusionnet.rpc.server import RPCContext

log = logging.getLogger("fusionnet.broker.jobs")


def _read_slice(path: Path, offset: int, length: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(length)


MAX_RUNNING_JOBS = 8
CANCEL_REPEAT = 60.0  # a cancel from the same peer this soon after its first is a retry of it
CANCEL_WAIT = 10.0  # a cancelled run releases its compnodes (5 s per call, all at once) within this


class JobService:
    name = "jobs"

    def __init__(self, context: JobContext) -> None:
        self.ctx = context
        self.runs: dict[str, JobRun] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._requests: dict[tuple[str, str], str] = {}  # (submitter, request id) -> job id (repeats)
        # submissions being taken in, and how many calls of each wait on or hold its lock
        self._submitting: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}
        self.admission = Admission.create(context.settings.admission, context.settings.common.dht.host_maddrs)
        # submissions past the MAX_RUNNING_JOBS check and not launched or refused yet: counted with the
        # running ones, or concurrent submissions would all pass the check while each awaits its checks
        self._admitting = 0
        self._uploads: StateUploads | None = None

    @property
    def jobs_dir(self) -> Path:
        return self.ctx.jobs_dir

    @property
    def uploads(self) -> StateUploads:
        if self._uploads is None:  # made on first use: the state dir is not there at construction
            self._uploads = StateUploads(self.jobs_dir.parent / "uploads")
        return self._uploads

    async def start(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        # Jobs a previous broker process left unfinished resume from their last checkpoint; the
        # compnodes re-attach when they get the new round's assignment.
        for row in self.ctx.store.list_jobs(10_000):
            if row["state"] not in ("QUEUED", "PLANNING", "RUNNING"):
                continue
            if str(row.get("name") or "").startswith(DEPLOYMENT_ROW):
                continue  # a deployment's: ``DeploymentService.start`` ends it
            try:
                job = self._load(row["job_id"], row.get("submitter") or "")
            except Exception as e:
                self.ctx.store.update_job(
                    row["job_id"], state="FAILED", error=f"cannot resume after a broker restart: {e}"
                )
                continue
            log.info("job %s: resuming after a broker restart", job.job_id)
            self._launch(job, self.admission.hold(job.submitter, check=False), resume=True)

    def _load(self, job_id: str, submitter: str) -> SubmittedJob:
        files = JobFiles(self.jobs_dir / job_id)
        if not files.has_submission():
            raise JobError("its submission was not saved")
        spec_doc, ir, state, data = files.load_submission()
        return SubmittedJob(
            job_id=job_id,
            spec=RunSpec.parse(spec_doc),
            ir=ir,
            graph=decode_ir(ir),
            state=state,
            data=data,
            submitter=submitter,
        )

    def _launch(self, job: SubmittedJob, hold: Hold, *, resume: bool = False) -> None:
        """Starts the job's run, which keeps ``hold`` (its place in its submitter's quota) until it ends."""
        run = JobRun(self.ctx, job, self.jobs_dir / job.job_id, resume=resume)
        self.runs[job.job_id] = run
        task = asyncio.get_running_loop().create_task(run.run(), name=f"job-{job.job_id}")
        self._tasks[job.job_id] = task
        self.ctx.live_jobs.add(job.job_id)

        def ended(_t: asyncio.Task[None]) -> None:
            self._tasks.pop(job.job_id, None)
            self.ctx.live_jobs.discard(job.job_id)
            hold.release()

        task.add_done_callback(ended)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _running(self) -> int:
        """Jobs running, and those admitted but not launched yet (``_admitting``)."""
        return sum(1 for t in self._tasks.values() if not t.done()) + self._admitting

    def _owner(self, job_id: str, auth: SubmitterAuth | None, context: RPCContext) -> dict:
        """The job's row, when the caller signed as its submitter (``admission.check_owner``)."""
        row = self.ctx.store.get_job(job_id)  # an unknown id: JobError naming it
        check_owner(
            row.get("submitter"),
            auth,
            broker=self.ctx.broker_id(),
            caller=context.remote_peer,
            scope=context.method,
            job_id=job_id,
        )
        return row

    async def _admit(self, request: SubmitJobRequest, context: RPCContext) -> str:
        """The submitter of a signed submission this broker takes from it now, else ``JobError``."""
        state_bytes, state_sha256, uploader = len(request.state), None, None
        if request.state_upload is not None:
            if request.state:
                raise JobError("submission: both an inline state and a state upload")
            upload = request.state_upload
            uploader, state_bytes, state_sha256 = await asyncio.to_thread(self.uploads.sha256, upload)
        nbytes = len(request.ir) + state_bytes + len(request.data)
        self.admission.check_size(nbytes)  # before hashing gigabytes
        spec = request.spec.model_dump(mode="json")
        digest = await asyncio.to_thread(
            partial(submission_digest, state_sha256=state_sha256),
            spec,
            request.ir,
            request.state,
            request.data,
            request.request_id or "",
        )
        submitter = self.admission.authorise_submit(
            request.auth, broker=self.ctx.broker_id(), caller=context.remote_peer, digest=digest
        )
        if uploader is not None and uploader != submitter:
            raise JobError(f"upload {request.state_upload}: not this submitter's upload")
        # its running jobs are counted in ``_accept``: a repeat of an accepted submission is not refused
        steps = request.spec.step_count
        self.admission.check_quota(submitter, running=0, steps=steps, nodes=0, nbytes=nbytes)
        return submitter

    # ---- RPC -------------------------------------------------------------------------------------
    @handles(SubmitJobRequest)
    async def rpc_submit_job(self, request: SubmitJobRequest, context: RPCContext) -> SubmitJobReply:
        submitter = await self._admit(request, context)
        if request.request_id is None:
            return await self._accept(request, submitter, context)
        key = (submitter, request.request_id)
        # A repeat (an answer lost on the way, a submitter interrupted that asks which job it made) may
        # come while the first is still being taken in: it waits for it, then answers its job.
        lock, users = self._submitting.get(key, (asyncio.Lock(), 0))
        self._submitting[key] = (lock, users + 1)
        try:
            async with lock:
                if key in self._requests:
                    job_id = self._requests[key]
                    return SubmitJobReply(job_id=job_id, steps=self.ctx.store.get_job(job_id)["steps"] or 0)
                reply = await self._accept(request, submitter, context)
                self._requests[key] = reply.job_id
                return reply
        finally:
            lock, users = self._submitting[key]
            if users > 1:
                self._submitting[key] = (lock, users - 1)
            else:
                del self._submitting[key]

    async def _accept(self, request: SubmitJobRequest, submitter: str, context: RPCContext) -> SubmitJobReply:
        # Both caps are checked and counted before the first await: the count lasts until the job is
        # launched (then its task counts, and keeps the hold) or refused.
        if self._running() >= MAX_RUNNING_JOBS:
            raise JobError(f"the broker already runs {MAX_RUNNING_JOBS} jobs; try again later")
        hold = self.admission.hold(submitter)
        self._admitting += 1
        try:
            return await self._take_in(request, submitter, context, hold)
        except BaseException:
            hold.release()
            raise
        finally:
            self._admitting -= 1

    async def _take_in(
        self, request: SubmitJobRequest, submitter: str, context: RPCContext, hold: Hold
    ) -> SubmitJobReply:
        """The checks, files and row of an admitted submission, then its launch (with ``hold``)."""
        spec = request.spec
        graph = await asyncio.to_thread(decode_ir, request.ir)
        self.admission.check_quota(submitter, running=0, steps=0, nodes=len(graph.nodes), nbytes=0)
        if graph.task != spec.task:
            raise JobError(
                f"submission: the IR was traced for task {graph.task!r}, the spec says {spec.task!r}"
            )
        job_id = secrets.token_hex(6)
        files = JobFiles(self.jobs_dir / job_id)
        data = unpack_tensors(request.data, "submission: data")
        try:
            # The state goes to disk as it came and is read from there when needed (one tensor at a
            # time for the checks): the broker never holds the model (issue 11).
            if request.state_upload is None:
                state = await asyncio.to_thread(files.write_submitted_state, request.state)
            else:
                state = await asyncio.to_thread(
                    files.adopt_submitted_state, partial(self.uploads.take, request.state_upload, submitter)
                )
            await asyncio.to_thread(check_submission, graph, state, data, spec)
        except BaseException:
            files.forget()
            raise
        self.ctx.store.create_job(job_id, spec.name, steps=spec.step_count, submitter=submitter)
        self.ctx.metrics.jobs_submitted.inc()
        job = SubmittedJob(
            job_id=job_id,
            spec=spec,
            ir=request.ir,
            graph=graph,
            state=state,
            data=data,
            submitter=submitter,
        )
        await asyncio.to_thread(files.save_submission, spec.model_dump(mode="json"), job.ir, None, data)
        self._launch(job, hold)
        log.info(
            "job %s (%s, %s, %d steps) accepted from submitter %s (peer %s)",
            job_id,
            spec.name,
            spec.task,
            spec.step_count,
            submitter[:16],
            context.remote_peer,
        )
        return SubmitJobReply(job_id=job_id, steps=spec.step_count)

    @handles(UploadStateRequest)
    async def rpc_upload_state(self, request: UploadStateRequest, context: RPCContext) -> UploadStateReply:
        """One chunk of a state too big for the submission message (``broker.uploads``)."""
        submitter = self.admission.authorise(
            request.auth,
            broker=self.ctx.broker_id(),
            caller=context.remote_peer,
            scope="upload_state",
            subject=request.upload_id,
        )
        r, limit = request, self.admission.config.max_submission_bytes
        received = await asyncio.to_thread(
            self.uploads.append, submitter, r.upload_id, r.offset, r.total, r.data, limit
        )
        return UploadStateReply(received=received)

    @handles(JobStatusRequest)
    async def rpc_job_status(self, request: JobStatusRequest, context: RPCContext) -> JobStatusReply:
        """The job's row, its per-step metrics from index ``since`` on, and where it runs."""
        job_id = request.job_id
        row = self._owner(job_id, request.auth, context)
        events = self.ctx.store.job_events(job_id)[-50:]
        run = self.runs.get(job_id)
        if run is None:
            return JobStatusReply(job=row, events=events)
        return JobStatusReply(
            job=row,
            metrics=run.progress.metrics[request.since :],
            placement=run.progress.placement,
            refused_frames=run.progress.refused_frames,
            recoveries=run.progress.recoveries,
            events=events,
        )

    @handles(JobRequest)
    async def rpc_leaving(self, request: JobRequest, context: RPCContext) -> LeavingReply:
        """A compnode going away gracefully (SIGTERM): its sub-DAG moves at the next step boundary."""
        job_id = request.job_id
        run = self.runs.get(job_id)
        if run is None or context.remote_peer not in run.peers:
            raise JobError(f"{context.remote_peer} runs no sub-DAG of job {job_id}")
        if job_id not in self._tasks:  # no step will come to move it: the leaver need not wait for one
            state = self.ctx.store.get_job(job_id)["state"]
            raise JobError(f"job {job_id} is over ({state}): nothing to hand over")
        run.leaving.add(context.remote_peer)
        log.info(
            "job %s: compnode %s is leaving; its sub-DAG moves at the next step", job_id, context.remote_peer
        )
        return LeavingReply(accepted=True)

    @handles(JobResultsRequest)
    async def rpc_job_results(self, request: JobResultsRequest, context: RPCContext) -> JobResultsReply:
        """The result files of a finished job (interface.md): their sizes and the small ones, or one
        chunk of one file, read from the job's folder (never the whole model in one message)."""
        job_id = request.job_id
        row = self._owner(job_id, request.auth, context)
        if row["state"] != "SUCCEEDED":
            raise JobError(f"job {job_id} is {row['state']}; results exist only for SUCCEEDED jobs")
        folder = self.jobs_dir / job_id
        paths = {name: folder / name for name in RESULT_FILES if (folder / name).is_file()}
        lacks = [n for n in ("metrics.jsonl", "plan.json") if n not in paths]
        if not paths.keys() & set(TENSOR_FILES):
            lacks.append(" or ".join(TENSOR_FILES))
        if lacks:  # its folder was deleted (how results expire) or cut short: never a partial answer
            missing = ", ".join(lacks)
            raise ExecutionError(
                f"job {job_id}'s results are no longer kept on this broker ({folder} lacks {missing})"
            )
        sizes = {name: path.stat().st_size for name, path in paths.items()}
        if request.file is None:
            small = [n for n, size in sizes.items() if size <= RESULTS_CHUNK_BYTES]
            files = {n: await asyncio.to_thread(paths[n].read_bytes) for n in small}
            return JobResultsReply(files=files, sizes=sizes)
        if request.file not in paths:
            raise JobError(f"job {job_id} has no result file {request.file!r}")
        data = await asyncio.to_thread(_read_slice, paths[request.file], request.offset, RESULTS_CHUNK_BYTES)
        return JobResultsReply(sizes=sizes, data=data)

    @handles(CancelJobRequest)
    async def rpc_cancel_job(self, request: CancelJobRequest, context: RPCContext) -> CancelJobReply:
        """Stops a job now: its in-flight step is abandoned, its compnodes released, its state CANCELLED.
        Answers once the compnodes are released (or ``CANCEL_WAIT`` passed). A job that already ended
        keeps its state. A live deployment's row is refused: it has no run here to stop (its
        ``DeploymentRun`` is the deployment service's), so marking it CANCELLED would leave it serving."""
        job_id = request.job_id
        row = self._owner(job_id, request.auth, context)
        name = str(row.get("name") or "")
        if name.startswith(DEPLOYMENT_ROW) and not JobState(row["state"]).terminal:
            deployment = name.removeprefix(DEPLOYMENT_ROW)
            raise JobError(f"job {job_id} is deployment {deployment}: use fusionnet undeploy {deployment}")
        if JobState(row["state"]).terminal:
            if row["state"] == JobState.CANCELLED and self._cancelled_by(job_id, context.remote_peer):
                # A repeat of the call that cancelled it (the RPC layer retries a stream p2pd dropped
                # before the answer): the same answer as the first time.
                return CancelJobReply(state=row["state"], cancelled=True, message=_cancelled(job_id))
            return CancelJobReply(
                state=row["state"], cancelled=False, message=f"job {job_id} already {row['state']}"
            )
        reason = f"{request.reason} (asked by {context.remote_peer})"
        self.ctx.store.add_job_event(job_id, "cancel", {"by": context.remote_peer, "reason": request.reason})
        run, task = self.runs.get(job_id), self._tasks.get(job_id)
        if run is not None and task is not None and not task.done():
            run.cancel(task, reason)
            done, _ = await asyncio.wait({task}, timeout=CANCEL_WAIT)
            if not done:
                log.warning("job %s: its run did not stop within %.0f s of the cancel", job_id, CANCEL_WAIT)
        mark_cancelled(self.ctx.store, job_id, reason)  # a no-op when the run recorded it already
        state = self.ctx.store.get_job(job_id)["state"]
        self.ctx.refresh_job_metrics()
        if state != JobState.CANCELLED:  # it ended on its own in the meantime
            return CancelJobReply(state=state, cancelled=False, message=f"job {job_id} already {state}")
        return CancelJobReply(state=state, cancelled=True, message=_cancelled(job_id))

    def _cancelled_by(self, job_id: str, peer: str, within: float = CANCEL_REPEAT) -> bool:
        """Whether ``peer`` asked for the job's cancel in the last ``within`` seconds."""
        events = [e for e in self.ctx.store.job_events(job_id) if e["kind"] == "cancel"]
        if not events:
            return False
        last = events[-1]
        return last["detail"].get("by") == peer and time.time() - last["at"] < within


def _cancelled(job_id: str) -> str:
    return f"job {job_id} cancelled; its compnodes are released"
