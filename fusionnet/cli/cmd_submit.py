"""``fusionnet submit JOB.yaml --initial-peers MADDR... --output DIR``: run a job on a swarm."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from fusionnet.cli.argtypes import add_initial_peers, positive_seconds, seconds
from fusionnet.cli.jobflags import (
    add_job_loading_flags,
    add_key_flag,
    check_job_for_command,
    check_output_dir,
)

DEFAULT_WAIT_COMPNODES = 60.0  # = runtime.jobcontrol's (not imported here: --help stays light)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "submit",
        help="trace a job locally, run it on the swarm, download its results",
        description="Traces the model of JOB.yaml on this machine, submits the IR, initial weights and data "
        "to the swarm's broker, shows a progress bar (step, loss, samples/s) and writes the result files "
        "(weights/grads/outputs.safetensors, metrics.jsonl, plan.json) to --output. Exit 0 on success; "
        "non-zero with a one-line reason on failure.",
    )
    p.add_argument("job", type=Path, help="job definition file (YAML)")
    add_initial_peers(p)
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="directory for the result files")
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,
        metavar="S",
        help="cancel the job on the broker and give up when it has not finished S seconds after it was "
        "submitted (Ctrl-C cancels it as well)",
    )
    p.add_argument(
        "--wait-compnodes",
        type=seconds,
        default=DEFAULT_WAIT_COMPNODES,
        metavar="S",
        help="wait up to S seconds for the broker to have the job's placement.compnodes ready before "
        "submitting (after that: submit to as many as it has, fail if none; default %(default)g)",
    )
    add_job_loading_flags(p)
    add_key_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.runtime.submit import submit_and_wait, summary

    check_output_dir(args.output)  # before the job is sent: a bad --output must not lose its results
    check_job_for_command(args)
    outcome = asyncio.run(
        submit_and_wait(
            args.job,
            args.initial_peers,
            args.output,
            timeout=args.timeout,
            allow_outside_paths=args.allow_outside_paths,
            wait_compnodes=args.wait_compnodes,
            key_path=args.key,
        )
    )
    print(summary(outcome))
    return 0
