"""A job's calls to its compnodes, typed: assign, step, collect, release and link probes, all at once
(assignments: each slice staged, then its compnode set up while the next is staged).

Every call names the compnode and the method when it fails (``compnode <peer> (step): ...``), and a
batch of calls ends at the first failure with the rest cancelled (their compnodes get a release when
the job re-plans). Timeouts are per method: a step may run for minutes on a slow compnode.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fusionnet.errors import DeviceMemoryError, FusionNetError
from fusionnet.messages.compnode_rpc import (
    AssignReply,
    AssignRequest,
    CollectReply,
    CompnodeClient,
    JobRequest,
    ProbeLinksRequest,
    ReleaseRequest,
    ReplicaChunk,
    ReplicaRequest,
    ReplicasReply,
    StageStateRequest,
    StepReply,
    StepRequest,
)
from fusionnet.results.slice_stream import SliceStream
from fusionnet.rpc.windows import gather

if TYPE_CHECKING:
    from fusionnet.broker.assignment_payloads import PreparedAssignment

log = logging.getLogger("fusionnet.broker.jobs")

ASSIGN_TIMEOUT = 120.0
STEP_TIMEOUT = 600.0
RELEASE_TIMEOUT = 5.0
PROBE_TIMEOUT = 10.0  # ``replicas``: a listing of a few files
# Assign calls in flight while the next slices are staged (``stage_and_assign``): a slice under
# ``--stage-part-mb`` rides in its assign request, so this bounds what the broker holds.
ASSIGN_WINDOW = 4

T = TypeVar("T")


class JobCalls:
    def __init__(self, client: CompnodeClient, job_id: str) -> None:
        self.client = client
        self.job_id = job_id
        self.assigned: dict[int, AssignReply] = {}  # the last ``assign`` reply of each sub-DAG

    async def assign(self, peers: Sequence[str], requests: Sequence[AssignRequest]) -> None:
        """Sub-DAG ``i`` (``requests[i]``) to ``peers[i]``; the replies are kept (``assigned``)."""
        replies = await gather(
            [
                self.named_call(p, "assign", self.client.call_assign(p, r, timeout=ASSIGN_TIMEOUT))
                for p, r in zip(peers, requests, strict=True)
            ]
        )
        for reply in replies:
            if isinstance(reply, AssignReply):  # (a test's stand-in client may answer nothing)
                self.assigned[reply.subdag] = reply

    async def stage_and_assign(
        self,
        peers: Sequence[str],
        prepare: Callable[[], Awaitable[PreparedAssignment]],
        part_bytes: int,
        window: int = ASSIGN_WINDOW,
    ) -> None:
        """Sub-DAG ``i`` to ``peers[i]``: its slice staged (``prepare``: the next sub-DAG's, read from disk
        as it is needed), then its ``assign``. A compnode's assign (its worker started, the slice unpacked
        and loaded: seconds at 100M parameters) runs while the next slices are staged to the others, at
        most ``window`` at once; a compnode holding several sub-DAGs gets them in order. The first
        failure cancels the assigns in flight and is raised before the next slice is staged."""
        assigning: list[tuple[str, asyncio.Task[None]]] = []
        self.assigned.clear()  # this round's replies only
        try:
            for peer in peers:
                for other, task in assigning:
                    if other == peer:
                        await task
                while sum(not task.done() for _, task in assigning) >= window:
                    running = [task for _, task in assigning if not task.done()]
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for _, task in assigning:
                    if task.done():
                        task.result()
                prepared = await prepare()
                for kind, stream in prepared.staged.items():  # a large slice goes ahead in parts
                    await self.stage(peer, prepared.request, kind, stream, part_bytes)
                assigning.append((peer, asyncio.ensure_future(self.assign([peer], [prepared.request]))))
                del prepared
            await asyncio.gather(*(task for _, task in assigning))
        except BaseException:
            for _, task in assigning:
                task.cancel()
            await asyncio.gather(*(task for _, task in assigning), return_exceptions=True)
            raise

    async def stage(
        self, peer: str, request: AssignRequest, kind: str, stream: SliceStream, part_bytes: int
    ) -> None:
        """Sends ``stream`` (the ``kind`` slice ``request`` names by size) to ``peer`` part by part, each
        read from disk in a thread just before it goes (``results.slice_stream``)."""
        parts = stream.parts(part_bytes)
        offset = 0
        while (data := await asyncio.to_thread(next, parts, None)) is not None:
            part = StageStateRequest(
                job_id=self.job_id,
                attempt=request.attempt,
                subdag=request.subdag,
                kind=kind,  # type: ignore[arg-type]  # "state" | "optim", from ``PreparedAssignment``
                offset=offset,
                total=stream.total,
                data=data,
            )
            del data
            await self.named_call(
                peer, "stage_state", self.client.call_stage_state(peer, part, timeout=ASSIGN_TIMEOUT)
            )
            offset += len(part.data)
            del part
        if offset != stream.total:
            raise FusionNetError(
                f"staging {kind} of sub-DAG {request.subdag}: {offset} of {stream.total} bytes"
            )

    async def step(
        self,
        peers: Sequence[str],
        step: int,
        *,
        timeout: float,
        snapshot: bool = False,
        keep_from: int | None = None,
        after: int | None = None,
        paces: Sequence[float | None] | None = None,
    ) -> list[StepReply]:
        """One step on every peer; ``timeout`` scales with the step's expected length (a busy compnode
        is not a dead one: ``failures.step_timeout``). ``snapshot``/``keep_from``/``paces`` (per peer,
        its snapshot's bytes/s): ``broker.replicas``; ``after``: a step sent ahead runs once that one is
        done."""
        request = StepRequest(
            job_id=self.job_id, step=step, snapshot=snapshot, keep_from=keep_from, after=after
        )
        requests = [
            request
            if paces is None or paces[i] is None
            else request.model_copy(update={"replica_pace": paces[i]})
            for i in range(len(peers))
        ]
        if len(set(peers)) < len(peers):  # compnodes holding several sub-DAGs: each call names its own
            requests = [r.model_copy(update={"subdag": i}) for i, r in enumerate(requests)]
        return await gather(
            [
                self.named_call(p, "step", self.client.call_step(p, r, timeout=timeout))
                for p, r in zip(peers, requests)
            ]
        )

    async def collect(
        self, peers: Sequence[str], part: str = "all", chunk: int = 0, subdags: Sequence[int] | None = None
    ) -> list[CollectReply]:
        """``part``: "state" or "optim" alone (``JobRequest.part``), ``chunk`` of it; ``subdags``: which
        sub-DAG of each peer (needed where a compnode holds several: interleaved chunks)."""
        which = [None] * len(peers) if subdags is None else list(subdags)
        requests = [JobRequest(job_id=self.job_id, part=part, chunk=chunk, subdag=s) for s in which]
        return await gather(
            [
                self.named_call(p, "collect", self.client.call_collect(p, r, timeout=ASSIGN_TIMEOUT))
                for p, r in zip(peers, requests, strict=True)
            ]
        )

    async def replicas(self, peer: str) -> ReplicasReply:
        """Which snapshots of the job ``peer`` keeps (``broker.replicas``)."""
        request = JobRequest(job_id=self.job_id)
        return await self.named_call(
            peer, "replicas", self.client.call_replicas(peer, request, timeout=PROBE_TIMEOUT)
        )

    async def fetch_replica(
        self, peer: str, subdag: int, step: int, chunk: int, offset: int = 0
    ) -> ReplicaChunk:
        request = ReplicaRequest(job_id=self.job_id, subdag=subdag, step=step, chunk=chunk, offset=offset)
        call = self.client.call_fetch_replica(peer, request, timeout=ASSIGN_TIMEOUT)
        return await self.named_call(peer, "fetch_replica", call)

    async def collect_parts(self, subdag: int, peer: str) -> AsyncIterator[tuple[str, bytes, bool]]:
        """A sub-DAG's state, then its optimizer state, each a safetensors file in byte ranges (the
        compnode says how many): every answer under the message bound however big the sub-DAG or any
        one tensor of it. Yields ``(part, bytes, ends_file)`` (``replicas.Parts``)."""
        for part in ("state", "optim"):
            chunk, chunks = 0, 1
            while chunk < chunks:
                (r,) = await self.collect([peer], part, chunk, [subdag])
                chunks = r.chunks
                data = r.state if part == "state" else r.optim
                if data is None and chunk == 0:  # nothing of this part (no optimizer state)
                    break
                if data is None:
                    raise FusionNetError(f"compnode {peer} (collect): chunk {chunk} of {part} is empty")
                yield part, data, chunk == chunks - 1
                chunk += 1

    async def release(self, peers: Sequence[str], why: str) -> None:
        """Best effort: a compnode that does not answer has forgotten the job or is gone."""
        request = ReleaseRequest(job_id=self.job_id, reason=why)
        results = await asyncio.gather(
            *(self.client.call_release(p, request, timeout=RELEASE_TIMEOUT) for p in peers),
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                log.debug("job %s: release: %s", self.job_id, r)

    async def probe(self, peer: str, method: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The untyped call ``links.probe_placement`` makes, served by the typed ``call_probe_links``."""
        assert method == "probe_links", method
        request = ProbeLinksRequest.model_validate(payload)
        call = self.client.call_probe_links(peer, request, timeout=timeout)
        reply = await self.named_call(peer, method, call)
        return reply.model_dump()

    @staticmethod
    async def named_call(peer: str, method: str, call: Awaitable[T]) -> T:
        """``call`` to ``peer``, its error naming the compnode and method (a device OOM also by ``peer``)."""
        try:
            return await call
        except DeviceMemoryError as e:  # named by peer: the broker places the job again without it
            raise DeviceMemoryError(f"compnode {peer} ({method}): {e}", peer=peer) from e
        except FusionNetError as e:
            raise type(e)(f"compnode {peer} ({method}): {e}") from e
