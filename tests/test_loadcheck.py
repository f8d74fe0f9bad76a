"""The load check's fork server (``runtime.loadcheck``): single-threaded so its children cannot inherit a
held lock, and a hung child is killed whether or not it got as far as its own session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionnet.errors import JobError
from fusionnet.runtime import loadcheck
from tests.jobfiles import REPO

pytestmark = pytest.mark.timeout(180)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_the_fork_server_is_single_threaded_after_a_check() -> None:
    loadcheck._SERVER.stop()  # a fresh server: its first fork is the one that follows the imports
    loadcheck.check_job_loads(REPO / "examples" / "mlp" / "job.yaml", allow_outside_paths=False)
    server = loadcheck._SERVER.proc
    assert server is not None and server.poll() is None
    # numpy's OpenBLAS would start a thread server at import (a fork could then inherit its held lock)
    assert loadcheck._SERVER.threads_at_fork == 1
    assert _threads(server.pid) == 1


def test_a_check_that_runs_past_its_time_is_killed_and_said(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file({"inputs": torch.zeros(2, 3)}, str(tmp_path / "data.safetensors"))
    (tmp_path / "model.py").write_text("import time\ntime.sleep(600)\n")
    (tmp_path / "job.yaml").write_text(
        "name: slow\ntask: infer\nmodel: {entrypoint: model.py:build}\n"
        "data: {path: data.safetensors, batch_size: 1}\n"
    )
    started = time.monotonic()
    with pytest.raises(JobError, match="did not finish in 3 s"):
        loadcheck.check_job_loads(tmp_path / "job.yaml", allow_outside_paths=False, timeout=3)
    assert time.monotonic() - started < 30  # killed and answered, not the server's own 60-s wait
    # the server answered the killed check and serves the next one
    loadcheck.check_job_loads(REPO / "examples" / "mlp" / "job.yaml", allow_outside_paths=False)


def test_kill_child_kills_a_session_or_a_child_without_one() -> None:
    lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # our process group
    session = subprocess.Popen(
        ["bash", "-c", "sleep 120 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert session.stdout is not None
        grandchild = int(session.stdout.readline())
        loadcheck.kill_child(lone.pid)
        assert lone.wait(timeout=30) == -9
        loadcheck.kill_child(session.pid)
        assert session.wait(timeout=30) == -9
        deadline = time.monotonic() + 30
        while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped by init: polled with a deadline
        assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text()
    finally:
        for p in (lone, session):
            if p.poll() is None:
                p.kill()
                p.wait()


NO_SUCH_PID = 4_194_305  # above Linux's largest pid: killing it finds no process


@pytest.mark.timeout(60)
def test_a_check_whose_answers_arrive_together_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine the check's child can finish before this process reads the fork's answer;
    the server's two lines (the child's pid, its exit) then arrive in one read. Both must be taken from
    it: a CI run once waited 120 + 60 s for a line already read, and called a quick refusal a hang."""
    server = loadcheck._Server()
    both = f'{{"pid": {NO_SUCH_PID}, "threads": 1}}\n{{"exit": 1}}\n'
    fake = [
        sys.executable,
        "-c",
        f"import sys; sys.stdin.readline(); sys.stdout.write({both!r}); sys.stdout.flush(); sys.stdin.read()",
    ]

    def started() -> subprocess.Popen[str]:
        if server.proc is None:
            server.proc = subprocess.Popen(fake, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return server.proc

    monkeypatch.setattr(server, "_started", started)
    try:
        begun = time.monotonic()
        assert server.run({"job": "x"}, timeout=20) == (1, False)
        assert time.monotonic() - begun < 15
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_model_that_crashes_the_check_leaves_no_core_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check's child runs the job's code; when that crashes the interpreter the child dumps no core
    into the caller's folder (hundreds of MB with torch loaded), even where the limit would allow one."""
    import resource

    import torch
    from safetensors.torch import save_file

    save_file({"inputs": torch.zeros(2, 3)}, str(tmp_path / "data.safetensors"))
    (tmp_path / "model.py").write_text("import ctypes\nctypes.string_at(0)\n")
    (tmp_path / "job.yaml").write_text(
        "name: crash\ntask: infer\nmodel: {entrypoint: model.py:build}\n"
        "data: {path: data.safetensors, batch_size: 1}\n"
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    loadcheck._SERVER.stop()  # the next server inherits the raised limit
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    monkeypatch.chdir(tmp_path)  # where a core file would be written
    try:
        with pytest.raises(JobError, match=r"killed the process \(SIGSEGV\)"):
            loadcheck.check_job_loads(tmp_path / "job.yaml", allow_outside_paths=False)
    finally:
        loadcheck._SERVER.stop()
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("core")]
