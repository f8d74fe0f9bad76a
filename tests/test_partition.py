"""Sub-DAG construction (Table 3), cycle refusal and the default balanced policy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.dag.trace import trace_model
from fusionnet.errors import PartitionError
from tests.dag_models import Figure3, SkipEverywhere, figure3_data, make_data


@pytest.fixture(scope="module")
def fig3_graph():
    torch.manual_seed(0)
    x, y = figure3_data(4)
    return trace_model(Figure3(), x, y, F.cross_entropy, "train").graph


TABLE3 = {  # the paper's split of Figure 3 (our graph has explicit flatten ops before Concat)
    "inputs": 1,
    "conv2d": 1,
    "add": 1,
    "max_pool2d": 1,
    "flatten": 1,
    "var_A": 2,
    "mul": 2,
    "flatten_1": 2,
    "cat": 3,
    "linear": 3,
    "labels": 3,
    "cross_entropy": 3,
}


def test_table2_kinds(fig3_graph) -> None:
    kinds = {n.name: n.kind for n in fig3_graph.nodes}
    assert kinds["inputs"] == kinds["labels"] == "placeholder"
    assert kinds["var_A"] == "variable"
    assert kinds["conv2d"] == kinds["linear"] == "parametric"
    assert kinds["add"] == kinds["max_pool2d"] == kinds["mul"] == kinds["cat"] == "non_parametric"
    assert kinds["cross_entropy"] == "loss"
    assert sorted(fig3_graph.node("inputs").users) == ["add", "conv2d"]
    assert sorted(fig3_graph.node("add").users) == ["max_pool2d", "mul"]


def test_table3_attributes(fig3_graph) -> None:
    part = build_partition(fig3_graph, TABLE3)
    s1, s2, s3 = part.subdags
    assert (s1.compnode, s2.compnode, s3.compnode) == (1, 2, 3)
    assert s1.nodes == ["inputs", "conv2d", "add", "max_pool2d", "flatten"]
    assert s1.inner_required == ["inputs", "conv2d", "add", "max_pool2d"]
    assert s1.outer_required == ["inputs"]
    assert s1.outwards == ["add", "flatten"]
    assert s1.compnode_users == [1, 2]
    assert s2.nodes == ["var_A", "mul", "flatten_1"]
    assert s2.inner_required == ["var_A", "mul"]
    assert s2.outer_required == ["add"]
    assert s2.outwards == ["flatten_1"] and s2.compnode_users == [2]
    assert set(s3.outer_required) == {"labels", "flatten", "flatten_1"}
    assert s3.inner_required == ["labels", "cat", "linear"]
    assert s3.outwards == [] and s3.compnode_users == []
    assert s3.holds_loss and s3.holds_output
    # Table 2's compnode location / compnode users are part of the analysis; the graph is not touched.
    assert part.assignment["add"] == 0 and part.node_users["add"] == [0, 1]
    assert fig3_graph.node("add").compnode is None and fig3_graph.node("add").compnode_users == []
    stamped = part.annotated(fig3_graph)
    assert stamped.node("add").compnode == 0 and stamped.node("add").compnode_users == [0, 1]
    assert stamped.node("cross_entropy").compnode == 2 and fig3_graph.node("cross_entropy").compnode is None
    assert "Inner required" in part.describe()


def test_cyclic_assignment_is_refused_naming_the_edges(fig3_graph) -> None:
    cyclic = dict(TABLE3, add=3)  # conv (1) -> add (3) -> pool (1): the sub-DAG graph has a cycle
    with pytest.raises(PartitionError, match=r"cyclic.*conv2d \(compnode 1\) -> add \(compnode 3\)"):
        build_partition(fig3_graph, cyclic)


def test_unassigned_and_unknown_nodes_are_refused(fig3_graph) -> None:
    missing = dict(TABLE3)
    missing.pop("mul")
    with pytest.raises(PartitionError, match="'mul' is not assigned"):
        build_partition(fig3_graph, missing)
    with pytest.raises(PartitionError, match="unknown nodes"):
        build_partition(fig3_graph, dict(TABLE3, ghost=1))


@pytest.mark.parametrize("pieces", [1, 2, 3, 4])
def test_balanced_assignment_is_acyclic_and_balanced(pieces: int) -> None:
    torch.manual_seed(0)
    x, y = make_data("skip", n=4)
    graph = trace_model(SkipEverywhere(), x, y, F.cross_entropy, "train").graph
    part = build_partition(graph, balanced_assignment(graph, pieces))
    assert len(part.subdags) == pieces
    weights = [s.cost["flops_fwd"] + s.cost["flops_bwd"] for s in part.subdags]
    ops = [n for n in graph.nodes if n.kind not in ("placeholder", "variable", "output")]
    biggest_op = max(int(n.cost["flops_fwd"]) + int(n.cost["flops_bwd"]) for n in ops)
    # Min-max over contiguous runs: no piece exceeds the ideal share by more than one op.
    assert max(weights) <= sum(weights) / pieces + biggest_op + len(ops)
    # Every later sub-DAG reads from an earlier one, and skip edges jump over whole sub-DAGs.
    for later in part.subdags[1:]:
        assert set(later.sources.values()) and max(later.sources.values()) < later.index
    if pieces >= 3:
        assert any(min(s.sources.values()) < s.index - 1 for s in part.subdags[2:])


def test_too_many_pieces_is_refused(fig3_graph) -> None:
    with pytest.raises(PartitionError, match="cannot cut"):
        balanced_assignment(fig3_graph, 1000)
