"""``fusionnet results JOB_ID --initial-peers MADDR... --output DIR``: download a finished job's results.

A job runs to its end on the swarm whether or not its submitter stays (a ``submit`` killed or cut
off); the broker keeps the result files of every SUCCEEDED job in its state dir until that folder is
removed, and this command fetches them later, the same files ``submit`` writes.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from fusionnet.cli.argtypes import add_initial_peers
from fusionnet.cli.jobflags import add_job_id_argument, add_key_flag, check_output_dir


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "results",
        help="download the results of a finished job from the broker",
        description="Writes the result files (weights/grads/outputs.safetensors, metrics.jsonl, plan.json) "
        "of the SUCCEEDED job JOB_ID, as the broker keeps them, to --output. For a job whose submitter "
        "went away (submit killed, connection lost). Exit 1 when the job has not succeeded (yet).",
    )
    add_job_id_argument(p)
    add_initial_peers(p)
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="directory for the result files")
    add_key_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.daemon.observer import SwarmObserver
    from fusionnet.errors import ExecutionError
    from fusionnet.messages.broker_rpc import BrokerClient, JobStatusRequest
    from fusionnet.runtime.jobcontrol import download_results
    from fusionnet.runtime.submitter import Signer, load_or_create_key

    check_output_dir(args.output)
    key = load_or_create_key(args.key)

    async def fetch() -> list[str]:
        async with SwarmObserver(args.initial_peers) as observer:
            broker = await observer.find_broker()
            client = BrokerClient(observer.call)
            signer = Signer(key, broker, observer.peer_id)
            request = JobStatusRequest(job_id=args.job_id, auth=signer.auth("job_status", args.job_id))
            status = await client.call_job_status(broker, request, timeout=30.0)
            state = status.job["state"]
            if state != "SUCCEEDED":  # not bad input: the job exists, it has no results (yet)
                error = status.job.get("error")
                raise ExecutionError(
                    f"job {args.job_id} is {state}" + (f" ({error})" if error else "")
                    + "; results exist only for SUCCEEDED jobs"
                )  # fmt: skip
            return await download_results(client, broker, args.job_id, args.output, signer)

    names = asyncio.run(fetch())
    print(f"job {args.job_id}: {', '.join(names)} written to {args.output}")
    return 0
