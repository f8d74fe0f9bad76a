"""One job on the broker, from plan to results (FusionAI 3.4-3.6).

PLANNING: pick compnodes from the registry and cut the IR into that many sub-DAGs; assign each
sub-DAG to its compnode (IR, assignment, peers, a fresh per-job data-path key, its slice of the
initial state and the dataset fields its placeholders read). RUNNING: drive the steps: every
compnode runs the step's GPipe schedule and exchanges activations and gradients with its peers
directly; the broker only starts the step and gathers losses and timings. Then it collects the
sub-DAGs' state (and gradients or outputs) and writes the result files of interface.md into the
job's folder under the broker's state dir. Every outcome ends with a ``release`` on every compnode.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusionnet.broker.store import JobState
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import Partition, balanced_assignment, build_partition
from fusionnet.errors import FusionNetError, JobError, PlanError
from fusionnet.runtime.blobs import pack_tensors, unpack_tensors
from fusionnet.runtime.jobwire import RunSpec
from fusionnet.runtime.local import RunResult, write_results
from fusionnet.runtime.results import assemble_state, plan_document

log = logging.getLogger("fusionnet.broker.jobs")

ASSIGN_TIMEOUT = 120.0
STEP_TIMEOUT = 600.0
RELEASE_TIMEOUT = 10.0


@dataclass
class SubmittedJob:
    job_id: str
    spec: RunSpec
    ir: bytes
    graph: IRGraph
    state: dict[str, torch.Tensor]
    data: dict[str, torch.Tensor]
    submitter: str


@dataclass
class JobProgress:
    """What ``job_status`` reports beyond the store's row."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    placement: list[dict[str, Any]] = field(default_factory=list)  # per sub-DAG: peer, nodes, predicted
    refused_frames: int = 0
    results: Path | None = None


class JobRun:
    def __init__(self, broker: Any, job: SubmittedJob, out_dir: Path) -> None:
        self.broker = broker
        self.job = job
        self.out_dir = out_dir
        self.progress = JobProgress()
        self.peers: list[str] = []
        self.partition: Partition | None = None

    # ---- orchestration ---------------------------------------------------------------------------
    async def run(self) -> None:
        job, store = self.job, self.broker.store
        try:
            store.update_job(job.job_id, state=JobState.PLANNING)
            self.partition, self.peers, predicted = self.plan()
            store.add_job_event(job.job_id, "planned", {"compnodes": self.peers, "predicted": predicted})
            await self._assign_all()
            store.update_job(job.job_id, state=JobState.RUNNING, step=0)
            busy = [0.0] * len(self.peers)
            outputs: list[dict[str, torch.Tensor]] = []
            for step in range(job.spec.step_count):
                await self._step(step, busy, outputs)
            result = await self._collect(busy, outputs, predicted)
            await asyncio.to_thread(write_results, self.out_dir, result, job.spec.task)
            self.progress.results = self.out_dir
            store.update_job(job.job_id, state=JobState.SUCCEEDED)
            log.info("job %s: succeeded; results in %s", job.job_id, self.out_dir)
        except asyncio.CancelledError:
            self._fail("the broker stopped while the job was running")
            raise
        except FusionNetError as e:
            self._fail(str(e))
        except Exception as e:  # a bug of ours must still end the job with a reason, not hang it
            log.exception("job %s: internal error", job.job_id)
            self._fail(f"internal error: {type(e).__name__}: {e}")
        finally:
            await self._release_all()
            self._update_job_gauges()

    def _fail(self, reason: str) -> None:
        log.warning("job %s: failed: %s", self.job.job_id, reason)
        if self.broker.store is not None:
            self.broker.store.update_job(self.job.job_id, state=JobState.FAILED, error=reason)

    def _update_job_gauges(self) -> None:
        self.broker.metrics.forget_job(self.job.job_id)
        if self.broker.store is not None:
            counts: dict[str, int] = {}
            for row in self.broker.store.list_jobs(10_000):
                counts[row["state"]] = counts.get(row["state"], 0) + 1
            self.broker.metrics.set_jobs(counts)

    # ---- planning --------------------------------------------------------------------------------
    def plan(self) -> tuple[Partition, list[str], dict[int, float] | None]:
        """Picks compnodes and cuts the graph. The scheduler (performance model) is used when every
        candidate has announced its hardware; otherwise the cost-balanced default policy."""
        candidates = [
            e
            for e in self.broker.registry.schedulable(backup=False)
            if e.record.data_path_address is not None
        ]
        candidates.sort(key=lambda e: e.peer_id)
        if not candidates:
            raise PlanError("no ONLINE compnode with a data path is registered with the broker")
        ops = sum(1 for n in self.job.graph.nodes if n.kind not in ("placeholder", "variable", "output"))
        want = min(self.job.spec.compnodes, len(candidates), max(ops, 1))
        if want < self.job.spec.compnodes:
            self.broker.store.add_job_event(
                self.job.job_id,
                "placement",
                {"asked": self.job.spec.compnodes, "using": want, "online": len(candidates)},
            )
        chosen = candidates[:want]
        assignment = balanced_assignment(self.job.graph, want)
        partition = build_partition(self.job.graph, assignment)
        peers = [e.peer_id for e in chosen]
        self.progress.placement = [
            {"subdag": s.index, "peer_id": peers[s.index], "nodes": len(s.nodes), "params": len(s.params)}
            for s in partition.subdags
        ]
        return partition, peers, None

    # ---- assignment ------------------------------------------------------------------------------
    async def _assign_all(self) -> None:
        assert self.partition is not None
        job, registry = self.job, self.broker.registry
        key = secrets.token_bytes(32)
        peers_doc = []
        for peer_id in self.peers:
            entry = registry.get(peer_id)
            address = None if entry is None else entry.record.data_path_address
            peers_doc.append({"peer_id": peer_id, "data_address": address})
        assignment = {n: s.index for s in self.partition.subdags for n in s.nodes}
        spec_doc = job.spec.model_dump(mode="json")
        calls = []
        for s in self.partition.subdags:
            wanted = {job.graph.node(p).target for p in s.placeholders}
            payload = {
                "job_id": job.job_id,
                "spec": spec_doc,
                "ir": job.ir,
                "assignment": assignment,
                "subdag": s.index,
                "peers": peers_doc,
                "key": key,
                "state": pack_tensors({k: job.state[k] for k in (*s.params, *s.buffers)}),
                "data": pack_tensors({k: v for k, v in job.data.items() if k in wanted}),
            }
            calls.append(self._call(self.peers[s.index], "assign", payload, ASSIGN_TIMEOUT))
        await self._gather(calls, "assign")

    # ---- steps -----------------------------------------------------------------------------------
    async def _step(self, step: int, busy: list[float], outputs: list[dict[str, torch.Tensor]]) -> None:
        job = self.job
        started = time.perf_counter()
        replies = await self._gather(
            [self._call(p, "step", {"job_id": job.job_id, "step": step}, STEP_TIMEOUT) for p in self.peers],
            f"step {step}",
        )
        seconds = time.perf_counter() - started
        samples = sum(job.spec.microbatch_sizes(step))
        row: dict[str, Any] = {"step": step, "seconds": seconds, "samples": samples}
        loss = None
        for i, r in enumerate(replies):
            busy[i] += _seconds(r, "fp_seconds") + _seconds(r, "bp_seconds") + _seconds(r, "update_seconds")
            if r.get("loss") is not None:
                loss = _float(r["loss"], f"step {step} loss from {self.peers[i]}")
            if r.get("outputs") is not None:
                outputs.append(unpack_tensors(r["outputs"], f"step {step} outputs from {self.peers[i]}"))
        self.progress.refused_frames = sum(int(r.get("refused") or 0) for r in replies)
        if loss is not None:
            row["loss"] = loss
        self.progress.metrics.append(row)
        self.broker.store.update_job(job.job_id, step=step + 1, loss=loss)
        self.broker.metrics.observe_step(
            job.job_id, step=step + 1, seconds=seconds, samples=samples, loss=loss, compnodes=len(self.peers)
        )

    # ---- results ---------------------------------------------------------------------------------
    async def _collect(
        self, busy: list[float], outputs: list[dict[str, torch.Tensor]], predicted: dict[int, float] | None
    ) -> RunResult:
        assert self.partition is not None
        job = self.job
        replies = await self._gather(
            [self._call(p, "collect", {"job_id": job.job_id}, ASSIGN_TIMEOUT) for p in self.peers], "collect"
        )
        states = [unpack_tensors(r.get("state"), f"state from {p}") for p, r in zip(self.peers, replies)]
        graph = job.graph
        weights = assemble_state(graph.state_keys, states, job.state, graph.aliases)
        grads = None
        if job.spec.task == "grad":
            pieces = [unpack_tensors(r.get("grads"), f"grads from {p}") for p, r in zip(self.peers, replies)]
            grads = assemble_state(graph.state_keys, pieces, None, graph.aliases)
        steps = max(job.spec.step_count, 1)
        measured = {i: t / steps for i, t in enumerate(busy)}
        plan = plan_document(
            self.partition,
            predicted=predicted,
            measured=measured,
            extra={
                "job": job.spec.name,
                "job_id": job.job_id,
                "task": job.spec.task,
                "frontend": graph.frontend,
                "compnodes": dict(enumerate(self.peers)),
            },
        )
        for doc in plan["subdags"]:
            doc["compnode"] = self.peers[doc["subdag"]]
        return RunResult(
            weights=weights,
            grads=grads,
            outputs=_join_outputs(outputs) if job.spec.task == "infer" else None,
            metrics=self.progress.metrics,
            plan=plan,
            measured_seconds=measured,
        )

    async def _release_all(self) -> None:
        if not self.peers:
            return
        results = await asyncio.gather(
            *(
                self.broker.call(p, "release", {"job_id": self.job.job_id}, timeout=RELEASE_TIMEOUT)
                for p in self.peers
            ),
            return_exceptions=True,
        )
        for peer, r in zip(self.peers, results):
            if isinstance(r, BaseException):
                log.debug("job %s: release on %s: %s", self.job.job_id, peer, r)

    # ---- calls -----------------------------------------------------------------------------------
    async def _call(self, peer: str, method: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            return await self.broker.call(peer, method, payload, timeout=timeout)
        except FusionNetError as e:
            raise type(e)(f"compnode {peer} ({method}): {e}") from e

    async def _gather(self, calls: list[Any], what: str) -> list[dict[str, Any]]:
        """All calls, or the first failure (the rest are cancelled: their compnodes get a release)."""
        tasks = [asyncio.ensure_future(c) for c in calls]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


def _seconds(reply: dict[str, Any], key: str) -> float:
    value = reply.get(key, 0.0)
    return float(value) if isinstance(value, int | float) and value >= 0 else 0.0


def _float(value: object, what: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise JobError(f"{what}: expected a number, got {type(value).__name__}")
    return float(value)


def _join_outputs(per_step: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """Micro-batch outputs ``"mb/leaf"`` of every step, in order, concatenated along the sample dim."""
    rows: list[torch.Tensor] = []
    for blob in per_step:
        keys = sorted(blob, key=lambda k: tuple(int(x) for x in k.split("/")))
        rows.extend(blob[k] for k in keys if k.endswith("/0"))
    return torch.cat(rows, dim=0) if rows else None


def check_submission(
    graph: IRGraph, state: dict[str, torch.Tensor], data: dict[str, torch.Tensor], spec: RunSpec
) -> None:
    """Refuses a submission whose parts disagree: state vs the IR's parameters, data vs the spec."""
    for table in (graph.params, graph.buffers):
        for k, meta in table.items():
            if k not in state:
                raise JobError(f"submission: state lacks {k!r}, which the IR reads")
            if list(state[k].shape) != list(meta["shape"]):
                raise JobError(
                    f"submission: state {k!r} has shape {list(state[k].shape)}, the IR says {meta['shape']}"
                )
    if "inputs" not in data:
        raise JobError("submission: data lacks the 'inputs' tensor")
    if spec.task != "infer" and graph.loss_node() is not None and "labels" not in data:
        needs_labels = any(n.kind == "placeholder" and n.target == "labels" for n in graph.nodes)
        if needs_labels:
            raise JobError("submission: data lacks the 'labels' tensor the loss reads")
    for name, t in data.items():
        if t.dim() == 0 or t.shape[0] != spec.n_samples:
            raise JobError(
                f"submission: data {name!r} has {t.shape[0] if t.dim() else 0} samples, "
                f"the spec says {spec.n_samples}"
            )
