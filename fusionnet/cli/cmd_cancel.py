"""``fusionnet cancel JOB_ID --initial-peers MADDR...``: stop a job on the swarm and free its compnodes.

The broker cancels the job's run at once (the step in flight is abandoned), releases its compnodes
(they drop their sub-DAGs) and records the job CANCELLED; a cancelled job has no results. Exit 0 when
the job is cancelled now or was already; 1 when it had already ended otherwise (SUCCEEDED, FAILED) or
no broker answers; 2 for an unknown job id, a job submitted with another key (only its submitter
may cancel it), or a live deployment's job (``fusionnet undeploy`` ends a deployment).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from fusionnet.cli.argtypes import add_initial_peers
from fusionnet.cli.jobflags import add_job_id_argument, add_key_flag


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "cancel",
        help="stop a running job and free its compnodes",
        description="Asks the swarm's broker to stop job JOB_ID now: its in-flight step is abandoned, its "
        "compnodes released, its state CANCELLED (no results are kept). Returns once the compnodes are "
        "released. Exit 0 when the job is cancelled (now or before), 1 when it had already ended "
        "otherwise, 2 for an unknown id or a deployment's job (use undeploy NAME).",
    )
    add_job_id_argument(p)
    add_initial_peers(p)
    add_key_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.daemon.observer import SwarmObserver
    from fusionnet.messages.broker_rpc import BrokerClient
    from fusionnet.runtime.jobcontrol import cancel_job
    from fusionnet.runtime.submitter import Signer, load_or_create_key

    key = load_or_create_key(args.key)

    async def cancel() -> Any:
        async with SwarmObserver(args.initial_peers) as observer:
            broker = await observer.find_broker()
            signer = Signer(key, broker, observer.peer_id)
            client = BrokerClient(observer.call)
            return await cancel_job(client, broker, args.job_id, "fusionnet cancel", signer)

    reply = asyncio.run(cancel())
    print(reply.message)
    return 0 if reply.state == "CANCELLED" else 1
