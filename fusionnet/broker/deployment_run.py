"""One deployment on the broker (issue 14): a long-lived ``infer`` placement whose steps are request batches.

It is a ``JobRun`` with another main loop: place and assign the sub-DAGs exactly as for a job (the
scheduler, ``assign``, link probes), then, instead of stepping through a dataset, stay resident and run
whatever batches the HTTP API's batcher hands over (``run_batch``), each a ``serve_step`` on every
compnode of the placement, with up to ``in_flight`` batches in the pipeline. ``undeploy`` (or the broker
stopping) ends it and releases the compnodes.

Rows of a batch are cut into micro-batches of the traced example's size (the IR's placeholder shape: a
``torch.export`` graph knows no other), the last one padded with copies of its last row; padded rows'
outputs are dropped.

Failover: a batch that fails because a compnode died (``PeerFailure`` from the ``FailureWatch``), or for
any other reason, makes the deployment re-place itself (replacement from the backup pool and the other
free compnodes, every sub-DAG assigned again) and runs the batch again. Batches are stateless (full
forward passes), so the retried batch gives the same outputs; a generation session continues with the
same tokens. A batch on which an op of the model raised (``ComputeError``: the rows are at fault) is
not run again as a whole: it fails with ``RowsFailed`` and the batcher runs its requests one by one, so
only the request that brought the bad rows gets the error.

A placement that cannot be made (every compnode gone, no backup left) does not end the deployment: the
batches of that moment fail (HTTP 503), and so does each later batch at once, with the reason, while
the deployment tries to place itself afresh at most once per ``REPLACE_EVERY`` seconds, as batches come.
Compnodes that join (or come back) take it up again; until then nothing waits out a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from functools import partial
from pathlib import Path

import torch

from fusionnet.broker import replanning
from fusionnet.broker.assignment_payloads import KEY_BYTES
from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.broker.context import JobContext
from fusionnet.broker.failures import PeerFailure
from fusionnet.broker.job_calls import JobCalls
from fusionnet.broker.jobrun import JobRun
from fusionnet.broker.serve_links import ServeLink, ServeLinks
from fusionnet.broker.store import JobState
from fusionnet.broker.submission import SubmittedJob
from fusionnet.errors import ComputeError, ExecutionError, FusionNetError
from fusionnet.messages.blobs import pack_tensors, unpack_tensors
from fusionnet.messages.serving_rpc import ServeStepReply, ServeStepRequest, ServingClient
from fusionnet.results.assemble import join_outputs
from fusionnet.rpc.windows import gather
from fusionnet.serving.answers import Answer, RowAnswers, RowsFailed
from fusionnet.serving.kv_sessions import CacheLost, StaleRows

log = logging.getLogger("fusionnet.broker.deployments")

BATCH_TIMEOUT = 120.0  # one batch's calls; a hung pipeline ends in a failover, never a hung request
BATCH_ATTEMPTS = 3  # placements a batch is tried on before its requests get an error
REPLACE_EVERY = 1.0  # seconds between two tries to place a deployment no placement could be made for


class DeploymentRun(JobRun):
    def __init__(
        self,
        context: JobContext,
        job: SubmittedJob,
        folder: Path,
        serving: ServingClient,
        *,
        cached: bool = False,
    ) -> None:
        super().__init__(context, job, folder)
        self.serving = serving
        # KV caches on the compnodes (``serving.kv_sessions``): rows carry the placement ("epoch") their
        # session's cache was built on, and a batch never moves to another placement (its caches are not
        # there): it fails with ``CacheLost`` and its sessions replay.
        self.cached = cached
        self.placed = asyncio.Event()  # set while a placement is assigned and takes batches
        self.stopping = asyncio.Event()
        self.failed: str | None = None
        self.abandoned: str | None = None  # why ``deploy`` gave up on it before it was placed
        self.batches = 0
        self.batch_seconds = 0.0  # wall time of the batches served, summed
        self.batch_rows = 0  # rows of the batches served (before padding to micro-batches), summed
        self.stage_seconds: list[float] = []  # per sub-DAG: FP seconds of the batches served, summed
        self._next_step = 0  # per placement: compnodes run batches in this order
        self._replacing = asyncio.Lock()
        self.unplaced: FusionNetError | None = None  # why the last placement could not be made
        self._unplaced_at = 0.0  # when it was tried
        meta = job.graph.node(self._input_placeholder()).meta
        self.mb_rows = int(meta["shape"][0])  # the traced example micro-batch
        self.row_shape = tuple(int(d) for d in meta["shape"][1:])
        self.row_dtype = getattr(torch, meta["dtype"])
        self._readers: set[int] = set()  # sub-DAG indices whose placeholders read the inputs
        # Batches straight to the compnodes' workers over the data path (``serve_links``): the keys of
        # the broker's links to this placement's sub-DAGs, and the links.
        self._keys: list[bytes] | None = None
        self.links = ServeLinks()

    def _input_placeholder(self) -> str:
        names = [n.name for n in self.job.graph.nodes if n.kind == "placeholder" and n.target == "inputs"]
        if len(names) != 1:
            raise ExecutionError("a deployed model must read exactly one input tensor 'inputs'")
        return names[0]

    @property
    def predicted_step(self) -> float | None:
        """The performance model's seconds for one full batch (``batch_size`` rows) on this placement."""
        return None if self._placement is None else self._placement.predicted_step

    def model_figures(self) -> dict[str, object] | None:
        """What the performance model says about this placement's batches, for ``status`` and
        ``perfmodel.generation_rate``: per sub-DAG C_p (refined by the compnodes' measured speed, as
        the batches go) and R_p per micro-batch of ``microbatch_rows`` rows, and the broker's measured
        call round trip to the pipeline's ends (its heartbeat RTTs to the first and the last compnode:
        the path every batch's call and answer take). None before a placement, or when the
        compnodes' hardware is not known."""
        placement = self._placement
        if placement is None or placement.stage_timing is None or not self.peers:
            return None
        # C_p as planned, scaled by how fast each compnode has since been measured to run
        fp = [
            placement.stage_timing[i][0] * self.ctx.speeds.slowness(peer) / self._planned_slowness[i]
            for i, peer in enumerate(self.peers)
        ]
        rtts = [self.ctx.registry.get(p) for p in (self.peers[0], self.peers[-1])]
        known = [e.rtt for e in rtts if e is not None and e.rtt is not None]
        return {
            "microbatch_rows": self.mb_rows,
            "stage_fp_seconds": fp,
            "stage_comm_seconds": [placement.stage_timing[i][1] for i in range(len(self.peers))],
            "call_seconds": sum(known) / len(known) if known else 0.0,
        }

    # ---- lifetime --------------------------------------------------------------------------------
    async def run(self) -> None:
        job, store = self.job, self.ctx.store
        try:
            store.update_job(job.job_id, state=JobState.PLANNING)
            await self._place(replanning.FIRST)
            store.update_job(job.job_id, state=JobState.RUNNING)
            await self.stopping.wait()
            if self.abandoned is not None:
                self._fail(self.abandoned)
            else:
                self._end(JobState.SUCCEEDED, step=self.batches)
        except asyncio.CancelledError:
            if self.abandoned is not None:  # deploy's own time limit, not the broker stopping
                self._fail(self.abandoned)
            else:
                self._end(JobState.CANCELLED, error="the broker stopped")
            raise
        except FusionNetError as e:
            self.failed = str(e)
            self._fail(str(e))
        except Exception as e:
            log.exception("deployment %s: internal error", job.spec.name)
            self.failed = f"internal error: {type(e).__name__}: {e}"
            self._fail(self.failed)
        finally:
            self.placed.clear()
            self.watch.detach()
            await self.links.replace({})
            await self._release_all("undeployed")
            self._update_job_gauges()

    def _end(self, state: JobState, *, step: int | None = None, error: str | None = None) -> None:
        if not self._ended_already():
            self.ctx.store.update_job(self.job.job_id, state=state, step=step, error=error)

    def _fail(self, reason: str, error: BaseException | None = None) -> None:
        if not self._ended_already():
            super()._fail(reason, error)

    def _ended_already(self) -> bool:
        """Whether something else ended the row first: it then keeps that state. Raising instead would
        fail the ``undeploy`` that has just removed the deployment (``cancel_job`` ended live deployment
        rows once; it refuses them now, and this keeps any other such path harmless)."""
        current = self.ctx.store.get_job(self.job.job_id)["state"]
        if JobState(current).terminal:
            log.info("deployment %s: its job row is %s already; kept", self.job.spec.name, current)
        return JobState(current).terminal

    def _checkpoint(self) -> Checkpoint:
        return Checkpoint(0, self.job.state, {}, [])

    def _serve_keys(self) -> list[bytes] | None:
        """Fresh keys of the broker's links to this placement's sub-DAGs (none with ``--serve-path
        rpc``): frames of an earlier placement no longer authenticate."""
        direct = self.ctx.settings.serve_path == "direct"
        self._keys = [secrets.token_bytes(KEY_BYTES) for _ in self.peers] if direct else None
        return self._keys

    async def _link_up(self) -> None:
        """The links to the sub-DAGs whose compnodes said their workers serve batches themselves."""
        links: dict[int, ServeLink] = {}
        keys, encryption = self._keys, self.job.spec.wire_encryption
        for i, peer in enumerate(self.peers if keys is not None else ()):
            reply, entry = self.calls.assigned.get(i), self.ctx.registry.get(peer)
            address = None if entry is None else entry.record.data_path_address
            if keys is not None and reply is not None and reply.serves_direct and address:
                links[i] = ServeLink(
                    self.ctx.broker_id(), self.job.job_id, peer, address, keys[i], encryption
                )
        await self.links.replace(links)
        if links:
            log.info("deployment %s: %d of %d sub-DAGs take their batches over the data path",
                     self.job.spec.name, len(links), len(self.peers))  # fmt: skip

    async def _place(self, replan: replanning.Replan) -> None:
        self.placed.clear()
        await self.links.replace({})
        await self._place_and_assign(self._checkpoint(), None, replan)
        await self._link_up()
        assert self.partition is not None
        names = {n.name for n in self.job.graph.nodes if n.kind == "placeholder"}
        self._readers = {s.index for s in self.partition.subdags if names & set(s.placeholders)}
        self._next_step = 0
        self.placed.set()

    async def _replace(self, attempt: int, error: Exception) -> None:
        """A batch on placement ``attempt`` failed: place again (once per failed placement)."""
        async with self._replacing:
            if self.attempt != attempt or self.stopping.is_set():
                return  # another batch re-placed it already
            dead = error.dead if isinstance(error, PeerFailure) else set()
            if isinstance(error, PeerFailure):
                self._exclude(error)  # lost ones as dead, a device out of memory as unfit
            log.warning("deployment %s: batch failed (%s); placing it again", self.job.spec.name, error)
            self.ctx.metrics.failovers.inc(len(dead))
            self.ctx.store.add_job_event(
                self.job.job_id, "failover", {"dead": sorted(dead), "why": str(error)[:300]}
            )
            await self._place_or_note(replanning.failure(dead))  # no one dead: the same, assigned afresh

    async def _place_or_note(self, replan: replanning.Replan) -> None:
        """``_place``; a placement that cannot be made is noted (``unplaced``) before it is raised, for
        the next batches to answer with at once and to try again (``_place_again``)."""
        try:
            await self._place(replan)
        except FusionNetError as e:
            self.unplaced, self._unplaced_at = e, time.monotonic()
            log.warning(
                "deployment %s: no placement (%s); trying again as batches come", self.job.spec.name, e
            )
            self.ctx.store.add_job_event(self.job.job_id, "unplaced", {"why": str(e)[:300]})
            raise
        self.unplaced = None

    async def _place_again(self) -> None:
        """After a placement that could not be made: a fresh one over whichever compnodes there are now,
        tried at most once per ``REPLACE_EVERY`` seconds; until one is made, ``ExecutionError`` at once."""
        async with self._replacing:
            if self.placed.is_set() or self.unplaced is None or self.stopping.is_set():
                return
            if time.monotonic() - self._unplaced_at < REPLACE_EVERY:
                raise ExecutionError(f"deployment {self.job.spec.name} has no compnodes: {self.unplaced}")
            try:
                await self._place_or_note(replanning.FIRST)
            except FusionNetError as e:
                raise ExecutionError(f"deployment {self.job.spec.name} has no compnodes: {e}") from e
            log.info("deployment %s: placed again on %d compnodes", self.job.spec.name, len(self.peers))

    # ---- batches ---------------------------------------------------------------------------------
    async def run_batch(
        self, rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None
    ) -> Answer:
        """Outputs for ``rows`` (one per row), on the current placement; re-placed and retried on failure.
        With ``keep`` (one flag per row): ``RowAnswers``, the outputs of the kept rows only."""
        n = int(rows.shape[0])
        count = -(-n // self.mb_rows)
        padded = torch.cat([rows, rows[-1:].expand(count * self.mb_rows - n, *rows.shape[1:])])
        sizes = [self.mb_rows] * count
        blob = pack_tensors(
            {
                f"{i}/inputs": padded[i * self.mb_rows : (i + 1) * self.mb_rows].contiguous()
                for i in range(count)
            }
        )
        picks = None if pick is None else [*pick, *[pick[-1]] * (count * self.mb_rows - n)]
        kept = None if keep is None else [*keep, *[False] * (count * self.mb_rows - n)]  # padding: nothing
        epochs = None
        if self.cached:  # the picks are the rows' epochs; the decoder answers one position per row
            epochs, picks = set(pick or ()), None
        error: Exception | None = None
        for _ in range(BATCH_ATTEMPTS):
            if self.unplaced is not None and not self.placed.is_set():
                await self._place_again()
            try:
                await asyncio.wait_for(self.placed.wait(), BATCH_TIMEOUT)
            except TimeoutError:  # a placement under way for that long (assignments of a big model)
                why = f"deployment {self.job.spec.name}: not placed within {BATCH_TIMEOUT:g} s"
                raise ExecutionError(why) from None
            attempt, step = self.attempt, self._next_step
            if epochs is not None and epochs != {attempt}:
                raise StaleRows(f"deployment {self.job.spec.name}: placed again since a row's session began")
            started = time.perf_counter()
            self._next_step += 1
            try:
                replies = await self.watch.guarded(self._serve(step, sizes, blob, picks, kept))
            except (PeerFailure, FusionNetError, TimeoutError) as e:
                error = e
                await self._replace(attempt, e)  # also when the rows were at fault: the pipeline
                # still waits for the failed batch's messages, a fresh placement does not
                if self.cached:
                    raise CacheLost(
                        f"deployment {self.job.spec.name}: batch failed ({e}); caches lost"
                    ) from e
                if isinstance(e, ComputeError):  # the same rows fail anywhere: no second attempt
                    raise RowsFailed(f"the model failed on these inputs: {e}") from e
                continue
            self._count(replies, time.perf_counter() - started, n, count)
            outputs, ids = self._outputs_of(replies)
            if keep is None:
                return outputs[:n]
            if ids is None or ids.shape[0] < n or outputs.shape[0] != sum(keep):
                raise ExecutionError("the output compnode did not answer the rows as kept")
            return RowAnswers(ids[:n], outputs)
        raise ExecutionError(f"deployment {self.job.spec.name}: batch failed {BATCH_ATTEMPTS} times: {error}")

    async def _serve(
        self, step: int, sizes: list[int], blob: bytes, picks: list[int] | None, keep: list[bool] | None
    ) -> list[ServeStepReply]:
        calls = []
        for i, peer in enumerate(self.peers):
            request = ServeStepRequest(
                job_id=self.job.job_id,
                step=step,
                sizes=sizes,
                data=blob if i in self._readers else b"",
                pick=picks,
                keep=keep,
            )
            # The output sub-DAG's answer is big when it carries rows of logits (every row's, or the
            # kept rows'): asked on a stream, it comes back on it. (The daemons' client streams every
            # call on kept streams, ``rpc.kept``, so the flag matters only to a client with a unary
            # limit; there an answer over it is stashed and fetched: slower, never wrong.)
            out = self.partition is not None and self.partition.subdags[i].holds_output
            big = out and (keep is None or any(keep))
            rpc = partial(
                self.serving.call_serve_step, peer, request, timeout=BATCH_TIMEOUT, large_answer=big
            )
            call = self.links.call(i, request, rpc)  # over the data path where it can, else the RPC
            # named: a compnode out of device memory is then excluded from the next placement (unfit)
            calls.append(JobCalls.named_call(peer, "serve_step", call))
        return await asyncio.wait_for(gather(calls), BATCH_TIMEOUT)

    def _count(self, replies: list[ServeStepReply], seconds: float, rows: int, microbatches: int) -> None:
        if len(self.stage_seconds) != len(replies):
            self.stage_seconds = [0.0] * len(replies)
        self.batches += 1
        self.batch_seconds += seconds
        self.batch_rows += rows
        timing = None if self._placement is None else self._placement.stage_timing
        for i, r in enumerate(replies):
            self.stage_seconds[i] += r.fp_seconds
            if timing is not None and i < len(self._planned_slowness):
                # refine the compnode's speed online, as a job's steps do (``planning.speeds``)
                predicted = timing[i][0] * microbatches
                self.ctx.speeds.observe(self.peers[i], self._planned_slowness[i], predicted, r.fp_seconds)

    def timing(self) -> dict[str, object]:
        """Mean wall seconds and rows per batch, and per sub-DAG the mean FP seconds (for ``status``)."""
        n = max(self.batches, 1)
        return {
            "batch_seconds_mean": self.batch_seconds / n,
            "batch_rows_mean": self.batch_rows / n,
            "stage_fp_seconds_mean": [s / n for s in self.stage_seconds],
            # sub-DAG calls answered over the data path (``serve_links``) and as serve_step RPCs
            "serve_calls": dict(self.links.calls),
        }

    def _outputs_of(self, replies: list[ServeStepReply]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's first output (rows in order) and, for a batch sent with ``keep``, every row's id."""
        answer = next((r for r in replies if r.outputs is not None), None)
        if answer is None:
            raise ExecutionError("no compnode answered with the model's outputs")
        joined = join_outputs([unpack_tensors(answer.outputs, "batch outputs")])
        if "outputs" not in joined:
            raise ExecutionError("the model's output holds no tensor")
        ids = None
        if answer.ids is not None:
            ids = join_outputs([unpack_tensors(answer.ids, "batch ids")]).get("outputs")
        return joined["outputs"], ids

    def abandon(self, why: str) -> None:
        """``deploy`` gives up on a placement that did not come in time: the run ends FAILED with ``why``."""
        self.abandoned = why

    async def stop(self) -> None:
        self.stopping.set()
