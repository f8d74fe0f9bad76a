"""``fusionnet status --initial-peers ...``: compnodes (role, backup, state, hardware, load) and jobs.

Two sources, merged: the broker's registry (heartbeats, jobs) over RPC, and the compnode records in the
DHT directly, so that a compnode the broker has not seen yet, or one that already said goodbye (OFFLINE),
still shows. ``--json`` prints the merged document instead of tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="show compnodes and jobs of a swarm",
        description="Finds the broker through the DHT, asks it for compnodes (role, backup, state, hardware, "
        "load, heartbeat) and jobs (state, step, loss), and lists the compnode records in the DHT as well "
        "(so OFFLINE ones show). Exit status 1 when no broker answers (what the DHT knows is still printed).",
    )
    p.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="any peer of the swarm")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument(
        "--timeout", type=float, default=15.0, metavar="S", help="limit for the broker call (default 15)"
    )
    p.set_defaults(func=run)


def merge_status(broker: dict[str, Any] | None, records: list[Any], now: float) -> list[dict[str, Any]]:
    """One row per compnode. The broker's view wins (it knows about heartbeats), except when the node's own
    record already says OFFLINE (the broker learns that only at its next refresh)."""
    rows: dict[str, dict[str, Any]] = {}
    for item in records:
        r = item.record
        rows[r.peer_id] = {
            "peer_id": r.peer_id,
            "role": r.role.value,
            "backup": r.backup,
            "state": r.state.value,
            "announced_state": r.state.value,
            "reachable": None,
            "hardware": None if r.hardware is None else r.hardware.model_dump(mode="json"),
            "load": r.load,
            "running_tasks": r.running_tasks,
            "data_path_address": r.data_path_address,
            "version": r.version,
            "last_heartbeat_age": None,
            "rtt_ms": None,
            "record_age": max(0.0, now - r.updated_at),
            "in_dht": True,
            "known_to_broker": False,
        }
    for entry in (broker or {}).get("compnodes", []):
        row = rows.get(entry["peer_id"])
        merged = {**(row or {"record_age": None, "in_dht": False}), **entry, "known_to_broker": True}
        if row is not None and row["announced_state"] == "OFFLINE":
            merged["state"] = merged["announced_state"] = "OFFLINE"
        rows[entry["peer_id"]] = merged
    return [rows[p] for p in sorted(rows)]


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:4]}…{peer_id[-8:]}"


def _num(value: Any, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def format_tables(doc: dict[str, Any]) -> str:
    lines = []
    broker = doc.get("broker")
    if broker:
        lines.append(f"broker {broker['peer_id']}  up {broker['uptime']:.0f} s  version {broker['version']}")
    else:
        lines.append(f"broker: {doc.get('broker_error') or 'not found'}")
    header = (
        "PEER",
        "ROLE",
        "BACKUP",
        "STATE",
        "DEVICE",
        "GFLOPS",
        "λ",
        "MEM GiB",
        "LOAD",
        "TASKS",
        "RTT ms",
        "BEAT s",
    )
    table = [header]
    for c in doc["compnodes"]:
        hw = c.get("hardware") or {}
        mem = hw.get("d_gpu") or hw.get("d_cpu")
        table.append((
            _short(c["peer_id"]), c["role"], "yes" if c["backup"] else "no", c["state"],
            hw.get("device_kind", "-"),
            _num(hw.get("peak_flops", 0) * hw.get("speed_factor", 0) if hw else None, ".1f", 1e9),
            _num(hw.get("speed_factor"), ".2f"), _num(mem, ".1f", 2**30),
            _num(c.get("load"), ".2f"), str(c.get("running_tasks", "-")),
            _num(c.get("rtt_ms"), ".1f"), _num(c.get("last_heartbeat_age"), ".1f"),
        ))  # fmt: skip
    lines.append(f"\ncompnodes ({len(doc['compnodes'])})")
    lines.extend(_render(table))
    jobs = doc.get("jobs") or []
    lines.append(f"\njobs ({len(jobs)})")
    if jobs:
        table = [("JOB", "NAME", "STATE", "STEP", "LOSS", "UPDATED")]
        for j in jobs:
            step = f"{j['step']}/{j['steps']}" if j.get("steps") else str(j["step"])
            updated = (
                time.strftime("%H:%M:%S", time.localtime(j["updated_at"])) if j.get("updated_at") else "-"
            )
            table.append((j["job_id"], j["name"], j["state"], step, _num(j.get("loss"), ".6f"), updated))
        lines.extend(_render(table))
    return "\n".join(lines)


def _render(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


async def gather(initial_peers: list[str], timeout: float) -> dict[str, Any]:
    from fusionnet.daemon.observer import SwarmObserver
    from fusionnet.dht.records import CompnodeRecord
    from fusionnet.errors import FusionNetError

    async with SwarmObserver(initial_peers) as observer:
        records = await observer.compnodes()
        broker: dict[str, Any] | None = None
        error = None
        try:
            broker = await observer.broker_status(timeout=timeout)
        except FusionNetError as e:
            error = str(e)
        now = time.time()
        return {
            "broker": None if broker is None else broker["broker"],
            "broker_error": error,
            "compnodes": merge_status(broker, records, now),
            "jobs": [] if broker is None else broker["jobs"],
            "dht_compnodes": [
                f.record.model_dump(mode="json") | {"expires_in": f.expires_at - now}
                for f in records
                if isinstance(f.record, CompnodeRecord)
            ],
        }


def run(args: argparse.Namespace) -> int:
    try:
        doc = asyncio.run(gather(args.initial_peers, args.timeout))
    except ValueError as e:  # bad multiaddrs, unreachable swarm (WireError): one line
        print(f"fusionnet status: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        print(format_tables(doc))
    return 0 if doc["broker"] is not None else 1
