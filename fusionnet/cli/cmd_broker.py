"""``fusionnet broker``: the broker daemon (DHT presence, compnode registry and heartbeats, job state)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    from fusionnet.daemon.flags import add_common_arguments

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
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between ping rounds (default 5)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="a compnode that has not answered a ping for this long is unreachable (default 15)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.broker.daemon import BrokerConfig, BrokerDaemon
    from fusionnet.daemon.config import common_config
    from fusionnet.daemon.plugins import BROKER_PLUGIN, add_plugin_services

    try:
        config = BrokerConfig(
            common=common_config(args, "broker"),
            heartbeat_period=args.heartbeat_period,
            heartbeat_timeout=args.heartbeat_timeout,
        )
        broker = BrokerDaemon(config)
        add_plugin_services(broker, BROKER_PLUGIN)
        return broker.serve()
    except ValueError as e:  # configuration and start-up problems (FusionNetErrors included): one line
        print(f"fusionnet broker: error: {e}", file=sys.stderr)
        return 2
