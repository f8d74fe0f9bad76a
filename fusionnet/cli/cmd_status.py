"""``fusionnet status --initial-peers ...``: compnodes (role, backup, state, hardware, load) and jobs.

Two sources, merged: the broker's registry (heartbeats, jobs) over RPC, and the compnode records in the
DHT directly, so that a compnode the broker has not seen yet, or one that already said goodbye (OFFLINE),
still shows. ``--json`` prints the merged document instead of tables.

The broker call is signed with the submitter key (``--key FILE``, else the default key of
``fusionnet.runtime.submitter``) when that key exists; then the broker shows this user's own jobs in full.
``status`` never makes a key: without one the call goes unsigned, and a ``--key`` file that does not exist
is refused (exit 2).

``--wait-compnodes N`` is the readiness check for scripts: it waits (up to ``--timeout`` seconds in all) until
the broker itself lists at least N compnodes ONLINE with a data path outside the backup pool, i.e. compnodes
it places a new job on (as ``submit`` counts them), then prints the status and exits 0; exit 3 when the time
runs out first.

``--watch`` keeps one swarm client open and redraws every ``--interval`` seconds until Ctrl-C (exit 0): on a
terminal the screen is cleared and redrawn in place; into a pipe or file each refresh is appended as a
block (with ``--json``: one JSON document per line). A failed refresh shows its error and the next one
tries again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fusionnet.cli.argtypes import add_initial_peers, positive_seconds
from fusionnet.cli.jobflags import add_key_flag
from fusionnet.runtime.jobcontrol import ready_compnodes

CLEAR_HOME = "\x1b[H"  # cursor to the top left
CLEAR_LINE_END = "\x1b[K"
CLEAR_BELOW = "\x1b[J"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="show compnodes and jobs of a swarm",
        description="Finds the broker through the DHT, asks it for compnodes (role, backup, state, hardware, "
        "load, heartbeat) and jobs (state, step, loss), and lists the compnode records in the DHT as well "
        "(so OFFLINE ones show). Exit status 1 when no broker answers (what the DHT knows is still printed).",
    )
    add_initial_peers(p)
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=15.0,
        metavar="S",
        help="limit for the broker call (default 15)",
    )
    p.add_argument(
        "--wait-compnodes",
        type=int,
        default=None,
        metavar="N",
        help="wait until the broker can place a job on N compnodes (ONLINE with a data path, backups not "
        "counted); --timeout bounds the whole wait; exit 3 if it runs out",
    )
    p.add_argument(
        "--watch", action="store_true", help="keep refreshing (clear screen and redraw) until Ctrl-C"
    )
    p.add_argument(
        "--interval",
        type=positive_seconds,
        default=2.0,
        metavar="S",
        help="seconds between refreshes with --watch (default %(default)s)",
    )
    # status signs with the key when it exists (own jobs in full) but, unlike the others, never makes one
    add_key_flag(
        p,
        "submitter key to sign the broker call with, so your own jobs show in full (default $FUSIONNET_KEY, "
        "else $FUSIONNET_HOME/submitter.key, else ~/.fusionnet/submitter.key, when it exists; status never "
        "makes a key)",
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
            "metrics_address": r.metrics_address,
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
            name = j.get("name") or "-"  # the broker names only the caller's own jobs
            table.append((j["job_id"], name, j["state"], step, _num(j.get("loss"), ".6f"), updated))
        lines.extend(_render(table))
    deployments = doc.get("deployments") or []
    if deployments:
        lines.append(f"\ndeployments ({len(deployments)})")
        table = [("NAME", "KIND", "JOB", "COMPNODES", "BATCHES", "QUEUED")]
        unplaced = []
        for d in deployments:
            table.append((
                str(d.get("id")), str(d.get("kind")), str(d.get("job_id")), str(d.get("compnodes")),
                str(d.get("batches", "-")), str(d.get("queued_rows", "-")),
            ))  # fmt: skip
            if d.get("unplaced"):  # every request gets 503 until a compnode joins
                unplaced.append(f"  {d.get('id')}: no placement: {d['unplaced']}")
        lines.extend(_render(table))
        lines.extend(unplaced)
    return "\n".join(lines)


def _render(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def summary(doc: dict[str, Any]) -> str:
    """One line: how many compnodes in which state, how many jobs running."""
    states: dict[str, int] = {}
    for c in doc["compnodes"]:
        states[c["state"]] = states.get(c["state"], 0) + 1
    nodes = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "none"
    running = sum(1 for j in doc.get("jobs") or [] if j.get("state") == "RUNNING")
    return f"compnodes: {nodes}; jobs running: {running}"


def render_frame(doc: dict[str, Any] | None, error: str | None, *, interval: float, tty: bool) -> str:
    """One refresh of ``--watch``: a header line, then the tables (or the error of this refresh)."""
    stamp = time.strftime("%H:%M:%S")
    header = f"fusionnet status  {stamp}  every {interval:g} s  (Ctrl-C to quit)"
    body = f"refresh failed: {error}" if doc is None else f"{summary(doc)}\n\n{format_tables(doc)}"
    lines = [header, "", *body.splitlines()]
    if tty:  # redraw in place: home, overwrite each line, clear whatever the last frame left below
        return CLEAR_HOME + "".join(f"{line}{CLEAR_LINE_END}\n" for line in lines) + CLEAR_BELOW
    return "\n".join(lines) + "\n\n"


async def collect(observer: Any, timeout: float, key: Any = None) -> dict[str, Any]:
    """The merged status document, read through an open ``SwarmObserver``; the broker call is signed with
    ``key`` (an ``Ed25519PrivateKey``, ``status_key``'s) when there is one."""
    from fusionnet.dht.records import CompnodeRecord
    from fusionnet.errors import FusionNetError

    records = await observer.compnodes()
    broker: dict[str, Any] | None = None
    error = None
    try:
        broker = await observer.broker_status(timeout=timeout, auth=_own_jobs_auth(observer, key))
    except FusionNetError as e:
        error = str(e)
    now = time.time()
    return {
        "broker": None if broker is None else broker["broker"],
        "broker_error": error,
        "compnodes": merge_status(broker, records, now),
        "jobs": [] if broker is None else broker["jobs"],
        "deployments": [] if broker is None else broker.get("deployments", []),
        "dht_compnodes": [
            f.record.model_dump(mode="json") | {"expires_in": f.expires_at - now}
            for f in records
            if isinstance(f.record, CompnodeRecord)
        ],
    }


def status_key(path: Path | None) -> Any:
    """The submitter key ``status`` signs with: ``--key FILE`` (``path``), else the default key when this
    user has one, else None (unsigned). Never makes a key: a ``--key`` file that does not exist, or is not a
    key, raises ValueError (one line, exit 2)."""
    from fusionnet.runtime.submitter import default_key_path, load_or_create_key

    if path is None:
        if not default_key_path().is_file():
            return None
    elif not path.exists():  # a directory or a file of garbage is not "no such file": the loader says what
        raise ValueError(f"--key: {path}: no such key file (status never makes one; `fusionnet key` does)")
    return load_or_create_key(path)  # None: the default key, named as such in its errors


def _own_jobs_auth(observer: Any, key: Any) -> Any:
    """Signs the status call with ``key`` when there is one (then the broker shows this user's own jobs in
    full; others' jobs show id, state and step only); None: unsigned."""
    from fusionnet.runtime.submitter import Signer

    if key is None:
        return None
    return lambda broker: Signer(key, broker, observer.peer_id).auth("status")


async def gather(initial_peers: list[str], timeout: float, key: Any = None) -> dict[str, Any]:
    from fusionnet.daemon.observer import SwarmObserver

    async with SwarmObserver(initial_peers) as observer:
        # the DHT lookup as well as the broker call: a swarm that answers nothing ends, as the other paths
        return await asyncio.wait_for(collect(observer, timeout, key), timeout + 10)


def placeable(doc: dict[str, Any], *, backups: bool = False) -> int:
    """Compnodes the broker itself lists ONLINE with a data path (the DHT, and a compnode's address file,
    can be ahead of the broker's registry) and that a new job is placed on: not the backup pool, which a
    placement takes only when no other compnode is there, as ``submit`` counts them
    (``jobcontrol.ready_compnodes``). ``backups``: those only."""
    known = [c for c in doc["compnodes"] if c.get("known_to_broker")]
    regular, spare = ready_compnodes(known)
    return spare if backups else regular


async def wait_compnodes(
    initial_peers: list[str], n: int, timeout: float, key: Any = None
) -> tuple[dict[str, Any], bool]:
    """Polls the broker through one swarm client until ``n`` compnodes are placeable or ``timeout`` passes;
    returns the last status document and whether ``n`` was reached."""
    from fusionnet.daemon.observer import SwarmObserver

    deadline = time.monotonic() + timeout
    async with SwarmObserver(initial_peers) as observer:
        while True:
            left = deadline - time.monotonic()
            doc = await asyncio.wait_for(
                collect(observer, max(1.0, min(15.0, left)), key), max(1.0, left) + 10
            )
            if placeable(doc) >= n:
                return doc, True
            if time.monotonic() >= deadline:
                return doc, False
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


async def watch(
    initial_peers: list[str], *, timeout: float, interval: float, as_json: bool, out: TextIO, key: Any = None
) -> None:
    """Refreshes until cancelled (Ctrl-C), through one swarm client kept open between refreshes."""
    from fusionnet.daemon.observer import SwarmObserver

    tty = out.isatty() and not as_json
    if tty:
        out.write(f"{CLEAR_HOME}{CLEAR_BELOW}fusionnet status: joining the swarm ...\n")
        out.flush()
    async with SwarmObserver(initial_peers) as observer:
        while True:
            started = time.monotonic()
            doc, error = None, None
            try:
                doc = await asyncio.wait_for(collect(observer, timeout, key), timeout + 10)
            except Exception as e:  # a UI loop: show the failure, try again next time
                error = f"{type(e).__name__}: {e}"
            if as_json:
                line = doc if doc is not None else {"error": error}
                out.write(json.dumps(line | {"time": time.time()}, sort_keys=True) + "\n")
            else:
                out.write(render_frame(doc, error, interval=interval, tty=tty))
            out.flush()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


def run(args: argparse.Namespace) -> int:
    try:
        key = status_key(getattr(args, "key", None))
    except (OSError, ValueError) as e:  # a --key that is missing, unreadable or not a key: one line
        print(f"fusionnet status: error: {e}", file=sys.stderr)
        return 2
    if args.watch:
        if not args.interval > 0:
            print(f"fusionnet status: error: --interval must be > 0, got {args.interval}", file=sys.stderr)
            return 2
        try:
            asyncio.run(
                watch(
                    args.initial_peers,
                    timeout=args.timeout,
                    interval=args.interval,
                    as_json=args.json,
                    out=sys.stdout,
                    key=key,
                )
            )
        except KeyboardInterrupt:  # the way out of --watch: asyncio.run has closed the swarm client
            return 0
        except ValueError as e:
            print(f"fusionnet status: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.wait_compnodes is not None:
        return _run_wait(args, key)
    try:
        doc = asyncio.run(gather(args.initial_peers, args.timeout, key))
    except ValueError as e:  # bad multiaddrs, unreachable swarm (WireError): one line
        print(f"fusionnet status: error: {e}", file=sys.stderr)
        return 2
    except TimeoutError:
        print(
            f"fusionnet status: error: the swarm answered nothing within {args.timeout + 10:g} s",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
    else:
        print(format_tables(doc))
    return 0 if doc["broker"] is not None else 1


def _run_wait(args: argparse.Namespace, key: Any = None) -> int:
    n = args.wait_compnodes
    if n < 1 or not args.timeout > 0:
        print("fusionnet status: error: --wait-compnodes needs N >= 1 and --timeout > 0", file=sys.stderr)
        return 2
    try:
        doc, reached = asyncio.run(wait_compnodes(args.initial_peers, n, args.timeout, key))
    except (ValueError, TimeoutError) as e:
        print(f"fusionnet status: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=1, sort_keys=True) if args.json else format_tables(doc))
    if not reached:
        print(
            f"fusionnet status: only {placeable(doc)} of {n} compnodes ready at the broker after "
            f"{args.timeout:g} s",
            file=sys.stderr,
        )
        return 3
    return 0
