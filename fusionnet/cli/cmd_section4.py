"""``fusionnet section4 [--output DIR]``: FusionAI section 4, 50 x RTX 3080 against 4 x H100."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "section4",
        help="reproduce FusionAI section 4: 50 x RTX 3080 vs 4 x H100 (table and plot)",
        description="Reproduces the analysis of FusionAI section 4 with the performance model: Bert-Large "
        "and a GPT-3-style model split as in Figure 4 over 50 RTX 3080s (one sub-DAG each) and over "
        "4 H100s, for a sweep of link bandwidths and latencies. Prints eq. (3) FP latency and eq. (4) "
        "pipelined throughput per setting (with the schedule simulator as a cross-check), writes "
        "section4.png (latency and throughput against bandwidth) and section4.json (every row) into "
        "--output, and ends with a JSON line of 3080-vs-H100 ratios.",
    )
    p.add_argument(
        "--output", type=Path, default=Path("."), metavar="DIR", help="folder for section4.png and .json"
    )
    p.add_argument(
        "--n-batches", type=int, default=512, metavar="N", help="pipelined batches n_b (default 512)"
    )
    p.add_argument("--batch-size", type=int, default=1, metavar="B", help="samples per batch (default 1)")
    p.add_argument("--gpt-seq", type=int, metavar="S", help="sequence length of the GPT-3-style model")
    p.add_argument("--no-plot", action="store_true", help="only the table and the JSON, no PNG")
    p.add_argument("--no-simulate", action="store_true", help="skip the schedule simulator's cross-check")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fusionnet.cli.jobflags import check_output_dir
    from fusionnet.errors import JobError
    from fusionnet.perfmodel.section4 import main

    # Refused here, in one line, before anything is written: the inner parser's own refusal would show
    # its usage (with flags this command does not take) after --output was made.
    sizes = (("--n-batches", args.n_batches), ("--batch-size", args.batch_size), ("--gpt-seq", args.gpt_seq))
    for flag, value in sizes:
        if value is not None and value < 1:
            raise JobError(f"{flag}: must be >= 1, got {value}")
    check_output_dir(args.output)  # a folder it cannot write: one line now, not a traceback at the end
    args.output.mkdir(parents=True, exist_ok=True)
    argv = [
        "--n-batches",
        str(args.n_batches),
        "--batch-size",
        str(args.batch_size),
        "--plot",
        str(args.output / "section4.png"),
        "--json",
        str(args.output / "section4.json"),
    ]
    if args.gpt_seq is not None:
        argv += ["--gpt-seq", str(args.gpt_seq)]
    if args.no_plot:
        argv.append("--no-plot")
    if args.no_simulate:
        argv.append("--no-simulate")
    return main(argv)
