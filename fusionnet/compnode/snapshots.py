"""Failover snapshots that do not stop the compute thread (issue 11: "a step never waits for it").

A snapshot is a sub-DAG's parameters, buffers and optimizer state as the last Update left them
(``compnode.replicas`` keeps and ships it). It used to be packed on the compute thread between two
steps with safetensors' ``save``, which copies every tensor two or three times, and on a GPU after a
synchronous device-to-host copy of each. Measured: 774 ms of an 808 ms step for a 125M Llama on three
H200 compnodes, 1.0 s of a 3.2 s step on 2 CPU cores.

Now every tensor is copied once, straight into the chunks (``SliceStream.packed``: 0.18 s against
safetensors' 0.35-0.5 s for 224 MB here). On a CUDA compnode the copy also leaves the compute thread:
that thread only copies the buffers (BatchNorm statistics change in FP) and records an event behind
the queued Update; a snapshot thread copies the parameters and the optimizer state from a side stream
that waits for the event, while the next step's FP and BP run (they read the parameters and never
write them). Only an Update does, so the next Update waits for the copy (``SnapshotGate``). On a CPU
compnode the copy stays on the compute thread, between the steps: there it needs the same cores the
next step computes on, and overlapping them measured no faster on 2 cores (a 125M Llama's snapshot
steps took 10-11 s either way) while the copy's memory then adds to the next step's activations.
What a snapshot costs the step (the compute thread's part and any wait of an Update) is what
``metrics.jsonl`` reports as ``checkpoint_seconds``; a wait is counted with the next snapshot.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fusionnet.compnode.assignment_intake import JobAssignment
from fusionnet.compnode.replicas import Chunk, pack_chunks
from fusionnet.dag.hooks import ExecutorHook, Phase


class SnapshotGate(ExecutorHook):
    """Holds an Update back until the snapshot copy in flight is done (compute thread only)."""

    def __init__(self) -> None:
        self._pending: Future[list[Chunk]] | None = None
        self._waited = 0.0

    def hold(self, copy: Future[list[Chunk]]) -> None:
        self._pending = copy

    def before(self, phase: Phase, step: int, mb: int) -> None:
        if phase != "update" or self._pending is None:  # FP and BP only read the parameters
            return
        pending, self._pending = self._pending, None
        if not pending.done():
            started = time.perf_counter()
            concurrent.futures.wait([pending])  # a failed copy fails its snapshot, not the step
            self._waited += time.perf_counter() - started

    def take_waited(self) -> float:
        """Seconds Updates waited for copies since the last call."""
        waited, self._waited = self._waited, 0.0
        return waited


class Snapshotter:
    """One job's snapshots: ``start`` on the compute thread; the copy on a thread of its own when
    ``overlap`` (default: on CUDA devices), else right there."""

    def __init__(self, job: JobAssignment, overlap: bool | None = None) -> None:
        self.job = job
        self.overlap = job.executor.device.type == "cuda" if overlap is None else overlap
        self.gate = SnapshotGate()
        job.executor.hooks.add(self.gate)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="snapshot") if self.overlap else None

    def start(self) -> tuple[Future[list[Chunk]], float]:
        """On the compute thread, right after the Update the snapshot is of: (the copy's future,
        seconds this snapshot and the Updates that waited for the last one took of the compute thread)."""
        started = time.perf_counter()
        executor = self.job.executor
        params, buffers = executor.live_tensors()
        optim = self.job.optim_tensors(live=True)
        if self._copier is None:
            done: Future[list[Chunk]] = Future()
            done.set_result(_pack(params | buffers, optim))
            return done, time.perf_counter() - started
        state = params | {k: v.clone() for k, v in buffers.items()}
        event = None
        if executor.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(executor.device))
        copy = self._copier.submit(_copy_out, state, optim, executor.device, event)
        self.gate.hold(copy)
        return copy, time.perf_counter() - started + self.gate.take_waited()

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=False)


def _copy_out(
    state: dict[str, torch.Tensor],
    optim: dict[str, torch.Tensor],
    device: torch.device,
    event: torch.cuda.Event | None,
) -> list[Chunk]:
    if event is None:
        return _pack(state, optim)
    side = torch.cuda.Stream(device)
    side.wait_event(event)  # the Update it snapshots is done on the device before any byte is read
    with torch.cuda.stream(side):
        return _pack(state, optim)


def _pack(state: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> list[Chunk]:
    return pack_chunks("state", state) + pack_chunks("optim", optim)
