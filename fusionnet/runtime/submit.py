"""Submitting a job to a swarm: trace locally, wait until the broker has the compnodes the job needs,
send IR + state + data, follow progress, download the results; cancel the job on Ctrl-C or --timeout.
Shared by ``fusionnet submit`` and ``fusionnet demo``.

The model's code never leaves this machine: the broker and compnodes receive only the IR (checked
against the operator allowlist) and tensors.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from fusionnet.dag.codec import encode_ir
from fusionnet.errors import ExecutionError, JobError
from fusionnet.job.loader import LoadedJob, load_job
from fusionnet.messages.auth import submission_digest
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.broker_rpc import (
    UPLOAD_CHUNK_BYTES,
    BrokerClient,
    JobStatusReply,
    JobStatusRequest,
    SubmitJobRequest,
    UploadStateRequest,
)
from fusionnet.messages.jobwire import run_spec_of
from fusionnet.rpc.protocol import RPCError
from fusionnet.rpc.windows import in_window
from fusionnet.runtime.jobcontrol import (
    DEFAULT_WAIT_COMPNODES,
    cancel_job,
    download_results,
    wait_for_compnodes,
)
from fusionnet.runtime.microbatch_sizes import runnable_counts, traced_count
from fusionnet.runtime.prepare import job_assignment, loss_reduction_of, trace_job
from fusionnet.runtime.submitter import Signer, load_or_create_key

SUBMIT_TIMEOUT = 300.0
WITHDRAW_TIMEOUT = 15.0  # an interrupted submission's job looked up again, to cancel it
UPLOAD_TIMEOUT = 300.0  # one chunk (32 MB on a slow uplink)
UPLOAD_WINDOW = 3  # chunks of an upload in flight at once
POLL_INTERVAL = 0.2
# A broker that cannot be reached (restarting on its state dir, a link down) is asked again, up to this
# many seconds; the job goes on without its submitter meanwhile, and resumes after a broker restart.
LOST_CONTACT = 120.0
RETRYABLE = (
    "IncompleteReadError", "ConnectionError", "ConnectionResetError", "Timeout", "P2PDaemonError",
    "ControlFailure",
)  # fmt: skip
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class SubmitOutcome:
    job_id: str
    state: str
    output: Path
    metrics: list[dict[str, Any]]
    placement: list[dict[str, Any]]


def submission_payload(job: LoadedJob, *, deployment: bool = False) -> SubmitJobRequest:
    """Traces the job here and packs what the broker needs (unsigned: ``signed`` adds the signature).
    ``deployment``: the broker pads every micro-batch to the traced size (``trace_job``'s ``every_size``)."""
    if deployment and job.spec.placement.schedule == "interleaved-1f1b":
        raise JobError(
            f"job {job.spec.name!r}: a deployment runs forwards only, where interleaved-1f1b's chunks would "
            "only add hops: leave placement.schedule out"
        )
    traced = trace_job(job, every_size=not deployment)
    if job.spec.placement.cuts:  # refused here, before anything is sent, as the broker would refuse it
        job_assignment(job, traced.graph, job.spec.placement.subdags)
    loss_reduction = loss_reduction_of(job)
    # data.microbatches auto: the counts the graph runs, for the broker to choose from at its placement
    choices = [] if deployment else runnable_counts(job, traced)
    data = {"inputs": job.inputs}
    if job.labels is not None:
        data["labels"] = job.labels
    return SubmitJobRequest(
        request_id=secrets.token_hex(16),
        spec=run_spec_of(job, loss_reduction, microbatches=traced_count(job.spec), choices=choices),
        ir=encode_ir(traced.graph),
        state=pack_tensors(traced.job_state(job.model.state_dict())),
        data=pack_tensors(data),
    )


def signed(request: SubmitJobRequest, signer: Signer) -> SubmitJobRequest:
    """The submission with the submitter's signature over its digest (``messages.auth``)."""
    assert request.request_id is not None
    spec = request.spec.model_dump(mode="json")
    digest = submission_digest(spec, request.ir, request.state, request.data, request.request_id)
    return request.model_copy(update={"auth": signer.auth("submit_job", digest)})


class Progress:
    """One refreshing line on a terminal (step, loss, samples/s); one line per step otherwise."""

    def __init__(self, steps: int, stream: TextIO = sys.stderr) -> None:
        self.steps = steps
        self.stream = stream
        self.tty = stream.isatty()

    def show(self, row: dict[str, Any]) -> None:
        done = row["step"] + 1
        width = 30
        filled = int(width * done / max(self.steps, 1))
        bar = "#" * filled + "-" * (width - filled)
        loss = f"  loss {row['loss']:.6f}" if row.get("loss") is not None else ""
        rate = row["samples"] / row["seconds"] if row.get("seconds") else 0.0
        text = f"[{bar}] step {done}/{self.steps}{loss}  {rate:.1f} samples/s"
        if self.tty:
            self.stream.write("\r" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


async def submit_and_wait(
    job_path: Path,
    initial_peers: Sequence[str],
    output: Path,
    *,
    stream: TextIO = sys.stderr,
    timeout: float | None = None,
    show_plan: bool = True,
    allow_outside_paths: bool = False,
    wait_compnodes: float = DEFAULT_WAIT_COMPNODES,
    key_path: Path | None = None,
) -> SubmitOutcome:
    """Submits the job once the broker has the compnodes it needs (bounded wait), follows it, downloads
    its results. Interrupted (Ctrl-C: this task cancelled) or past ``timeout``, it cancels the job on the
    broker and says so: a job is never left running with nobody waiting for it."""
    from fusionnet.daemon.observer import SwarmObserver

    job = load_job(job_path, allow_outside_paths=allow_outside_paths)
    key = load_or_create_key(key_path)
    request = await asyncio.to_thread(submission_payload, job)
    async with SwarmObserver(initial_peers) as observer:
        client = BrokerClient(observer.call)
        broker = await observer.find_broker()
        signer = Signer(key, broker, observer.peer_id)
        await wait_for_compnodes(client, broker, request.spec.compnodes, wait_compnodes, stream)
        # A big state travels in chunks while it is hashed for the signature, which covers it as if it
        # were inline (the hash of a GB of state takes seconds; so does its upload).
        upload = None
        if len(request.state) > UPLOAD_CHUNK_BYTES:
            upload = asyncio.create_task(upload_state(client, broker, signer, request.state, stream))
        try:
            request = await asyncio.to_thread(signed, request, signer)
            if upload is not None:
                request = request.model_copy(update={"state": b"", "state_upload": await upload})
        finally:
            if upload is not None and not upload.done():  # signing failed: the upload is of no use
                upload.cancel()
                await asyncio.gather(upload, return_exceptions=True)
        try:
            reply = await client.call_submit_job(broker, request, timeout=SUBMIT_TIMEOUT)
        except asyncio.CancelledError:  # Ctrl-C while the broker takes it: it may have started the job
            await _withdraw(client, broker, request, signer, stream)
            raise
        job_id = reply.job_id
        print(
            f"job {job_id} submitted to broker {broker} as submitter {signer.submitter_id[:16]}", file=stream
        )
        follow = _Follow(client, broker, job_id, Progress(reply.steps, stream), show_plan, signer)
        try:
            status = await asyncio.wait_for(follow.until_done(), timeout)
        except asyncio.CancelledError:  # Ctrl-C (asyncio.run cancels us, then raises KeyboardInterrupt)
            follow.progress.close()
            await _cancel_on_broker(client, signer, job_id, "the submitter was interrupted", stream)
            raise
        except TimeoutError:
            follow.progress.close()
            await _cancel_on_broker(client, signer, job_id, f"submit --timeout {timeout:g} s passed", stream)
            raise ExecutionError(f"job {job_id} did not finish within {timeout:g} s; cancelled") from None
        follow.progress.close()
        state, why = status.job["state"], status.job.get("error") or "no reason given"
        if state == "CANCELLED":  # by someone else (``fusionnet cancel``): not the job file's fault
            raise ExecutionError(f"job {job_id} was cancelled: {why}")
        if state != "SUCCEEDED":  # the job's input at fault: exit 2; the swarm's or a peer's: exit 1
            raise (ExecutionError if status.job.get("error_kind") == "work" else JobError)(
                f"job {job_id} {state}: {why}"
            )
        started = time.perf_counter()
        names = await download_results(client, broker, job_id, output, signer)
        size, took = sum((output / n).stat().st_size for n in names), time.perf_counter() - started
        print(f"results downloaded: {size / 1e6:.0f} MB in {took:.1f} s", file=stream)
    return SubmitOutcome(job_id, state, output, follow.metrics, follow.placement)


async def upload_state(
    client: BrokerClient, broker: str, signer: Signer, state: bytes, stream: TextIO
) -> str:
    """Sends a state too big for one message in chunks of ``UPLOAD_CHUNK_BYTES`` (``broker.uploads``);
    returns the upload id the submission names. The first chunk opens the upload; then up to
    ``UPLOAD_WINDOW`` calls are in flight, so one chunk's trip, decoding and write on the broker overlap
    the next ones'. Neither side holds more than that many chunks of it."""
    upload_id = secrets.token_hex(16)
    auth = signer.auth("upload_state", upload_id)
    view = memoryview(state)
    started = time.perf_counter()

    async def send(offset: int) -> int:
        chunk = bytes(view[offset : offset + UPLOAD_CHUNK_BYTES])
        request = UploadStateRequest(
            upload_id=upload_id, offset=offset, total=len(state), data=chunk, auth=auth
        )
        reply = await client.call_upload_state(broker, request, timeout=UPLOAD_TIMEOUT)
        return reply.received

    held = await send(0)
    rest = await in_window(send, range(UPLOAD_CHUNK_BYTES, len(state), UPLOAD_CHUNK_BYTES), UPLOAD_WINDOW)
    held = max([held, *rest])
    if held != len(state):
        raise ExecutionError(f"upload {upload_id}: the broker holds {held} of {len(state)} bytes sent")
    print(f"state uploaded: {len(state) / 1e6:.0f} MB in {time.perf_counter() - started:.1f} s", file=stream)
    return upload_id


async def _withdraw(
    client: BrokerClient, broker: str, request: SubmitJobRequest, signer: Signer, stream: TextIO
) -> None:
    """A submission interrupted before its answer came: the broker may hold the job already, running
    with nobody to wait for it. The same request again (the broker answers a request id it knows with
    its job, ``rpc_submit_job``) names it, and it is cancelled; the user is told either way."""
    try:
        reply = await client.call_submit_job(broker, request, timeout=WITHDRAW_TIMEOUT)
    except Exception as e:
        print(f"the submission may have reached the broker ({e}); see `fusionnet status`", file=stream)
        return
    await _cancel_on_broker(client, signer, reply.job_id, "the submitter was interrupted", stream)


async def _cancel_on_broker(
    client: BrokerClient, signer: Signer, job_id: str, why: str, stream: TextIO
) -> None:
    """Cancels the job and prints what happened: the user must know whether it still runs."""
    try:
        reply = await cancel_job(client, signer.broker, job_id, why, signer)
    except Exception as e:  # the broker is gone or does not answer: say so, the job may still run
        print(f"job {job_id} could NOT be cancelled on the broker ({e}); "
              f"try `fusionnet cancel {job_id}`", file=stream)  # fmt: skip
        return
    if reply.cancelled:
        print(f"job {job_id} cancelled on the broker ({why})", file=stream)
    else:
        print(f"job {job_id} was not cancelled: {reply.message}", file=stream)


class _Follow:
    """Polls ``job_status`` until the job ends, showing the placement once and each step's row."""

    def __init__(
        self,
        client: BrokerClient,
        broker: str,
        job_id: str,
        progress: Progress,
        show_plan: bool,
        signer: Signer,
    ) -> None:
        self.client, self.broker, self.job_id, self.signer = client, broker, job_id, signer
        self.progress, self.show_plan = progress, show_plan
        self.metrics: list[dict[str, Any]] = []
        self.placement: list[dict[str, Any]] = []

    async def until_done(self) -> JobStatusReply:
        while True:
            auth = self.signer.auth("job_status", self.job_id)
            request = JobStatusRequest(job_id=self.job_id, since=len(self.metrics), auth=auth)
            status = await _poll(self.client, self.broker, request)
            if status.placement and not self.placement:
                self.placement = status.placement
                if self.show_plan:
                    for p in self.placement:
                        print(
                            f"  sub-DAG {p['subdag']}: {p['nodes']} nodes, {p['params']} parameters "
                            f"on compnode {p['peer_id']}",
                            file=self.progress.stream,
                        )
            for row in status.metrics:
                self.metrics.append(row)
                self.progress.show(row)
            if status.job["state"] in TERMINAL:
                return status
            await asyncio.sleep(POLL_INTERVAL)


async def _poll(client: BrokerClient, broker: str, request: JobStatusRequest) -> JobStatusReply:
    """``job_status`` is idempotent: asked again while the broker cannot be reached (a stream that broke
    on the way, a broker restarting), for up to ``LOST_CONTACT`` seconds; then one line that names the
    job and what to do next."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + LOST_CONTACT, POLL_INTERVAL
    while True:
        try:
            return await client.call_job_status(broker, request, timeout=30.0)
        except RPCError as e:
            if e.kind not in RETRYABLE:
                raise
            if loop.time() + delay > deadline:
                job = request.job_id
                raise ExecutionError(
                    f"lost contact with the broker for {LOST_CONTACT:g} s while following job {job} ({e}); "
                    f"it may still run: see `fusionnet status`, then `fusionnet results {job} --output DIR` "
                    f"or `fusionnet cancel {job}`"
                ) from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)


def summary(outcome: SubmitOutcome) -> str:
    losses = [r["loss"] for r in outcome.metrics if r.get("loss") is not None]
    loss = f"; loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
    steps = len(outcome.metrics)
    return f"job {outcome.job_id} {outcome.state} in {steps} steps{loss}; results in {outcome.output}"


def load_plan(output: Path) -> dict[str, Any]:
    return json.loads((output / "plan.json").read_text())
