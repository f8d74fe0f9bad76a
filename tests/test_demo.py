"""`fusionnet demo` end to end, as the README's quick start runs it: a real local swarm of processes
trains the bundled GPT job, shows the plan and the loss falling, writes the results and leaves no
process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.swarm, pytest.mark.slow]


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions ``text`` (the daemons carry their state dirs in it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if text in cmdline and state not in ("Z", "X"):
                found.append(int(entry.name))
    return found


@pytest.mark.timeout(180)
def test_demo_trains_the_gpt_job_and_cleans_up(tmp_path: Path) -> None:
    workdir, out = tmp_path / "work", tmp_path / "out"
    cmd = [sys.executable, "-m", "fusionnet.cli.main", "demo", "--compnodes", "2"]
    cmd += ["--output", str(out), "--workdir", str(workdir)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
        shown = done.stdout + done.stderr
        assert done.returncode == 0, shown[-4000:]
        assert "plan as run" in shown and "performance model" in shown and "SUCCEEDED" in shown, shown
        for name in ("weights.safetensors", "plan.json", "metrics.jsonl"):
            assert (out / name).is_file(), name
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 10 and rows[-1]["loss"] < rows[0]["loss"]  # the loss falls
        plan = json.loads((out / "plan.json").read_text())
        assert len(plan["subdags"]) == 2 and plan["predicted_step_seconds"] > 0
        assert _processes_mentioning(str(workdir)) == []  # every daemon and its children are gone
    finally:
        for pid in _processes_mentioning(str(workdir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
