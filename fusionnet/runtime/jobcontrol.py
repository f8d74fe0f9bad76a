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
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from fusionnet.errors import ExecutionError, JobError
from fusionnet.messages.broker_rpc import (
    RESULTS_CHUNK_BYTES,
    BrokerClient,
    CancelJobReply,
    CancelJobRequest,
    JobResultsRequest,
    JobStatusReply,
    JobStatusRequest,
    StatusRequest,
)
from fusionnet.results.files import RESULT_FILES
from fusionnet.rpc.windows import in_window
from fusionnet.runtime.submitter import Signer

DEFAULT_WAIT_COMPNODES = 60.0
WAIT_POLL = 0.25
CANCEL_TIMEOUT = 30.0  # the broker answers once the job's compnodes are released (at most ~10 s)
RESULTS_TIMEOUT = 300.0
RESULTS_WINDOW = 3  # chunks of a result file in flight at once (each call's trip overlaps the others')


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
    """The result files of a SUCCEEDED job kept on the broker, written into ``output``; their names. Result
    files of another job there (a reused ``--output``: the weights of a train job beside an infer job's
    outputs) are removed, so the folder holds this job's results only.
    Only the job's submitter may fetch them: every request is signed with its key. Small files come in
    the first answer; a big one (the weights of a large model) in chunks, written as they come to a
    temporary file that takes its name once complete."""

    def request(file: str | None = None, offset: int = 0) -> JobResultsRequest:
        auth = signer.auth("job_results", job_id)
        return JobResultsRequest(job_id=job_id, auth=auth, file=file, offset=offset)

    first = await client.call_job_results(broker, request(), timeout=RESULTS_TIMEOUT)
    if not first.sizes:
        raise ExecutionError(f"the broker holds no result files of job {job_id}")
    for name in first.sizes:
        if "/" in name or "\\" in name or name.startswith(".") or not name:
            raise JobError(f"broker sent a result file with a bad name {name[:80]!r}")
    try:
        output.mkdir(parents=True, exist_ok=True)
        for name, blob in first.files.items():
            (output / name).write_bytes(blob)
        for name, size in first.sizes.items():
            if name not in first.files:
                await _download_file(client, broker, partial(request, name), output / name, size)
        for name in set(RESULT_FILES) - set(first.sizes):  # an earlier job's, left in a reused --output
            if (output / name).is_file():
                (output / name).unlink()
    except OSError as e:  # a full disk, a file where the folder was: the results are still on the broker
        raise ExecutionError(
            f"job {job_id}'s results could not be written to {output} ({e.strerror or e}); they stay on the "
            f"broker: fetch them with `fusionnet results {job_id} --output DIR`"
        ) from None
    return sorted(first.sizes)


async def _download_file(
    client: BrokerClient,
    broker: str,
    request: Callable[[int], JobResultsRequest],
    path: Path,
    size: int,
) -> None:
    """One big result file in chunks of ``RESULTS_CHUNK_BYTES``, up to ``RESULTS_WINDOW`` in flight,
    each written at its offset of a temporary file that takes ``path``'s name once complete (and is
    gone when the download fails)."""
    part = path.with_name(f".{path.name}.part")
    with part.open("wb") as f:

        async def fetch(offset: int) -> None:
            got = await client.call_job_results(broker, request(offset), timeout=RESULTS_TIMEOUT)
            expected = min(RESULTS_CHUNK_BYTES, size - offset)
            if len(got.data) != expected:
                raise JobError(
                    f"result file {path.name}: the broker sent {len(got.data)} bytes at byte {offset} "
                    f"of {size}, not {expected}"
                )
            await asyncio.to_thread(os.pwrite, f.fileno(), got.data, offset)

        try:
            await in_window(fetch, range(0, size, RESULTS_CHUNK_BYTES), RESULTS_WINDOW)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    part.replace(path)
