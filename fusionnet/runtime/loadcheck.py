"""Loading a job once in a child process first, so the user's model code cannot hang or end the command.

A job file names Python code (``model.entrypoint``) that ``plan``, ``run`` and ``submit`` import and
call. Code that loops at import, calls ``sys.exit(0)``, crashes the interpreter or returns the wrong
thing would otherwise hang the command, make it exit 0 with no output, or end in a traceback. The
child process loads the job exactly as the command will (``load_job``: schema, paths, model, weights,
data, preflight forward) under a time limit; the command loads it itself only once the child said the
job is sound. The child's verdict travels as one JSON object in a file: nothing is unpickled.

Run as ``python -m fusionnet.runtime.loadcheck --result FILE [--allow-outside-paths] JOB.yaml``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from fusionnet.errors import JobError

log = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT = 120.0  # seconds; a 1B-parameter model builds in well under a minute


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def _verdict(code: int | None, result: Path, entrypoint_hint: str) -> str | None:
    """None when the child loaded the job; else the one-line error to show."""
    try:
        doc = json.loads(result.read_text() or "null")
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and doc.get("ok") is True and code == 0:
        return None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return doc["error"][:1000]
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"{entrypoint_hint}: loading the model killed the process ({name})"
    return f"{entrypoint_hint}: loading the model ended the process (exit code {code}) before it was loaded"


def check_job_loads(
    job_path: Path, *, allow_outside_paths: bool, timeout: float = DEFAULT_LOAD_TIMEOUT
) -> None:
    """Raises one JobError when loading ``job_path`` fails, exits, crashes or exceeds ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="fusionnet-loadcheck-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "fusionnet.runtime.loadcheck", "--result", str(result)]
        cmd += ["--allow-outside-paths"] if allow_outside_paths else []
        cmd += ["--", str(job_path)]
        # A new session lets a timeout kill whatever the model code started too. What the model code
        # prints is kept for --log-level DEBUG only: the command's own output stays one line.
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            printed, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise JobError(
                f"model.entrypoint: loading the job did not finish in {timeout:g} s (a loop at import or in "
                "the builder?); raise --load-timeout if the model is really that slow to build"
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        code = proc.returncode
        if printed:
            log.debug(
                "output of the load check of %s:\n%s", job_path, printed[-4000:].decode(errors="replace")
            )
        verdict = _verdict(code, result, "model.entrypoint")
    if verdict is not None:
        raise JobError(verdict)


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fusionnet.runtime.loadcheck")
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--allow-outside-paths", action="store_true")
    parser.add_argument("job", type=Path)
    args = parser.parse_args(argv)
    from fusionnet.job.loader import load_job

    def report(doc: dict[str, object]) -> None:
        args.result.write_text(json.dumps(doc))

    try:
        load_job(args.job, allow_outside_paths=args.allow_outside_paths)
    except JobError as e:
        report({"error": str(e)})
        return 1
    except SystemExit as e:
        report({"error": f"model.entrypoint: the model code called sys.exit({e.code!r}) while loading"})
        return 1
    except BaseException as e:  # anything else the user's code raised outside build_model's own guard
        report({"error": f"model.entrypoint: loading the job raised {type(e).__name__}: {str(e)[:300]}"})
        return 1
    report({"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
