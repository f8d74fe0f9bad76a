"""The sandbox workers' CPU and memory series (``metrics.workers``): read from /proc, kept across ends."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionnet.metrics import CompnodeMetrics
from fusionnet.metrics.workers import ProcessFigures, WorkerProcesses, parse_stat

pytestmark = pytest.mark.timeout(60)

# A real line's shape, with a command name holding ") (" and spaces.
STAT = (
    "4242 (fusion ) (job x) S 1 4242 4242 0 -1 4194560 900 0 0 0 "
    "250 50 0 0 39 19 3 0 123456 800000000 5000 18446744073709551615"
)


def test_stat_fields_are_counted_after_the_last_parenthesis() -> None:
    assert parse_stat(STAT, 100.0, 4096) == ProcessFigures(
        started=123456, cpu_seconds=3.0, resident_bytes=5000 * 4096
    )


def _write(proc: Path, pid: int, utime: int, started: int = 7) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    fields = ["S"] + ["0"] * 10 + [str(utime), "0"] + ["0"] * 6 + [str(started), "0", "10"]
    (proc / str(pid) / "stat").write_text(f"{pid} (w) " + " ".join(fields))


def test_cpu_of_ended_workers_stays_and_recycled_pids_are_new(tmp_path: Path) -> None:
    import os
    import shutil

    tick = os.sysconf("SC_CLK_TCK")
    workers = WorkerProcesses(proc=tmp_path)
    _write(tmp_path, 10, utime=2 * tick)
    _write(tmp_path, 11, utime=3 * tick)
    workers.look(10)
    workers.look(11)
    assert workers.refresh()[:2] == (2, 5.0)
    shutil.rmtree(tmp_path / "10")  # ended: its last figure stays counted
    _write(tmp_path, 11, utime=4 * tick)
    assert workers.refresh()[:2] == (1, 6.0)
    _write(tmp_path, 11, utime=1 * tick, started=99)  # pid 11 recycled by another process
    assert workers.refresh()[:2] == (0, 6.0)
    workers.look(12)  # already gone when looked at: nothing to count
    assert workers.refresh() == (0, 6.0, 0)
    _write(tmp_path, 13, utime=1 * tick)
    workers.look(13)  # started, then looked at again just before it is stopped
    _write(tmp_path, 13, utime=5 * tick)
    workers.look(13)
    shutil.rmtree(tmp_path / "13")
    assert workers.refresh() == (0, 11.0, 0)


def test_a_real_process_is_scraped_on_the_compnode_registry() -> None:
    metrics = CompnodeMetrics(process=False)
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nprint('up', flush=True)\n"
            "t=time.process_time()\nwhile time.process_time()-t<0.3: pass\nsys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        # started: its interpreter is in memory (read before that, its RSS was 132 kB)
        assert busy.stdout is not None and busy.stdout.readline() == b"up\n"
        metrics.workers.look(busy.pid)

        def sample(name: str) -> float:
            value = metrics.registry.get_sample_value(name)
            assert value is not None, name
            return value

        assert sample("fusionnet_sandbox_workers") == 1
        assert sample("fusionnet_sandbox_resident_memory_bytes") > 1 << 20
        # Burns 0.3 s of CPU before it waits: the counter reaches it while the process lives.

        deadline = time.monotonic() + 20
        while sample("fusionnet_sandbox_cpu_seconds_total") < 0.25:
            assert time.monotonic() < deadline, "the worker's CPU never showed"
            time.sleep(0.05)
    finally:
        busy.communicate(b"", timeout=10)
    assert sample("fusionnet_sandbox_workers") == 0
    assert sample("fusionnet_sandbox_cpu_seconds_total") >= 0.25
