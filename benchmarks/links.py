"""Real links: a GPT-2 job on a swarm spread over network namespaces with shaped links (issue 16).

One run. The broker (and the submitter) sit in one network namespace, each compnode in its own, every
link limited with ``tbf`` to the given rate in both directions (``fusionnet.runtime.netns``: root and
iproute2 needed), daemons started with the README's "Running a real swarm" commands
(``fusionnet.runtime.netns_swarm``). The job: a GPT-2 built from a ``transformers`` config (random
init, nothing downloaded; tied input/output embeddings), 12.4M parameters, seq 128, batch 8 in 4
micro-batches, SGD with momentum, ``placement.schedule`` from ``--schedule`` (default ``auto``: the
broker's performance model picks the schedule), compnodes with ``--threads 1``. Beside it, in this
process:

- plain PyTorch  ``fusionnet.reference`` on one thread: median ms/step after the first step, and the
                 final weights (exactness);
- swarm          per rate and compnode count, on a fresh swarm whose broker first ran a warm-up job
                 (``--warmup`` steps: it has probed the links and learnt its compnodes' real speed, as
                 a broker in service has): median ms/step after the first step (``metrics.jsonl``),
                 the broker's prediction (``plan.json``), the work split (forward FLOPs per sub-DAG),
                 bytes across the busiest cut per step and direction (from the IR: activations per
                 micro-batch, shared parameters once per step, a tied embedding as the rows of the
                 step's tokens), the schedule that ran, compnodes falsely declared lost;
- GPipe bound    what a perfect GPipe pipeline of the same compute over the same link could do:
                 max(plain x (m + k - 1) / (m k), cut bytes / rate);
- failover       at 100 Mbit/s, 2 working compnodes + 1 ``--backup``: a working compnode SIGKILLs
                 itself in the FP of its 4th step (``FUSIONNET_FAULT``); step time before and after
                 the backup took over, and the final weights against plain PyTorch.

Prints a table, then one JSON line.

    python benchmarks/links.py [--steps 8] [--runs 1gbit:2 1gbit:3 100mbit:2 100mbit:3 20mbit:3]
                               [--warmup 10] [--schedule auto [...]] [--no-failover] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import MODEL_PY  # noqa: E402
from swarm_jobs import WORKDIR_HELP, run_main, work_folder  # noqa: E402

from fusionnet.runtime.netns import NetLab, rate_bits, unavailable  # noqa: E402
from fusionnet.runtime.netns_swarm import NetnsSwarm  # noqa: E402

# (vocab, hidden, layers, heads, kv heads, intermediate): 12.4M parameters with tied embeddings
FULL = (30000, 256, 6, 8, 8, 1024)
QUICK = (8000, 128, 2, 4, 4, 512)
SEQ, BATCH, MICROBATCHES = 128, 8, 4
RUNS = ("1gbit:2", "1gbit:3", "100mbit:2", "100mbit:3", "20mbit:3")
TOL = 1e-5
SGD = {"name": "sgd", "lr": 0.01, "kwargs": {"momentum": 0.9}}


@dataclass
class LinkRun:
    rate: str
    compnodes: int
    asked: str = "auto"  # the job's placement.schedule
    measured_ms: float = float("nan")
    predicted_ms: float = float("nan")
    split: list[float] = field(default_factory=list)  # share of forward FLOPs per sub-DAG
    schedule: str = ""  # the pipeline schedule that ran (``auto`` settled by the broker)
    cut_mb: float = 0.0  # MB per step and direction across the busiest cut
    bound_ms: float = float("nan")
    max_diff: float = float("nan")
    falsely_lost: int = 0
    jobs: int = 1  # measured jobs run in a row on the swarm (``--repeat``), all succeeded
    error: str | None = None
    before_ms: float | None = None  # failover: before and after the backup came in
    after_ms: float | None = None

    @property
    def prediction_error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def write_job(
    folder: Path, dims: tuple[int, ...], steps: int, compnodes: int, schedule: str = "auto"
) -> Path:
    import torch
    import yaml
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, dims[0], (BATCH * steps, SEQ), generator=g)
    save_file({"inputs": ids, "labels": ids.clone()}, str(folder / "data.safetensors"))
    (folder / "model.py").write_text(MODEL_PY)
    keys = ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate")
    doc = {
        "name": "gpt2-links",
        "task": "train",
        "model": {
            "entrypoint": "model.py:build",
            "kwargs": {"family": "gpt2", **dict(zip(keys, dims)), "seq": SEQ},
        },
        "data": {"path": "data.safetensors", "batch_size": BATCH, "microbatches": MICROBATCHES},
        "optimizer": SGD,
        "steps": steps,
        "seed": 0,
        "placement": {"compnodes": compnodes, "schedule": schedule},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cut_bytes(graph: Any, plan: dict[str, Any], scale: float) -> float:
    """Bytes per step and direction across the busiest cut: each value read from another sub-DAG, per
    micro-batch, except shared parameters, which cross once per step (a tied embedding as the rows of
    the step's tokens, ``dag.row_lookup``)."""
    from fusionnet.dag.row_lookup import row_lookups
    from fusionnet.planning.costgraph import traded_bytes

    lookups = row_lookups(graph)
    per_pair: dict[tuple[int, int], float] = {}
    where = {n: s["subdag"] for s in plan["subdags"] for n in s["nodes"]}
    for s in plan["subdags"]:
        for name in s["outer_required_data"]:
            node = graph.node(name)
            if node.kind == "placeholder":
                continue
            nbytes = float(node.cost.get("activation_bytes", 0))
            nbytes = nbytes if node.kind == "variable" else nbytes * scale * MICROBATCHES
            if name in lookups:
                nbytes = min(nbytes, traded_bytes(graph, lookups[name], scale, MICROBATCHES))
            pair = (where[name], s["subdag"])
            per_pair[pair] = per_pair.get(pair, 0.0) + nbytes
    return max(per_pair.values(), default=0.0)


def rows_ms(rows: list[dict[str, Any]]) -> float:
    return statistics.median(r["seconds"] for r in rows) * 1e3 if rows else float("nan")


def run_swarm(
    workdir: Path, job: Path, run: LinkRun, ref: dict[str, Any], plain_ms: float, graph: Any, scale: float,
    *, backups: int = 0, fault: str | None = None, warmup: Path | None = None, repeat: int = 1,
    timeout: float = 1500,
) -> LinkRun:  # fmt: skip
    """``warmup``: a job run first on the same swarm, so that its broker has measured the links and
    learnt how fast its compnodes really run (``planning.speeds``), as a broker in service has;
    ``repeat``: the job is run that many times in a row (the first one's figures are reported; every
    one must succeed, and a compnode declared lost during any of them counts as falsely lost)."""
    from safetensors.torch import load_file

    out = workdir / "out"
    env = {0: {"FUSIONNET_FAULT": fault}} if fault else {}
    with NetLab(run.compnodes + backups + 1, run.rate) as lab:
        swarm = NetnsSwarm(lab, workdir / "swarm", backups=backups, compnode_env=env)
        try:
            swarm.start()
            if warmup is not None:
                done = swarm.submit(warmup, workdir / "out-warmup", timeout=timeout)
                if done.returncode != 0:
                    run.error = "warm-up job: " + (done.stdout + done.stderr).strip()[-300:]
                    return run
            done = swarm.submit(job, out, timeout=timeout)
            for again in range(2, repeat + 1):
                if done.returncode != 0:
                    break
                done = swarm.submit(job, workdir / f"out-{again}", timeout=timeout)
                run.jobs = again
        finally:
            swarm.stop()
            logs = swarm.dump_logs()
            (workdir / "daemons.log").write_text(logs)
    if done.returncode != 0:
        run.error = (
            (done.stdout + done.stderr).strip().splitlines()[-1][:300] if done.stdout + done.stderr else "?"
        )
        return run
    plan = json.loads((out / "plan.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recoveries = plan.get("recoveries") or []
    broker_log = logs.split("===== broker =====")[-1].rsplit("succeeded;", 1)[0]  # up to the last job's end
    run.falsely_lost = 0 if fault else broker_log.count("counts as lost")
    if fault and recoveries:
        failed = int(recoveries[0].get("failed_step", 0))
        run.before_ms = rows_ms([r for r in rows if 1 <= r["step"] < failed])
        run.after_ms = rows_ms([r for r in rows if r["step"] > failed + 1])
        run.measured_ms = run.before_ms
    else:
        run.measured_ms = rows_ms(rows[1:])
    run.predicted_ms = float(plan["predicted_step_seconds"] or float("nan")) * 1e3
    run.schedule = str((plan.get("schedule") or {}).get("name", ""))
    flops = [float(s["cost"].get("flops_fwd", 0)) for s in plan["subdags"]]
    run.split = [round(f / max(sum(flops), 1.0), 3) for f in flops]
    run.cut_mb = cut_bytes(graph, plan, scale) / 1e6
    k, m = max(1, sum(1 for share in run.split if share > 0.02)), MICROBATCHES  # stages with work
    compute = plain_ms * (m + k - 1) / (m * k)
    run.bound_ms = max(compute, run.cut_mb * 1e6 / (rate_bits(run.rate) / 8) * 1e3)
    got = load_file(str(out / "weights.safetensors"))
    run.max_diff = max((got[k] - v).abs().max().item() for k, v in ref.items() if k in got)
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="training steps per job (default 8, >= 6)")
    p.add_argument("--runs", nargs="+", default=list(RUNS), help="RATE:COMPNODES pairs (tc rate syntax)")
    p.add_argument("--no-failover", action="store_true", help="skip the SIGKILL run at 100 Mbit/s")
    p.add_argument("--repeat", type=int, default=1, help="run each row's job this many times in a row")
    p.add_argument(
        "--warmup", type=int, default=10,
        help="steps of a job run first on each swarm (its broker then knows links and speeds; 0: none)",
    )  # fmt: skip
    p.add_argument(
        "--schedule",
        nargs="+",
        default=["auto"],
        choices=["gpipe", "1f1b", "zero-bubble", "auto"],
        help="the jobs' placement.schedule (default auto: the broker's performance model picks); several: "
        "each link row runs once per schedule, one after another, for a same-run comparison",
    )
    p.add_argument("--quick", action="store_true", help=f"a small model {QUICK} instead of {FULL}")
    p.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    args = p.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"links benchmark needs network namespaces: {why}", file=sys.stderr)
        return 2
    if args.steps < 6:
        p.error("--steps must be >= 6 (the failover lands in step 3)")
    runs = []
    for spec in args.runs:
        rate, _, n = spec.partition(":")
        rate_bits(rate)
        runs.extend(LinkRun(rate, int(n or 2), asked=schedule) for schedule in args.schedule)
    workdir = work_folder(args.workdir, "fusionnet-links-")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.monotonic()

    import torch

    from fusionnet.job.loader import load_job
    from fusionnet.planning.costgraph import micro_batch_scale
    from fusionnet.reference import run_reference
    from fusionnet.runtime.prepare import trace_job

    torch.set_num_threads(1)
    dims = QUICK if args.quick else FULL
    job_path = write_job(workdir / "job", dims, args.steps, 2)
    job = load_job(job_path)
    n_params = sum(v.numel() for v in job.model.parameters())
    graph = trace_job(job).graph
    scale = micro_batch_scale(graph, BATCH, MICROBATCHES)
    reference = run_reference(job)
    ref = reference.weights
    # The median step after the first, as the swarm's figure is: the model copy and the first step's
    # one-off costs are not a step (the total over the job made plain PyTorch look 20 % slower).
    plain_ms = statistics.median(reference.step_seconds[1:]) * 1e3
    print(f"gpt2 {dims}: {n_params / 1e6:.1f}M parameters; plain PyTorch {plain_ms:.0f} ms/step; "
          f"logs in {workdir}", flush=True)  # fmt: skip
    for i, run in enumerate(runs):
        path = write_job(workdir / f"job{i}", dims, args.steps, run.compnodes, run.asked)
        warmup = (
            write_job(workdir / f"warmup{i}", dims, args.warmup, run.compnodes, run.asked)
            if args.warmup
            else None
        )
        folder = workdir / f"run{i}-{run.rate}-{run.compnodes}"
        run_swarm(folder, path, run, ref, plain_ms, graph, scale, warmup=warmup, repeat=args.repeat)
        print(f"  {run.rate} x{run.compnodes}: {run.measured_ms:.0f} ms/step "
              f"(predicted {run.predicted_ms:.0f}), split {run.split}, error {run.error}",
              flush=True)  # fmt: skip
    failover = None
    if not args.no_failover:
        failover = LinkRun("100mbit", 2)
        path = write_job(workdir / "job-failover", dims, args.steps, 2, args.schedule[0])
        run_swarm(workdir / "failover", path, failover, ref, plain_ms, graph, scale, backups=1, fault="fp:3")
        print(f"  failover: before {failover.before_ms} after {failover.after_ms} ms/step, "
              f"error {failover.error}", flush=True)  # fmt: skip
    return report(runs, failover, plain_ms, n_params, dims, time.monotonic() - t0)


def report(
    runs: list[LinkRun],
    failover: LinkRun | None,
    plain_ms: float,
    n_params: int,
    dims: tuple[int, ...],
    wall: float,
) -> int:
    header = ("link", "compnodes", "measured ms/step", "predicted", "error", "/ plain", "GPipe bound",
              "cut MB/step", "split (FLOPs)", "schedule", "falsely lost", "max diff")  # fmt: skip
    table = [header, ("none (plain PyTorch, 1 thread)", "-", f"{plain_ms:.0f}", *["-"] * 9)]
    for r in runs:
        if r.error:
            table.append((r.rate, str(r.compnodes), "FAILED", r.error[:60], *["-"] * 8))
            continue
        table.append((
            r.rate, str(r.compnodes), f"{r.measured_ms:.0f}", f"{r.predicted_ms:.0f}",
            f"{r.prediction_error:+.0%}", f"{r.measured_ms / plain_ms:.2f}", f"{r.bound_ms:.0f}",
            f"{r.cut_mb:.2f}", "/".join(f"{s:.0%}" for s in r.split), r.schedule or "-",
            f"{r.falsely_lost} in {r.jobs} job(s)",
            f"{r.max_diff:.1e}",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print()
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    split_runs = [r for r in runs if not r.error and sum(1 for s in r.split if s > 0.02) > 1]
    errors = [abs(r.prediction_error) for r in split_runs]
    median_error = statistics.median(errors) if errors else None
    if failover is not None:
        ratio = (failover.after_ms or float("nan")) / (failover.before_ms or float("nan"))
        print(f"\nfailover at 100 Mbit/s (SIGKILL in step 3, backup takes over): "
              f"before {failover.before_ms} ms/step, after {failover.after_ms} ms/step (x{ratio:.2f}), "
              f"max diff {failover.max_diff:.1e}"
              + (f", FAILED: {failover.error}" if failover.error else ""))  # fmt: skip
    print(f"median |predicted - measured| / measured over split plans: "
          f"{'-' if median_error is None else f'{median_error:.0%}'}")  # fmt: skip
    ok = all(r.error is None and r.max_diff <= TOL for r in runs) and (
        failover is None or (failover.error is None and failover.max_diff <= TOL)
    )
    summary = {
        "benchmark": "links",
        "model": {"family": "gpt2", "params": n_params, "dims": list(dims), "seq": SEQ, "batch": BATCH,
                  "microbatches": MICROBATCHES},
        "plain_ms_per_step": round(plain_ms, 1),
        "runs": [
            {"rate": r.rate, "compnodes": r.compnodes, "measured_ms": round(r.measured_ms, 1),
             "predicted_ms": round(r.predicted_ms, 1), "vs_plain": round(r.measured_ms / plain_ms, 3),
             "gpipe_bound_ms": round(r.bound_ms, 1), "cut_mb_per_step": round(r.cut_mb, 3), "split": r.split,
             "schedule": r.schedule,
             "falsely_lost": r.falsely_lost, "jobs": r.jobs, "max_diff": r.max_diff, "error": r.error}
            for r in runs
        ],
        "median_prediction_error_split": None if median_error is None else round(median_error, 3),
        "failover": None if failover is None else {
            "before_ms": failover.before_ms, "after_ms": failover.after_ms, "max_diff": failover.max_diff,
            "error": failover.error,
        },
        "exact": ok,
        "wall_s": round(wall, 1),
    }  # fmt: skip
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
