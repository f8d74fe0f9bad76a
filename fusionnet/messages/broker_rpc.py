"""The broker's RPC surface: one request and one reply model per method, and ``BrokerClient``.

Methods (served by ``broker.daemon`` and ``broker.jobs``):

- ``ping``        heartbeat echo (``PingRequest`` -> ``PingReply``, shared with compnodes)
- ``status``      compnodes and jobs, for ``fusionnet status`` and dashboards
- ``upload_state`` one chunk of a submission's state too big for one message (before ``submit_job``)
- ``submit_job``  spec + IR + state (or the upload holding it) + data of a new job -> its id and step count
- ``job_status``  a job's row, its per-step metrics from ``since`` on, placement, recoveries, events
- ``job_results`` the result files of a SUCCEEDED job, by name
- ``cancel_job``  stops a job at once (in-flight step abandoned, compnodes released) -> its state
- ``leaving``     a compnode going away gracefully announces it (its sub-DAG moves at the next step)

Rows that are documents of their own (a job's store row, metrics rows, events) stay maps: their
schema belongs to the store and to interface.md, and a client shows them as they come.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from fusionnet.messages.auth import SubmitterAuth
from fusionnet.messages.base import Caller, JobId, Message, TypedCaller
from fusionnet.messages.jobwire import RunSpec

MAX_JOB_LIMIT = 10_000
MAX_PING_JOBS = 1024  # a broker with more live jobs than this sends none (its compnodes then keep theirs)


class PingRequest(Message):
    nonce: Annotated[str, Field(max_length=128)] = ""
    # A broker's heartbeat: every job and deployment it runs now. A compnode drops what it holds for this
    # broker that is not among them (a release that never arrived); None: not said (any other pinger).
    jobs: Annotated[list[JobId], Field(max_length=MAX_PING_JOBS)] | None = None


class PingReply(Message):
    nonce: str
    peer_id: str
    state: str
    load: float | None = None  # compnodes only
    running_tasks: int | None = None  # compnodes only
    time: float | None = None  # compnodes only: their wall clock


class StatusRequest(Message):
    job_limit: Annotated[int, Field(ge=0, le=MAX_JOB_LIMIT)] = 50
    auth: SubmitterAuth | None = None  # scope "status": the caller's own jobs are shown in full


class StatusReply(Message):
    broker: dict[str, Any]
    compnodes: list[dict[str, Any]]
    jobs: list[dict[str, Any]]
    deployments: list[dict[str, Any]] = []  # resident models (issue 14); older brokers omit it


UploadId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
UPLOAD_CHUNK_BYTES = 32 << 20  # what one ``upload_state`` call carries at most


class SubmitJobRequest(Message):
    request_id: Annotated[str, Field(max_length=64)] | None = None  # repeated submissions map to one job
    spec: RunSpec
    ir: bytes  # ``fusionnet.dag.codec`` bytes; decoded against the allowlist by the broker
    state: bytes  # safetensors (``blobs``)
    data: bytes  # safetensors (``blobs``)
    auth: SubmitterAuth | None = None  # scope "submit_job", subject ``auth.submission_digest``
    # The state sent before, in chunks (``UploadStateRequest``): ``state`` is then empty, and the
    # signature covers the uploaded bytes' hash as it would the inline state's.
    state_upload: UploadId | None = None


class UploadStateRequest(Message):
    """``data`` at ``offset`` of an upload of ``total`` bytes of submission state (a safetensors blob too
    big for one message). The first chunk starts at 0, the others come in any order; a repeated chunk (a
    retried call) changes nothing."""

    upload_id: UploadId
    offset: Annotated[int, Field(ge=0)]
    total: Annotated[int, Field(ge=1)]
    data: Annotated[bytes, Field(min_length=1, max_length=UPLOAD_CHUNK_BYTES)]
    auth: SubmitterAuth | None = None  # scope "upload_state", subject the upload id


class UploadStateReply(Message):
    received: Annotated[int, Field(ge=0)]  # bytes of the upload the broker holds


class SubmitJobReply(Message):
    job_id: JobId
    steps: Annotated[int, Field(ge=0)]


class JobRequest(Message):
    """A request that names one job and nothing else (``job_results``, ``leaving``)."""

    job_id: JobId
    auth: SubmitterAuth | None = None  # the job's submitter (scope: the method, subject: the job id)


class JobStatusRequest(JobRequest):
    since: Annotated[int, Field(ge=0)] = 0  # first metrics row wanted


class JobStatusReply(Message):
    job: dict[str, Any]
    metrics: list[dict[str, Any]] = []
    placement: list[dict[str, Any]] = []
    refused_frames: int = 0
    recoveries: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []


ResultFileName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_.-]{0,63}$")]
RESULTS_CHUNK_BYTES = 32 << 20  # what one ``job_results`` answer carries at most


class JobResultsRequest(JobRequest):
    """``file`` None: every result file's size, and the small ones inline; else ``RESULTS_CHUNK_BYTES``
    of ``file`` from ``offset`` on (a big weights file comes in chunks: no answer, on either side,
    holds the model)."""

    file: ResultFileName | None = None
    offset: Annotated[int, Field(ge=0)] = 0


class JobResultsReply(Message):
    files: dict[str, bytes] = {}  # file name -> contents, for the files of at most one chunk
    sizes: dict[str, int] = {}  # every result file -> its size in bytes
    data: bytes = b""  # the chunk of ``JobResultsRequest.file`` asked for


class LeavingReply(Message):
    accepted: bool


class CancelJobRequest(JobRequest):
    reason: Annotated[str, Field(max_length=200)] = "cancelled by the user"


class CancelJobReply(Message):
    state: str  # the job's state after the call: CANCELLED, or the terminal state it already had
    cancelled: bool  # this call stopped it (False: it had already ended)
    message: str  # one line for the user


class BrokerClient(TypedCaller):
    """Typed calls to a broker: ``await BrokerClient(daemon.call).call_job_status(broker, request)``."""

    def __init__(self, call: Caller) -> None:
        super().__init__(call)

    async def call_ping(self, peer: str, request: PingRequest, **kw: Any) -> PingReply:
        return await self.call_typed(peer, "ping", request, PingReply, **kw)

    async def call_status(self, peer: str, request: StatusRequest, **kw: Any) -> StatusReply:
        return await self.call_typed(peer, "status", request, StatusReply, **kw)

    async def call_submit_job(self, peer: str, request: SubmitJobRequest, **kw: Any) -> SubmitJobReply:
        return await self.call_typed(peer, "submit_job", request, SubmitJobReply, **kw)

    async def call_upload_state(self, peer: str, request: UploadStateRequest, **kw: Any) -> UploadStateReply:
        return await self.call_typed(peer, "upload_state", request, UploadStateReply, **kw)

    async def call_job_status(self, peer: str, request: JobStatusRequest, **kw: Any) -> JobStatusReply:
        return await self.call_typed(peer, "job_status", request, JobStatusReply, **kw)

    async def call_job_results(self, peer: str, request: JobResultsRequest, **kw: Any) -> JobResultsReply:
        return await self.call_typed(peer, "job_results", request, JobResultsReply, **kw)

    async def call_cancel_job(self, peer: str, request: CancelJobRequest, **kw: Any) -> CancelJobReply:
        return await self.call_typed(peer, "cancel_job", request, CancelJobReply, **kw)

    async def call_leaving(self, peer: str, request: JobRequest, **kw: Any) -> LeavingReply:
        return await self.call_typed(peer, "leaving", request, LeavingReply, **kw)
