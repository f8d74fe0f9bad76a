"""Daemon log lines carry the role and peer id, so the interleaved logs of a local swarm stay readable."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s [{label}] %(name)s: %(message)s"


def install_peer_label(role: str, peer_id: str) -> None:
    """Re-formats the root handlers (set up by the CLI) to prefix every line with ``[role peer_id]``."""
    formatter = logging.Formatter(LOG_FORMAT.format(label=f"{role} {peer_id}"))
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO)
    for handler in root.handlers:
        handler.setFormatter(formatter)
