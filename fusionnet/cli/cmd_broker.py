"""``fusionnet broker``: the broker daemon (DHT presence, compnode registry and heartbeats, job state)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    from fusionnet.daemon.flags import add_common_arguments, finite_number

    p = subparsers.add_parser(
        "broker",
        help="run the broker daemon",
        description="Broker daemon: joins (or starts) the DHT, announces itself, keeps a registry of "
        "compnodes from their DHT records and ping-pong heartbeats, keeps job state in SQLite under "
        "--state-dir, and answers `fusionnet status`. Writes its multiaddrs to --address-file once ready. "
        "Stops gracefully on SIGINT/SIGTERM; a second signal forces the exit.",
    )
    add_common_arguments(p, initial_peers_required=False)
    p.add_argument(
        "--heartbeat-period",
        type=finite_number,
        default=1.0,
        metavar="S",
        help="seconds between ping rounds (default 1)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=finite_number,
        default=3.0,
        metavar="S",
        help="a compnode that has not answered a ping for this long is unreachable and its sub-DAGs "
        "are moved (default 3)",
    )
    p.add_argument(
        "--sync-every",
        type=int,
        default=0,
        metavar="K",
        help="train jobs: also collect parameters and optimizer state on the broker every K steps "
        "(default 0: never; each sub-DAG's state is replicated in the background to another compnode of "
        "the job, and after a failure the job goes on from the newest replicated step)",
    )
    p.add_argument(
        "--steps-ahead",
        action="store_true",
        help="send each step's call while the previous step still runs, so a compnode starts it the "
        "moment it is done (not across syncs, re-plans or hand-overs; default off: measured slower "
        "on a loaded 2-core machine)",
    )
    p.add_argument(
        "--replica-interval",
        type=finite_number,
        default=2.0,
        metavar="SECONDS",
        help="train jobs: start a round of failover snapshots (each sub-DAG's state copied to another "
        "compnode of the job) at most every SECONDS (default 2; 0 = as often as the links allow), and "
        "no sooner than 10x what the last round cost the steps. A failover replays the steps since the "
        "newest complete round",
    )
    p.add_argument(
        "--compnode-mtbf",
        type=finite_number,
        default=None,  # the broker's own (``broker.churn.PRIOR_MTBF``), kept in one place
        metavar="SECONDS",
        help="train jobs: the seconds assumed between unplanned losses of one compnode before the broker "
        "has seen any (default 3600); with what it sees, rounds of failover snapshots are spaced by "
        "Young's interval sqrt(2 x a round's cost x the job's mean time between losses) when that is "
        "longer, which loses the least time to rounds and replays together (0 = off)",
    )
    p.add_argument(
        "--stage-part-mb",
        type=finite_number,
        default=32.0,
        metavar="MB",
        help="a sub-DAG's state (or optimizer state) over this size is sent to its compnode in parts of "
        "this size before the assignment, so the broker holds one part at a time whatever the model "
        "size (default 32; keep it under the compnodes' --rpc-max-mb)",
    )
    p.add_argument(
        "--placement",
        choices=("model", "balanced"),
        default="model",
        help="how jobs are cut and placed: 'model' = the scheduler of problem (2) with the performance "
        "model (default); 'balanced' = FLOP-balanced pieces on the fastest compnodes (the plain policy, "
        "for comparison); a job that names placement.cuts is cut there either way",
    )
    p.add_argument(
        "--replan-gain",
        type=finite_number,
        default=0.1,
        metavar="F",
        help="elastic join: a compnode that joins mid-job gets work when the performance model predicts "
        "a step time shorter by more than this fraction (default 0.1: 10%%)",
    )
    p.add_argument(
        "--interleave-gain",
        type=finite_number,
        default=None,
        metavar="F",
        help="placement.schedule auto: run interleaved-1f1b (each compnode looping over several "
        "sub-DAGs) only when the performance model predicts a step shorter by more than this fraction "
        "than the best schedule of one sub-DAG per compnode (default 0.05; 1 never interleaves; a "
        "negative value interleaves even when predicted that much slower; -1 whenever an interleaved "
        "cut runs and fits, to try the schedule)",
    )
    p.add_argument(
        "--sd-file",
        type=Path,
        metavar="FILE",
        help="rewrite this Prometheus file_sd JSON with the compnodes' metrics endpoints at every refresh "
        "(the same targets are always served as http_sd at /sd/compnodes on --metrics-port)",
    )
    add_admission_flags(p)
    p.add_argument(
        "--http-port",
        type=int,
        metavar="PORT",
        help="serve the HTTP API of this broker's deployments (OpenAI-compatible /v1/completions, "
        "/v1/models, /v1/infer) on this port (0: any free port; default: no HTTP API)",
    )
    p.add_argument(
        "--http-host",
        default="127.0.0.1",
        metavar="HOST",
        help="where --http-port listens (default 127.0.0.1)",
    )
    p.add_argument(
        "--serve-path",
        choices=["direct", "rpc"],
        default="direct",
        help="how a deployment's batches reach its compnodes: straight to their sandbox workers over the "
        "data path, answered on it (direct, the default; a compnode that cannot takes RPC calls) or "
        "as serve_step RPC calls through the daemons (rpc)",
    )
    p.set_defaults(func=run)


def add_admission_flags(p: Any) -> None:
    """Who may submit, and per-submitter quotas (``fusionnet.broker.admission``)."""
    from fusionnet.daemon.flags import finite_number

    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--submitters",
        type=Path,
        metavar="FILE",
        help="only these submitters may submit: one submitter id (what `fusionnet key` prints) a line; "
        "re-read when it changes. Default: open on a loopback-only broker, closed otherwise",
    )
    who.add_argument(
        "--open-submissions",
        action="store_true",
        help="any submitter key may submit (logged as a warning; quotas still apply per key)",
    )
    for flag, default, what in (
        (
            "--max-jobs-per-submitter",
            4,
            "jobs (queued or running) and deployments one submitter may have at once",
        ),
        ("--max-steps", 100_000, "steps of one job"),
        ("--max-graph-nodes", 20_000, "IR nodes of one job"),
    ):
        p.add_argument(flag, type=int, default=default, metavar="N", help=f"{what} (default %(default)s)")
    p.add_argument(
        "--max-submission-mb",
        type=finite_number,
        default=1024.0,
        metavar="MB",
        help="IR + weights + data of one submission, MiB (default %(default)g)",
    )


def run(args: argparse.Namespace) -> int:
    from fusionnet.broker.admission import AdmissionConfig
    from fusionnet.broker.config import BrokerConfig
    from fusionnet.broker.daemon import BrokerDaemon
    from fusionnet.broker.jobs import JobService
    from fusionnet.daemon.config import common_config
    from fusionnet.metrics import BROKER_METRICS
    from fusionnet.planning.placement import BALANCED, SCHEDULER

    if args.http_port is not None and not 0 <= args.http_port < 65536:
        print(
            f"fusionnet broker: error: --http-port must be in 0..65535, got {args.http_port}", file=sys.stderr
        )
        return 2
    try:
        config = BrokerConfig(
            common=common_config(args, "broker"),
            heartbeat_period=args.heartbeat_period,
            heartbeat_timeout=args.heartbeat_timeout,
            sync_every=args.sync_every,
            steps_ahead=args.steps_ahead,
            replica_interval=args.replica_interval,
            **({} if args.compnode_mtbf is None else {"compnode_mtbf": args.compnode_mtbf}),
            stage_part_mb=args.stage_part_mb,
            replan_gain=args.replan_gain,
            **({} if args.interleave_gain is None else {"interleave_gain": args.interleave_gain}),
            placement_policy=BALANCED if args.placement == "balanced" else SCHEDULER,
            serve_path=args.serve_path,
            sd_file=args.sd_file,
            admission=AdmissionConfig(
                submitters_file=args.submitters,
                open_submissions=args.open_submissions,
                max_jobs_per_submitter=args.max_jobs_per_submitter,
                max_steps=args.max_steps,
                max_graph_nodes=args.max_graph_nodes,
                max_submission_bytes=int(args.max_submission_mb * 2**20),
            ),
        )
        # One broker per process: its metrics are the process's set, so module-level users count too.
        broker = BrokerDaemon(config, BROKER_METRICS)
        jobs = JobService(broker.job_context())
        broker.add_service(jobs)
        broker.add_service(deployment_service(broker, args.http_host, args.http_port, jobs.admission))
        broker.serve_and_exit()  # the process ends here, with the daemon's exit code
    except ValueError as e:  # configuration and start-up problems (FusionNetErrors included): one line
        print(f"fusionnet broker: error: {e}", file=sys.stderr)
        return 2


def deployment_service(broker: Any, host: str, port: int | None, admission: Any = None) -> Any:
    """The deployments and their HTTP API (issue 14), reporting to the broker's metrics and status."""
    from fusionnet.broker.deployments import DeploymentService
    from fusionnet.messages.serving_rpc import ServingClient

    service = DeploymentService(
        broker.job_context(),
        ServingClient(broker.call),
        http_host=host,
        http_port=port,
        observer=broker.metrics.serving,
        admission=admission,  # deployments come from the submitters jobs come from
    )
    broker.describe_deployments = service.describe
    return service
