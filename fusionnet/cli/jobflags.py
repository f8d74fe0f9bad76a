"""The job-loading flags that ``plan``, ``run`` and ``submit`` share, the one way they load a job, and the
``--output`` and ``JOB_ID`` checks of the commands that write results or name a job."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusionnet.job.loader import LoadedJob


def add_job_loading_flags(p: Any) -> None:
    from fusionnet.cli.argtypes import positive_seconds
    from fusionnet.runtime.loadcheck import DEFAULT_LOAD_TIMEOUT

    p.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="let the job file name files outside its folder (absolute paths, '..', symlinks out) and "
        "importable modules as model.entrypoint; off by default, since a job file's model code runs here",
    )
    p.add_argument(
        "--load-timeout",
        type=positive_seconds,  # nan, inf, 0 or -1 would never or always time out: refused by argparse
        default=DEFAULT_LOAD_TIMEOUT,
        metavar="S",
        help="give up when loading the job's model (and running its forward once on the first "
        f"micro-batch) takes longer than S seconds (default {DEFAULT_LOAD_TIMEOUT:g})",
    )


def check_job_for_command(args: argparse.Namespace) -> None:
    """Checks ``args.job`` without loading it here: first what needs no user code (schema, paths, data;
    milliseconds, in this process), then the model in a child process (bounded; the model code cannot
    hang or exit this command)."""
    from fusionnet.job.loader import check_job_without_model
    from fusionnet.runtime.loadcheck import check_job_loads

    check_job_without_model(args.job, allow_outside_paths=args.allow_outside_paths)
    check_job_loads(args.job, allow_outside_paths=args.allow_outside_paths, timeout=args.load_timeout)


def load_job_for_command(args: argparse.Namespace) -> LoadedJob:
    """Checks ``args.job`` (``check_job_for_command``), then loads it here."""
    from fusionnet.job.loader import load_job

    check_job_for_command(args)
    return load_job(args.job, allow_outside_paths=args.allow_outside_paths)


def check_output_dir(output: Path) -> None:
    """``--output`` is a directory we can write, checked now: finding out after a job ran would lose it.
    Folders made for the check are removed again (the command makes them when it writes): a job refused
    later, or an unknown job id, leaves no empty folder behind."""
    from fusionnet.errors import JobError

    shown = str(output) if str(output).isprintable() and len(str(output)) <= 200 else repr(str(output))[:200]
    made: list[Path] = []  # deepest first
    try:
        try:
            if output.exists() and not output.is_dir():
                raise JobError(f"--output: {shown} exists and is not a directory")
            made = _missing_folders(output)
            output.mkdir(parents=True, exist_ok=True)
        except JobError:
            raise
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:100]
            raise JobError(f"--output: {shown}: cannot create the directory ({reason})") from None
        probe = output / ".fusionnet-write-test"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise JobError(f"--output: {output}: not writable ({e.strerror or e})") from None
        _check_result_names_free(output, shown)
    finally:
        for folder in made:
            with contextlib.suppress(OSError, ValueError):  # ValueError: a NUL byte, never made
                folder.rmdir()


def _check_result_names_free(output: Path, shown: str) -> None:
    """Each result file is written to ``NAME.tmp`` and renamed onto ``NAME`` once the work is done: a
    directory in either place would fail that write, and lose the results, after the whole job ran.
    Refused now, naming the entry. (A symlink is replaced itself, whatever it points to.)"""
    from fusionnet.errors import JobError
    from fusionnet.results.files import RESULT_FILES

    for name in RESULT_FILES:
        for entry in (output / name, output / f"{name}.tmp"):
            if entry.is_dir() and not entry.is_symlink():
                raise JobError(
                    f"--output: {shown}/{entry.name} is a directory where a result file goes; remove it "
                    "or choose another --output"
                )


def add_job_id_argument(p: Any) -> None:
    """``JOB_ID`` as brokers make them, checked here so that a typo is a clear bad-input error."""

    def job_id(text: str) -> str:
        if not (0 < len(text) <= 64 and text.isascii() and text.isalnum()):
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a job id (letters and digits, <= 64)")
        return text

    p.add_argument("job_id", metavar="JOB_ID", type=job_id, help="the job's id (submit and status print it)")


def check_output_file(path: Path, flag: str) -> None:
    """A file a command writes once its work is done (``plan --json``) can be written: checked before the
    work, so a bad path is one line naming ``flag`` now, not a traceback after the work."""
    from fusionnet.errors import JobError

    shown = str(path) if str(path).isprintable() and len(str(path)) <= 200 else repr(str(path))[:200]
    # Folders made for the check are removed again, as check_output_dir does (the command makes them
    # when it writes): a job refused later leaves no empty folders behind.
    made: list[Path] = []
    try:
        if path.is_dir():
            raise JobError(f"{flag}: {shown} is a directory; expected a file name")
        made = _missing_folders(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with path.open("a"):
            pass
        if not existed:
            path.unlink()
    except JobError:
        raise
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:100]
        raise JobError(f"{flag}: {shown}: cannot write the file ({reason})") from None
    finally:
        for folder in made:
            with contextlib.suppress(OSError, ValueError):
                folder.rmdir()


def _missing_folders(folder: Path) -> list[Path]:
    """``folder`` and its ancestors that do not exist yet, deepest first (what ``mkdir(parents=True)``
    would make)."""
    missing: list[Path] = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def add_key_flag(p: Any, help: str | None = None) -> None:
    """``--key FILE``: the submitter key (``runtime.submitter``) a broker knows this user by."""
    p.add_argument(
        "--key",
        type=Path,
        metavar="FILE",
        help=help
        or "submitter key: who you are to the broker (default $FUSIONNET_KEY, else "
        "$FUSIONNET_HOME/submitter.key, else ~/.fusionnet/submitter.key; made on first use)",
    )
