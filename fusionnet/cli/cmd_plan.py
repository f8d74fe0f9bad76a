"""``fusionnet plan JOB.yaml [--nodes NODES.yaml] [--json FILE]``: the sub-DAG plan, nothing run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fusionnet.cli.jobflags import add_job_loading_flags, check_output_file, load_job_for_command


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the sub-DAG plan and predicted step time without running anything",
        description="Traces JOB.yaml, lets the scheduler cut it into sub-DAGs (or cuts it at the job's "
        "placement.cuts) and place them, and prints "
        "FusionAI's Table 3 for the plan with the performance model's predictions: FP, BP and Update "
        "seconds per sub-DAG, memory per device, the bottleneck and the predicted step time. With --nodes, "
        "plans for the swarm described in NODES.yaml (catalog devices such as 'RTX 3080' or explicit "
        "specs, and the network; see README); without it, for placement.compnodes compnodes like this "
        "machine (profiled once in a few seconds, then cached under ~/.cache/fusionnet) on loopback links.",
    )
    p.add_argument("job", type=Path, help="job definition file (YAML)")
    p.add_argument("--nodes", type=Path, metavar="NODES.yaml", help="swarm to plan for (see README)")
    p.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the plan as JSON to FILE (plan.json's format)"
    )
    add_job_loading_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.json:
        check_output_file(args.json, "--json")
    job = load_job_for_command(args)
    # Imported once the job is known to load: a refused job never pays for the planner's imports.
    from fusionnet.runtime.planjob import plan_job

    planned = plan_job(job, nodes_file=args.nodes)
    print(planned.prepared.partition.describe())
    print()
    print(planned.explanation)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(planned.document, indent=2) + "\n")
        print(f"plan written to {args.json}")
    return 0
