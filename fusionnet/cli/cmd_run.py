"""``fusionnet run JOB.yaml --local N --output DIR``: the job in one process on N virtual compnodes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fusionnet.cli.jobflags import add_job_loading_flags, check_output_dir, load_job_for_command


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a job in one process on N virtual compnodes (debugging, dry runs)",
        description="Runs JOB.yaml in this process on N virtual compnodes: the same tracer, planner and "
        "executor as the swarm, with an in-memory channel instead of the network. Writes the result files "
        "(weights/grads/outputs.safetensors, metrics.jsonl, plan.json) to --output. plan.json holds each "
        "sub-DAG's measured FP+BP+Update seconds per step next to the performance model's prediction for "
        "this machine (profiled once, a few seconds, then cached) and the relative error.",
    )
    p.add_argument("job", type=Path, help="job definition file (YAML)")
    p.add_argument(
        "--local", type=int, required=True, metavar="N", help="number of virtual compnodes (sub-DAGs)"
    )
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="directory for the result files")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="only the last line: no plan table, no per-step progress, no measured-against-predicted lines",
    )
    p.add_argument(
        "--no-predict",
        action="store_true",
        help="skip the performance model's predictions (and the one-time profiling of this machine)",
    )
    add_job_loading_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.errors import JobError
    from fusionnet.runtime.local import run_local
    from fusionnet.runtime.microbatch_sizes import with_compnodes
    from fusionnet.runtime.prepare import prepare_job

    if args.local < 1:
        raise JobError(f"--local: must be >= 1, got {args.local}")
    check_output_dir(args.output)
    job = with_compnodes(load_job_for_command(args), args.local)
    prepared = prepare_job(job, args.local)
    if not args.quiet:
        print(prepared.partition.describe())

    def progress(row: dict[str, Any]) -> None:
        if args.quiet:
            return
        loss = f" loss={row['loss']:.6f}" if "loss" in row else ""
        rate = row["samples"] / row["seconds"] if row["seconds"] > 0 else float("inf")
        print(f"step {row['step'] + 1}{loss} samples/s={rate:.1f}", file=sys.stderr)

    device = None
    if not args.no_predict:
        from fusionnet.profiling.calibration import local_device_spec

        device = local_device_spec()
    result = run_local(job, args.local, args.output, prepared=prepared, on_step=progress, device=device)
    if not args.quiet and result.predicted_seconds is not None:
        for i, measured in sorted(result.measured_seconds.items()):
            predicted = result.predicted_seconds.get(i)
            error = f"{(predicted - measured) / measured:+.0%}" if predicted is not None and measured else "-"
            print(
                f"sub-DAG {i}: measured {measured * 1e3:.3f} ms/step, predicted "
                f"{(predicted or 0.0) * 1e3:.3f} ms/step ({error})"
            )
    print(f"results written to {args.output}")
    return 0
