"""The broker's ``assign`` payloads (``broker.assignment_payloads``) as a pure function: each compnode
gets its own sub-DAG's slice of the checkpoint and data, and every compnode the same map, peers and
key."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fusionnet.broker.assignment_payloads import assignment_payloads, iter_assignment_payloads
from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.broker.submission import SubmittedJob
from fusionnet.dag.codec import encode_ir
from fusionnet.dag.partition import Partition, balanced_assignment, build_partition
from fusionnet.job.loader import load_job
from fusionnet.messages.blobs import unpack_tensors
from fusionnet.messages.jobwire import run_spec_of
from fusionnet.runtime.prepare import trace_job
from tests.jobfiles import REPO


def test_each_compnode_gets_its_slice_and_all_share_the_map_and_peers_and_a_key_per_link() -> None:
    submitted, partition, state = _figure3(3)
    graph = submitted.graph
    optim = {f"opt::{k}::exp_avg": torch.zeros(1) for k in graph.params}
    ckpt = Checkpoint(4, state, optim)
    peers = ["pa", "pb", "pc"]
    requests = assignment_payloads(submitted, partition, peers, {"pa": "127.0.0.1:1", "pb": None}, 2, ckpt)
    docs = [r.model_dump() for r in requests]  # what goes on the wire
    assert [d["subdag"] for d in docs] == [0, 1, 2]
    assert all(len(k) == 32 for d in docs for i, k in enumerate(d["link_keys"]) if i != d["subdag"])
    assert docs[0]["peers"] == [
        {"peer_id": "pa", "data_address": "127.0.0.1:1"},
        {"peer_id": "pb", "data_address": None},
        {"peer_id": "pc", "data_address": None},
    ]
    owned = set()
    for s, doc in zip(partition.subdags, docs):
        assert doc["job_id"] == "j1" and doc["attempt"] == 2 and doc["ir"] == submitted.ir
        assert doc["assignment"] == {n: t.index for t in partition.subdags for n in t.nodes}
        state = unpack_tensors(doc["state"], "state")
        assert set(state) == {*s.params, *s.buffers}
        owned |= set(s.params)
        if s.params:
            assert set(unpack_tensors(doc["optim"], "optim")) == {f"opt::{k}::exp_avg" for k in s.params}
        else:
            assert doc["optim"] is None
        fields = set(unpack_tensors(doc["data"], "data"))
        assert fields == {graph.node(p).target for p in s.placeholders}
    assert owned == set(graph.params)  # every parameter goes to exactly one compnode
    # a fresh key per placement: frames of an earlier placement no longer authenticate
    again = assignment_payloads(submitted, partition, peers, {}, 3, ckpt)
    assert again[0].link_keys[1] != docs[0]["link_keys"][1]
    # one key per link, both ends hold it, nobody else does: no member can forge another's frames
    n = len(docs)
    links = {(i, j): docs[i]["link_keys"][j] for i in range(n) for j in range(n) if i != j}
    assert all(links[i, j] == links[j, i] for i, j in links)
    assert len({links[i, j] for i, j in links if i < j}) == n * (n - 1) // 2
    assert all(doc["key"] is None and doc["link_keys"][i] == b"" for i, doc in enumerate(docs))


def _figure3(pieces: int) -> tuple[SubmittedJob, Partition, dict[str, torch.Tensor]]:
    """The bundled Figure 3 job, traced and cut into ``pieces`` balanced sub-DAGs, and its state."""
    job = load_job(REPO / "examples" / "figure3" / "job.yaml")
    traced = trace_job(job)
    graph = traced.graph
    submitted = SubmittedJob(
        job_id="j1",
        spec=run_spec_of(job, "mean"),
        ir=encode_ir(graph),
        graph=graph,
        state=dict(traced.state),
        data={"inputs": job.inputs, "labels": job.labels},
        submitter="me",
    )
    return submitted, build_partition(graph, balanced_assignment(graph, pieces)), dict(traced.state)


def _figure3_halves() -> tuple[SubmittedJob, Partition, Checkpoint]:
    submitted, partition, state = _figure3(2)
    optim = {f"opt::{k}::exp_avg": torch.full_like(state[k], 0.5) for k in submitted.graph.params}
    return submitted, partition, Checkpoint(4, state, optim)


def test_slices_over_the_part_size_are_staged_with_the_bytes_an_inline_slice_would_carry() -> None:
    submitted, partition, ckpt = _figure3_halves()
    inline = assignment_payloads(submitted, partition, ["pa", "pb"], {}, 2, ckpt, key=b"k" * 32)
    staged = list(
        iter_assignment_payloads(
            submitted, partition, ["pa", "pb"], {}, 2, ckpt, key=b"k" * 32, stage_over=10
        )
    )
    for plain, prepared in zip(inline, staged, strict=True):
        request = prepared.request
        assert set(prepared.staged) == {"state", "optim"}
        assert request.state == b"" and request.optim is None
        assert request.staged_state == prepared.staged["state"].total
        assert request.staged_optim == prepared.staged["optim"].total
        for kind, blob in (("state", plain.state), ("optim", plain.optim)):
            joined = b"".join(prepared.staged[kind].parts(7))
            want, got = unpack_tensors(blob, "inline"), unpack_tensors(joined, "staged")
            assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        # everything else is what the inline request says
        same = plain.model_dump(exclude={"state", "optim", "staged_state", "staged_optim"})
        assert request.model_dump(exclude={"state", "optim", "staged_state", "staged_optim"}) == same


def test_an_assign_request_cannot_carry_a_slice_both_inline_and_staged() -> None:
    submitted, partition, ckpt = _figure3_halves()
    doc = assignment_payloads(submitted, partition, ["pa", "pb"], {}, 2, ckpt)[0].model_dump()
    with pytest.raises(ValidationError, match="state is staged"):
        type(assignment_payloads(submitted, partition, ["pa", "pb"], {}, 2, ckpt)[0]).model_validate(
            doc | {"staged_state": 10}
        )
    with pytest.raises(ValidationError, match="optim is staged"):
        type(assignment_payloads(submitted, partition, ["pa", "pb"], {}, 2, ckpt)[0]).model_validate(
            doc | {"state": b"", "staged_state": 10, "staged_optim": 5}
        )
