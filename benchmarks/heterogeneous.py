"""Does the scheduler's plan beat an equal split on a heterogeneous swarm by the ratio the model predicts?

Issue 4's acceptance point: "on a local swarm made heterogeneous on purpose, the scheduler's plan beats an
equal split by the ratio the model predicts, +-15%". The swarm is a broker and two compnodes on loopback,
``--threads 1`` each, one of them ``--slowdown F`` (``fusionnet.compnode.throttle``: it sleeps (F-1)x
the time of its own compute and announces a profile F times slower; sleeping uses no CPU, so the emulation
holds on a small shared machine). The job is the bundled GPT example made heavier so that compute
dominates (``--n-layer``, ``--d-model``, ``--batch-size``, ``--microbatches``; plain SGD with momentum),
2 sub-DAGs. It runs twice per F, each time on a fresh swarm:

- ``model``     the broker's default placement: the scheduler with the performance model;
- ``balanced``  ``fusionnet broker --placement balanced``: FLOP-balanced halves on the fastest compnodes.

Per run: the median of ``metrics.jsonl`` ``seconds`` (the broker's wall time of a step) after
``--warmup`` steps, and ``plan.json``'s ``predicted_step_seconds`` (the model's step time for the
placement that ran, on the compnodes' announced hardware; the broker predicts the balanced split too).
measured speedup = balanced step / model step; predicted speedup = balanced predicted / model predicted;
``speedup_ratio`` = measured / predicted, within 15% of 1 is the acceptance. Also printed: each sub-DAG's
nodes, compnode, predicted and measured (FP+BP+Update, as the compnode reports it) seconds per step, and
each compnode's announced speed. The broker runs with ``--sync-every`` (default 1000: a checkpoint only at
the end) to keep wall time down; a sync runs between steps and is not part of a step's ``seconds``.
Both runs start from the same weights and see the same batches and are exact, so their final weights must
agree (``exact``: max abs diff <= 1e-5, also checked against plain PyTorch, ``fusionnet.reference``).

What the model does not see, and why the *ratio* still holds (2-core shared VM, F=3, one torch thread):
steps measure 10-25% above the prediction under both policies, from the step RPCs and activation
transfers (about 6 ms a step: a tiny job's steps take 7 ms for a predicted 1.5 ms) and from compute that
runs in bursts between waits (measured in one process: 7.5 ms back to back, 8.2 ms after 28 ms idle), so
most of it cancels in the ratio. The agreement is worst where the plans differ most in shape: at F=4 the
model gives the slowed node nothing (one compute stream, +13% over its prediction) while the balanced
pipeline idles between bursts on both nodes (+31%), so the measured speedup beats the predicted one.

Prints the split and a table per F, then one JSON line. Logs and results stay in ``--workdir``.

    python benchmarks/heterogeneous.py [--slowdown 3] [--slowdown 2 3 4] [--steps 24] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from swarm_jobs import WORKDIR_HELP, run_main, work_folder, write_gpt_job  # noqa: E402

from fusionnet.daemon.observer import SwarmObserver  # noqa: E402
from fusionnet.runtime.process_swarm import CompnodeSpec, ProcessSwarm  # noqa: E402
from fusionnet.runtime.submit import submit_and_wait  # noqa: E402

TOL = 1e-5
WITHIN = 0.15
SGD = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}
POLICIES = ("model", "balanced")
SLOW = 0  # compnode0 is the slowed one


@dataclass
class Run:
    slowdown: float
    policy: str
    step_seconds: list[float] = field(default_factory=list)
    predicted_step: float | None = None
    plan_policy: str | None = None
    subdags: list[dict[str, Any]] = field(default_factory=list)  # nodes, compnode, predicted, measured
    speeds: dict[str, float] = field(default_factory=dict)  # compnode name -> announced FLOPS
    weights: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None

    def median_step(self, warmup: int) -> float | None:
        rows = self.step_seconds[warmup:] or self.step_seconds
        return statistics.median(rows) if rows else None


def write_job(workdir: Path, args: argparse.Namespace) -> Path:
    """The GPT example, heavier, 2 compnodes, SGD."""
    return write_gpt_job(
        workdir / "gpt-heterogeneous.yaml",
        model={"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head},
        data={"batch_size": args.batch_size, "microbatches": args.microbatches},
        name="gpt-heterogeneous",
        steps=args.steps,
        optimizer=SGD,
        placement={"compnodes": 2},
    )


async def drive(swarm: ProcessSwarm, job_path: Path, out: Path, run: Run, timeout: float) -> None:
    async with SwarmObserver(swarm.initial_peers) as observer:
        await swarm.wait_members(observer)
        names = {d.peer_id: d.name for d in swarm.compnodes}
        for c in (await observer.broker_status())["compnodes"]:
            hw = c.get("hardware") or {}
            if c["peer_id"] in names and hw:
                run.speeds[names[c["peer_id"]]] = hw["peak_flops"] * hw["speed_factor"]
        await submit_and_wait(
            job_path, swarm.initial_peers, out, stream=io.StringIO(), timeout=timeout, show_plan=False
        )


def run_once(slowdown: float, policy: str, job_path: Path, workdir: Path, args: argparse.Namespace) -> Run:
    from safetensors.torch import load_file

    run = Run(slowdown, policy)
    specs = [
        CompnodeSpec(
            threads=args.threads, refresh_period=2.0, extra=["--slowdown", str(slowdown)] if i == SLOW else []
        )
        for i in range(2)
    ]
    broker_argv = ["--refresh-period", "2", "--placement", policy, "--sync-every", str(args.sync_every)]
    swarm = ProcessSwarm(workdir / "swarm", specs, broker_argv=broker_argv)
    out = workdir / "out"
    started = time.monotonic()
    try:
        swarm.start()
        asyncio.run(drive(swarm, job_path, out, run, args.timeout))
    except Exception as e:
        run.error = f"{type(e).__name__}: {e} (logs in {workdir / 'swarm'})"
        return run
    finally:
        names = {}
        with contextlib.suppress(Exception):
            names = {d.peer_id: d.name for d in swarm.compnodes}
        swarm.stop()
        run.wall_s = time.monotonic() - started
    plan = json.loads((out / "plan.json").read_text())
    run.plan_policy = plan.get("policy")
    run.predicted_step = plan.get("predicted_step_seconds")
    for s in plan["subdags"]:
        run.subdags.append(
            {
                "subdag": s["subdag"],
                "nodes": len(s["nodes"]),
                "params": len(s["params"]),
                "compnode": names.get(s["compnode"], s["compnode"]),
                "predicted_s": s.get("predicted_seconds"),
                "measured_s": s.get("measured_seconds"),
            }
        )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run.step_seconds = [r["seconds"] for r in rows]
    run.weights = load_file(str(out / "weights.safetensors"))
    return run


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def compare(model: Run, balanced: Run, warmup: int, ref: dict[str, Any] | None) -> dict[str, Any]:
    """One slow-down's result: speedups, their ratio, exactness."""
    m_step, b_step = model.median_step(warmup), balanced.median_step(warmup)
    ok = model.error is None and balanced.error is None and m_step and b_step
    measured = b_step / m_step if ok else None  # type: ignore[operator]
    predicted = (
        balanced.predicted_step / model.predicted_step
        if ok and model.predicted_step and balanced.predicted_step
        else None
    )
    ratio = measured / predicted if measured is not None and predicted else None
    diffs = {}
    if ok:
        diffs["model_vs_balanced"] = max_diff(model.weights, balanced.weights)
        if ref is not None:
            diffs["model_vs_torch"] = max_diff(model.weights, ref)
            diffs["balanced_vs_torch"] = max_diff(balanced.weights, ref)
    return {
        "slowdown": model.slowdown,
        "model_step_s": None if m_step is None else round(m_step, 4),
        "balanced_step_s": None if b_step is None else round(b_step, 4),
        "model_predicted_s": None if model.predicted_step is None else round(model.predicted_step, 4),
        "balanced_predicted_s": None
        if balanced.predicted_step is None
        else round(balanced.predicted_step, 4),
        "model_prediction_error": None
        if not ok or not model.predicted_step
        else round(m_step / model.predicted_step - 1, 4),  # type: ignore[operator]
        "balanced_prediction_error": None
        if not ok or not balanced.predicted_step
        else round(b_step / balanced.predicted_step - 1, 4),  # type: ignore[operator]
        "measured_speedup": None if measured is None else round(measured, 4),
        "predicted_speedup": None if predicted is None else round(predicted, 4),
        "speedup_ratio": None if ratio is None else round(ratio, 4),
        "within_15pct": ratio is not None and abs(ratio - 1.0) <= WITHIN,
        "exact": bool(diffs) and max(diffs.values()) <= TOL,
        "max_weight_diff": {k: float(f"{v:.3g}") for k, v in diffs.items()},
        "policies": [model.plan_policy, balanced.plan_policy],
        "split": {r.policy: r.subdags for r in (model, balanced)},
        "speeds": {r.policy: r.speeds for r in (model, balanced)},
        "errors": [r.error for r in (model, balanced) if r.error],
    }


def print_split(run: Run, warmup: int) -> None:
    speeds = ", ".join(f"{k} {v / 1e9:.2f} GFLOPS" for k, v in sorted(run.speeds.items()))
    print(f"  {run.policy} ({run.plan_policy}); announced: {speeds}")
    for s in run.subdags:
        slow = " (slowed)" if s["compnode"] == f"compnode{SLOW}" else ""
        print(
            f"    sub-DAG {s['subdag']}: {s['nodes']:4d} nodes, {s['params']:3d} params on "
            f"{s['compnode']}{slow}: predicted {fmt(s['predicted_s'])} s, measured {fmt(s['measured_s'])} s"
        )
    print(
        f"    step: predicted {fmt(run.predicted_step)} s, measured median {fmt(run.median_step(warmup))} s "
        f"(after {warmup} warm-up steps; all: {' '.join(f'{x:.2f}' for x in run.step_seconds)})"
    )


def print_table(results: list[dict[str, Any]]) -> None:
    header = (
        "F", "model step s (pred)", "balanced step s (pred)", "measured speedup", "predicted speedup",
        "ratio", "within 15%", "exact",
    )  # fmt: skip
    rows = [header]
    for r in results:
        rows.append(
            (
                f"{r['slowdown']:g}",
                f"{fmt(r['model_step_s'])} ({fmt(r['model_predicted_s'])})",
                f"{fmt(r['balanced_step_s'])} ({fmt(r['balanced_predicted_s'])})",
                fmt(r["measured_speedup"]),
                fmt(r["predicted_speedup"]),
                fmt(r["speedup_ratio"]),
                "yes" if r["within_15pct"] else "NO",
                "yes" if r["exact"] else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print()
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--slowdown", type=float, nargs="+", default=[3.0], metavar="F",
        help="slow-down(s) of compnode0; several = a sweep (default 3)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=24, help="training steps per job (default 24)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median (default 3)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT layers (default 4)")
    p.add_argument("--d-model", type=int, default=128, help="GPT width (default 128)")
    p.add_argument("--n-head", type=int, default=4, help="GPT heads (default 4)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per compnode (default 1)")
    p.add_argument("--sync-every", type=int, default=1000, help="broker checkpoint period (default 1000)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take (default 300)")
    p.add_argument("--no-reference", action="store_true", help="skip the plain PyTorch check")
    p.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    p.add_argument("--quick", action="store_true", help="12 steps, 2 warm-up steps")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 12, 2
    if any(f < 1 for f in args.slowdown) or args.steps <= args.warmup or args.warmup < 0:
        p.error("--slowdown must be >= 1, and --steps > --warmup >= 0")
    return args


def summarize(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON line: one slow-down's figures, or per-slow-down lists for a sweep."""
    keys = ("slowdown", "measured_speedup", "predicted_speedup", "speedup_ratio")
    sweep = len(results) > 1
    summary: dict[str, Any] = {
        "benchmark": "heterogeneous",
        "job": f"examples/gpt n_layer={args.n_layer} d_model={args.d_model} batch={args.batch_size} "
        f"microbatches={args.microbatches}",
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "sync_every": args.sync_every,
        # One slow-down: its figures; a sweep: one list entry per slow-down, in the order given.
        **{k: [r[k] for r in results] if sweep else results[0][k] for k in keys},
        "within_15pct": all(r["within_15pct"] for r in results),
        "exact": all(r["exact"] for r in results),
    }
    if sweep:
        summary["within_15pct_each"] = [r["within_15pct"] for r in results]
        summary["sweep"] = [
            {k: v for k, v in r.items() if k not in ("split", "speeds", "policies")} for r in results
        ]
    else:
        steps = ("model_step_s", "balanced_step_s", "model_predicted_s", "balanced_predicted_s")
        summary.update({k: results[0][k] for k in (*steps, "max_weight_diff", "errors")})
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = work_folder(args.workdir, "fusionnet-heterogeneous-")
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    t_start = time.monotonic()

    job_path = write_job(workdir, args)
    ref = None
    if not args.no_reference:
        from fusionnet.job.loader import load_job
        from fusionnet.reference import run_reference

        ref = run_reference(load_job(job_path)).weights
    print(
        f"GPT n_layer={args.n_layer} d_model={args.d_model}, batch {args.batch_size} in "
        f"{args.microbatches} micro-batches, {args.steps} steps, 2 compnodes --threads {args.threads}, "
        f"compnode{SLOW} --slowdown F; logs in {workdir}",
        flush=True,
    )
    results = []
    for f in args.slowdown:
        runs = {}
        for policy in POLICIES:
            run = run_once(f, policy, job_path, workdir / f"F{f:g}-{policy}", args)
            runs[policy] = run
            state = (
                f"FAILED: {run.error}" if run.error else f"median step {fmt(run.median_step(args.warmup))} s"
            )
            print(f"[{time.monotonic() - t_start:5.0f} s] F={f:g} {policy}: {state}", flush=True)
        print(f"F={f:g} split:")
        for run in runs.values():
            if run.error is None:
                print_split(run, args.warmup)
        results.append(compare(runs["model"], runs["balanced"], args.warmup, ref))

    print_table(results)
    summary = summarize(results, args)
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(summary))
    return 0 if summary["within_15pct"] and summary["exact"] else 1


if __name__ == "__main__":
    run_main(main)
