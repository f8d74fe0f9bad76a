"""The command-line flags every daemon shares. Kept free of heavy imports (no hivemind, no torch), so that
``fusionnet --help`` stays fast; ``config.common_config`` turns the parsed flags into a ``DaemonConfig``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

# Same values as fusionnet.dht.node.DEFAULT_HOST_MADDRS and fusionnet.rpc.protocol.DEFAULT_MAX_MESSAGE_BYTES
# (not imported: those modules pull in hivemind); tests/test_daemons_state.py checks they agree.
DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
DEFAULT_MAX_MESSAGE_MB = 512.0
DEFAULT_REFRESH_PERIOD = 10.0


def finite_number(text: str) -> float:
    """A float flag's value: ``nan`` and ``inf`` are refused by the parser (``nan`` passes every range
    check written as ``x < 0``, and a wait of ``nan`` seconds ends at once or never)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: a finite number")
    return value


def add_common_arguments(p: argparse.ArgumentParser, *, initial_peers_required: bool) -> None:
    p.add_argument(
        "--initial-peers",
        nargs="+",
        default=[],
        required=initial_peers_required,
        metavar="MADDR",
        help="multiaddrs of peers already in the swarm (/ip4/HOST/tcp/PORT/p2p/PEERID)",
    )
    p.add_argument(
        "--host-maddrs",
        nargs="+",
        default=list(DEFAULT_HOST_MADDRS),
        metavar="MADDR",
        help="multiaddrs to listen on (default: loopback, free port)",
    )
    p.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=[],
        metavar="MADDR",
        help="multiaddrs to advertise (behind NAT)",
    )
    p.add_argument(
        "--state-dir", type=Path, metavar="DIR", help="persistent state (default: a temporary dir)"
    )
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address for --metrics-port")
    p.add_argument(
        "--address-file",
        type=Path,
        metavar="FILE",
        help="write visible multiaddrs here, one per line, once ready",
    )
    p.add_argument(
        "--refresh-period",
        type=finite_number,
        default=DEFAULT_REFRESH_PERIOD,
        metavar="S",
        help="seconds between DHT re-announcements; records expire after 3 periods (default %(default)s)",
    )
    p.add_argument(
        "--rpc-max-mb",
        type=finite_number,
        default=DEFAULT_MAX_MESSAGE_MB,
        metavar="MB",
        help="largest RPC message accepted or sent, MiB (default %(default)s)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=finite_number,
        default=10.0,
        metavar="S",
        help="seconds in-flight RPC calls get to finish on shutdown (default %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=finite_number,
        default=60.0,
        metavar="S",
        help="seconds each service gets to finish or hand over its work on shutdown (default %(default)s)",
    )
