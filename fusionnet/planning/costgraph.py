"""IR graph -> the performance model's cost graph, and a cost-graph assignment back onto IR nodes.

Only operators become ops; data placeholders and variables are folded into their first user, as in
Table 3 (labels are fed where the loss is computed; a variable lives with the op that first reads it),
so the scheduler cannot separate a placeholder from its user and every plan maps back onto IR nodes
(``ir_assignment``). Costs were traced on one example micro-batch; ``micro_batch_scale`` rescales them
to the job's micro-batch. A tied weight traded as rows (``dag.row_lookup``: its lookup's side gets only
the rows of the step's tokens) keeps its edge from the lookup, priced at those rows (``traded_bytes``),
while its bytes, optimizer and Update count with its dense user, where ``build_partition`` puts it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fusionnet.dag.costs import op_name
from fusionnet.dag.flop_rules import RULES
from fusionnet.dag.ir import IRGraph, IRNode
from fusionnet.dag.registry import REGISTRY
from fusionnet.dag.row_lookup import RowLookup, row_lookups
from fusionnet.errors import FusionNetError, PlanError
from fusionnet.perfmodel.types import CostGraph, OpCost

OPS = ("parametric", "non_parametric", "loss")  # IR kinds that become cost-graph ops
# flop_rules kind -> Overheads op class
_RULE_CLASS = {
    **dict.fromkeys(("linear", "matmul", "addmm", "sdpa"), "matmul"),
    "conv": "conv",
    **dict.fromkeys(("elementwise", "pow", "minmax", "dropout", "fill"), "elementwise"),
    **dict.fromkeys(("norm", "softmax", "reduction"), "norm"),
    "pool": "pool",
    **dict.fromkeys(("loss", "cross_entropy"), "loss"),
    "gather": "gather",
    **dict.fromkeys(("copy", "view"), "copy"),  # a "view" rule that wrote bytes had to copy
}


def op_class(node: IRNode) -> str:
    """Which ``Overheads`` class (``perfmodel.types.OP_CLASSES``) prices ``node``: by its cost rule's
    kind; an op that neither computes nor writes anything is a view."""
    if not node.cost.get("flops_fwd") and not node.cost.get("bytes_written"):
        return "view"
    try:
        target = node.op if node.op.startswith("method:") else REGISTRY.resolve(node.op)
        rule = RULES.get(op_name(target))
    except FusionNetError:
        rule = None
    return _RULE_CLASS.get(rule.kind, "other") if rule is not None else "other"


def owners(graph: IRGraph) -> dict[str, str]:
    """Placeholder / variable -> the operator it is folded into (its first user that is an op)."""
    ops = [n.name for n in graph.nodes if n.kind in OPS]
    owner: dict[str, str] = {}
    for n in graph.nodes:
        if n.kind in ("placeholder", "variable"):
            users = [u for u in n.users if graph.node(u).kind in OPS]
            owner[n.name] = users[0] if users else ops[0]
    return owner


def cost_graph(
    graph: IRGraph,
    optimizer: str | Mapping[str, str] | None = None,
    *,
    scale: float = 1.0,
    microbatches: int = 1,
) -> CostGraph:
    """The IR as the performance model sees it (module docstring). ``optimizer`` is one profile name for
    every parameter or a map from parameter key to name; ``scale`` multiplies per-micro-batch FLOPs and
    bytes (planning for a micro-batch of another size than the traced one). A parameter read across a
    cut crosses once per step (and its gradient once back): its edge is a ``step_edges`` entry, and in
    ``edges`` (what the searches price per micro-batch) its bytes are spread over ``microbatches``."""
    ops = [n for n in graph.nodes if n.kind in OPS]
    if not ops:
        raise PlanError("the graph has no operators to place")
    owner = owners(graph)
    # A tied weight traded as rows (``dag.row_lookup``) lives, with its optimizer state and Update, with
    # its dense user; its edge keeps the lookup -> dense user direction (the op order) but carries rows.
    lookups = row_lookups(graph)
    folded: dict[str, list[IRNode]] = {}
    for name, op in owner.items():
        folded.setdefault(lookups[name].dense_user if name in lookups else op, []).append(graph.node(name))

    def per_mb(value: Any) -> int:
        return round(int(value or 0) * scale)

    def opt_of(keys: list[str]) -> str | None:
        if optimizer is None or isinstance(optimizer, str):
            return optimizer
        return next((optimizer[k] for k in keys if k in optimizer), None)

    needs: dict[str, bool] = {}  # a gradient flows into the node's output
    for n in graph.nodes:
        needs[n.name] = n.kind == "variable" or bool(n.param_keys()) or any(needs[s] for s in n.input_names())
    costs = []
    for n in ops:
        extra = folded.get(n.name, [])
        keys = n.param_keys() + [k for v in extra if v.kind == "variable" for k in v.param_keys()]
        param_bytes = int(n.cost.get("param_bytes", 0)) + sum(
            int(v.cost.get("param_bytes", 0)) for v in extra if v.kind == "variable"
        )
        held = sum(int(v.cost.get("activation_bytes", 0)) for v in extra if v.kind == "placeholder")
        costs.append(
            OpCost(
                name=n.name,
                kind=n.kind,
                flops_fwd=per_mb(n.cost.get("flops_fwd")),
                flops_bwd=per_mb(n.cost.get("flops_bwd")),
                bytes_read=per_mb(n.cost.get("bytes_read")),
                bytes_written=per_mb(n.cost.get("bytes_written")),
                param_bytes=param_bytes,
                activation_bytes=per_mb(int(n.cost.get("activation_bytes", 0)) + held),
                optimizer=opt_of(keys) if param_bytes else None,
                op_class=op_class(n),
                param_tensors=len(keys),
                input_grad=any(needs[s] for s in n.input_names() if graph.node(s).kind != "variable"),
            )
        )
    # an infer sub-DAG keeps the parameters it received (``SubDagExecutor.resident``): they cost
    # memory, no time per step
    resident = graph.task == "infer"
    edges: dict[tuple[str, str], int] = {}
    step_edges: dict[tuple[str, str], int] = {}
    per_mb_edges: set[tuple[str, str]] = set()  # edges carrying a per-micro-batch value too
    for n in ops:
        for src in n.input_names():
            producer = owner.get(src, src)
            if producer == n.name or graph.node(src).kind == "output":
                continue
            node = graph.node(src)
            nbytes = int(node.cost.get("activation_bytes", 0))
            if node.kind != "variable":
                nbytes = per_mb(nbytes)
                per_mb_edges.add((producer, n.name))
            elif resident and node.target not in graph.params:
                per_mb_edges.add((producer, n.name))  # an infer buffer (a KV cache) crosses every step
            else:
                if src in lookups:
                    nbytes = min(nbytes, traded_bytes(graph, lookups[src], scale, microbatches))
                step_edges[(producer, n.name)] = step_edges.get((producer, n.name), 0) + nbytes
                nbytes = 0 if resident else -(-nbytes // max(1, microbatches))
            edges[(producer, n.name)] = edges.get((producer, n.name), 0) + nbytes
    # an edge that also carries per-micro-batch values is timed per micro-batch as a whole
    once = {k: v for k, v in step_edges.items() if k not in per_mb_edges}
    return CostGraph(
        tuple(costs),
        tuple((a, b, nbytes) for (a, b), nbytes in edges.items()),
        tuple((a, b, nbytes) for (a, b), nbytes in once.items()),
        resident_step_edges=resident,
    )


def traded_bytes(graph: IRGraph, lookup: RowLookup, scale: float, microbatches: int) -> int:
    """Bytes of a row trade per step and direction: as many rows (and their int64 ids) as the step has
    index values, at most every row of the weight."""
    target = graph.node(lookup.variable).target
    assert target is not None
    shape = [int(d) for d in graph.params[target]["shape"]]
    meta = graph.node(lookup.placeholder).meta
    traced = math.prod(int(d) for d in meta["shape"]) if isinstance(meta, dict) and "shape" in meta else 0
    rows = min(shape[0], math.ceil(traced * scale) * max(1, microbatches))
    row_bytes = math.prod(shape[1:]) * _itemsize(graph.params[target].get("dtype", "float32"))
    return rows * (row_bytes + 8)


def _itemsize(dtype: str) -> int:
    return {"float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int8": 1, "uint8": 1}.get(dtype, 4)


def micro_batch_scale(graph: IRGraph, batch_size: int | None, microbatches: int) -> float:
    """Per-micro-batch costs were traced on one example micro-batch; rescale them to ``batch_size``."""
    traced = graph.traced_samples()
    if batch_size is None or not traced:
        return 1.0
    return batch_size / microbatches / traced


def ir_assignment(graph: IRGraph, op_label: Mapping[str, int]) -> dict[str, int]:
    """Cost-graph op -> label, extended to every IR node: placeholders and variables go with the op
    they were folded into, the output with the producer of its last input (as build_partition does)."""
    owner = owners(graph)
    labels: dict[str, int] = {}
    for n in graph.nodes:
        if n.kind in OPS:
            labels[n.name] = op_label[n.name]
        elif n.kind in ("placeholder", "variable"):
            labels[n.name] = op_label[owner[n.name]]
        else:  # output
            inputs = n.input_names()
            labels[n.name] = labels[inputs[-1]] if inputs else 0
    return labels
