"""Failure recovery on a real swarm: the time of each phase of passive and proactive recovery.

The job is the bundled GPT example (``examples/gpt/job.yaml``: 2 compnodes, SGD with momentum so that
the runs compare, ``--steps`` steps), run on a local swarm of processes on loopback with the broker's
default settings (heartbeat every 1 s, 3 s timeout, a checkpoint after every step): the broker, two
working compnodes and one ``--backup`` compnode, a fresh swarm per run.

- passive   a working compnode is armed with ``FUSIONNET_FAULT=<phase>:<k>[:<micro-batch>]`` and SIGKILLs
            itself in FP, BP or Update of its k-th step (seeded points). The broker's ``plan.json``
            gives, per recovery, ``detection`` (from the start of the failed step or sync to the broker
            knowing which compnode is dead), ``redistribution`` (survivors released, the lost sub-DAG
            assigned to the backup from the last checkpoint) and ``replay`` (the steps since the
            checkpoint run again). "from the kill" is the broker's detection time minus the time of the
            victim's last log line (its "SIGKILL" line; both clocks of one machine).
- proactive once the job is RUNNING past step 3, the compnode running the sub-DAG with the most parameters
            (sub-DAG 0 on a tie; a plan may give a sub-DAG no parameters at all) gets SIGTERM: it announces
            ``leaving``, the broker syncs at the next step boundary and hands the sub-DAG to the
            backup. ``handover_stall`` is the time the job stands still for that; "notice" is the time from
            the SIGTERM to the hand-over being done (it includes the rest of the step running meanwhile).

Every run's final weights are compared with plain PyTorch (``fusionnet.reference``, max abs diff
<= 1e-5: ``exact``). The step time is the median ``seconds`` of the runs' ``metrics.jsonl``. Confidant
(Table 7) reports 16.8 s for passive and 4.5 s for proactive recovery; the ratios are FusionNet / Confidant.
Prints one line per run, a table, then one JSON line. Logs and results stay in ``--workdir``.

    python benchmarks/recovery.py [--runs 3] [--steps 30] [--seed 0] [--workdir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from swarm_jobs import WORKDIR_HELP, run_main, work_folder, write_gpt_job  # noqa: E402

from fusionnet.daemon.observer import SwarmObserver  # noqa: E402
from fusionnet.messages.broker_rpc import BrokerClient  # noqa: E402
from fusionnet.runtime.jobcontrol import job_status  # noqa: E402
from fusionnet.runtime.process_swarm import CompnodeSpec, ProcessSwarm  # noqa: E402
from fusionnet.runtime.processes import DaemonProcess  # noqa: E402
from fusionnet.runtime.submit import submit_and_wait  # noqa: E402
from fusionnet.runtime.submitter import Signer, load_or_create_key  # noqa: E402

CONFIDANT_PASSIVE_S = 16.8
CONFIDANT_PROACTIVE_S = 4.5
PASSIVE_TARGET_S = 5.0
PROACTIVE_TARGET_S = 1.0
TOL = 1e-5
SGD = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}
PHASES = ("fp", "bp", "update")
WAIT_RUNNING_S = 120.0
LEAVER_EXIT_S = 30.0


@dataclass
class RunRecord:
    scenario: str
    fault: str | None = None
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    max_diff: float = float("nan")
    from_kill: float | None = None  # passive: kill (victim's last log line) -> broker's detection
    notice: float | None = None  # proactive: SIGTERM -> "handed-over" event
    leaver_exit: int | None = None
    moved: str = ""  # the sub-DAG that was lost or handed over
    wall_s: float = 0.0
    error: str | None = None

    @property
    def exact(self) -> bool:
        return self.error is None and self.max_diff <= TOL


def write_job(workdir: Path, steps: int) -> Path:
    """The GPT example with 2 compnodes, SGD and ``steps``."""
    return write_gpt_job(
        workdir / "gpt-recovery.yaml", steps=steps, optimizer=SGD, placement={"compnodes": 2}
    )


def log_time(line: str) -> float:
    """Wall time of a daemon log line (``%(asctime)s``: local time, milliseconds)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def wait_running(observer: SwarmObserver, step: int, deadline: float) -> str:
    """The id of the job once it is RUNNING at ``step`` or later."""
    while True:
        with contextlib.suppress(Exception):  # the broker may be busy; try again until the deadline
            jobs = (await observer.broker_status())["jobs"]
            running = [j for j in jobs if j["state"] == "RUNNING" and j["step"] >= step]
            if running:
                return running[0]["job_id"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job was not RUNNING past step {step} within {WAIT_RUNNING_S:.0f} s")
        await asyncio.sleep(0.1)


async def drive(swarm: ProcessSwarm, job_path: Path, out: Path, rec: RunRecord, timeout: float) -> None:
    async with SwarmObserver(swarm.initial_peers) as observer:
        await swarm.wait_members(observer)
        broker = await observer.find_broker()
        brokers = BrokerClient(observer.call)
        signer = Signer(load_or_create_key(None), broker, observer.peer_id)  # submit's own key: its job
        submit = asyncio.create_task(
            submit_and_wait(job_path, swarm.initial_peers, out, stream=io.StringIO(), timeout=timeout)
        )
        leaver: DaemonProcess | None = None
        sigterm_at = 0.0
        try:
            if rec.scenario == "proactive":
                running = asyncio.create_task(wait_running(observer, 3, time.monotonic() + WAIT_RUNNING_S))
                await asyncio.wait({submit, running}, return_when=asyncio.FIRST_COMPLETED)
                if not running.done():
                    running.cancel()
                    await submit  # it finished or failed before step 3: raise its error
                    raise RuntimeError("the job finished before it could be interrupted; use more --steps")
                status = await job_status(brokers, broker, running.result(), signer)
                victim = max(status.placement, key=lambda p: (p["params"], -p["subdag"]))
                rec.moved = f"sub-DAG {victim['subdag']} ({victim['nodes']} nodes, {victim['params']} params)"
                leaver = next(d for d in swarm.compnodes if d.peer_id == victim["peer_id"])
                sigterm_at = time.time()
                leaver.send(signal.SIGTERM)
            outcome = await submit
            if rec.fault:
                lost = [p for p in outcome.placement if p["peer_id"] == swarm.compnodes[0].peer_id]
                rec.moved = "".join(
                    f"sub-DAG {p['subdag']} ({p['nodes']} nodes, {p['params']} params)" for p in lost
                )
        finally:
            if not submit.done():
                submit.cancel()
                await asyncio.gather(submit, return_exceptions=True)
        status = await job_status(brokers, broker, outcome.job_id, signer)
    if leaver is not None:
        handed = [e for e in status.events if e["kind"] == "handed-over"]
        rec.notice = handed[0]["at"] - sigterm_at if handed else None
        with contextlib.suppress(Exception):
            rec.leaver_exit = await asyncio.to_thread(leaver.proc.wait, LEAVER_EXIT_S)


def run_once(
    scenario: str, fault: str | None, job_path: Path, ref: Any, workdir: Path, timeout: float
) -> RunRecord:
    from safetensors.torch import load_file

    rec = RunRecord(scenario, fault)
    env = {"FUSIONNET_FAULT": fault} if fault else {}  # compnode0 is a working one (not a backup)
    specs = [CompnodeSpec(refresh_period=2.0, env=env), CompnodeSpec(refresh_period=2.0)]
    specs.append(CompnodeSpec(refresh_period=2.0, backup=True))
    swarm = ProcessSwarm(workdir / "swarm", specs, broker_argv=["--refresh-period", "2"])
    out = workdir / "out"
    started = time.monotonic()
    try:
        swarm.start()
        asyncio.run(drive(swarm, job_path, out, rec, timeout))
    except Exception as e:
        rec.error = f"{type(e).__name__}: {e} (logs in {workdir / 'swarm'})"
        return rec
    finally:
        swarm.stop()
        rec.wall_s = time.monotonic() - started
    plan = json.loads((out / "plan.json").read_text())
    rec.recoveries = plan.get("recoveries", [])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rec.step_seconds = [r["seconds"] for r in rows]
    weights = load_file(str(out / "weights.safetensors"))
    if sorted(weights) != sorted(ref):
        rec.error = f"weights have keys {sorted(weights)}, the reference {sorted(ref)}"
    else:
        rec.max_diff = max((weights[k].double() - ref[k].double()).abs().max().item() for k in ref)
    if fault:
        kills = [line for line in swarm.compnodes[0].log_path.read_text(errors="replace").splitlines()
                 if "fault injection: SIGKILL" in line]  # fmt: skip
        detected = [r["detected_at"] for r in rec.recoveries if "detected_at" in r]
        if kills and detected:
            rec.from_kill = detected[0] - log_time(kills[-1])
        if not kills:
            rec.error = f"the armed compnode never hit its fault point {fault}"
    return rec


def describe(rec: RunRecord) -> str:
    """One run's recoveries, for its progress line."""
    if rec.error:
        return f"FAILED: {rec.error}"
    nan = float("nan")
    if rec.scenario == "passive":
        what = "; ".join(
            f"detection {r.get('detection', nan):.2f} s, redistribution "
            f"{r.get('redistribution', nan):.2f} s, replay {r.get('replay', nan):.2f} s (failed step "
            f"{r.get('failed_step')}, "
            f"from {r.get('replay_from')}{', superseded' if r.get('superseded') else ''})"
            for r in rec.recoveries
            if "detection" in r
        )
        what = what or "no recovery recorded"
        return what + (f"; from the kill {rec.from_kill:.2f} s" if rec.from_kill is not None else "")
    stalls = [r["handover_stall"] for r in rec.recoveries if "handover_stall" in r]
    what = ", ".join(f"stall {s:.2f} s" for s in stalls) or "no hand-over recorded"
    what += f"; notice {rec.notice:.2f} s" if rec.notice is not None else ""
    return what + f"; leaver exit code {rec.leaver_exit}"


def line(rec: RunRecord) -> str:
    exact = f"exact (max diff {rec.max_diff:.1e})" if rec.exact else "NOT exact"
    moved = f" {rec.moved}" if rec.moved else ""
    return f"{rec.scenario} {rec.fault or 'SIGTERM'}{moved}: {describe(rec)}; {exact}"


def fault_points(seed: int, runs: int, steps: int) -> list[str]:
    """Seeded fault points, the phases taken in turn (fp, bp, update) from a seeded start."""
    rng = random.Random(seed)
    start = rng.randrange(len(PHASES))
    points = []
    for i in range(runs):
        phase = PHASES[(start + i) % len(PHASES)]
        k = rng.randrange(3, max(4, steps // 2))
        points.append(f"{phase}:{k}" + (f":{rng.randrange(2)}" if phase in ("fp", "bp") else ""))
    return points


def spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize(records: list[RunRecord], steps: int, runs: int) -> dict[str, Any]:
    """Prints the phase table (FusionNet against Confidant's Table 7); returns the JSON line's fields."""
    passive = [r for rec in records if rec.scenario == "passive" for r in rec.recoveries if "detection" in r]
    complete = [r for r in passive if all(k in r for k in ("redistribution", "replay"))]
    phases = {k: [r[k] for r in complete] for k in ("detection", "redistribution", "replay")}
    totals = [r["detection"] + r["redistribution"] + r["replay"] for r in complete]
    from_kill = [rec.from_kill for rec in records if rec.from_kill is not None]
    stalls = [r["handover_stall"] for rec in records for r in rec.recoveries if "handover_stall" in r]
    notices = [rec.notice for rec in records if rec.notice is not None]
    step_s = [s for rec in records for s in rec.step_seconds]

    rows = [
        ("detection (step start -> known dead)", spread(phases["detection"]), "-"),
        ("detection from the kill (logs)", spread(from_kill), "-"),
        ("redistribution", spread(phases["redistribution"]), "-"),
        ("replay", spread(phases["replay"]), "-"),
        ("passive total", spread(totals), f"{CONFIDANT_PASSIVE_S}"),
        ("proactive stall", spread(stalls), f"{CONFIDANT_PROACTIVE_S}"),
        ("  SIGTERM -> handed over", spread(notices), "-"),
        ("fault-free step (context)", spread(step_s), "-"),
    ]
    header = ("phase", "FusionNet median (min-max) s", "Confidant Table 7 s")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(3)]
    print()
    for row in [header, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())

    p_total, p_stall = median(totals), median(stalls)
    return {
        "benchmark": "recovery",
        "job": "examples/gpt",
        "steps": steps,
        "runs": runs,
        "passive_detection_s": median(phases["detection"]),
        "passive_detection_from_kill_s": median(from_kill),
        "passive_redistribution_s": median(phases["redistribution"]),
        "passive_replay_s": median(phases["replay"]),
        "passive_total_s": p_total,
        "proactive_stall_s": p_stall,
        "proactive_notice_s": median(notices),
        "step_s": median(step_s),
        "confidant_passive_s": CONFIDANT_PASSIVE_S,
        "confidant_proactive_s": CONFIDANT_PROACTIVE_S,
        "passive_vs_confidant": round(p_total / CONFIDANT_PASSIVE_S, 4) if p_total is not None else None,
        "proactive_vs_confidant": round(p_stall / CONFIDANT_PROACTIVE_S, 4) if p_stall is not None else None,
        "passive_target_met": p_total is not None and max(totals) < PASSIVE_TARGET_S,
        "proactive_target_met": p_stall is not None and max(stalls) < PROACTIVE_TARGET_S,
        "exact": all(rec.exact for rec in records),
        "faults": [rec.fault for rec in records if rec.fault],
        "failed_runs": sum(1 for rec in records if rec.error),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    p.add_argument("--steps", type=int, default=30, help="training steps per job (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault points (default 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take (default 300)")
    p.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    p.add_argument("--quick", action="store_true", help="1 run per scenario, 12 steps")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.steps = 1, 12
    if args.runs < 1 or args.steps < 8:
        p.error("--runs must be >= 1 and --steps >= 8")
    workdir = work_folder(args.workdir, "fusionnet-recovery-")
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    t_start = time.monotonic()

    from fusionnet.job.loader import load_job
    from fusionnet.reference import run_reference

    job_path = write_job(workdir, args.steps)
    ref = run_reference(load_job(job_path)).weights
    print(f"GPT example, {args.steps} steps, {args.runs} run(s) per scenario; logs in {workdir}", flush=True)
    plan = [("passive", f) for f in fault_points(args.seed, args.runs, args.steps)]
    plan += [("proactive", None)] * args.runs
    records: list[RunRecord] = []
    for i, (scenario, fault) in enumerate(plan):
        rec = run_once(scenario, fault, job_path, ref, workdir / f"{i:02d}-{scenario}", args.timeout)
        records.append(rec)
        print(f"  [{time.monotonic() - t_start:5.0f} s] {line(rec)}", flush=True)

    summary = summarize(records, args.steps, args.runs)
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(summary))
    return 0 if not summary["failed_runs"] and summary["exact"] else 1


if __name__ == "__main__":
    run_main(main)
