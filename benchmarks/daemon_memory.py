"""How much memory each daemon of a benchmark's swarm occupies: its own peak (``VmHWM``), its process
tree's (a compnode's sandbox fork server and job workers) sampled as PSS, and, on a CUDA machine, the
device memory each tree holds as ``nvidia-smi`` reports it (the state of ``compnode --device cuda``
lives there, not in host memory)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from pathlib import Path


def vm_kb(pid: int, field_name: str) -> int:
    """A ``/proc/<pid>/status`` memory field in kB (0 once the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants now: a compnode's sandbox fork server and job workers."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (torch's libraries in a fork server and its workers)
    counted once over the processes that share them, so the sum over a tree is what it occupies."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class TreeMemory:
    """Samples each daemon's process tree (PSS summed) every ``period`` s and keeps the peak: with
    sandbox workers a compnode is several processes, whose peaks ``VmHWM`` of one cannot show."""

    def __init__(self, pids: dict[str, int], period: float = 0.25, gpu: bool = False) -> None:
        self.pids = pids
        self.period = period
        self.peak = dict.fromkeys(pids, 0)
        self.gpu = gpu and shutil.which("nvidia-smi") is not None
        self.gpu_peak = dict.fromkeys(pids, 0)  # device bytes of each tree (gpu=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict[str, int]:
        return {name: sum(pss_bytes(p) for p in tree_pids(pid)) for name, pid in self.pids.items()}

    def sample_gpu(self) -> dict[str, int]:
        used = gpu_bytes_by_pid()
        return {name: sum(used.get(p, 0) for p in tree_pids(pid)) for name, pid in self.pids.items()}

    def _run(self) -> None:
        rounds = 0
        while not self._stop.wait(self.period):
            for name, total in self.sample().items():
                self.peak[name] = max(self.peak[name], total)
            rounds += 1
            if self.gpu and rounds % 4 == 0:  # nvidia-smi takes tens of ms: every fourth round
                for name, total in self.sample_gpu().items():
                    self.gpu_peak[name] = max(self.gpu_peak[name], total)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def gpu_bytes_by_pid() -> dict[int, int]:
    """pid -> device memory it holds, from ``nvidia-smi`` (empty where there is none or it fails)."""
    cmd = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used: dict[int, int] = {}
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            pid, mib = (field.strip() for field in line.split(","))
            used[int(pid)] = used.get(int(pid), 0) + int(mib) * 2**20
    return used
