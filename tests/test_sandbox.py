"""Sandboxed execution (issue 12): a compnode's sub-task service running each assignment in a worker
process of its own. Same results as the in-process executor, to the bit; a worker that crashes, runs
out of its memory budget or talks nonsense fails its job with a message that says so, and the service
goes on taking and running jobs; released jobs leave no process behind."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fusionnet.compnode.daemon import CompnodeConfig
from fusionnet.compnode.faults import ENV as FAULT_ENV
from fusionnet.compnode.sandbox_client import SandboxedJob
from fusionnet.compnode.sandbox_ipc import IPCChannel, IPCError, frame_message, frame_of
from fusionnet.compnode.sandbox_pool import SandboxPool
from fusionnet.compnode.tasks import SubtaskService
from fusionnet.errors import ExecutionError, JobError
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.rpc.server import RPCContext
from fusionnet.wire.frames import TensorFrame
from fusionnet.wire.handoff import OTHER_LANES
from tests.test_subtask_service import BROKER, PEERS, FakeNode, FakePath, figure3_assign_docs


@pytest.fixture(scope="module")
def whole_job() -> dict[str, Any]:
    """figure3 as one sub-DAG (it runs alone, no peers needed), for compnode ``PEERS[0]``."""
    return figure3_assign_docs(1)[0]


def service(*, sandbox: bool, memory_gb: float | None = None) -> SubtaskService:
    node = FakeNode()
    node.peer_id = PEERS[0]
    # The workers compute with this process's torch thread count: then their floats are the inline ones.
    node.settings = CompnodeConfig(
        trusted_brokers=(BROKER,),
        sandbox=sandbox,
        sandbox_memory_gb=memory_gb,
        threads=torch.get_num_threads(),
    )
    s = SubtaskService(node)  # type: ignore[arg-type]
    s.server, s.p2p = FakePath(), FakePath()  # type: ignore[assignment]
    return s


async def call(s: SubtaskService, method: str, payload: dict[str, Any]) -> dict[str, Any]:
    handler = getattr(s, f"rpc_{method}")
    return await handler(payload, RPCContext(remote_peer=BROKER, method=method))


async def train(
    s: SubtaskService, doc: dict[str, Any], steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    await call(s, "assign", doc)
    losses = [(await call(s, "step", {"job_id": "j1", "step": k}))["loss"] for k in range(steps)]
    reply = await call(s, "collect", {"job_id": "j1", "part": "all"})
    return losses, unpack_tensors(reply["state"], "state")


@pytest.mark.timeout(120)
def test_a_sandboxed_job_equals_the_in_process_one_and_its_worker_goes_with_it(whole_job: dict) -> None:
    async def run() -> None:
        inline = service(sandbox=False)
        want_losses, want = await train(inline, whole_job, 3)
        s = service(sandbox=True)
        got_losses, got = await train(s, whole_job, 3)
        assert got_losses == want_losses
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        host = s.jobs["j1"].host
        # Its worker reads its peers' values: the daemon's paths leave the workers' lane to it.
        assert host.reads_values and s.server.lanes == s.p2p.lanes == OTHER_LANES  # type: ignore[attr-defined]
        assert inline.server.lanes is None  # type: ignore[attr-defined]
        # Two snapshots queued at once (replication of two steps in flight): each has its own chunks.
        first, second = host.snapshot(), host.snapshot()
        want_chunks, _ = await inline.jobs["j1"].host.snapshot()
        for got_chunks, _ in (await first, await second):
            assert [p for p, _ in got_chunks] == [p for p, _ in want_chunks]
            for (_, a), (_, b) in zip(got_chunks, want_chunks):
                x, y = unpack_tensors(a, "got"), unpack_tensors(b, "want")
                assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in y)
        worker = host.process  # type: ignore[attr-defined]
        assert worker.pid != os.getpid() and worker.is_alive()
        limits = Path(f"/proc/{worker.pid}/limits")
        if limits.exists():  # Linux: the worker may not dump core (forbid_core_dumps)
            core = next(line for line in limits.read_text().splitlines() if line.startswith("Max core"))
            assert core.split()[4:6] == ["0", "0"], core
        await call(s, "release", {"job_id": "j1", "reason": "done"})
        for _ in range(100):  # the release stops the worker (closing is asynchronous)
            if not worker.is_alive():
                break
            await asyncio.sleep(0.05)
        assert not worker.is_alive() and "j1" not in s.jobs

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_a_crashing_worker_fails_its_job_and_the_service_goes_on(
    whole_job: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker dies of SIGSEGV in the first step's FP (fault point ``crash``, as an op crashing the
    interpreter would): the step fails naming the signal and the job as the cause; this process lives,
    and the next job runs to the same weights as an in-process run."""

    async def run() -> None:
        _, want = await train(service(sandbox=False), whole_job, 2)
        monkeypatch.setenv(FAULT_ENV, "crash:0")  # read by the service: only the sandboxed one is armed
        s = service(sandbox=True)
        await call(s, "assign", whole_job)
        with pytest.raises(
            ExecutionError, match=r"sandbox worker died \(it was killed by SIGSEGV.*own graph"
        ):
            await call(s, "step", {"job_id": "j1", "step": 0})
        with pytest.raises(ExecutionError, match="SIGSEGV"):  # and every later call of that job
            await call(s, "collect", {"job_id": "j1", "part": "all"})
        await call(s, "release", {"job_id": "j1", "reason": "failed"})
        _, got = await train(s, whole_job, 2)  # the point fired once: this one runs
        assert all(torch.equal(got[k], want[k]) for k in want)
        await call(s, "release", {"job_id": "j1", "reason": "done"})

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_a_job_over_its_memory_budget_is_refused_and_the_next_one_runs(whole_job: dict) -> None:
    """A 1 MiB budget: rebuilding figure3 (a few KB of weights, but torch's allocations) fails inside
    the worker with an error; the service holds nothing of it. With a sane budget the job runs."""

    async def run() -> None:
        tight = service(sandbox=True, memory_gb=1 / 1024)
        doc = {**whole_job}
        with pytest.raises((ExecutionError, JobError)) as refused:
            await train(tight, doc, 1)
        assert "j1" not in tight.jobs or (await _released(tight))
        assert "--sandbox-memory-gb" in str(refused.value)
        roomy = service(sandbox=True, memory_gb=2.0)
        losses, _ = await train(roomy, whole_job, 1)
        assert losses[0] is not None
        await call(roomy, "release", {"job_id": "j1", "reason": "done"})

    asyncio.run(run())


async def _released(s: SubtaskService) -> bool:
    await call(s, "release", {"job_id": "j1", "reason": "over budget"})
    return "j1" not in s.jobs


# ---- the socket between daemon and worker ---------------------------------------------------------
def test_frames_cross_the_socket_as_they_are_and_malformed_ones_are_refused() -> None:
    async def run() -> None:
        a, b = socket.socketpair()
        left, right = IPCChannel(a), IPCChannel(b)
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        frame = TensorFrame("j1", PEERS[0], "act", 2, 1, "linear_1", t)
        header, blobs = frame_message(frame)
        await left.send({"op": "frame", **header}, blobs)
        got_header, got_blobs = await right.recv()
        back = frame_of(got_header, got_blobs)
        assert torch.equal(back.tensor, t) and (back.step, back.microbatch, back.name) == (2, 1, "linear_1")
        for bad, why in (
            ({**got_header, "shape": [5, 4]}, "does not fill"),
            ({**got_header, "dtype": "object"}, "unknown"),
            ({**got_header, "shape": "3x4"}, "list of at most 32"),
            ({**got_header, "kind": "evil"}, "frame fields"),
            ({**got_header, "step": -1}, "step"),
        ):
            with pytest.raises(IPCError, match=why):
                frame_of(bad, got_blobs)
        # a prefix that announces more than the limit is refused before anything is allocated
        a.setblocking(True)
        a.sendall((1 << 30).to_bytes(4, "little") + (0).to_bytes(8, "little"))
        with pytest.raises(IPCError, match="exceeds the limits"):
            await right.recv()
        left.close()
        right.close()

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_releasing_a_job_ends_its_runaway_worker(whole_job: dict) -> None:
    """A worker stuck in a stretch of compute (a 10^4x ``--slowdown``: a step that would take minutes)
    does not read its socket; releasing the job (what the broker's step timeout, a cancel or the
    assignment TTL lead to) kills it within seconds, and its step call fails instead of hanging."""

    async def run() -> None:
        s = service(sandbox=True)
        s.node.settings.slowdown = 1e4
        s.sandboxes.slowdown = 1e4  # type: ignore[union-attr]
        await call(s, "assign", whole_job)
        worker = s.jobs["j1"].host.process  # type: ignore[attr-defined]
        step = asyncio.ensure_future(call(s, "step", {"job_id": "j1", "step": 0}))
        await asyncio.sleep(1.0)  # well inside the first (slowed) stretch
        assert not step.done() and worker.is_alive()
        started = asyncio.get_running_loop().time()
        await call(s, "release", {"job_id": "j1", "reason": "step timed out"})
        with pytest.raises(ExecutionError, match="released"):
            await asyncio.wait_for(step, 15)
        for _ in range(200):
            if not worker.is_alive():
                break
            await asyncio.sleep(0.05)
        assert not worker.is_alive() and asyncio.get_running_loop().time() - started < 15

    asyncio.run(run())


async def _waiting_for(s: Any, call_: asyncio.Future[Any], step: int, deadline: float = 30.0) -> None:
    """Until the call sent ahead waits for ``step`` (the job's event for it exists), with a deadline;
    the call must not have finished meanwhile."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while step not in s.jobs["j1"].ended:
        assert not call_.done(), "the step sent ahead ran (or failed) instead of waiting"
        assert loop.time() < end, f"the step sent ahead did not start waiting for step {step}"
        await asyncio.sleep(0.01)
    assert not call_.done()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sandbox", [True, False])
def test_a_step_sent_ahead_waits_for_the_one_before_it_whatever_the_arrival_order(
    whole_job: dict, sandbox: bool
) -> None:
    """The broker sends step k + 1 while step k runs (``after=k``). Arriving first, it must not take
    the job (its peers still need this compnode's step k: a deadlock): it runs once k is done, and the
    losses are those of steps run one by one; a job released meanwhile fails it instead."""

    async def run() -> None:
        want, _ = await train(service(sandbox=False), whole_job, 3)
        s = service(sandbox=sandbox)
        await call(s, "assign", whole_job)
        ahead = asyncio.ensure_future(call(s, "step", {"job_id": "j1", "step": 1, "after": 0}))
        await _waiting_for(s, ahead, 0)
        first = await call(s, "step", {"job_id": "j1", "step": 0})
        second = await ahead
        third = await call(s, "step", {"job_id": "j1", "step": 2})
        assert [first["loss"], second["loss"], third["loss"]] == want
        stuck = asyncio.ensure_future(call(s, "step", {"job_id": "j1", "step": 4, "after": 3}))
        await _waiting_for(s, stuck, 3)
        await call(s, "release", {"job_id": "j1", "reason": "cancelled"})
        with pytest.raises(JobError, match="released"):
            await asyncio.wait_for(stuck, 10)

    asyncio.run(run())


CRASH = """
import os, signal, sys
if sys.argv[1] == "forbid":
    from fusionnet.core_dumps import forbid_core_dumps
    forbid_core_dumps()
os.kill(os.getpid(), signal.SIGSEGV)
"""


def _crash_in(folder: Path, mode: str) -> list[Path]:
    """A process that dies of SIGSEGV in ``folder``, core limit as high as allowed: the files it left."""
    folder.mkdir()
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    done = subprocess.run(
        [sys.executable, "-c", CRASH, mode],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (hard, hard)),
        timeout=60,
    )
    assert done.returncode == -signal.SIGSEGV
    return list(folder.iterdir())


@pytest.mark.timeout(120)
def test_a_crashing_worker_writes_no_core_dump(tmp_path: Path) -> None:
    """A job that crashes its worker must not leave the worker's memory on the compnode's disk (nor make the
    daemon wait while the kernel writes it). Where this machine would write a core file into the crashing
    process's folder, the same crash without ``forbid_core_dumps`` shows that it does."""
    assert _crash_in(tmp_path / "forbidden", "forbid") == []
    pattern = Path("/proc/sys/kernel/core_pattern")
    plain_files = pattern.exists() and not pattern.read_text().startswith(("|", "/"))
    if plain_files and resource.getrlimit(resource.RLIMIT_CORE)[1] != 0:
        written = _crash_in(tmp_path / "allowed", "allow")
        for path in written:  # hundreds of MB: not left in the test's folder
            path.unlink()
        assert written != []  # the check above can fail here


class _DeadWorker:
    """The ``multiprocessing`` process of a worker that died of SIGSEGV."""

    exitcode = -signal.SIGSEGV
    pid = 0

    def join(self, timeout: float | None = None) -> None:
        return None

    def kill(self) -> None:
        raise AssertionError("a dead worker is not killed")


@pytest.mark.timeout(60)
def test_a_worker_dying_with_our_messages_unread_fails_its_calls() -> None:
    """A worker that dies with messages of the daemon unread in its socket (a step sent ahead, a peer's
    activations: timing decides) resets the socket instead of closing it. The daemon must see that death
    as it sees a clean end: every pending call fails naming the signal, none waits forever (a CI run once
    waited for the job's whole timeout)."""

    async def run() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        job = SandboxedJob(SandboxPool(None, 1.0, None, None), PEERS[0], "j1", 1, send=_no_send)
        job.process, job.channel = _DeadWorker(), IPCChannel(ours)
        _, pending = job._queue("step", {"step": 0})
        for _ in range(200):  # the call reached the worker's socket, unread
            await asyncio.sleep(0.01)
            if len(theirs.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)) > 0:
                break
        theirs.close()  # the worker's end goes with unread data in it: a reset
        job._reader = asyncio.ensure_future(job._read())
        with pytest.raises(ExecutionError, match=r"sandbox worker died \(it was killed by SIGSEGV"):
            await asyncio.wait_for(pending, 10)
        with pytest.raises(ExecutionError, match="SIGSEGV"):  # and every later call
            await asyncio.wait_for(job.collect("all", 0), 10)

    asyncio.run(run())


async def _no_send(dst: int, frame: TensorFrame) -> None:
    raise AssertionError("nothing is sent")
