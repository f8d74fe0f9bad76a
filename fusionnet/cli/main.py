"""Entry point of the ``fusionnet`` console script.

Each sub-command is a module ``fusionnet.cli.cmd_<name>`` exposing ``add_parser(subparsers)`` (which
registers its parser and sets ``func=run``) and ``run(args) -> int``. Modules are imported lazily by
name so that ``fusionnet --help`` does not pay for importing torch or hivemind.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from fusionnet import __version__
from fusionnet.cli.argtypes import check_initial_peers
from fusionnet.errors import ComputeError, FusionNetError, IRError, JobError, PartitionError, TraceError

# Exit codes (README "Commands"): 0 success, 1 the work failed (swarm, job, peers), 2 bad input (the job
# file, its model or data, the command line), 130 interrupted.
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
# The errors that are the input's fault: the same kinds as the broker's ``jobrun.INPUT_ERRORS`` (a model
# that raises on its rows, a graph or cut that is refused), so that ``run --local`` exits as ``submit``
# does for the same job. Spelled out, not imported: importing the broker here would load hivemind for
# every command, ``--help`` included (tests/test_job_refusals_audit.py keeps the two equal).
BAD_INPUT = (JobError, TraceError, IRError, PartitionError, ComputeError)

# Order is the order shown by --help.
COMMANDS: tuple[str, ...] = (
    "demo", "broker", "compnode", "submit", "cancel", "results", "deploy", "run", "plan", "status",
    "section4", "key",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusionnet",
        description="FusionNet: decentralized training and serving of neural networks on a swarm of "
        "heterogeneous compnodes (after the FusionAI paper).",
    )
    parser.add_argument("--version", action="version", version=f"fusionnet {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging verbosity"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"fusionnet.cli.cmd_{name}")
        except ModuleNotFoundError as e:
            if e.name == f"fusionnet.cli.cmd_{name}":
                continue  # sub-command not part of this build
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        check_initial_peers(args)
        return int(args.func(args) or 0)
    except SystemExit as e:
        # Only the command's own run reaches here (argparse's --help and usage errors exit in parse_args
        # above, untouched). A command that names a job runs its model code in this process (load, trace):
        # a sys.exit there must not end the command silently, with status 0 and nothing done. Commands
        # without a job keep SystemExit's own meaning (a daemon's library may exit on purpose).
        if getattr(args, "job", None) is None:
            raise
        code = " ".join(repr(e.code).split())[:100]
        print(
            f"fusionnet {args.command}: error: model.entrypoint: the model code called sys.exit({code}) "
            "while the command ran it",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    except FusionNetError as e:
        # User-facing errors are one line, no traceback: the message already says what and where.
        # One line even when a message quotes text with line breaks (a parser's, a model's exception).
        message = " ".join(str(e).split("\n"))
        print(f"fusionnet {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT if isinstance(e, BAD_INPUT) else EXIT_FAILED
    except Exception as e:
        # A bug of ours, not the user's: still one line, the traceback only when asked for.
        if args.log_level == "DEBUG":
            raise
        print(
            f"fusionnet {args.command}: error: internal error {type(e).__name__}: {str(e)[:300]} "
            "(run with --log-level DEBUG for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"fusionnet {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
