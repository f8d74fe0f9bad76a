"""``fusionnet demo [--compnodes N] [--output DIR]``: a whole swarm on loopback, one job, results, stop."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import fusionnet

BUNDLED_JOB = Path(fusionnet.__file__).resolve().parents[1] / "examples" / "gpt" / "job.yaml"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="start a local swarm (broker + N compnodes), run the bundled example job, stop everything",
        description="Starts a broker and N compnodes on loopback, each its own process with a real DHT, "
        "submits the bundled example job (a small character-level GPT with tied embeddings), shows the plan "
        "and the loss falling, writes the results to --output and stops every process. Needs no outside "
        "service.",
    )
    p.add_argument("--compnodes", type=int, default=3, metavar="N", help="number of compnodes (default 3)")
    p.add_argument(
        "--output", type=Path, default=Path("demo-results"), metavar="DIR", help="result directory"
    )
    p.add_argument("--job", type=Path, default=BUNDLED_JOB, help="job file to run instead of the bundled one")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the daemons' state and logs here (default: a temp dir)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.cli.jobflags import check_output_dir
    from fusionnet.errors import JobError
    from fusionnet.job.loader import check_job_without_model

    if args.compnodes < 1:
        raise JobError(f"--compnodes: must be >= 1, got {args.compnodes}")
    if not args.job.is_file():
        if args.job == BUNDLED_JOB:  # examples/ lives in the repository: a wheel install has none
            raise JobError(
                f"the bundled example job is not installed with the package ({BUNDLED_JOB} is missing: "
                "a non-editable install); pass --job JOB.yaml, e.g. examples/gpt/job.yaml of the repository"
            )
        raise JobError(f"--job: no such file {args.job}")
    # Before the swarm starts, as ``submit`` checks them before it sends the job: found out afterwards, a
    # bad --output loses the results (the broker that kept them is stopped), a bad job file the start-up.
    check_output_dir(args.output)
    check_job_without_model(args.job)
    if args.workdir is not None:
        return _demo(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="fusionnet-demo-") as tmp:
        return _demo(args, Path(tmp))


def _demo(args: argparse.Namespace, workdir: Path) -> int:
    from fusionnet.daemon.observer import SwarmObserver
    from fusionnet.runtime.process_swarm import CompnodeSpec, ProcessSwarm
    from fusionnet.runtime.submit import load_plan, submit_and_wait, summary

    started = time.monotonic()
    print(f"starting a broker and {args.compnodes} compnodes on loopback (logs in {workdir}) ...")
    # The daemons' own heartbeat settings; refreshes every 2 s so that members show up quickly.
    specs = [CompnodeSpec(refresh_period=2.0)] * args.compnodes
    with ProcessSwarm(workdir, specs, broker_argv=["--refresh-period", "2"]) as swarm:

        async def wait_and_submit() -> Any:
            async with SwarmObserver(swarm.initial_peers) as observer:
                await swarm.wait_members(observer)
            print(f"swarm ready in {time.monotonic() - started:.1f} s: broker {swarm.initial_peers[0]}")
            print(f"submitting {args.job} ...")
            # Members are up already: a demo with fewer compnodes than the job asks for need not wait.
            return await submit_and_wait(args.job, swarm.initial_peers, args.output, wait_compnodes=0.0)

        outcome = asyncio.run(wait_and_submit())
        print("stopping the swarm ...")
    plan = load_plan(args.output)
    policy = plan.get("policy") or "?"
    print(f"\nplan as run (FusionAI Table 3), placed by the {policy} policy:")
    for s in plan["subdags"]:
        measured, predicted = s.get("measured_seconds"), s.get("predicted_seconds")
        timing = f", {measured * 1000:.1f} ms/step busy" if measured else ""
        if predicted is not None:
            timing += f" (predicted {predicted * 1000:.1f})"
        print(
            f"  sub-DAG {s['subdag']} on {s['compnode'][:16]}...: {len(s['nodes'])} nodes, "
            f"{len(s['outer_required_data'])} outer inputs, {len(s['outwards_data'])} outwards{timing}"
        )
    print(summary(outcome))
    print(f"demo finished in {time.monotonic() - started:.1f} s")
    return 0
