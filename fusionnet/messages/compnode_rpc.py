"""A compnode's RPC surface: one request and one reply model per method, and ``CompnodeClient``.

Methods (served by ``compnode.daemon`` and ``compnode.tasks``; only the broker that assigned a job
may drive, read or release it):

- ``ping``         heartbeat echo (``broker_rpc.PingRequest`` -> ``PingReply``)
- ``info``         the compnode's current record, straight from it (``dht.records.CompnodeRecord``)
- ``assign``       one sub-DAG of a job: spec, IR, op -> sub-DAG map, peers, data-path key, its state
- ``step``         run one GPipe step (FP, BP, Update) -> loss, phase times, refused frames, outputs
- ``collect``      the sub-DAG's parameters, optimizer state and (task grad) gradients
- ``release``      forget the job (end, failover, re-plan)
- ``probe_links``  time the links to the sub-DAGs ``to`` over the data path
- ``replicate``    (from the job's compnode of that sub-DAG) keep a snapshot of its state after a step
- ``replicas``     which snapshots (sub-DAG, step) this compnode keeps for the job
- ``fetch_replica`` one chunk of one of them (the broker, to recover a lost sub-DAG)

The size and range limits here are what a compnode accepts from a broker; what the IR and the
tensors mean is checked after decoding (``compnode.assignment_intake``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from fusionnet.dht.records import CompnodeRecord
from fusionnet.messages.base import Caller, JobId, Message, PeerIdText, TypedCaller
from fusionnet.messages.broker_rpc import PingReply, PingRequest
from fusionnet.messages.jobwire import RunSpec

MAX_PEERS = 4096
MIN_KEY_BYTES = 16
MAX_PROBE_BYTES = 8 << 20  # one link probe's payload (a compnode refuses larger probe frames)
MAX_PROBE_SIZES, MAX_PROBE_REPEATS = 8, 10

NonNegative = Annotated[int, Field(ge=0)]
# A compnode's timings feed the speed book, the replica pacing and metrics.jsonl: finite or refused
Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class JobRequest(Message):
    """A request about one job the caller assigned (``collect``)."""

    job_id: JobId
    # collect: "state" or "optim" alone keeps each answer (and the memory it takes on both sides) to
    # one of them, under the message bound for big sub-DAGs; the other field is then empty / None.
    part: Literal["all", "state", "optim"] = "all"
    # collect of "state"/"optim": which chunk of the part (``CollectReply.chunks`` says how many), so
    # that no answer outgrows the message bound however big the sub-DAG
    chunk: Annotated[int, Field(ge=0, le=1 << 20)] = 0
    # which of the job's sub-DAGs on this compnode the call is about (interleaved schedules hold several
    # per compnode); None: the compnode's only one (older brokers omit it)
    subdag: NonNegative | None = None


class JobPeer(Message):
    peer_id: PeerIdText
    data_address: Annotated[str, Field(min_length=3, max_length=300)] | None = None  # HOST:PORT


def first_subdag_of_others(peers: Sequence[JobPeer], ours: Collection[int]) -> dict[str, int]:
    """Every compnode of a job that holds none of ``ours`` -> its first sub-DAG: links and their keys
    are per pair of compnodes, however many sub-DAGs each holds (interleaved chunks)."""
    others: dict[str, int] = {}
    for i, p in enumerate(peers):
        if i not in ours:
            others.setdefault(p.peer_id, i)
    return others


class AssignRequest(Message):
    job_id: JobId
    attempt: NonNegative = 0  # the broker's assignment round (failover and re-plan start a new one)
    spec: RunSpec
    ir: bytes
    assignment: dict[str, NonNegative]  # op name -> sub-DAG index, the whole graph
    subdag: NonNegative  # which of them this compnode runs
    peers: Annotated[list[JobPeer], Field(min_length=1, max_length=MAX_PEERS)]  # per sub-DAG
    # Data-path keys: per sub-DAG, the key of our link with its compnode (ours: empty), so a member
    # of the job can forge no frame between two others (``wire.mac.link_key``); or one job-wide
    # ``key`` (tests, one-process runs).
    link_keys: Annotated[list[bytes], Field(max_length=MAX_PEERS)] | None = None
    key: Annotated[bytes, Field(min_length=MIN_KEY_BYTES, max_length=1024)] | None = None
    state: bytes  # safetensors: this sub-DAG's parameters and buffers (empty when staged)
    optim: bytes | None = None  # safetensors: its optimizer state (opt::<key>::<slot>)
    # Set: the state / optimizer slice came ahead in ``stage_state`` calls, this many bytes in all
    # (``results.slice_stream``, ``compnode.staging``); the inline field is then empty.
    staged_state: NonNegative | None = None
    staged_optim: NonNegative | None = None
    data: bytes  # safetensors: the dataset fields its placeholders read
    # Per sub-DAG: the sub-DAG whose compnode keeps the replica of its state (None: no replication,
    # the broker collects checkpoints itself).
    replica_holders: Annotated[list[NonNegative], Field(max_length=MAX_PEERS)] | None = None
    # A deployment's sub-DAG: the key of the broker's link to it, for ``serve_step`` as frames on the
    # direct data path (``messages.serve_frames``); None: batches come as RPC calls only.
    serve_key: Annotated[bytes, Field(min_length=MIN_KEY_BYTES, max_length=1024)] | None = None

    @model_validator(mode="after")
    def _subdag_has_a_peer(self) -> AssignRequest:
        if self.subdag >= len(self.peers):
            raise ValueError(f"subdag {self.subdag} but only {len(self.peers)} peers")
        if self.staged_state is not None and self.state:
            raise ValueError("state is staged: the inline state must be empty")
        if self.staged_optim is not None and self.optim:
            raise ValueError("optim is staged: the inline optim must be empty")
        holders = self.replica_holders
        if holders is not None and (
            len(holders) != len(self.peers)
            or any(
                h >= len(self.peers) or self.peers[h].peer_id == self.peers[i].peer_id
                for i, h in enumerate(holders)
            )
        ):
            raise ValueError("replica_holders: per sub-DAG, a sub-DAG of another compnode")
        if (self.key is None) == (self.link_keys is None):
            raise ValueError("give either key or link_keys")
        links = self.link_keys
        ours = set(self.own_subdags())
        if links is not None and (
            len(links) != len(self.peers)
            or any(links[i] for i in ours)
            or any(not MIN_KEY_BYTES <= len(k) <= 1024 for i, k in enumerate(links) if i not in ours)
        ):
            raise ValueError(
                f"link_keys: one key of {MIN_KEY_BYTES}..1024 bytes per sub-DAG of another compnode, "
                "empty for ours"
            )
        return self

    def own_subdags(self) -> list[int]:
        """The sub-DAGs of the job on our compnode (several with an interleaved schedule), ascending."""
        me = self.peers[self.subdag].peer_id
        return [i for i, p in enumerate(self.peers) if p.peer_id == me]

    def keys_by_sender(self) -> dict[str, bytes]:
        """Per other compnode of the job, the key of its link to us (one link per compnode pair)."""
        others = first_subdag_of_others(self.peers, self.own_subdags())
        return {peer: self.key_of_link(i) for peer, i in others.items()}

    def key_of_link(self, other: int) -> bytes:
        """The key of frames between our sub-DAG and sub-DAG ``other`` (either direction)."""
        if self.link_keys is not None:
            return self.link_keys[other]
        assert self.key is not None
        return self.key


class StageStateRequest(Message):
    """One part of a sub-DAG's state or optimizer slice, ahead of the ``assign`` that names its size."""

    job_id: JobId
    attempt: NonNegative = 0
    subdag: NonNegative
    kind: Literal["state", "optim"]
    offset: NonNegative  # where ``data`` starts in the slice; parts come in order
    total: NonNegative  # the slice's size in bytes
    data: bytes

    @model_validator(mode="after")
    def _inside(self) -> StageStateRequest:
        if self.offset + len(self.data) > self.total:
            raise ValueError(
                f"part [{self.offset}, {self.offset + len(self.data)}) beyond {self.total} bytes"
            )
        return self


class StageStateReply(Message):
    received: NonNegative  # bytes of the slice in so far


class AssignReply(Message):
    subdag: NonNegative
    nodes: NonNegative
    # the sub-DAG's worker reads the broker's ``serve`` frames itself (``compnode.worker_serves``)
    serves_direct: bool = False


class StepRequest(JobRequest):
    step: NonNegative
    # Sent ahead (the broker's next step while this one runs): start only once step ``after`` is done
    # here, whatever order the two calls arrive in.
    after: NonNegative | None = None
    snapshot: bool = False  # replicate the state after this step to its holder (in the background)
    keep_from: NonNegative | None = None  # snapshots of earlier steps are no longer needed
    # bytes/s the snapshot may take on the link to its holder (a share of the measured bandwidth, so the
    # activations on that link never queue behind it); None: unpaced
    replica_pace: Annotated[float, Field(gt=0.0, le=1e12)] | None = None


class StepReply(Message):
    step: NonNegative
    loss: float | None = None  # the sub-DAG that holds the loss reports it
    fp_seconds: Seconds = 0.0
    bp_seconds: Seconds = 0.0
    update_seconds: Seconds = 0.0
    activation_peak_bytes: NonNegative = 0  # the most activation bytes held at once in the step
    sent_bytes: NonNegative = 0  # tensor bytes sent to other sub-DAGs in the step (after compression)
    refused: NonNegative = 0  # frames refused so far for this job (bad key, wrong sender, ...)
    outputs: bytes | None = None  # infer: safetensors of "<micro-batch>/<leaf>" outputs
    replicated: NonNegative | None = None  # the latest snapshot step its holder has confirmed
    snapshot_seconds: Seconds = 0.0  # compute-thread time the last snapshot took (checkpoint overhead)

    @property
    def busy_seconds(self) -> float:
        return self.fp_seconds + self.bp_seconds + self.update_seconds


class CollectReply(Message):
    state: bytes
    grads: bytes | None = None
    optim: bytes | None = None
    # part "state" / "optim": chunk k is bytes [k*C, (k+1)*C) of the part as one safetensors stream
    # (``results.slice_stream``), in ``chunks`` chunks; part "all": whole blobs in one answer.
    chunks: Annotated[int, Field(ge=1, le=1 << 20)] = 1


class ReleaseRequest(JobRequest):
    reason: Annotated[str, Field(max_length=1000)] = "done"


class ReleaseReply(Message):
    released: bool
    refused: NonNegative = 0


class ProbeSettings(Message):
    """How to probe: payload sizes (bytes; two distinct at least, for a slope) and repeats per size;
    None: the compnode's defaults."""

    sizes: (
        Annotated[
            list[Annotated[int, Field(ge=1, le=MAX_PROBE_BYTES)]],
            Field(min_length=2, max_length=MAX_PROBE_SIZES),
        ]
        | None
    ) = None
    repeats: Annotated[int, Field(ge=1, le=MAX_PROBE_REPEATS)] | None = None

    @model_validator(mode="after")
    def _two_distinct_sizes(self) -> ProbeSettings:
        if self.sizes is not None and len(set(self.sizes)) < 2:
            raise ValueError("sizes: two of them must differ")
        return self


class ProbeLinksRequest(ProbeSettings, JobRequest):
    to: Annotated[list[NonNegative], Field(min_length=1, max_length=MAX_PEERS)]  # sub-DAG indices


class ProbedLink(Message):
    alpha: float
    beta: float
    round_trips: Any = None
    # Too few probe sizes came back to fit (a very slow link): alpha and beta are a lower bound on its
    # slowness (``compnode.linkprobe.bound_link``). An older broker ignores it and takes them as measured.
    bound: bool = False


class ProbeLinksReply(Message):
    links: dict[str, ProbedLink]  # by destination sub-DAG index (a msgpack map key is a string)


class InfoRequest(Message):
    pass


class ReplicateRequest(JobRequest):
    """Chunk ``chunk`` of ``chunks`` of the snapshot of sub-DAG ``subdag`` taken before step ``step``
    (its state after ``step - 1``), from the compnode that runs it to the one that keeps its replica.
    Chunks keep every message (and the memory it takes on both sides) to a few tens of MB."""

    attempt: NonNegative
    subdag: NonNegative
    step: NonNegative
    chunk: NonNegative = 0
    chunks: Annotated[int, Field(ge=1, le=1 << 16)] = 1
    blob: bytes  # safetensors; ``part`` says which ("state" or "optim")
    landed: bool = False  # ``blob`` is empty: the chunk went over the data path, confirm it once stored

    @model_validator(mode="after")
    def _chunk_in_range(self) -> ReplicateRequest:
        if self.chunk >= self.chunks:
            raise ValueError(f"chunk {self.chunk} of {self.chunks}")
        if self.landed == bool(self.blob):
            raise ValueError("a chunk comes either in 'blob' or, with 'landed', over the data path")
        return self


class ReplicateReply(Message):
    complete: bool  # both parts of that snapshot are kept now


class ReplicasReply(Message):
    held: dict[str, list[NonNegative]]  # sub-DAG index -> steps of complete snapshots kept here


class ReplicaRequest(JobRequest):
    """``fetch_replica``: one chunk of a kept snapshot."""

    subdag: NonNegative
    step: NonNegative
    chunk: NonNegative = 0
    offset: NonNegative = 0  # where in the chunk's file the answer starts (answers are byte ranges)


class ReplicaChunk(Message):
    part: Literal["state", "optim"]
    chunks: Annotated[int, Field(ge=1)]  # of the whole snapshot
    blob: bytes  # bytes [offset, offset + len) of the chunk's safetensors file
    size: NonNegative | None = None  # the whole file's size (None: ``blob`` is the whole file)


class CompnodeClient(TypedCaller):
    """Typed calls to a compnode: ``await CompnodeClient(broker.call).call_step(peer, request)``."""

    def __init__(self, call: Caller) -> None:
        super().__init__(call)

    async def call_ping(self, peer: str, request: PingRequest, **kw: Any) -> PingReply:
        return await self.call_typed(peer, "ping", request, PingReply, **kw)

    async def call_info(self, peer: str, request: InfoRequest, **kw: Any) -> CompnodeRecord:
        return await self.call_typed(peer, "info", request, CompnodeRecord, **kw)

    async def call_assign(self, peer: str, request: AssignRequest, **kw: Any) -> AssignReply:
        return await self.call_typed(peer, "assign", request, AssignReply, **kw)

    async def call_stage_state(self, peer: str, request: StageStateRequest, **kw: Any) -> StageStateReply:
        return await self.call_typed(peer, "stage_state", request, StageStateReply, **kw)

    async def call_step(self, peer: str, request: StepRequest, **kw: Any) -> StepReply:
        return await self.call_typed(peer, "step", request, StepReply, **kw)

    async def call_collect(self, peer: str, request: JobRequest, **kw: Any) -> CollectReply:
        return await self.call_typed(peer, "collect", request, CollectReply, **kw)

    async def call_release(self, peer: str, request: ReleaseRequest, **kw: Any) -> ReleaseReply:
        return await self.call_typed(peer, "release", request, ReleaseReply, **kw)

    async def call_probe_links(self, peer: str, request: ProbeLinksRequest, **kw: Any) -> ProbeLinksReply:
        return await self.call_typed(peer, "probe_links", request, ProbeLinksReply, **kw)

    async def call_replicate(self, peer: str, request: ReplicateRequest, **kw: Any) -> ReplicateReply:
        return await self.call_typed(peer, "replicate", request, ReplicateReply, **kw)

    async def call_replicas(self, peer: str, request: JobRequest, **kw: Any) -> ReplicasReply:
        return await self.call_typed(peer, "replicas", request, ReplicasReply, **kw)

    async def call_fetch_replica(self, peer: str, request: ReplicaRequest, **kw: Any) -> ReplicaChunk:
        return await self.call_typed(peer, "fetch_replica", request, ReplicaChunk, **kw)
