"""Failover checkpoints that never pass through the broker: each sub-DAG's state is replicated to
another compnode of the job (``compnode.replicas``), and the broker only keeps the books.

- ``ReplicaBook``: which snapshot the broker asks for next and which one is complete. One round in
  flight: a snapshot is asked for (``snapshot`` in a ``step`` request) when every sub-DAG confirmed the
  last one, so a slow link makes rounds sparser instead of piling snapshots up, and every sub-DAG has
  snapshots of the same steps. ``committed`` (every sub-DAG's replica of that step is kept) goes out
  as ``keep_from``: older snapshots may be deleted.
- ``ring_holders``: sub-DAG ``i``'s replica lives with sub-DAG ``i + 1`` (mod n): one lost compnode
  always leaves its snapshot with its successor and the others' on their own disks.
- ``best_step``: after a failure, the newest step that every sub-DAG has a snapshot of on a live
  compnode (``replicas`` answers); the broker fetches those, one sub-DAG at a time, into a checkpoint on
  its disk and replays from there.
- ``checkpoint_from_replicas`` / ``assemble_checkpoint``: those snapshots (or, for the results and
  hand-overs, the compnodes' live state) into a checkpoint on the broker's disk, part by part.
- ``ReplicaPointer``: what a restarted broker needs to find them again (``replicas.json``: attempt,
  peers, committed step, how many rows of its ``step_rows`` file are its metrics rows), a few hundred bytes
  whatever the model's size and the job's length.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fusionnet.broker.checkpoints import Checkpoint, JobFiles
from fusionnet.broker.churn import young_interval
from fusionnet.broker.job_calls import JobCalls
from fusionnet.broker.tensorfiles import StreamedFile, TensorFiles
from fusionnet.errors import FusionNetError
from fusionnet.messages.blobs import pack_tensors
from fusionnet.rpc.windows import in_window

log = logging.getLogger("fusionnet.broker.jobs")

# A round that never completed (a snapshot lost on its way) is asked for again after this many steps,
# and no sooner than ``--replica-interval`` seconds, doubled at each retry of the same round: with
# steps of tens of milliseconds, a round that merely took longer than 4 steps was asked for again
# and again, each new snapshot queued behind the last, and replication took the CPU from the steps.
ROUND_RETRY = 4
# A round's snapshots share the links with the activations: after a round that took k steps to
# complete, the next is asked for only (PACE - 1) * k steps later, so replication holds the links for
# at most about 1 / PACE of the steps (every PACE-th step on a fast link; sparser on a slow one) and a
# failover replays at most a few steps more.
PACE = 3
# Sub-DAGs whose state the broker collects at once (``assemble_checkpoint``): each holds one answer
# (a compnode's ``COLLECT_CHUNK_BYTES``, 32 MiB) in the broker's memory while it is written.
COLLECT_WINDOW = 4
# And a round starts at most every this many seconds (the broker's ``--replica-interval``): with steps
# of tens of milliseconds, a round every PACE steps made a third of the steps 2-3x slower (measured in
# ``benchmarks/pipeline_vs_torch.py``); a failover replays at most this long of steps more.
REPLICA_INTERVAL = 2.0
# And a snapshot may take at most this share of its link's measured bandwidth (``StepRequest.replica_pace``,
# paced by TCP on the compnode): at full rate, a round filled a shaped link's queue, and every activation
# frame of the steps it spanned waited behind it (100 Mbit/s: +60 % step time in ``benchmarks/links.py``).
REPLICA_LINK_SHARE = 0.25
# And rounds cost at most about this share of the job's time: a round's cost is what the steps it spanned
# took beyond the clean steps' median (a snapshot's copies, chunks and writes take the cores the stages
# compute on), and the next round starts no sooner than cost / share after the last one started. At a
# realistic size (50M parameters, 0.6 s steps, 3 stages on 2 cores) a round cost 0.5-1.2 s, and one
# every 2 s slowed every third step 2-3x: the pipeline benchmark's median step was 1.45x the one
# without replication. A failover then replays up to cost / share seconds of steps more. Where the
# job's compnodes fail rarely, Young's interval (``churn``) spaces rounds farther still.
REPLICA_TIME_SHARE = 0.1
# Clean steps (no round in flight) whose median is the cost's baseline.
BASELINE_STEPS = 9


def ring_holders(n: int) -> list[int] | None:
    """Sub-DAG -> the sub-DAG whose compnode keeps its replica; None with a single sub-DAG (the broker
    then collects the checkpoint itself)."""
    return [(i + 1) % n for i in range(n)] if n >= 2 else None


def replicas_apart(peers: Sequence[str]) -> bool:
    """Whether every sub-DAG's ring holder (``ring_holders``) is on another compnode than the sub-DAG
    (``peers[i]`` runs sub-DAG i): a copy on its own compnode dies with it."""
    holders = ring_holders(len(peers))
    return holders is not None and all(peers[i] != peers[h] for i, h in enumerate(holders))


class ReplicaBook:
    def __init__(
        self,
        interval: float = REPLICA_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        mtbf: Callable[[], float | None] = lambda: None,
    ) -> None:
        """``mtbf()``: seconds between unplanned losses of the job's compnodes now (``churn``); None:
        rounds are spaced by ``interval`` and ``REPLICA_TIME_SHARE`` only."""
        self.interval, self.clock, self.mtbf = interval, clock, mtbf
        self.reset(0, enabled=False)

    def reset(self, n: int, *, enabled: bool) -> None:
        """A new placement of ``n`` sub-DAGs: nothing of it is replicated yet."""
        self.n, self.enabled = n, enabled and n >= 2
        self.round: int | None = None  # the snapshot step asked for and not yet confirmed by all
        self.asked_at = 0
        self.committed: int | None = None
        self.reported: dict[int, int] = {}
        self.next_at = 0  # the first step a new round may be asked at (``PACE``)
        self.started: float | None = None  # when the last round was asked for (``interval``)
        self.retries = 0  # of the round in flight (``ROUND_RETRY``)
        self.clean: deque[float] = deque(maxlen=BASELINE_STEPS)  # seconds of steps without a round
        self.spanned: list[float] = []  # seconds of the steps the round in flight has spanned so far
        self.not_before: float | None = None  # the clock's earliest next round (``REPLICA_TIME_SHARE``)

    def holders(self) -> list[int] | None:
        return ring_holders(self.n) if self.enabled else None

    def request(self, step: int) -> tuple[bool, int | None]:
        """(take a snapshot after ``step``, keep_from) for the ``step`` request."""
        if not self.enabled:
            return False, None
        now = self.clock()
        waited = None if self.started is None else now - self.started
        if self.round is None:
            if step < self.next_at or (waited is not None and waited < self.interval):
                return False, self.committed
            if self.not_before is None:  # the last round completed before any clean step: price it now
                self.not_before = self._budgeted_start()
            if self.not_before is not None and now < self.not_before:
                return False, self.committed
            self.retries, self.spanned = 0, []
        elif step - self.asked_at < ROUND_RETRY or (waited or 0.0) < self.interval * 2**self.retries:
            return False, self.committed
        else:
            self.retries += 1
        self.round, self.asked_at, self.started = step + 1, step, now
        return True, self.committed

    def observe(
        self, replicated: Sequence[int | None], step: int | None = None, seconds: float | None = None
    ) -> bool:
        """The sub-DAGs' latest confirmed snapshots from the replies of ``step``, which took ``seconds``;
        True when a round completed (the next one then waits ``PACE`` and its cost's budget)."""
        if seconds is not None:
            (self.clean if self.round is None else self.spanned).append(seconds)
        for i, r in enumerate(replicated):
            if r is not None:
                self.reported[i] = max(self.reported.get(i, r), r)
        if self.round is None or len(self.reported) < self.n:
            return False
        done = min(self.reported.values())
        if done < self.round and (self.committed is None or done <= self.committed):
            return False
        self.committed = done
        if done >= self.round:
            at = self.round if step is None else step
            span = max(1, at - self.asked_at)  # steps the round held the links
            self.round, self.next_at = None, at + (PACE - 1) * span
            self.not_before = self._budgeted_start()
        return True

    def _budgeted_start(self) -> float | None:
        """When the round just completed has been paid for: its start plus the longer of its cost /
        ``REPLICA_TIME_SHARE`` and Young's interval for its cost and the job's ``mtbf``. None before
        any clean step (the job's first round, asked at once): ``request`` asks again once there is one.
        That first round's span holds the first steps, slower than the rest (buffers allocated, caches
        cold): its price errs long, which at worst delays the second round, not a step."""
        if not self.clean or not self.spanned or self.started is None:
            return None
        cost = round_cost(self.spanned, statistics.median(self.clean))
        wait = cost / REPLICA_TIME_SHARE
        mtbf = self.mtbf()
        if mtbf is not None:
            wait = max(wait, young_interval(cost, mtbf))
        return self.started + wait

    def pointer(self, attempt: int, peers: Sequence[str], rows: Sequence[dict[str, Any]]) -> ReplicaPointer:
        """The committed step as a restarted broker finds it again."""
        assert self.committed is not None
        kept = [r for r in rows if r["step"] < self.committed]
        return ReplicaPointer(attempt, list(peers), self.committed, kept)


def round_cost(spanned: Sequence[float], baseline: float) -> float:
    """Seconds a replication round added to the steps it spanned, against a clean step's ``baseline``."""
    return sum(max(0.0, s - baseline) for s in spanned)


def best_step(
    held: Mapping[str, Mapping[int, Sequence[int]]], n: int, after: int
) -> tuple[int, list[str]] | None:
    """The newest step > ``after`` that each of the ``n`` sub-DAGs has a snapshot of on some peer of
    ``held`` (peer -> sub-DAG -> steps), with the peer to fetch each from (its own compnode first)."""
    steps = sorted({s for by in held.values() for ss in by.values() for s in ss if s > after}, reverse=True)
    for step in steps:
        sources = []
        for i in range(n):
            have = [p for p, by in held.items() if step in by.get(i, ())]
            if not have:
                break
            sources.append(have[0])
        else:
            return step, sources
    return None


@dataclass
class ReplicaPointer:
    attempt: int
    peers: list[str]
    step: int  # committed: every sub-DAG has a replica of the state before this step
    metrics: list[dict[str, Any]] = field(default_factory=list)  # rows of the steps before ``step``

    @staticmethod
    def path(folder: Path) -> Path:
        return folder / "replicas.json"

    def save(self, files: JobFiles) -> None:
        """``replicas.json``, its rows appended to their own file first (``step_rows``)."""
        path = self.path(files.folder)
        files.folder.mkdir(parents=True, exist_ok=True)
        doc = {"attempt": self.attempt, "peers": self.peers, "step": self.step}
        doc["rows"] = files.replica_rows.sync(self.metrics)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        files.replica_rows.prune()

    @classmethod
    def load(cls, files: JobFiles) -> ReplicaPointer | None:
        try:
            doc = json.loads(cls.path(files.folder).read_text())
            # rows in a file of their own (``step_rows``); in the document itself before that
            rows = files.replica_rows.load(doc["rows"]) if "rows" in doc else list(doc["metrics"])
            return cls(int(doc["attempt"]), [str(p) for p in doc["peers"]], int(doc["step"]), rows)
        except (OSError, ValueError, KeyError, TypeError):
            return None


# (sub-DAG, peer) -> pieces (part, bytes, ends_file): consecutive byte ranges of safetensors files, each
# file ending with the piece that says so (a replica chunk is a whole file; a collect answer a range).
Parts = Callable[[int, str], AsyncIterator[tuple[str, bytes, bool]]]


async def assemble_checkpoint(
    files: JobFiles, step: int, last: Checkpoint, sources: Sequence[str], parts: Parts, prefix: str
) -> Checkpoint:
    """The checkpoint before ``step`` from each sub-DAG's blobs (sub-DAG ``i`` from ``sources[i]``),
    written to disk as they come: the broker holds one blob (at most a sub-DAG's state) per sub-DAG in
    flight, never the model. Up to ``COLLECT_WINDOW`` sub-DAGs come at once: each answer is a request and
    a reply through its compnode's daemon and worker, so one compnode at a time left the broker's link
    idle while each prepared its next part. Tensors no sub-DAG holds keep their value from ``last``; a
    tensor two sub-DAGs hold is the later sub-DAG's, as when they came one after the other. Metrics: the
    caller's."""
    state = last.state if isinstance(last.state, TensorFiles) else None
    if state is None:  # an in-memory state (tests): on disk first, like the submission
        blob = await asyncio.to_thread(pack_tensors, last.state)
        state = await asyncio.to_thread(files.write_part, step, "base-state", blob, "state")

    async def one(source: tuple[int, str]) -> dict[str, list[TensorFiles]]:
        return await _fetch_subdag(files, step, *source, parts, prefix)

    fetched = await in_window(one, enumerate(sources), COLLECT_WINDOW)
    optim = TensorFiles()
    for got in fetched:  # in sub-DAG order
        for written in got["state"]:
            state = state.merged(written)
        for written in got["optim"]:
            optim = optim.merged(written)
    return Checkpoint(step, state, optim, [])


async def _fetch_subdag(
    files: JobFiles, step: int, i: int, peer: str, parts: Parts, prefix: str
) -> dict[str, list[TensorFiles]]:
    """Sub-DAG ``i``'s files from ``peer``, each written as its parts come (a file cut short is
    abandoned)."""
    out: dict[str, list[TensorFiles]] = {"state": [], "optim": []}
    k = 0
    current: StreamedFile | None = None
    try:
        async for part, data, ends_file in parts(i, peer):
            if current is None:
                current = files.streamed_part(step, f"{prefix}-s{i:03d}-{part}-{k:05d}")
            await asyncio.to_thread(current.append, data)
            del data
            if not ends_file:
                continue
            what = f"{'state' if part == 'state' else 'optimizer state'} of sub-DAG {i} from {peer}"
            written = await asyncio.to_thread(current.finish, what)
            current, k = None, k + 1
            out["state" if part == "state" else "optim"].append(written)
    finally:
        if current is not None:  # the peer failed in the middle of a file
            current.abandon()
    return out


async def checkpoint_from_replicas(
    calls: JobCalls, files: JobFiles, live: Sequence[str], n: int, last: Checkpoint, attempt: int
) -> Checkpoint | None:
    """After a failure (or a broker restart): the newest checkpoint after ``last`` that the snapshots on
    the ``live`` compnodes make up for all ``n`` sub-DAGs, fetched to the broker's disk chunk by chunk;
    None when they hold none (the caller goes on from ``last``). Metrics: the caller's."""
    held: dict[str, dict[int, list[int]]] = {}
    for peer in dict.fromkeys(live):  # a compnode of several sub-DAGs (interleaved chunks) is asked once
        try:
            reply = await calls.replicas(peer)
        except FusionNetError as e:  # gone too, or never held the job: not a source
            log.info("job %s: no snapshots from %s: %s", calls.job_id, peer, e)
            continue
        held[peer] = {int(k): list(v) for k, v in reply.held.items()}
    found = best_step(held, n, last.step)
    if found is None:
        return None
    step, sources = found

    async def parts(i: int, peer: str) -> AsyncIterator[tuple[str, bytes, bool]]:
        """Each snapshot chunk (a safetensors file on the holder) in byte ranges of bounded size."""
        chunk, count = 0, 1
        while chunk < count:
            offset = 0
            while True:
                reply = await calls.fetch_replica(peer, i, step, chunk, offset)
                count = reply.chunks
                size = len(reply.blob) if reply.size is None else reply.size
                offset += len(reply.blob)
                if offset < size and not reply.blob:
                    raise FusionNetError(f"{peer}: snapshot chunk {chunk} of sub-DAG {i} stops at {offset}")
                yield reply.part, reply.blob, offset >= size
                if offset >= size:
                    break
            chunk += 1

    return await assemble_checkpoint(files, step, last, sources, parts, f"r{attempt}")


async def recovered_checkpoint(
    calls: JobCalls,
    files: JobFiles,
    live: Sequence[str],
    n: int,
    last: Checkpoint,
    attempt: int,
    rows: Sequence[dict[str, Any]],
) -> Checkpoint | None:
    """``checkpoint_from_replicas`` with the metrics rows before its step, made the job's current
    checkpoint on disk; None (go on from ``last``) when there is none or a source died meanwhile."""
    try:
        got = await checkpoint_from_replicas(calls, files, live, n, last, attempt)
    except FusionNetError as e:  # one more compnode gone while we fetched: the older checkpoint
        log.warning("job %s: replicas not fetched (%s); going on from step %d", calls.job_id, e, last.step)
        return None
    if got is None:
        return None
    ckpt = replace(got, metrics=[r for r in rows if r["step"] < got.step])
    await asyncio.to_thread(files.save_checkpoint, ckpt, attempt)
    log.info("job %s: checkpoint before step %d from the compnodes' replicas", calls.job_id, ckpt.step)
    return ckpt


async def resumed_from_replicas(
    calls: JobCalls, files: JobFiles, ckpt: Checkpoint, attempt: int
) -> tuple[Checkpoint, int, bool]:
    """A restarted broker's checkpoint: the replicas its ``ReplicaPointer`` names when they are newer
    than ``ckpt`` and still there. Returns (checkpoint, attempt, whether a pointer was found)."""
    pointer = ReplicaPointer.load(files)
    if pointer is None or pointer.step <= ckpt.step:
        return ckpt, attempt, pointer is not None
    attempt = max(attempt, pointer.attempt)
    n, rows = len(pointer.peers), pointer.metrics
    got = await recovered_checkpoint(calls, files, pointer.peers, n, ckpt, attempt, rows)
    return (ckpt if got is None else got), attempt, True
