"""A submitter's control over jobs on a broker: waiting for the compnodes a job needs, cancelling a job,
downloading the results a broker keeps. Shared by ``fusionnet submit``, ``cancel`` and ``results``.

Readiness is asked of the broker itself (its registry: ONLINE, answering heartbeats, with a data
path), not read from the DHT or from address files: a compnode's record can be in the DHT seconds
before the broker's next refresh takes it in, and a job sent in between would be placed on fewer
compnodes or refused. The wait is bounded; when it runs out with some compnodes ready the job goes
to the broker anyway (it places the job on what it has), with none it is not sent.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, TextIO

from fusionnet.errors import ExecutionError, JobError
from fusionnet.messages.broker_rpc import (
    BrokerClient,
    CancelJobReply,
    CancelJobRequest,
    JobResultsRequest,
    JobStatusReply,
    JobStatusRequest,
    StatusRequest,
)
from fusionnet.runtime.submitter import Signer

DEFAULT_WAIT_COMPNODES = 60.0
WAIT_POLL = 0.25
CANCEL_TIMEOUT = 30.0  # the broker answers once the job's compnodes are released (at most ~10 s)
RESULTS_TIMEOUT = 300.0


def ready_compnodes(compnodes: list[dict[str, Any]]) -> tuple[int, int]:
    """(regular, backup) compnodes the broker could place work on now: ONLINE (which means answering
    heartbeats) with a data path. A placement takes regular ones first, backups only when there are none."""
    ready = [c for c in compnodes if c.get("state") == "ONLINE" and c.get("data_path_address")]
    backups = sum(1 for c in ready if c.get("backup"))
    return len(ready) - backups, backups


async def wait_for_compnodes(
    client: BrokerClient, broker: str, wanted: int, timeout: float, stream: TextIO
) -> int:
    """Until the broker has ``wanted`` compnodes ready (returns how many it has), saying so once when it
    has to wait; after ``timeout`` seconds goes on with fewer, or raises ``ExecutionError`` with none."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        reply = await client.call_status(broker, StatusRequest(job_limit=0), timeout=15.0)
        regular, backups = ready_compnodes(reply.compnodes)
        if regular >= wanted:
            if said:
                print(f"{regular} compnodes ready at the broker", file=stream)
            return regular
        if time.monotonic() >= deadline:
            break
        if not said:
            print(
                f"waiting up to {timeout:g} s for {wanted} compnodes to be ready at the broker "
                f"({regular} now)",
                file=stream,
            )
            said = True
        await asyncio.sleep(WAIT_POLL)
    usable = regular or backups
    if usable == 0:
        raise ExecutionError(
            f"no compnode is ready at the broker after {timeout:g} s (ONLINE with a data path); "
            "start compnodes or raise --wait-compnodes"
        )
    print(
        f"only {usable} of {wanted} compnodes ready at the broker after {timeout:g} s; submitting anyway "
        "(the broker places the job on the compnodes it has)",
        file=stream,
    )
    return usable


async def cancel_job(
    client: BrokerClient, broker: str, job_id: str, reason: str, signer: Signer
) -> CancelJobReply:
    """Only the job's submitter may cancel it: the request is signed with its key."""
    auth = signer.auth("cancel_job", job_id)
    request = CancelJobRequest(job_id=job_id, reason=reason[:200], auth=auth)
    return await client.call_cancel_job(broker, request, timeout=CANCEL_TIMEOUT)


async def job_status(client: BrokerClient, broker: str, job_id: str, signer: Signer) -> JobStatusReply:
    """A job's status in full (placement, events, metrics): only for its submitter, signed with its key."""
    request = JobStatusRequest(job_id=job_id, auth=signer.auth("job_status", job_id))
    return await client.call_job_status(broker, request, timeout=CANCEL_TIMEOUT)


async def download_results(
    client: BrokerClient, broker: str, job_id: str, output: Path, signer: Signer
) -> list[str]:
    """The result files of a SUCCEEDED job kept on the broker, written into ``output``; their names.
    Only the job's submitter may fetch them: every request is signed with its key. Small files come in
    the first answer; a big one (the weights of a large model) in chunks, written as they come to a
    temporary file that takes its name once complete."""

    def request(file: str | None = None, offset: int = 0) -> JobResultsRequest:
        auth = signer.auth("job_results", job_id)
        return JobResultsRequest(job_id=job_id, auth=auth, file=file, offset=offset)

    first = await client.call_job_results(broker, request(), timeout=RESULTS_TIMEOUT)
    for name in first.sizes:
        if "/" in name or "\\" in name or name.startswith(".") or not name:
            raise JobError(f"broker sent a result file with a bad name {name[:80]!r}")
    output.mkdir(parents=True, exist_ok=True)
    for name, blob in first.files.items():
        (output / name).write_bytes(blob)
    for name, size in first.sizes.items():
        if name in first.files:
            continue
        part = output / f".{name}.part"
        with part.open("wb") as f:
            while f.tell() < size:
                got = await client.call_job_results(broker, request(name, f.tell()), timeout=RESULTS_TIMEOUT)
                if not got.data:
                    raise JobError(f"result file {name} ended at {f.tell()} of {size} bytes on the broker")
                await asyncio.to_thread(f.write, got.data)
        part.replace(output / name)
    return sorted(first.sizes)
