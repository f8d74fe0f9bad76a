"""Row-served embeddings (``dag.row_lookup``, ``dag.row_trade``): which tied weights are traded as rows,
where the partition puts them, what the cost model charges, what a peer may send, and training that
still equals plain PyTorch's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fusionnet.dag.channel import Channel, MessageKey
from fusionnet.dag.partition import build_partition
from fusionnet.dag.rebuild import compact_embedding
from fusionnet.dag.row_lookup import base_op, row_lookups
from fusionnet.dag.row_trade import check_traded
from fusionnet.dag.trace import trace_model
from fusionnet.errors import ExecutionError
from fusionnet.job.loader import load_job
from fusionnet.planning.costgraph import cost_graph
from fusionnet.planning.pipeline_schedule import check_schedule, stage_edges
from fusionnet.reference import run_reference
from fusionnet.runtime.local import InMemorySwarm, run_local
from fusionnet.runtime.prepare import prepare_job, trace_job
from fusionnet.runtime.process_swarm import BlockingObserver, running_swarm
from fusionnet.runtime.submit import submit_and_wait
from tests.dag_models import token_data
from tests.jobfiles import REPO, write_job

pytestmark = pytest.mark.timeout(300)
V, D, T = 200, 16, 6


class TiedLM(nn.Module):
    """A tiny tied LM: embedding lookup, one layer, the output projection reading the same matrix."""

    def __init__(self, lookup: str = "plain") -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.lookup = lookup

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        ids = idx + 1 if self.lookup == "shifted" else idx.reshape(idx.shape[0], -1)
        h = torch.tanh(self.mid(self.wte(ids % V if self.lookup == "shifted" else ids)))
        return h @ self.wte.weight.t()


def _graph(lookup: str = "plain", task: str = "train") -> Any:
    torch.manual_seed(0)
    idx = torch.randint(0, V, (4, T))
    loss = nn.CrossEntropyLoss()

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss(out.reshape(-1, V), y.reshape(-1))

    labels = None if task == "infer" else idx
    return trace_model(TiedLM(lookup), idx, labels, None if task == "infer" else loss_fn, task).graph


def _two_pieces(graph: Any) -> dict[str, int]:
    """The lookup and everything before the middle layer on 0, the rest on 1."""
    names = [n.name for n in graph.nodes]
    cut = next(i for i, n in enumerate(graph.nodes) if base_op(n.op) == "tanh") + 1
    return {name: 0 if i < cut else 1 for i, name in enumerate(names) if graph.node(name).kind != "output"}


def test_a_tied_weight_read_by_a_lookup_and_a_projection_is_traded_as_rows() -> None:
    graph = _graph()
    ((v, lookup),) = row_lookups(graph).items()
    assert graph.node(v).target == "wte.weight" and base_op(graph.node(lookup.lookup).op) == "embedding"
    assert graph.node(lookup.placeholder).kind == "placeholder"
    assert base_op("aten.view.default") == "view" and base_op("method:view") == "view"


def test_lookups_that_compute_their_ids_are_not_traded() -> None:
    assert row_lookups(_graph("shifted")) == {}  # ids + 1 are not a subset of the data's values


def _example_gpt_graph() -> Any:
    """The bundled GPT (symbolic tracing: ``F.embedding(input, weight, ..., max_norm, ..., sparse)``)."""
    return trace_job(load_job(REPO / "examples" / "gpt" / "job.yaml")).graph


@pytest.mark.parametrize("argument", ["max_norm", "sparse"])
def test_lookups_that_renormalise_or_want_sparse_gradients_are_not_traded(argument: str) -> None:
    for graph in (_graph(), _example_gpt_graph()):  # aten.embedding, then F.embedding
        ((_, lookup),) = row_lookups(graph).items()
        node = graph.node(lookup.lookup)
        if node.op.startswith("aten."):  # (weight, indices, padding_idx, scale_grad, sparse); no max_norm
            node.args = [*node.args[:2], -1, False, argument == "sparse"]
            assert bool(row_lookups(graph)) is (argument != "sparse")
        else:
            node.kwargs = {**node.kwargs, argument: 1.0 if argument == "max_norm" else True}
            assert row_lookups(graph) == {}


def test_infer_graphs_keep_their_resident_copy() -> None:
    assert row_lookups(_graph(task="infer")) == {}


def test_the_partition_keeps_the_weight_with_its_dense_user_and_orders_nothing_by_the_trade() -> None:
    graph = _graph()
    ((v, lookup),) = row_lookups(graph).items()
    partition = build_partition(graph, _two_pieces(graph))  # the caller put the weight with the lookup
    first, second = partition.subdags
    assert v in second.nodes and "wte.weight" in second.params and "wte.weight" not in first.params
    assert lookup.lookup in first.nodes and first.row_reads == [v] and second.row_serves == [v]
    assert first.sources[v] == 1 and second.consumers[v] == [0]  # the rows go back against the order
    assert stage_edges(partition) == [(0, 1)]  # ... yet no FP waits on them
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        check_schedule(schedule, partition, 4, "train")


def test_no_trade_when_the_ids_data_sits_on_another_sub_dag() -> None:
    """The lookup's sub-DAG asks for the step's rows before its first FP, from the data it holds: with the
    ids on another sub-DAG the weight goes the ordinary way, once per step, whole."""
    graph = _graph()
    ((v, lookup),) = row_lookups(graph).items()
    label = {name: piece + 1 for name, piece in _two_pieces(graph).items()}
    label[lookup.placeholder] = 0
    label.update({n: 0 for n in graph.node(lookup.lookup).input_names() if n != v})  # the ids' reshape
    label[v] = label[lookup.lookup]
    partition = build_partition(graph, label)
    assert all(not s.row_reads and not s.row_serves for s in partition.subdags)
    assert v in partition.subdags[1].nodes  # where the caller put it, with the lookup


def test_the_cost_model_charges_rows_not_the_matrix() -> None:
    graph = _graph()
    ((_, lookup),) = row_lookups(graph).items()
    costs = cost_graph(graph, microbatches=2)
    (edge,) = [e for e in costs.step_edges if e[0] == lookup.lookup]
    tokens = 4 * T * 2  # the traced micro-batch's ids, two micro-batches a step
    assert edge[2] == min(V, tokens) * (D * 4 + 8) < V * D * 4 + V * 8
    held = {op.name: op.param_bytes for op in costs.ops}
    assert held[lookup.dense_user] >= V * D * 4 and held[lookup.lookup] == 0  # Update runs with the owner


def test_a_peer_s_trade_values_are_checked_against_the_weight() -> None:
    graph = _graph()
    ((v, _),) = row_lookups(graph).items()
    first, second = build_partition(graph, _two_pieces(graph)).subdags
    ids = torch.tensor([0, 3, 7])
    assert check_traded(graph, second, 0, "act", v, ids)
    assert check_traded(graph, first, 1, "act", v, torch.zeros(3, D))
    assert check_traded(graph, second, 0, "grad", v, [torch.zeros(3, D)])
    assert not check_traded(graph, first, 1, "act", first.outer_required[0], ids)  # no trade: the IR's
    bad = [
        (second, "act", ids.float()),
        (second, "act", torch.arange(V + 1)),
        (first, "act", torch.zeros(3, D + 1)),
        (first, "act", torch.zeros(V + 1, D)),
        (second, "grad", [torch.zeros(3, D), torch.zeros(3, D)]),
        (second, "grad", [torch.zeros(3, D, dtype=torch.long)]),
    ]
    for sub, kind, value in bad:
        src = 0 if sub is second else 1
        with pytest.raises(ValueError, match=repr(v)):
            check_traded(graph, sub, src, kind, v, value)


def _tied_job(folder: Path, task: str = "train", steps: int = 3) -> Path:
    ids, labels = token_data(16, seq=8, vocab=200)
    return write_job(
        folder, model_class="HFCausalLM", inputs=ids, labels=labels, loss=False, batch_size=8,
        microbatches=4, steps=steps, compnodes=2, task=task, model_kwargs={"vocab": 200},
    )  # fmt: skip


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_training_with_rows_traded_equals_plain_pytorch(tmp_path: Path, schedule: str) -> None:
    pytest.importorskip("transformers")
    path = _tied_job(tmp_path / "job")
    job = load_job(path)
    prepared = prepare_job(job, 2)
    assert any(s.row_reads for s in prepared.partition.subdags), "the cut should separate the lookup"
    want = run_reference(load_job(path))
    swarm = InMemorySwarm(prepared, schedule)

    async def run() -> list[float]:
        losses = []
        for data in swarm.steps():
            reports = await swarm.step(data)
            losses.extend(r.loss for r in reports if r.loss is not None)
        return losses

    losses = asyncio.run(run())
    got: dict[str, torch.Tensor] = {}
    for ex in swarm.executors:
        got |= ex.state()
    for k, w in got.items():
        if k in want.weights:
            assert (w - want.weights[k]).abs().max().item() <= 1e-5, k
    assert max(abs(a - b) for a, b in zip(losses, want.losses)) <= 1e-5


@pytest.mark.parametrize(
    ("aten", "padding_idx"),
    [(True, -1), (True, 7), (True, 8), (False, None), (False, 7), (False, -13), (False, 8)],
)
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_a_lookup_in_the_step_s_rows_equals_the_lookup_in_the_whole_matrix(
    aten: bool, padding_idx: int | None, scale_grad_by_freq: bool
) -> None:
    """``compact_embedding`` on the rows of the ids only: same values, and the rows' gradient equals the
    whole matrix's gradient at those rows (padding row included: 7 is among the ids, 8 is not, -13 is
    row 7 counted from the end of 20)."""
    torch.manual_seed(0)
    rows = 20
    full = torch.randn(rows, 5, requires_grad=True)
    indices = torch.tensor([[3, 7, 3, 11], [0, 7, 19, 3]])
    ids = torch.unique(indices)
    compact = full.detach()[ids].clone().requires_grad_(True)
    if aten:
        fn = torch.ops.aten.embedding.default
        want = fn(full, indices, padding_idx, scale_grad_by_freq)
        got = compact_embedding(fn, True, rows, ids, compact, indices, padding_idx, scale_grad_by_freq)
    else:
        fn = torch.nn.functional.embedding
        want = fn(indices, full, padding_idx, scale_grad_by_freq=scale_grad_by_freq)
        got = compact_embedding(
            fn, False, rows, ids, indices, compact, padding_idx, scale_grad_by_freq=scale_grad_by_freq
        )
    assert torch.equal(got, want)
    seed = torch.randn_like(want)
    want.backward(seed)
    got.backward(seed)
    assert full.grad is not None and compact.grad is not None
    assert torch.equal(compact.grad, full.grad[ids])
    assert float(full.grad.abs().sum()) == pytest.approx(float(compact.grad.abs().sum()))  # nothing else


def test_a_lookup_in_the_step_s_rows_refuses_an_index_outside_the_matrix() -> None:
    ids = torch.tensor([1, 4])
    with pytest.raises(IndexError, match=r"outside 0\.\.9"):
        compact_embedding(
            torch.nn.functional.embedding, False, 10, ids, torch.tensor([4, 10]), torch.ones(2, 3)
        )


def test_the_lookup_side_holds_no_matrix_the_size_of_the_weight(tmp_path: Path) -> None:
    """The reader's step value of the traded weight is its rows only, and the gradient it sends back is
    one row per id."""
    pytest.importorskip("transformers")
    prepared = prepare_job(load_job(_tied_job(tmp_path / "job", steps=1)), 2)
    swarm = InMemorySwarm(prepared, "gpipe")
    reader = next(ex for ex in swarm.executors if ex.subdag.row_reads)
    (v,) = reader.subdag.row_reads
    sent: list[torch.Tensor] = []

    class Watching(Channel):
        def __init__(self, inner: Channel) -> None:
            self.inner = inner

        async def send(self, dst: int, key: MessageKey, value: Any) -> None:
            if key[0] == "grad" and key[3] == v:
                sent.extend(t for t in (value if isinstance(value, list) else [value]) if t is not None)
            await self.inner.send(dst, key, value)

        async def recv(self, src: int, key: MessageKey) -> Any:
            return await self.inner.recv(src, key)

    reader.channel = Watching(reader.channel)
    leaves: list[torch.Tensor] = []

    async def run() -> None:
        for data in swarm.steps():
            task = asyncio.ensure_future(swarm.step(data))
            while v not in reader._step_inputs and not task.done():
                await asyncio.sleep(0.001)
            leaves.append(reader._step_inputs[v])
            await task

    asyncio.run(run())
    ids = reader._row_ids[v]
    rows, *width = reader._shape_of(v)
    assert 0 < len(ids) < rows
    assert tuple(leaves[0].shape) == (len(ids), *width)
    assert len(sent) == 1 and tuple(sent[0].shape) == (len(ids), *width)


def test_run_local_writes_the_reference_weights(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = _tied_job(tmp_path / "job", steps=2)
    got = run_local(load_job(path), 2, tmp_path / "out")
    want = run_reference(load_job(path))
    assert max((got.weights[k] - want.weights[k]).abs().max().item() for k in want.weights) <= 1e-5


class TamperingChannel(Channel):
    """Rewrites the ids one sub-DAG asks rows for."""

    def __init__(self, inner: Channel, ids: torch.Tensor) -> None:
        self.inner, self.ids = inner, ids

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        if key[0] == "act" and isinstance(value, torch.Tensor) and value.dtype == torch.long:
            value = self.ids
        await self.inner.send(dst, key, value)

    async def recv(self, src: int, key: MessageKey) -> Any:
        return await self.inner.recv(src, key)


def test_ids_out_of_range_are_refused_by_the_owner(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    prepared = prepare_job(load_job(_tied_job(tmp_path / "job", steps=1)), 2)
    swarm = InMemorySwarm(prepared, "gpipe")
    reader = next(ex for ex in swarm.executors if ex.subdag.row_reads)
    reader.channel = TamperingChannel(reader.channel, torch.tensor([1, 200]))

    async def run() -> None:
        for data in swarm.steps():
            await asyncio.wait_for(swarm.step(data), 60)

    with pytest.raises(ExecutionError, match="not distinct int64 ids below 200"):
        asyncio.run(run())


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_a_split_tied_gpt2_trains_exactly_on_a_real_swarm(tmp_path: Path) -> None:
    """Broker and two compnodes as processes, the lookup and the projection on different compnodes: the
    ids, rows and row gradients go over the real data path (checked by the receiver's validation) and
    the trained weights equal plain PyTorch's."""
    pytest.importorskip("transformers")
    path = _tied_job(tmp_path / "job")
    balanced = {"extra": ["--placement", "balanced"]}  # always both compnodes, whatever the load
    with running_swarm(tmp_path / "swarm", [{}, {}], broker_kw=balanced) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(2, 90)
        finally:
            observer.close()
        out = tmp_path / "out"
        asyncio.run(submit_and_wait(path, sw.initial_peers, out, timeout=240))
        refused = [
            line for node in sw.compnodes for line in node.log_text().splitlines() if "refused" in line
        ]
    assert not refused, refused[:3]
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["subdags"]) == 2
    want = run_reference(load_job(path)).weights
    got = load_file(out / "weights.safetensors")
    assert sorted(got) == sorted(want)
    assert max((got[k].double() - want[k].double()).abs().max().item() for k in want) <= 1e-5
    # the plan as run: the LM head's sub-DAG owns the tied weight and serves its rows to the lookup's
    (lookup_side, owner) = plan["subdags"]
    (tied,) = owner["rows_served"]
    assert lookup_side["rows_read"] == [tied] and tied in owner["nodes"]
    assert "lm.transformer.wte.weight" in owner["params"]
    assert "lm.transformer.wte.weight" not in lookup_side["params"]
