"""``fusionnet compnode``: the compnode daemon (profiling, hardware record, sub-task execution)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    from fusionnet.compnode.compute import INLINE_COMPUTE_MS
    from fusionnet.daemon.flags import add_common_arguments, finite_number

    p = subparsers.add_parser(
        "compnode",
        help="run a compnode daemon",
        description="Compnode daemon: joins the DHT through --initial-peers, profiles this machine, "
        "announces its hardware record (JOINING -> ONLINE) and refreshes it, answers the broker's heartbeats "
        "and runs sub-tasks. SIGTERM = graceful leave (DRAINING, hand work over, OFFLINE); a second signal "
        "forces it.",
    )
    add_common_arguments(p, initial_peers_required=True)
    p.add_argument(
        "--role", choices=["supernode", "antnode"], default="supernode", help="FusionAI node class"
    )
    p.add_argument("--backup", action="store_true", help="join the broker's backup pool")
    p.add_argument("--threads", type=int, metavar="N", help="torch compute threads (default: torch's choice)")
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device that runs the sub-DAGs (parameters, gradients and optimizer state live there) "
        "and that is profiled and announced (D_gpu): cpu (default), cuda, cuda:N or mps",
    )
    p.add_argument(
        "--data-host",
        metavar="HOST",
        help="address of the direct data path, announced to peers (default: the host of --announce-maddrs, "
        "else of --host-maddrs, else this machine's first non-loopback address; 127.0.0.1 only when "
        "libp2p listens on loopback); 0.0.0.0 listens everywhere and announces that default",
    )
    p.add_argument(
        "--data-port", type=int, default=0, metavar="PORT", help="port of the data path (0 = free)"
    )
    p.add_argument("--reprofile", action="store_true", help="ignore the cached hardware profile")
    p.add_argument(
        "--slowdown",
        type=finite_number,
        default=1.0,
        metavar="F",
        help="emulate a device F (>= 1) times slower: sleep (F-1)x the time of each FP/BP/Update and "
        "announce the profile divided by F, for heterogeneous swarms on one machine (default: 1)",
    )
    p.add_argument(
        "--metrics-announce-host",
        metavar="HOST",
        help="host Prometheus reaches --metrics-port at, announced for service discovery (default: "
        "--metrics-host, or the host of the first announced multiaddr when that binds every interface)",
    )
    p.add_argument(
        "--trusted-broker",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="also take assignments from this broker (repeatable; the peers named in --initial-peers "
        "are trusted already, nobody else is)",
    )
    p.add_argument(
        "--assignment-ttl",
        type=finite_number,
        default=60.0,
        metavar="S",
        help="release an assignment whose broker sent no step, call or heartbeat for S seconds "
        "(default %(default)g)",
    )
    p.add_argument(
        "--sandbox",
        choices=["process", "off"],
        default="process",
        help="where a job's sub-DAG is decoded, rebuilt and run: 'process' (default), a worker process "
        "per assignment with a memory limit, so a job that crashes or runs away ends only itself; "
        "'off', on this daemon's compute thread (one process; a crashing job takes the compnode down)",
    )
    p.add_argument(
        "--sandbox-memory-gb",
        type=finite_number,
        metavar="GB",
        help="private memory one job's worker may use beyond its start-up (CPU devices; default: 90%% "
        "of this machine's RAM); a job past it fails with an error naming its worker",
    )
    p.add_argument(
        "--worker-sends",
        choices=["direct", "daemon"],
        default="direct",
        help="how a sandbox worker's activations and gradients leave: 'direct' (default), over the "
        "worker's own TCP connections to the receivers' data paths; 'daemon', handed to this daemon, "
        "which sends them (one more hop per value; for hosts that let only the daemon connect out)",
    )
    p.add_argument(
        "--worker-receives",
        choices=["direct", "daemon"],
        default="direct",
        help="how the values other compnodes' workers send reach a sandbox worker: 'direct' (default), "
        "this daemon hands their connections to the worker, which reads and checks the frames itself; "
        "'daemon', this daemon reads them and relays each value to the worker (one more hop per value)",
    )
    p.add_argument(
        "--inline-compute-ms",
        type=finite_number,
        default=INLINE_COMPUTE_MS,
        metavar="MS",
        help="a sandbox worker runs an FP, BP or Update on its event loop instead of its compute thread "
        "when its recent ones took at most MS milliseconds and no send is pending: two thread wake-ups "
        f"fewer per value's trip (default {INLINE_COMPUTE_MS:g}; 0: always on the compute thread)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.compnode.daemon import CompnodeConfig, CompnodeDaemon
    from fusionnet.compnode.tasks import SubtaskService
    from fusionnet.daemon.config import common_config
    from fusionnet.metrics import COMPNODE_METRICS

    try:
        config = CompnodeConfig(
            common=common_config(args, "compnode"),
            role=args.role,
            backup=args.backup,
            threads=args.threads,
            device=args.device,
            data_host=args.data_host,
            data_port=args.data_port,
            reprofile=args.reprofile,
            slowdown=args.slowdown,
            metrics_announce_host=args.metrics_announce_host,
            trusted_brokers=tuple(args.trusted_broker),
            assignment_ttl=args.assignment_ttl,
            sandbox=args.sandbox == "process",
            sandbox_memory_gb=args.sandbox_memory_gb,
            worker_sends=args.worker_sends,
            worker_receives=args.worker_receives,
            inline_compute_ms=args.inline_compute_ms,
        )
        # One compnode per process: its metrics are the process's set, so module-level users count too.
        compnode = CompnodeDaemon(config, COMPNODE_METRICS)
        compnode.add_service(SubtaskService(compnode))
        compnode.serve_and_exit()  # the process ends here, with the daemon's exit code
    except ValueError as e:  # configuration and start-up problems (FusionNetErrors included): one line
        print(f"fusionnet compnode: error: {e}", file=sys.stderr)
        return 2
