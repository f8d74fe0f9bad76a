"""Peer ids named in multiaddrs: the ``/p2p/<id>`` part that pins whom a daemon or client trusts."""

from __future__ import annotations

from collections.abc import Iterable


def peer_ids_of_maddrs(maddrs: Iterable[str]) -> list[str]:
    """The peer ids a list of multiaddrs names (``.../p2p/<id>`` or the older ``.../ipfs/<id>``), in
    order, each once."""
    ids: list[str] = []
    for maddr in maddrs:
        parts = maddr.rstrip("/").split("/")
        for i, part in enumerate(parts[:-1]):
            if part in ("p2p", "ipfs") and parts[i + 1] and parts[i + 1] not in ids:
                ids.append(parts[i + 1])
    return ids
