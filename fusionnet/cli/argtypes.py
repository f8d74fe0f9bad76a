"""Argument types the commands share: a flag's bad value is refused by argparse itself (exit 2) before
anything is traced, uploaded or dialled, instead of surfacing later as an internal error or a wait that
never ends (``nan`` compares false with every deadline). ``--initial-peers`` is checked once for every
command in ``main`` (``check_initial_peers``), in the one-line form of the other refusals."""

from __future__ import annotations

import argparse
import math
from typing import Any


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def seconds(text: str) -> float:
    """A duration that may be 0: finite and >= 0."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: seconds, a number >= 0")
    return value


def positive_seconds(text: str) -> float:
    """A limit or a period: finite and > 0."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: seconds, a number > 0")
    return value


# Clients pin their broker (README "Security model"): the peers given are the broker's, not any member's.
BROKER_PEERS_HELP = (
    "the broker's multiaddr, /ip4/HOST/tcp/PORT/p2p/PEERID: its --address-file lines (the command talks "
    "to that broker only, never to a peer a DHT record names)"
)


def add_initial_peers(p: Any, help: str = BROKER_PEERS_HELP) -> None:
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help=help)


def check_initial_peers(args: argparse.Namespace) -> None:
    """The command's ``--initial-peers``, if it takes them, checked (``dht.node.check_initial_peers``)."""
    peers = getattr(args, "initial_peers", None)
    if peers:
        from fusionnet.dht.node import check_initial_peers as check  # here: only commands given peers pay

        check(peers)
