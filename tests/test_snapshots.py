"""Failover snapshots off the compute thread (``compnode.snapshots``): the one-copy packer gives the
bytes safetensors gives, and a snapshot taken while the next step runs holds exactly the state after
the Update it was started behind. FP and BP go on while it is copied, the next Update waits for the
copy, and that wait is reported as the snapshot's cost. The copy is slowed down here so that each
ordering is forced, not left to chance."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load

from fusionnet.compnode import snapshots
from fusionnet.compnode.snapshots import Snapshotter
from fusionnet.dag.hooks import HookChain
from fusionnet.messages.blobs import pack_tensors, unpack_tensors
from fusionnet.results.slice_stream import SliceStream

pytestmark = pytest.mark.timeout(60)


def test_packed_stream_holds_what_safetensors_holds() -> None:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 8, generator=g)
    tensors = {
        "a.weight": torch.randn(5, 7, generator=g),
        "b.half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "c.scalar": torch.tensor(2.5, dtype=torch.float64),
        "d.empty": torch.zeros(0, 3),
        "e.strided": wide[:, ::2],  # not contiguous: its values, not its storage
        "f.ints": torch.arange(10, dtype=torch.int64),
        "g.tied": wide,  # shares storage with e.strided: safetensors' save refuses that, we copy
    }
    keys = sorted(tensors)
    packed = SliceStream(tensors, keys).packed()
    got = load(bytes(packed))
    assert sorted(got) == keys
    for k in keys:
        assert got[k].dtype == tensors[k].dtype and torch.equal(got[k], tensors[k]), k
    without_tied = {k: v for k, v in tensors.items() if k != "g.tied"}
    assert (
        load(bytes(SliceStream(without_tied, sorted(without_tied)).packed())).keys()
        == load(pack_tensors(without_tied)).keys()
    )


class _FakeJob:
    """What ``Snapshotter`` reads of a ``JobAssignment``: an executor's live tensors, device and hooks,
    and the optimizer state."""

    def __init__(self) -> None:
        self.weight = torch.zeros(64)
        self.running_mean = torch.zeros(4)  # a buffer FP changes in place
        self.momentum = torch.zeros(64)
        self.executor = SimpleNamespace(
            live_tensors=lambda: ({"w": self.weight}, {"bn.running_mean": self.running_mean}),
            device=torch.device("cpu"),
            hooks=HookChain(),
        )

    def optim_tensors(self, live: bool = False) -> dict[str, torch.Tensor]:
        assert live
        return {"opt::w::momentum_buffer": self.momentum}

    def run(self, phase: str, work: Any) -> float:
        """``work`` as the executor runs a phase (through the hooks); returns when it ran."""

        def timed() -> float:
            work()
            return time.perf_counter()

        return self.executor.hooks.run(phase, 1, 0, timed)


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The snapshot copy starts only once the test lets it (the event), then takes 0.2 s."""
    release = threading.Event()
    real = snapshots.pack_chunks

    def held(part: str, tensors: dict[str, torch.Tensor]) -> Any:
        if part == "state":
            assert release.wait(10)
            time.sleep(0.2)
        return real(part, tensors)

    monkeypatch.setattr(snapshots, "pack_chunks", held)
    return release


def _chunks_as_tensors(chunks: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for _, blob in chunks:
        out |= unpack_tensors(bytes(blob), "snapshot")
    return out


def test_fp_and_bp_run_during_the_copy_and_the_update_waits_for_it(slow_copy: threading.Event) -> None:
    job = _FakeJob()
    job.weight.fill_(1.0)
    job.momentum.fill_(0.5)
    job.running_mean.fill_(3.0)
    snap = Snapshotter(job, overlap=True)  # type: ignore[arg-type]
    try:
        copy, _ = snap.start()
        assert not copy.done()  # the copy waits for the release: the compute thread did not copy
        # FP changes a buffer in place while the copy waits: the snapshot keeps the value it started on.
        job.run("fp", lambda: job.running_mean.add_(1.0))
        job.run("bp", lambda: None)
        assert not copy.done()  # FP and BP did not wait for the copy
        released_at = time.perf_counter()
        threading.Timer(0.1, slow_copy.set).start()

        def update() -> None:
            job.weight.add_(1.0)
            job.momentum.add_(1.0)

        updated_at = job.run("update", update)
        assert copy.done() and updated_at >= released_at + 0.3  # waited for the release and the copy
        snapshot = _chunks_as_tensors(copy.result())
        assert torch.equal(snapshot["w"], torch.ones(64))  # the state before this Update
        assert torch.equal(snapshot["opt::w::momentum_buffer"], torch.full((64,), 0.5))
        assert torch.equal(snapshot["bn.running_mean"], torch.full((4,), 3.0))
        assert torch.equal(job.weight, torch.full((64,), 2.0))
        # The next snapshot reports the wait the Update had: the step paid it.
        slow_copy.set()
        copy2, seconds2 = snap.start()
        assert seconds2 >= 0.15
        assert torch.equal(_chunks_as_tensors(copy2.result())["w"], torch.full((64,), 2.0))
        # An Update whose snapshot's copy is done does not wait.
        copy3, _ = snap.start()
        copy3.result()
        job.run("update", lambda: None)
        assert snap.gate.take_waited() == 0.0
    finally:
        slow_copy.set()
        snap.close()


def test_on_a_cpu_compnode_the_copy_is_done_when_start_returns() -> None:
    job = _FakeJob()
    job.weight.fill_(1.0)
    snap = Snapshotter(job)  # type: ignore[arg-type]
    assert not snap.overlap  # the executor's device is the CPU
    copy, _ = snap.start()
    assert copy.done()
    job.run("update", lambda: job.weight.add_(1.0))
    assert torch.equal(_chunks_as_tensors(copy.result())["w"], torch.ones(64))
    snap.close()


def test_a_failed_copy_fails_its_snapshot_and_not_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(part: str, tensors: dict[str, torch.Tensor]) -> Any:
        time.sleep(0.1)
        raise MemoryError("no room for the snapshot")

    monkeypatch.setattr(snapshots, "pack_chunks", broken)
    job = _FakeJob()
    snap = Snapshotter(job, overlap=True)  # type: ignore[arg-type]
    try:
        copy, _ = snap.start()
        job.run("update", lambda: job.weight.add_(1.0))  # waits, then runs
        assert torch.equal(job.weight, torch.ones(64))
        with pytest.raises(MemoryError, match="no room"):
            copy.result()
    finally:
        snap.close()
