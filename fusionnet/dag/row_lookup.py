"""Row-served embeddings: a tied weight whose far side only looks rows up gets those rows, not the weight.

A tied language model reads its embedding matrix twice: an embedding lookup at the bottom and the
output projection at the top. Cut between them, the matrix crossed the cut whole once per step and its
gradient came back whole (30.7 MB each way for a 30000 x 256 GPT-2), although the lookup reads only
the rows of the step's tokens (at most 1024 of 30000 there). ``row_lookups`` finds such weights: a
trainable ``variable`` read by exactly one embedding lookup, whose indices are a data placeholder's
values only rearranged (views, slices: a subset of them), and by exactly one other op.

For those, ``build_partition`` keeps the weight with its other (dense) user, and the executors trade
rows instead (``executor.RowTrade``): at the start of a step the lookup's sub-DAG sends the unique
token ids of the whole step (a superset of the rows it will read), the owner answers with those rows,
the lookup runs on a local matrix holding them, and after its last backward the lookup's sub-DAG sends
back the gradient of those rows only, which the owner adds into the weight's gradient before Update.
Bytes per step: rows of the step's distinct tokens each way, instead of the whole matrix each way.
The sub-DAG edge from the owner back to the lookup is a step-start exchange, not an FP dependency, so
the partition leaves it out of the sub-DAG order and of the schedules' deadlock check.

Pure functions of the IR; infer graphs keep their resident copy (``executor``) and get none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fusionnet.dag.ir import IRGraph, IRNode

# Ops that only rearrange or select their input's elements: the values they give are a subset of the
# values they read, so the placeholder's values are a superset of the ids the lookup reads.
_REARRANGING = frozenset(
    [
        "view",
        "reshape",
        "_unsafe_view",
        "flatten",
        "unsqueeze",
        "squeeze",
        "contiguous",
        "clone",
        "alias",
        "expand",
        "slice",
        "select",
        "narrow",
        "permute",
        "transpose",
        "t",
        "detach",
        "lift_fresh_copy",
    ]
)
_EMBEDDING = frozenset({"embedding"})


@dataclass(frozen=True)
class RowLookup:
    variable: str  # the tied weight's variable node
    lookup: str  # the embedding node that reads rows of it
    dense_user: str  # the one other op that reads it whole
    placeholder: str  # the data placeholder whose values index it (rearranged)


def base_op(op: str) -> str:
    """``aten.view.default`` -> ``view``; ``method:view`` -> ``view``; ``F.embedding`` -> ``embedding``."""
    if op.startswith("method:"):
        return op[len("method:") :]
    if op.startswith("aten."):
        return op.split(".")[1]
    return op.rsplit(".", 1)[-1]


def _node_arg(node: IRNode, position: int, keyword: str) -> str | None:
    """The node name passed at ``position`` or as ``keyword``, or None when that argument is no node."""
    value = node.args[position] if len(node.args) > position else node.kwargs.get(keyword)
    if isinstance(value, dict) and set(value) == {"$node"} and isinstance(value["$node"], str):
        return value["$node"]
    return None


def _lookup_args(node: IRNode) -> tuple[str | None, str | None]:
    """(weight, indices) node names of an embedding call, or (None, None) when it is not one this can
    serve rows to (``max_norm`` renormalises the weight in place; ``sparse`` gives a sparse gradient)."""
    if node.kind == "output" or base_op(node.op) not in _EMBEDDING:
        return None, None
    if node.op.startswith("aten."):  # aten.embedding(weight, indices, padding_idx, scale_grad, sparse)
        sparse = node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False)
        if sparse is not False:
            return None, None
        return _node_arg(node, 0, "weight"), _node_arg(node, 1, "indices")
    # F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    max_norm = node.args[3] if len(node.args) > 3 else node.kwargs.get("max_norm")
    sparse = node.args[6] if len(node.args) > 6 else node.kwargs.get("sparse", False)
    if max_norm is not None or sparse is not False:
        return None, None
    return _node_arg(node, 1, "weight"), _node_arg(node, 0, "input")


def _source_placeholder(graph: IRGraph, name: str, depth: int = 0) -> str | None:
    """The placeholder whose values ``name`` only rearranges, or None."""
    node = graph.node(name)
    if node.kind == "placeholder":
        return node.name
    if depth > 16 or base_op(node.op) not in _REARRANGING or node.param_keys() or node.buffer_keys():
        return None
    inputs = node.input_names()
    return _source_placeholder(graph, inputs[0], depth + 1) if len(inputs) == 1 else None


def row_lookups(graph: IRGraph) -> dict[str, RowLookup]:
    """Variable node -> its ``RowLookup``, for every tied weight the module docstring describes."""
    if graph.task == "infer":
        return {}
    found: dict[str, RowLookup] = {}
    for v in graph.nodes:
        if v.kind != "variable" or v.target not in graph.params or len(v.users) != 2:
            continue
        lookups, dense = [], []
        for u in v.users:
            user = graph.node(u)
            weight, indices = _lookup_args(user)
            if weight == v.name and indices is not None and indices != v.name:
                lookups.append((user.name, indices))
            else:
                dense.append(user.name)
        if len(lookups) != 1 or len(dense) != 1 or graph.node(dense[0]).kind == "output":
            continue
        placeholder = _source_placeholder(graph, lookups[0][1])
        if placeholder is not None:
            found[v.name] = RowLookup(v.name, lookups[0][0], dense[0], placeholder)
    return found


def rehome_row_weights(lookups: Mapping[str, RowLookup], label: Mapping[str, int]) -> dict[str, int]:
    """``label`` with each weight of ``lookups`` moved to its dense user's label where it will be traded
    (``build_partition``): the owner must be the side that reads it whole."""
    out = dict(label)
    for v, r in lookups.items():
        if label[r.lookup] != label[r.dense_user] and label[r.placeholder] == label[r.lookup]:
            out[v] = label[r.dense_user]
    return out


def traded(lookup: RowLookup, label: Mapping[str, int]) -> bool:
    """Whether ``lookup``'s weight is traded as rows under ``label`` (node -> sub-DAG or label): the weight
    and its lookup apart, and the ids' data with the lookup, which asks for the step's rows with it
    before its first FP."""
    r = lookup
    return label[r.variable] != label[r.lookup] and label[r.placeholder] == label[r.lookup]
