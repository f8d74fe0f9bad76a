"""What the broker sends each compnode of a placement in ``assign`` (FusionAI 3.5-3.6), as
``messages.compnode_rpc.AssignRequest`` models (the compnode's side: ``compnode.assignment_intake``).

One payload per sub-DAG: the job's spec and IR, the whole op -> sub-DAG assignment (so every compnode
knows where its inputs come from and its outputs go), its own sub-DAG index, every peer with its data
path address, a fresh per-placement data-path key (frames of an earlier placement no longer
authenticate), its slice of the checkpoint (parameters, buffers and optimizer state it owns) and the
dataset fields its placeholders read. A pure function of data, so the wire contract is tested without
a swarm.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.broker.submission import SubmittedJob
from fusionnet.broker.tensorfiles import select
from fusionnet.dag.partition import Partition
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.compnode_rpc import AssignRequest, JobPeer
from fusionnet.results.slice_stream import PART_BYTES, SliceStream
from fusionnet.wire.mac import link_key

KEY_BYTES = 32


@dataclass
class PreparedAssignment:
    """An ``assign`` request, and the parts of its slice that go ahead of it in ``stage_state`` calls
    (``"state"`` / ``"optim"``: the request then carries their sizes instead of the bytes)."""

    request: AssignRequest
    staged: dict[str, SliceStream] = field(default_factory=dict)


def assignment_payloads(
    job: SubmittedJob,
    partition: Partition,
    peers: Sequence[str],
    data_addresses: Mapping[str, str | None],
    attempt: int,
    ckpt: Checkpoint,
    *,
    key: bytes | None = None,
    replica_holders: list[int] | None = None,
) -> list[AssignRequest]:
    """The ``assign`` request of every sub-DAG, in sub-DAG order (sub-DAG ``i`` runs on ``peers[i]``)."""
    prepared = iter_assignment_payloads(
        job,
        partition,
        peers,
        data_addresses,
        attempt,
        ckpt,
        key=key,
        replica_holders=replica_holders,
        stage_over=None,
    )
    return [p.request for p in prepared]


def iter_assignment_payloads(
    job: SubmittedJob,
    partition: Partition,
    peers: Sequence[str],
    data_addresses: Mapping[str, str | None],
    attempt: int,
    ckpt: Checkpoint,
    *,
    key: bytes | None = None,
    schedule: str | None = None,
    chunks: int | None = None,
    replica_holders: list[int] | None = None,
    stage_over: int | None = PART_BYTES,
    serve_keys: Sequence[bytes] | None = None,
) -> Iterator[PreparedAssignment]:
    """``assignment_payloads`` one at a time: the broker sends each before it reads the next slice of
    the checkpoint. ``schedule``, ``chunks``: the pipeline schedule the placement settled on (the job's
    ``auto`` becomes a name here, and may become interleaved-1f1b with its chunks). A state or optimizer
    slice over ``stage_over`` bytes is not packed: it is staged part by part (``results.slice_stream``),
    so the broker holds one part at a time (issue 11); ``None`` packs every slice inline. ``serve_keys``
    (a deployment): per sub-DAG, the key of the broker's link to it (``broker.serve_links``)."""
    spec = job.spec
    if schedule is not None:  # ``chunks``: sub-DAGs per compnode of that schedule (auto may interleave)
        spec = spec.model_copy(
            update={"schedule": schedule, "chunks": spec.chunks if chunks is None else chunks}
        )
    key = secrets.token_bytes(KEY_BYTES) if key is None else key  # the round's master: never sent
    peers_doc = [JobPeer(peer_id=p, data_address=data_addresses.get(p)) for p in peers]
    assignment = {n: s.index for s in partition.subdags for n in s.nodes}
    # Link keys are per pair of compnodes: a compnode holding several sub-DAGs (interleaved) checks every
    # frame from one sender with one key, so each compnode is named by its first sub-DAG.
    device = [peers.index(p) for p in peers]
    for s in partition.subdags:
        wanted = {job.graph.node(p).target for p in s.placeholders}
        state_keys, optim_keys = ckpt.slice_keys(s.params, s.buffers)
        staged: dict[str, SliceStream] = {}
        blobs: dict[str, bytes | None] = {"state": None, "optim": None}
        for kind, tensors, keys in (("state", ckpt.state, state_keys), ("optim", ckpt.optim, optim_keys)):
            if kind == "optim" and not keys:
                continue
            stream = SliceStream(tensors, keys)
            if stage_over is not None and stream.total > stage_over:
                staged[kind] = stream
            else:  # small: packed here; the tensors go before the request is handed out
                blobs[kind] = pack_tensors(select(tensors, keys))
        request = AssignRequest(
            job_id=job.job_id,
            attempt=attempt,
            spec=spec,
            ir=job.ir,
            assignment=assignment,
            subdag=s.index,
            peers=peers_doc,
            link_keys=[
                b"" if device[j] == device[s.index] else link_key(key, device[s.index], device[j])
                for j in range(len(peers))
            ],
            state=blobs["state"] or b"",
            optim=blobs["optim"],
            staged_state=staged["state"].total if "state" in staged else None,
            staged_optim=staged["optim"].total if "optim" in staged else None,
            data=pack_tensors({k: v for k, v in job.data.items() if k in wanted}),
            replica_holders=replica_holders,
            serve_key=None if serve_keys is None else serve_keys[s.index],
        )
        del blobs
        yield PreparedAssignment(request, staged)
        del request
