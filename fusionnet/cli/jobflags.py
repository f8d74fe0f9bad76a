"""The job-loading flags that ``plan``, ``run`` and ``submit`` share, the one way they load a job, and the
``--output`` and ``JOB_ID`` checks of the commands that write results or name a job."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusionnet.job.loader import LoadedJob


def add_job_loading_flags(p: Any) -> None:
    from fusionnet.runtime.loadcheck import DEFAULT_LOAD_TIMEOUT

    p.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="let the job file name files outside its folder (absolute paths, '..', symlinks out) and "
        "importable modules as model.entrypoint; off by default, since a job file's model code runs here",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        default=DEFAULT_LOAD_TIMEOUT,
        metavar="S",
        help="give up when loading the job's model takes longer than S seconds "
        f"(default {DEFAULT_LOAD_TIMEOUT:g})",
    )


def load_job_for_command(args: argparse.Namespace) -> LoadedJob:
    """Loads ``args.job`` in a child process first (bounded; the model code cannot hang or exit this
    command), then here."""
    from fusionnet.job.loader import load_job
    from fusionnet.runtime.loadcheck import check_job_loads

    check_job_loads(args.job, allow_outside_paths=args.allow_outside_paths, timeout=args.load_timeout)
    return load_job(args.job, allow_outside_paths=args.allow_outside_paths)


def check_output_dir(output: Path) -> None:
    """``--output`` is a directory we can write, made now: finding out after a job ran would lose it."""
    from fusionnet.errors import JobError

    if output.exists() and not output.is_dir():
        raise JobError(f"--output: {output} exists and is not a directory")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JobError(f"--output: {output}: cannot create the directory ({e.strerror or e})") from None
    probe = output / ".fusionnet-write-test"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise JobError(f"--output: {output}: not writable ({e.strerror or e})") from None


def add_job_id_argument(p: Any) -> None:
    """``JOB_ID`` as brokers make them, checked here so that a typo is a clear bad-input error."""

    def job_id(text: str) -> str:
        if not (0 < len(text) <= 64 and text.isascii() and text.isalnum()):
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a job id (letters and digits, <= 64)")
        return text

    p.add_argument("job_id", metavar="JOB_ID", type=job_id, help="the job's id (submit and status print it)")
