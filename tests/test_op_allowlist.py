"""The curated operator allowlist (issue 12, deliver 1): attack IRs are refused at decode, sizes are
capped at run time, and the tracer names the node and op of a model that uses a refused op."""

from __future__ import annotations

import msgpack
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusionnet.dag.codec import decode_ir, encode_ir
from fusionnet.dag.guards import element_cap
from fusionnet.dag.rebuild import run_whole_graph
from fusionnet.dag.registry import REGISTRY
from fusionnet.dag.trace import trace_model
from fusionnet.errors import ExecutionError, IRError, TraceError
from tests.dag_models import SkipEverywhere, make_data


class _Factory(nn.Module):
    """Reads its batch size from the input and builds a tensor of that size: a factory op in the IR."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.zeros(x.shape[0], 3) + x.new_ones(x.shape[0], 3)


def _traced(model: nn.Module):
    torch.manual_seed(0)
    x, y = make_data("skip", n=6)
    return trace_model(model, x, y, F.cross_entropy, "train"), x, y


TRACED, X, Y = _traced(SkipEverywhere())


def _doc() -> dict:
    return msgpack.unpackb(encode_ir(TRACED.graph), raw=False)


def _decode(doc: dict):
    return decode_ir(msgpack.packb(doc, use_bin_type=True))


@pytest.mark.timeout(60)
def test_the_sparse_to_dense_attack_is_refused_at_decode() -> None:
    # tensor([[2e9]]) -> sparse_coo_tensor(i, v, [4]) -> to_dense segfaulted a compnode
    doc = _doc()
    ops = [n for n in doc["nodes"] if n["kind"] == "non_parametric"]
    ops[0]["op"], ops[0]["args"] = "torch.tensor", [[[2e9]]]
    for op in ("torch.sparse_coo_tensor", "aten.sparse_coo_tensor.indices", "method:to_dense"):
        ops[1]["op"] = op
        with pytest.raises(IRError, match=rf"node '{ops[1]['name']}'.*unknown operator '{op}'"):
            _decode(doc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "op",
    [
        "torch.empty",
        "torch.empty_like",
        "torch.empty_strided",
        "method:new_empty",
        "method:new_empty_strided",
        "aten.empty.memory_format",
        "aten.empty_strided.default",
        "aten.new_empty.default",
        "aten.empty_like.default",
        "method:data_ptr",
        "method:untyped_storage",
        "aten._unsafe_view.default",
        "aten._sparse_coo_tensor_unsafe.default",
        "aten.quantize_per_tensor.default",
        "method:int_repr",
        "method:grad_fn",
        "method:data",
        "method:grad",
        "method:_base",
        "method:register_hook",
        "method:resize_",
        "aten.add.out",
        "aten.max.dim_max",
        "torch._C._nn.linear",
        "F.has_torch_function",
    ],
)
def test_attack_ops_are_refused_at_decode(op: str) -> None:
    doc = _doc()
    node = next(n for n in doc["nodes"] if n["kind"] == "non_parametric")
    node["op"] = op
    with pytest.raises(IRError, match=rf"node '{node['name']}'.*unknown operator"):
        _decode(doc)


def test_every_pointer_or_storage_method_is_refused() -> None:
    for name in dir(torch.Tensor):
        if any(bad in name for bad in ("data_ptr", "storage", "sparse", "empty", "unsafe", "quant")):
            assert not REGISTRY.is_known(f"method:{name}"), name
    for name in ("grad_fn", "data", "grad", "is_leaf", "names", "real", "imag", "output_nr"):
        assert not REGISTRY.is_known(f"method:{name}"), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "op,args",
    [
        ("torch.zeros", [1 << 40]),
        ("torch.ones", [[1 << 20, 1 << 20]]),
        ("torch.full", [[1 << 20, 1 << 20], 1.0]),
        ("torch.arange", [0, 1e15]),
        ("torch.randn", [1 << 16, 1 << 16]),
        ("aten.zeros.default", [[1 << 33]]),
        ("aten.arange.default", [1 << 40]),
    ],
)
def test_factory_sizes_over_the_cap_are_refused_before_allocating(op: str, args: list) -> None:
    with pytest.raises(ExecutionError, match="per-op cap"):
        REGISTRY.executable(op)(*args)


def test_size_changing_views_are_capped() -> None:
    x = torch.ones(4)
    big = element_cap() + 1
    cases = [
        ("method:new_zeros", (x, [big])),
        ("method:new_full", (x, [big], 1.0)),
        ("method:expand", (torch.ones(1, 1), big, 1)),
        ("aten.expand.default", (torch.ones(1, 1), [big, 1])),
        ("method:repeat", (x, 1 << 30)),
        ("aten.repeat.default", (x, [1 << 30])),
        ("torch.repeat_interleave", (x, 1 << 30)),
        ("method:repeat_interleave", (x, torch.tensor([1 << 30] * 4))),
        ("F.pad", (x, (0, big))),
        ("F.one_hot", (torch.tensor([big]),)),
    ]
    for op, args in cases:
        with pytest.raises(ExecutionError, match="per-op cap"):
            REGISTRY.executable(op)(*args)
    assert REGISTRY.executable("method:expand")(torch.ones(1, 3), 2, 3).shape == (2, 3)
    assert REGISTRY.executable("F.one_hot")(torch.tensor([1, 2])).shape == (2, 3)


@pytest.mark.timeout(120)
def test_a_huge_factory_size_in_a_decoded_ir_fails_the_run_not_the_process() -> None:
    traced, x, y = _traced(_Factory())
    doc = msgpack.unpackb(encode_ir(traced.graph), raw=False)
    node = next(n for n in doc["nodes"] if n["op"] in ("torch.zeros", "aten.zeros.default"))
    node["args"] = [[1 << 40, 3]]
    graph = _decode(doc)  # a size is data, the decoder cannot know it: the run refuses it
    with pytest.raises(ExecutionError, match=r"zeros(\.default)?: would produce"):
        run_whole_graph(graph, traced.state, {"inputs": x, "labels": y})
    assert torch.equal(
        run_whole_graph(traced.graph, traced.state, {"inputs": x, "labels": y}),
        run_whole_graph(decode_ir(encode_ir(traced.graph)), traced.state, {"inputs": x, "labels": y}),
    )


class _UsesEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.empty_like(x).zero_() + x)


@pytest.mark.timeout(120)
def test_the_tracer_names_the_node_and_op_that_is_not_allowed() -> None:
    with pytest.raises(TraceError) as info:
        _traced(_UsesEmpty())
    text = str(info.value)
    assert "symbolic_trace: node 'empty_like': operator torch.empty_like is not on the operator" in text
    assert "torch.export: node 'empty_like'" in text and "aten.empty_like" in text


def test_sparse_invariant_checks_are_on() -> None:
    assert torch.sparse.check_sparse_tensor_invariants.is_enabled()
