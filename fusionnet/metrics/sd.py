"""Prometheus service discovery for compnodes: file_sd JSON and the http_sd endpoint.

Compnodes come and go, so Prometheus learns their metrics endpoints from the broker, which sees
them in the DHT. Two ways, same JSON (a list of ``{"targets": ["host:port"], "labels": {...}}``):

- file_sd: the broker rewrites a file (``write_file_sd``), atomically, so Prometheus's file watcher
  never reads half a file;
- http_sd: the broker's metrics server answers ``GET /sd/compnodes`` (``http_sd_app``).

Labels per target: ``role`` (supernode/antnode), ``backup`` (true/false), ``peer`` (libp2p peer id;
one series per node by nature, which is what a per-node dashboard filters on).
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from fusionnet.metrics.common import ROLES, label_value

SD_PATH = "/sd/compnodes"  # where the broker's metrics server serves http_sd


class ScrapeTarget(NamedTuple):
    """One compnode's metrics endpoint as the broker knows it."""

    host: str
    metrics_port: int
    role: str
    backup: bool
    peer_id: str


TargetSource = Callable[[], Iterable[tuple[str, int, str, bool, str]]]


def _address(host: str, port: int, where: str) -> str:
    if not isinstance(host, str) or not host or any(c.isspace() or c in "/[]" for c in host):
        raise ValueError(f"{where}: metrics host {host!r} is not a host name or IP address")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None  # a DNS name
    if ip is not None and ip.is_unspecified:
        raise ValueError(f"{where}: metrics host {host} is a bind-all address, not one Prometheus can scrape")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"{where}: metrics port {port!r} is not in 1..65535")
    return f"[{host}]:{port}" if ip is not None and ip.version == 6 else f"{host}:{port}"


def file_sd_targets(compnodes: Iterable[tuple[str, int, str, bool, str]]) -> list[dict[str, Any]]:
    """The file_sd / http_sd document for compnodes given as (host, metrics_port, role, backup, peer_id).

    One group per compnode (their labels differ), sorted by peer id so that a rewrite with the same
    swarm produces the same bytes. A peer listed twice is refused: it would be scraped twice.
    """
    groups: dict[str, dict[str, Any]] = {}
    for item in compnodes:
        try:
            host, port, role, backup, peer_id = item
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"scrape target {item!r}: expected (host, metrics_port, role, backup, peer_id)"
            ) from e
        if not isinstance(peer_id, str) or not peer_id or not peer_id.isalnum():
            raise ValueError(f"scrape target {item!r}: peer id {peer_id!r} is not a base58 peer id")
        where = f"compnode {peer_id}"
        if not isinstance(backup, bool):
            raise ValueError(f"{where}: backup must be true or false, got {backup!r}")
        if peer_id in groups:
            raise ValueError(f"{where}: listed twice as a scrape target")
        groups[peer_id] = {
            "targets": [_address(host, port, where)],
            "labels": {
                "role": label_value(role, ROLES, "role"),
                "backup": "true" if backup else "false",
                "peer": peer_id,
            },
        }
    return [groups[p] for p in sorted(groups)]


def encode_targets(groups: list[dict[str, Any]]) -> bytes:
    return (json.dumps(groups, indent=2, sort_keys=True) + "\n").encode()


def write_file_sd(path: str | os.PathLike[str], compnodes: Iterable[tuple[str, int, str, bool, str]]) -> bool:
    """Atomically replace ``path`` with the file_sd document; returns False when it was already current.

    Write to a temporary file in the same directory, fsync, then ``os.replace``: Prometheus either
    sees the old file or the new one. Skipping identical rewrites spares it a reload per refresh.
    """
    target = Path(path)
    data = encode_targets(file_sd_targets(compnodes))
    try:
        if target.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; Prometheus may run as another user
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def http_sd_app(source: TargetSource) -> Callable[..., list[bytes]]:
    """A WSGI app serving ``source()`` as a Prometheus http_sd document (at any path it is mounted on).

    Prometheus requires status 200 and ``application/json``; when ``source`` fails we answer 500 so
    that Prometheus keeps its last good target list instead of dropping every compnode.
    """

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ.get("REQUEST_METHOD", "GET") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain")])
            return [b"use GET\n"]
        try:
            body = encode_targets(file_sd_targets(source()))
        except Exception as e:  # the target source is the broker's registry: report, never crash the server
            msg = f"service discovery failed: {type(e).__name__}: {e}\n".encode()
            start_response("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")])
            return [msg]
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app
