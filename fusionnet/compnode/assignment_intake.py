"""One job's sub-DAG on a compnode: decoded and checked IR, rebuilt executor, network channel, data.

Built from the broker's ``assign`` message (``messages.compnode_rpc.AssignRequest``, made by
``broker.assignment_payloads``), which carries the whole IR, the node -> sub-DAG assignment, this node's
sub-DAG index, the job's peers (peer id and data-path address per sub-DAG), a fresh per-job key for the
data path, this sub-DAG's initial state, the dataset fields its placeholders read, and the ``RunSpec``.
The message model has already checked shapes, types and ranges; here every part is checked for what it
means before anything runs: the IR by the codec (allowlisted ops only), the partition by
``build_partition``, the peers against it, the state against the IR's parameter table, the data against
the run spec.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fusionnet.compnode.netchannel import NetChannel
from fusionnet.compnode.value_frames import check_against_meta
from fusionnet.dag.channel import MessageKey
from fusionnet.dag.checkpoint import load_optimizer_tensors, optimizer_tensors
from fusionnet.dag.codec import decode_ir
from fusionnet.dag.devices import HOST
from fusionnet.dag.executor import SubDagExecutor
from fusionnet.dag.hooks import StepReport
from fusionnet.dag.ir import IRGraph, dtype_name
from fusionnet.dag.partition import SubDag, build_partition
from fusionnet.dag.precision import FOUND_INF_NODE, compute_dtype
from fusionnet.dag.row_trade import check_traded
from fusionnet.errors import JobError, PlanError, WireError
from fusionnet.job.optim import optimizer_factory
from fusionnet.messages.blobs import pack_tensors, unpack_tensors
from fusionnet.messages.compnode_rpc import AssignRequest, JobPeer
from fusionnet.messages.jobwire import RunSpec, select_fields
from fusionnet.planning.pipeline_schedule import check_schedule
from fusionnet.wire.frames import TensorFrame

log = logging.getLogger("fusionnet.compnode.assignment_intake")

SendFrame = Callable[[str, str | None, TensorFrame, bytes], Awaitable[str]]  # -> path used


@dataclass
class JobAssignment:
    job_id: str
    broker: str  # the peer that assigned the job: the only one that may drive or release it
    attempt: int  # the broker's assignment round (a failover or re-plan starts a new one)
    spec: RunSpec
    graph: IRGraph
    subdag: SubDag
    peers: list[JobPeer]
    fields: dict[str, torch.Tensor]
    executor: SubDagExecutor
    channel: NetChannel
    example_batch: int
    replica_holders: list[int] | None = None  # per sub-DAG: who keeps its snapshots (None: nobody)
    steps_done: set[int] = field(default_factory=set)
    last_report: StepReport | None = None
    created_at: float = field(default_factory=time.time)

    @property
    def index(self) -> int:
        return self.subdag.index

    def step_data(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The dataset fields this sub-DAG's placeholders read, per micro-batch of ``step``."""
        wanted = {self.graph.node(p).target for p in self.subdag.placeholders}
        return select_fields(self.fields, wanted, self.spec, step)

    async def run_step(self, step: int) -> StepReport:
        data = self.step_data(step)
        sent = self.channel.bytes_sent
        report = await self.executor.run_step(step, data, self.spec.microbatch_sizes(step))
        report.sent_bytes = self.channel.bytes_sent - sent  # the step's activations and gradients
        self.channel.mailbox.forget_step(step)
        self.steps_done.add(step)
        self.last_report = report
        return report

    def validate(self, src: int, key: MessageKey, value: Any) -> None:
        """Checks a received value against the IR: an activation must look like the producer's output,
        a gradient list like the flattened value it is the gradient of (``None`` allowed per part)."""
        kind, step, mb, node_name = key
        if node_name == FOUND_INF_NODE:  # fp16's per-step flag, from any sub-DAG of the job
            if kind != "grad" or not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise WireError(f"sub-DAG {src} sent a malformed found-inf flag")
            return
        compute = compute_dtype(self.spec.precision)
        try:
            node = self.graph.node(node_name)
        except KeyError:
            raise WireError(f"sub-DAG {src} sent a value for unknown node {node_name!r}") from None
        where = f"{kind} {node_name!r} from sub-DAG {src}"
        try:  # rows of a tied weight and their ids (``dag.row_trade``) have shapes of their own
            if check_traded(self.graph, self.subdag, src, kind, node_name, value):
                return
        except ValueError as e:
            raise WireError(f"{where}: {e}") from None
        if kind == "act":
            if node_name not in self.subdag.outer_required or self.subdag.sources.get(node_name) != src:
                raise WireError(f"{where}: this sub-DAG does not read that value from that sub-DAG")
            check_against_meta(value, node.meta, self.example_batch, where, compute, self._rows(step, mb))
            return
        if node_name not in self.subdag.outwards or src not in self.subdag.consumers.get(node_name, ()):
            raise WireError(f"{where}: that sub-DAG does not consume this value")
        metas = _flatten_meta(node.meta)
        parts, _ = tree_flatten(value)
        if len(parts) != len(metas):
            raise WireError(f"{where}: {len(parts)} gradient parts, expected {len(metas)}")
        for i, (g, m) in enumerate(zip(parts, metas)):
            if g is not None:
                check_against_meta(g, m, self.example_batch, f"{where}[{i}]", compute, self._rows(step, mb))

    def _rows(self, step: int, mb: int) -> int | None:
        """The samples of micro-batch ``mb`` of ``step`` where the spec fixes them (train and grad steps;
        an infer placement may be a deployment, whose batches the broker sizes per request)."""
        if self.spec.task == "infer" or not 0 <= step < self.spec.step_count:
            return None
        sizes = self.spec.microbatch_sizes(step)
        return sizes[mb] if 0 <= mb < len(sizes) else None

    def state_blob(self) -> bytes:
        """On the compute thread (no Update meanwhile): packing is the only copy."""
        return pack_tensors(self.executor.state(copy=False))

    def grads_blob(self) -> bytes:
        return pack_tensors(self.executor.gradients())

    def optim_tensors(self, live: bool = False) -> dict[str, torch.Tensor]:
        """Optimizer state (and fp16's loss scale) as CPU copies, or (``live``) the optimizer's own
        tensors where they live, for a snapshot that copies them before the next Update."""
        executor = self.executor
        tensors = optimizer_tensors(executor.optimizers, executor.named_params, copy=not live)
        if not live:
            tensors = {k: v.to(HOST) for k, v in tensors.items()}
        if self.executor.scaler is not None:
            tensors |= self.executor.scaler.state()
        return tensors

    def optim_blob(self) -> bytes:
        return pack_tensors(self.optim_tensors())


def _flatten_meta(meta: Any) -> list[Any]:
    if isinstance(meta, dict) and "$seq" in meta:
        return [m for child in meta["$seq"] for m in _flatten_meta(child)]
    return [meta]


@dataclass(frozen=True)
class _Decoded:
    """An ``assign`` request's parts, decoded and checked against each other."""

    graph: IRGraph
    subdag: SubDag
    peers: list[JobPeer]
    state: dict[str, torch.Tensor]
    fields: dict[str, torch.Tensor]


def _decode(request: AssignRequest, own_peer_id: str) -> _Decoded:
    job_id, spec = request.job_id, request.spec
    graph = decode_ir(request.ir)
    partition = build_partition(graph, request.assignment)
    n = len(partition.subdags)
    if request.subdag >= n:
        raise JobError(f"assign {job_id}: subdag must be in 0..{n - 1}")
    try:  # the broker settles ``auto`` and checked the schedule; a peer's word is checked again
        check_schedule(spec.schedule, partition, spec.microbatches, spec.task, spec.chunks)
    except PlanError as e:
        raise JobError(f"assign {job_id}: {e}") from None
    if len(request.peers) != n:
        raise JobError(f"assign {job_id}: {len(request.peers)} peers for {n} sub-DAGs")
    mine = request.peers[request.subdag].peer_id
    if mine != own_peer_id:
        raise JobError(f"assign {job_id}: sub-DAG {request.subdag} is for {mine}, not this node")
    subdag = partition.subdags[request.subdag]
    # No blob bound of our own: an inline state is bounded by the RPC message limit, a staged one by
    # the memory check of ``staging`` (a slice of a large model may exceed 1 GiB).
    state = unpack_tensors(request.state, f"assign {job_id}: state", max_bytes=len(request.state))
    _check_state(graph, subdag, state, job_id)
    fields = unpack_tensors(request.data, f"assign {job_id}: data")
    _check_fields(graph, subdag, fields, spec, job_id)
    return _Decoded(graph, subdag, list(request.peers), state, fields)


def _executor(
    request: AssignRequest, parts: _Decoded, channel: NetChannel, device: torch.device
) -> SubDagExecutor:
    spec = request.spec
    executor = SubDagExecutor(
        parts.graph,
        parts.subdag,
        parts.state,
        channel,
        task=spec.task,
        make_optimizers=optimizer_factory(spec.task, spec.optimizer_spec()),
        loss_reduction=spec.loss_reduction,
        precision=spec.precision,
        subdags=len(parts.peers),
        schedule=spec.schedule,
        device=device,
        chunks=spec.chunks,
        own_state=True,  # unpacked for it alone: a 100M-parameter slice is not held twice
    )
    if request.optim is not None:
        what = f"assign {request.job_id}: optimizer state"
        optim = unpack_tensors(request.optim, what, max_bytes=len(request.optim))
        load_optimizer_tensors(executor.optimizers, executor.named_params, optim)
        if executor.scaler is not None:
            try:
                executor.scaler.load_state(optim)
            except ValueError as e:
                raise JobError(f"assign {request.job_id}: {e}") from None
    return executor


def build_assignment(
    request: AssignRequest,
    *,
    own_peer_id: str,
    broker: str,
    send: Callable[[int, TensorFrame], Awaitable[None]],
    device: torch.device = HOST,
) -> JobAssignment:
    """Checks a validated ``assign`` request for what it means and builds the executor on ``device``.
    Raises ``JobError``/``IRError``/``WireError``/``PartitionError`` naming the bad part
    (``DeviceMemoryError`` when its state does not fit the device); nothing is kept on failure."""
    parts = _decode(request, own_peer_id)
    index = request.subdag
    holder: dict[str, JobAssignment] = {}
    channel = NetChannel(
        job_id=request.job_id,
        peer_id=own_peer_id,
        subdag_of_peer={p.peer_id: i for i, p in enumerate(parts.peers) if i != index},
        send_frame=send,
        validate=lambda src, k, v: holder["a"].validate(src, k, v),
        compression=request.spec.wire_compression,
        # several sub-DAGs per compnode (interleaved): frames name their sub-DAGs
        routes=(index, [p.peer_id for p in parts.peers]) if request.spec.chunks > 1 else None,
    )
    job = JobAssignment(
        job_id=request.job_id,
        broker=broker,
        attempt=request.attempt,
        spec=request.spec,
        graph=parts.graph,
        subdag=parts.subdag,
        peers=parts.peers,
        fields=parts.fields,
        executor=_executor(request, parts, channel, device),
        channel=channel,
        # the batch size of the IR's recorded shapes: the traced micro-batch (data.microbatches auto may
        # run another count), else the first of step 0
        example_batch=parts.graph.traced_samples() or request.spec.microbatch_sizes(0)[0],
        replica_holders=request.replica_holders,
    )
    holder["a"] = job
    return job


def _check_state(graph: IRGraph, subdag: SubDag, state: dict[str, torch.Tensor], job_id: str) -> None:
    for k in (*subdag.params, *subdag.buffers):
        if k not in state:
            raise JobError(f"assign {job_id}: state lacks {k!r} of sub-DAG {subdag.index}")
        want = graph.params.get(k) or graph.buffers.get(k)
        if want is not None and (
            list(state[k].shape) != list(want["shape"]) or dtype_name(state[k].dtype) != want["dtype"]
        ):
            raise JobError(
                f"assign {job_id}: state {k!r} is {dtype_name(state[k].dtype)}{list(state[k].shape)}, "
                f"the IR says {want['dtype']}{want['shape']}"
            )


def _check_fields(
    graph: IRGraph, subdag: SubDag, fields: dict[str, torch.Tensor], spec: RunSpec, job_id: str
) -> None:
    wanted = {graph.node(p).target for p in subdag.placeholders}
    for name in wanted:
        if name not in fields:
            raise JobError(f"assign {job_id}: data lacks field {name!r} read by sub-DAG {subdag.index}")
    for name, t in fields.items():
        if t.dim() == 0 or t.shape[0] != spec.n_samples:
            raise JobError(
                f"assign {job_id}: data field {name!r} has {t.shape[0] if t.dim() else 0} samples, "
                f"the run spec says {spec.n_samples}"
            )
