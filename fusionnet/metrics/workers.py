"""CPU and memory of a compnode's sandbox workers (``--sandbox process``), for Prometheus.

Why: sub-DAGs compute in worker processes forked from the compnode's fork server, so the daemon's own
``process_cpu_seconds_total`` misses nearly all of a compnode's work, and an operator could not tell a
busy compnode from an idle one. The workers are not the daemon's children (the fork server's), so
neither ``getrusage`` nor the daemon's process collector sees them; their figures come from
``/proc/<pid>/stat`` at scrape time, as ``prometheus_client``'s ``ProcessCollector`` reads the
daemon's.

The CPU counter covers every worker this daemon started, also the ones that ended: a worker's last
figure read is kept when it goes (its final moments between that scrape and its exit are lost, a
fraction of a scrape interval), so the counter never goes down while workers come and go. A pid is
recognised by its start time as well, so a recycled pid is never taken for the worker it replaced.
Without ``/proc`` (not Linux) the series read 0 workers and 0 seconds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessFigures:
    started: int  # clock ticks after boot: with the pid, names one process for good
    cpu_seconds: float  # user + system
    resident_bytes: int


def parse_stat(stat: str, ticks_per_second: float, page_bytes: int) -> ProcessFigures:
    """The figures in one ``/proc/<pid>/stat`` line. The command name (field 2) may hold spaces and
    parentheses, so the fields are counted after its last ``)``."""
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): utime is field 14, stime 15, starttime 22, rss 24 (in pages).
    utime, stime = int(fields[11]), int(fields[12])
    return ProcessFigures(
        started=int(fields[19]),
        cpu_seconds=(utime + stime) / ticks_per_second,
        resident_bytes=int(fields[21]) * page_bytes,
    )


def read_process(pid: int, proc: Path = PROC) -> ProcessFigures | None:
    """``pid``'s figures, or None once it is gone (or without ``/proc``)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        return parse_stat(stat, os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return None


class WorkerProcesses(Collector):
    """``fusionnet_sandbox_workers``, ``fusionnet_sandbox_cpu_seconds_total`` and
    ``fusionnet_sandbox_resident_memory_bytes`` over the pids it is told to ``look`` at."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc
        self._lock = threading.Lock()  # scrapes run on the metrics server's thread, looks on the loop's
        self._live: dict[int, ProcessFigures] = {}  # pid -> its last figures read
        self._ended_cpu = 0.0  # the last figures of the workers that ended

    def look(self, pid: int) -> None:
        """Reads worker ``pid`` now and counts it from then on until it ends. Called when a worker
        starts and again just before it is stopped, so a job shorter than a scrape interval counts."""
        self._read(pid, adopt=True)

    def _read(self, pid: int, *, adopt: bool) -> None:
        """Rereads ``pid``; a process found under a known pid that started later is a stranger
        (the pid was recycled), taken on only when ``adopt`` (we were told it is a worker)."""
        figures = read_process(pid, self._proc)
        with self._lock:
            last = self._live.get(pid)
            if last is not None and (figures is None or figures.started != last.started):
                self._ended_cpu += last.cpu_seconds  # ended (or recycled) since it was last read
                del self._live[pid]
                last = None
            if figures is not None and (adopt or last is not None):
                self._live[pid] = figures

    def refresh(self) -> tuple[int, float, int]:
        """(live workers, CPU seconds of all workers so far, resident bytes of the live ones)."""
        for pid in list(self._live):
            self._read(pid, adopt=False)
        with self._lock:
            live = list(self._live.values())
            cpu = self._ended_cpu + sum(f.cpu_seconds for f in live)
            return len(live), cpu, sum(f.resident_bytes for f in live)

    def describe(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        """The families, without reading ``/proc`` (what a registry checks names with)."""
        return self._families(0, 0.0, 0)

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        return self._families(*self.refresh())

    @staticmethod
    def _families(
        workers: int, cpu: float, resident: int
    ) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(
            "fusionnet_sandbox_workers", "Sandbox worker processes running sub-DAGs now", value=workers
        )
        yield CounterMetricFamily(
            "fusionnet_sandbox_cpu_seconds",
            "User and system CPU time of this compnode's sandbox workers, the ended ones included",
            value=cpu,
        )
        yield GaugeMetricFamily(
            "fusionnet_sandbox_resident_memory_bytes",
            "Resident memory of this compnode's live sandbox workers",
            value=resident,
        )
