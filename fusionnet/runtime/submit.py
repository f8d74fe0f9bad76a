"""Submitting a job to a swarm: trace locally, send IR + state + data to the broker, follow progress,
download the results. Shared by ``fusionnet submit`` and ``fusionnet demo``.

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
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.broker_rpc import (
    BrokerClient,
    JobRequest,
    JobStatusReply,
    JobStatusRequest,
    SubmitJobRequest,
)
from fusionnet.messages.jobwire import run_spec_of
from fusionnet.rpc.protocol import RPCError
from fusionnet.runtime.prepare import loss_reduction_of, trace_job

SUBMIT_TIMEOUT = 300.0
POLL_INTERVAL = 0.2
POLL_RETRIES = 5
RETRYABLE = ("IncompleteReadError", "ConnectionError", "ConnectionResetError", "Timeout", "P2PDaemonError")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class SubmitOutcome:
    job_id: str
    state: str
    output: Path
    metrics: list[dict[str, Any]]
    placement: list[dict[str, Any]]


def submission_payload(job: LoadedJob) -> SubmitJobRequest:
    """Traces the job here and packs what the broker needs."""
    traced = trace_job(job)
    loss_reduction = loss_reduction_of(job)
    data = {"inputs": job.inputs}
    if job.labels is not None:
        data["labels"] = job.labels
    return SubmitJobRequest(
        request_id=secrets.token_hex(16),
        spec=run_spec_of(job, loss_reduction),
        ir=encode_ir(traced.graph),
        state=pack_tensors(traced.job_state(job.model.state_dict())),
        data=pack_tensors(data),
    )


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
) -> SubmitOutcome:
    from fusionnet.daemon.observer import SwarmObserver

    job = load_job(job_path, allow_outside_paths=allow_outside_paths)
    request = await asyncio.to_thread(submission_payload, job)
    async with SwarmObserver(initial_peers) as observer:
        client = BrokerClient(observer.call)
        broker = await observer.find_broker()
        reply = await client.call_submit_job(broker, request, timeout=SUBMIT_TIMEOUT)
        job_id, steps = reply.job_id, reply.steps
        print(f"job {job_id} submitted to broker {broker}", file=stream)
        progress = Progress(steps, stream)
        metrics: list[dict[str, Any]] = []
        placement: list[dict[str, Any]] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status = await _poll(client, broker, JobStatusRequest(job_id=job_id, since=len(metrics)))
            if status.placement and not placement:
                placement = status.placement
                if show_plan:
                    for p in placement:
                        print(
                            f"  sub-DAG {p['subdag']}: {p['nodes']} nodes, {p['params']} parameters "
                            f"on compnode {p['peer_id']}",
                            file=stream,
                        )
            for row in status.metrics:
                metrics.append(row)
                progress.show(row)
            state = status.job["state"]
            if state in TERMINAL:
                break
            if deadline is not None and time.monotonic() > deadline:
                progress.close()
                raise ExecutionError(f"job {job_id} did not finish within {timeout:.0f} s (state {state})")
            await asyncio.sleep(POLL_INTERVAL)
        progress.close()
        if state != "SUCCEEDED":
            raise JobError(f"job {job_id} {state}: {status.job.get('error') or 'no reason given'}")
        results = await client.call_job_results(broker, JobRequest(job_id=job_id), timeout=SUBMIT_TIMEOUT)
    output.mkdir(parents=True, exist_ok=True)
    for name, blob in results.files.items():
        if "/" in name or name.startswith("."):
            raise JobError(f"broker sent a result file with a bad name {name!r}")
        (output / name).write_bytes(blob)
    return SubmitOutcome(job_id, state, output, metrics, placement)


async def _poll(client: BrokerClient, broker: str, request: JobStatusRequest) -> JobStatusReply:
    """``job_status`` is idempotent: a stream that breaks on the way is simply asked again."""
    for attempt in range(POLL_RETRIES):
        try:
            return await client.call_job_status(broker, request, timeout=30.0)
        except RPCError as e:
            if attempt == POLL_RETRIES - 1 or e.kind not in RETRYABLE:
                raise
            await asyncio.sleep(POLL_INTERVAL * (attempt + 1))
    raise AssertionError("unreachable")


def summary(outcome: SubmitOutcome) -> str:
    losses = [r["loss"] for r in outcome.metrics if r.get("loss") is not None]
    loss = f"; loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else ""
    steps = len(outcome.metrics)
    return f"job {outcome.job_id} {outcome.state} in {steps} steps{loss}; results in {outcome.output}"


def load_plan(output: Path) -> dict[str, Any]:
    return json.loads((output / "plan.json").read_text())
