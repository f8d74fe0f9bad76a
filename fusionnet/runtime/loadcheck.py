"""Loading a job once in a child process first, so the user's model code cannot hang or end the command.

A job file names Python code (``model.entrypoint``) that ``plan``, ``run`` and ``submit`` import and
call. Code that loops at import, calls ``sys.exit(0)``, crashes the interpreter or returns the wrong
thing would otherwise hang the command, make it exit 0 with no output, or end in a traceback. The
child process loads the job exactly as the command will (``load_job``: schema, paths, model, weights,
data, preflight forward), then runs the model's forward on the job's first whole micro-batch as tracing
will (``prepare.forward_on_example``: model code may misbehave only on more than one row, or only in
train mode), all under one time limit; the command loads it itself only once the child said the job is
sound. The child's verdict travels as one JSON object in a file: nothing is unpickled.

The children are forked from one server process per command that has torch and the loader imported
already (``python -m fusionnet.runtime.loadcheck --serve``, started by the first check, ending with the
process that started it when its stdin closes): a check costs tens of milliseconds instead of a new
interpreter importing torch (seconds), which matters to every caller that checks more than one job in
a process (the bad-input sweep checks hundreds). The server is single-threaded, so forking it is safe,
unlike forking a command that runs torch or hivemind threads. Requests and answers are JSON lines.

By hand: ``python -m fusionnet.runtime.loadcheck --result FILE [--allow-outside-paths] JOB.yaml``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fusionnet.core_dumps import forbid_core_dumps
from fusionnet.errors import JobError

log = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT = 120.0  # seconds; a 1B-parameter model builds in well under a minute


class _Server:
    """The parent's end of the fork server: one check at a time (a lock), restarted if it died."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.lock = threading.Lock()
        self.threads_at_fork: int | None = None  # the server's threads when it forked the last child
        self._unread = b""  # what was read of the server's output past the last whole line

    def _started(self) -> subprocess.Popen[str]:
        if self.proc is None or self.proc.poll() is not None:
            cmd = [sys.executable, "-m", "fusionnet.runtime.loadcheck", "--serve"]
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=os.environ | SERVER_ENV,
            )
            self._unread = b""
        return self.proc

    def _answer(self, proc: subprocess.Popen[str], deadline: float) -> dict[str, Any] | None:
        """The server's next line, or None at the deadline (or when the server is gone).

        Read from the pipe's descriptor into our own buffer: ``select`` sees only the descriptor, so a
        line already pulled into a file object's buffer with the one before it (the child's exit, when
        the check ended before this process read the fork's answer, as on a loaded machine) would be
        waited for until the deadline: 120 s, then the check called hung."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._unread:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return json.loads(line)

    def run(self, request: dict[str, Any], timeout: float) -> tuple[int | None, bool]:
        """Forks a child for ``request``: (its exit code, or -signal; None if the server failed), and
        whether it ran past ``timeout`` (then it was killed, with all it started)."""
        with self.lock:
            proc = self._started()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
            except OSError:
                return None, False
            # the server's own start (importing torch) counts against no job: it has a deadline of its own
            forked = self._answer(proc, time.monotonic() + SERVER_START_TIMEOUT)
            if forked is None or "pid" not in forked:
                self.stop()
                return None, False
            self.threads_at_fork = forked.get("threads")
            done = self._answer(proc, time.monotonic() + timeout)
            if done is not None:
                return int(done["exit"]), False
            kill_child(int(forked["pid"]))
            if self._answer(proc, time.monotonic() + SERVER_START_TIMEOUT) is None:
                self.stop()  # out of step with the server: a fresh one next time
            return None, True

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None
            self._unread = b""


SERVER_START_TIMEOUT = 60.0
# The server must stay single-threaded to be forked safely. numpy (imported with torch) starts
# OpenBLAS's thread server at import on a multi-core machine; a fork while that thread holds its lock
# leaves the child hung before it ran a line of ours (seen once in a CI run: a check that never
# answered). One BLAS thread means no thread server.
SERVER_ENV = {"OPENBLAS_NUM_THREADS": "1"}


def kill_child(pid: int) -> None:
    """Kills a check's child and all it started: its session, or the child alone when it never got
    as far as ``setsid`` (then its pid names no process group)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    except PermissionError:
        pass


_SERVER = _Server()


# How messages name the check's second stage (``prepare.forward_on_example``).
FORWARD = "the model's forward on the first micro-batch"


def _report_doc(result: Path) -> dict[str, Any] | None:
    """What the child last wrote to its result file: its verdict, or the stage it had reached (a child
    that was killed or ended itself wrote no verdict), or None."""
    try:
        doc = json.loads(result.read_text() or "null")
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _forward_stage(doc: dict[str, Any] | None) -> str | None:
    """``the model's forward on the first micro-batch (inputs (8, 16))`` when the child had got as far as
    that forward, else None (it was still loading the job)."""
    if doc is None or doc.get("stage") != "forward":
        return None
    example = doc.get("example")
    return FORWARD + (f" ({example})" if isinstance(example, str) else "")


def _verdict(code: int | None, result: Path, entrypoint_hint: str) -> str | None:
    """None when the child loaded the job; else the one-line error to show."""
    doc = _report_doc(result)
    if doc is not None and doc.get("ok") is True and code == 0:
        return None
    if doc is not None and isinstance(doc.get("error"), str):
        return doc["error"][:1000]
    forward = _forward_stage(doc)
    doing = forward or "loading the model"
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"{entrypoint_hint}: {doing} killed the process ({name})"
    if forward is not None:
        return f"{entrypoint_hint}: {forward} ended the process (exit code {code})"
    return f"{entrypoint_hint}: loading the model ended the process (exit code {code}) before it was loaded"


def check_job_loads(
    job_path: Path,
    *,
    allow_outside_paths: bool,
    timeout: float = DEFAULT_LOAD_TIMEOUT,
    deployment: bool = False,
) -> None:
    """Raises one JobError when loading ``job_path`` fails, exits, crashes or exceeds ``timeout``.
    ``deployment`` (``fusionnet deploy``): loaded as a deployment (task ``generate`` admitted), and only
    loaded: ``deploy`` traces what it serves its own way (a causal LM wrapped for KV caches)."""
    with tempfile.TemporaryDirectory(prefix="fusionnet-loadcheck-") as tmp:
        result, printed = Path(tmp) / "result.json", Path(tmp) / "output.txt"
        request = {
            "job": str(Path(job_path).absolute()),
            "allow_outside_paths": allow_outside_paths,
            "deployment": deployment,
            "result": str(result),
            "printed": str(printed),
            "cwd": os.getcwd(),  # the server started in an earlier state of this process
            "env": dict(os.environ),
        }
        code, timed_out = _SERVER.run(request, timeout)
        forward = _forward_stage(_report_doc(result)) if timed_out else None
        if forward is not None:
            raise JobError(
                f"model.entrypoint: {forward} did not finish in {timeout:g} s (a loop or a wait in "
                "forward?); raise --load-timeout if the model is really that slow"
            )
        if timed_out:
            raise JobError(
                f"model.entrypoint: loading the job did not finish in {timeout:g} s (a loop at import or in "
                "the builder?); raise --load-timeout if the model is really that slow to build"
            )
        if code is None:
            raise JobError("model.entrypoint: the load check could not start a process to load the job in")
        output = printed.read_bytes() if printed.exists() else b""
        if output:
            text = output[-4000:].decode(errors="replace")
            log.debug("output of the load check of %s:\n%s", job_path, text)
        verdict = _verdict(code, result, "model.entrypoint")
    if verdict is not None:
        raise JobError(verdict)


def _serve() -> int:
    """The fork server: one JSON request a line on stdin; forks a child per request, answers its pid,
    then its exit code (``-signal`` when killed). Ends when stdin closes."""
    # Imported once here, inherited by every child: the loader, and what runs the first micro-batch.
    import fusionnet.job.loader
    import fusionnet.runtime.prepare  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        threads = _thread_count()
        pid = os.fork()
        if pid == 0:
            _check_in_child(request)
        print(json.dumps({"pid": pid, "threads": threads}), flush=True)
        status = _wait_for_child(pid)
        if status is None:  # the command is gone (stdin closed mid-check): so is its check
            kill_child(pid)
            os.waitpid(pid, 0)
            return 0
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # whatever the model code left running in the child's session
        print(json.dumps({"exit": code}), flush=True)
    return 0


def _thread_count() -> int | None:
    """This process's threads (Linux), reported with each fork: anything but 1 is a fork hazard."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _wait_for_child(pid: int) -> int | None:
    """The child's wait status; None when stdin becomes readable meanwhile (the command sends one request
    at a time and waits for its answer, so that can only be the end of stdin: the command is gone)."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if select.select([sys.stdin], [], [], 0.05)[0]:
            return None


def _check_in_child(request: dict[str, Any]) -> None:
    """The forked child: its own session (a timeout kills all it started), its output into a file (the
    command's own output stays one line), the caller's directory and environment, then the load."""
    code = 1
    try:
        os.setsid()
        forbid_core_dumps()  # model code that crashes the interpreter leaves no 100s-of-MB core behind
        out = os.open(request["printed"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        job, result = Path(request["job"]), Path(request["result"])
        code = _load_and_report(
            job, request["allow_outside_paths"], result, request.get("deployment") is True
        )
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os._exit(code)  # no interpreter teardown: nothing the model code registered (atexit, threads) runs


def _load_and_report(job: Path, allow_outside_paths: bool, result: Path, deployment: bool = False) -> int:
    from fusionnet.job.loader import load_job
    from fusionnet.runtime.prepare import example_shapes, forward_on_example

    def report(doc: dict[str, object]) -> None:
        result.write_text(json.dumps(doc))

    try:
        loaded = load_job(job, allow_outside_paths=allow_outside_paths, deployment=deployment)
    except JobError as e:
        report({"error": str(e)})
        return 1
    except SystemExit as e:
        report({"error": f"model.entrypoint: the model code called sys.exit({e.code!r}) while loading"})
        return 1
    except BaseException as e:  # anything else the user's code raised outside build_model's own guard
        report({"error": f"model.entrypoint: loading the job raised {type(e).__name__}: {str(e)[:300]}"})
        return 1
    if deployment:
        report({"ok": True})
        return 0
    # Why here too: the command traces the model on its first whole micro-batch in its own process, with
    # no time limit; the preflight above ran one row in eval mode. What that forward does beyond raising
    # (sys.exit, os._exit, a hang, a crash) is caught here, where it ends only this child. The stage is
    # written first, so that a child killed or ended meanwhile is said to have died in the forward.
    try:
        example = example_shapes(loaded)
    except Exception as e:  # the command's trace builds the same micro-batch and says what is wrong with it
        log.debug("the first micro-batch could not be built: %s: %s", type(e).__name__, e)
        report({"ok": True})
        return 0
    report({"stage": "forward", "example": example})
    forward = f"{FORWARD} ({example})"
    try:
        forward_on_example(loaded)
    except SystemExit as e:
        report({"error": f"model.entrypoint: the model code called sys.exit({e.code!r}) in {forward}"})
        return 1
    except Exception as e:
        # An exception is the command's to report: its trace runs the same forward and says what failed
        # with the job's context (the micro-batch's shapes, an embedding too small for the data).
        log.debug("the forward on the first micro-batch raised %s: %s", type(e).__name__, e)
    except BaseException as e:  # KeyboardInterrupt and the like, raised by the model code on purpose
        said = f": {str(e)[:300]}" if str(e) else ""
        report({"error": f"model.entrypoint: {forward} raised {type(e).__name__}{said}"})
        return 1
    report({"ok": True})
    return 0


def _child(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fusionnet.runtime.loadcheck")
    parser.add_argument("--serve", action="store_true", help="run the fork server (JSON lines on stdin)")
    parser.add_argument("--result", type=Path)
    parser.add_argument("--allow-outside-paths", action="store_true")
    parser.add_argument("job", type=Path, nargs="?")
    args = parser.parse_args(argv)
    if args.serve:
        return _serve()
    if args.result is None or args.job is None:
        parser.error("--result and JOB are required without --serve")
    return _load_and_report(args.job, args.allow_outside_paths, args.result)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
