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

from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.partition import Partition
from fusionnet.messages.blobs import pack_tensors
from fusionnet.messages.compnode_rpc import AssignRequest, JobPeer

KEY_BYTES = 32


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
    return list(
        iter_assignment_payloads(
            job, partition, peers, data_addresses, attempt, ckpt, key=key, replica_holders=replica_holders
        )
    )


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
    replica_holders: list[int] | None = None,
) -> Iterator[AssignRequest]:
    """``assignment_payloads`` one at a time: the broker sends each before it reads the next slice of
    the checkpoint, so it never holds more than one sub-DAG's state (issue 11). ``schedule``: the
    pipeline schedule the placement settled on (the job's ``auto`` becomes a name here)."""
    spec = job.spec if schedule is None else job.spec.model_copy(update={"schedule": schedule})
    key = secrets.token_bytes(KEY_BYTES) if key is None else key
    peers_doc = [JobPeer(peer_id=p, data_address=data_addresses.get(p)) for p in peers]
    assignment = {n: s.index for s in partition.subdags for n in s.nodes}
    for s in partition.subdags:
        wanted = {job.graph.node(p).target for p in s.placeholders}
        state, optim = ckpt.for_subdag(s.params, s.buffers)
        # Packed, then the tensors go before the request is handed out: while it is sent the broker
        # holds the slice as bytes only, not as tensors too.
        state_blob, optim_blob = pack_tensors(state), pack_tensors(optim) if optim else None
        del state, optim
        yield AssignRequest(
            job_id=job.job_id,
            attempt=attempt,
            spec=spec,
            ir=job.ir,
            assignment=assignment,
            subdag=s.index,
            peers=peers_doc,
            key=key,
            state=state_blob,
            optim=optim_blob,
            data=pack_tensors({k: v for k, v in job.data.items() if k in wanted}),
            replica_holders=replica_holders,
        )
        del state_blob, optim_blob
