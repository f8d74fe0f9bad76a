"""``fusionnet plan JOB.yaml [--nodes NODES.yaml] [--json FILE]``: the sub-DAG plan, nothing run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print the sub-DAG plan and predicted step time without running anything",
        description="Traces JOB.yaml, cuts it into sub-DAGs and prints FusionAI's Table 3 for the plan "
        "with the performance model's predictions. With --nodes, plans for the swarm described in "
        "NODES.yaml (devices from the catalog or explicit specs) instead of placement.compnodes local "
        "CPU compnodes.",
    )
    p.add_argument("job", type=Path, help="job definition file (YAML)")
    p.add_argument("--nodes", type=Path, metavar="NODES.yaml", help="swarm to plan for (see README)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the plan as JSON to FILE")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.job.loader import load_job
    from fusionnet.runtime.planning import plan_job

    job = load_job(args.job)
    planned = plan_job(job, nodes_file=args.nodes)
    print(planned.prepared.partition.describe())
    print()
    print(planned.explanation)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(planned.document, indent=2) + "\n")
        print(f"plan written to {args.json}")
    return 0
