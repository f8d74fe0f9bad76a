"""Partitioning: an assignment of IR nodes to compnodes -> sub-DAGs with FusionAI Table 3's attributes.

The mechanism (``build_partition``) accepts any assignment over any DAG, branches and skip edges
across cuts included, and refuses one whose sub-DAG graph is cyclic (a sub-DAG could then never
start its FP), naming the edges involved. Policies that *produce* assignments are separate pure
functions: ``balanced_assignment`` (the default, contiguous pieces balanced by cost) here, and the
performance-model scheduler in ``fusionnet.planning.scheduler``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fusionnet.dag.ir import IRGraph, IRNode
from fusionnet.dag.row_lookup import rehome_row_weights, row_lookups, traded
from fusionnet.errors import PartitionError

COST_FIELDS = ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written", "param_bytes", "activation_bytes")


@dataclass
class SubDag:
    """One sub-task's graph (a row of Table 3) plus what the executor needs to route messages."""

    index: int
    compnode: int
    nodes: list[str]
    inner_required: list[str]  # nodes here whose outputs are read here
    outer_required: list[str]  # data placeholders held here + nodes of other sub-DAGs read here
    outwards: list[str]  # nodes here read by other sub-DAGs
    compnode_users: list[int]  # sub-DAGs that read this one's outwards data
    sources: dict[str, int] = field(default_factory=dict)  # outer required node -> producing sub-DAG
    consumers: dict[str, list[int]] = field(default_factory=dict)  # outwards node -> reading sub-DAGs
    placeholders: list[str] = field(default_factory=list)  # dataset fields fed here
    params: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    holds_loss: bool = False
    holds_output: bool = False
    cost: dict[str, int] = field(default_factory=dict)
    # tied weights traded as rows (``row_lookup``): those this sub-DAG owns and serves rows of, and those
    # it looks rows up in
    row_serves: list[str] = field(default_factory=list)
    row_reads: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Partition:
    """The analysis of an assignment: the sub-DAGs (Table 3) and each node's Table 2 location. The graph
    it was built from is not touched; ``annotated`` gives a copy with the Table 2 fields filled."""

    subdags: list[SubDag]  # in a topological order of the sub-DAG graph
    assignment: dict[str, int]  # node -> sub-DAG index (Table 2 "Compnode location")
    node_users: dict[str, list[int]] = field(default_factory=dict)  # node -> Table 2 "Compnode users"

    def annotated(self, graph: IRGraph) -> IRGraph:
        """A copy of ``graph`` whose nodes carry their compnode location and users (Table 2)."""
        nodes = [
            replace(n, compnode=self.assignment[n.name], compnode_users=list(self.node_users[n.name]))
            for n in graph.nodes
        ]
        return replace(graph, nodes=nodes)

    def describe(self) -> str:
        """Table 3 as text."""
        rows = [("Sub-DAG", "Compnode", "Nodes", "Inner required", "Outer required", "Outwards", "Users")]
        for s in self.subdags:
            rows.append(
                (
                    str(s.index),
                    str(s.compnode),
                    ", ".join(s.nodes),
                    ", ".join(s.inner_required) or "-",
                    ", ".join(s.outer_required) or "-",
                    ", ".join(s.outwards) or "-",
                    ", ".join(map(str, s.compnode_users)) or "-",
                )
            )
        return _table(rows)


def _table(rows: list[tuple[str, ...]], max_width: int = 48) -> str:
    rows = [tuple(c if len(c) <= max_width else c[: max_width - 3] + "..." for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def build_partition(graph: IRGraph, assignment: Mapping[str, int]) -> Partition:
    """Builds sub-DAGs from ``assignment`` (node name -> any int label; the output node may be omitted).

    Labels are renumbered 0..k-1 in a topological order of the sub-DAG graph; ``compnode`` keeps
    the caller's label. A pure analysis: ``graph`` is left as it is (``Partition.annotated`` stamps
    Table 2's compnode location/users onto a copy).
    """
    # A tied weight traded as rows lives with its dense user (``row_lookup``); its edge to the lookup is a
    # step-start exchange, not an FP dependency, so it orders nothing.
    lookups = row_lookups(graph)
    label = rehome_row_weights(lookups, _labels(graph, assignment))
    exchanged = {(v, r.lookup) for v, r in lookups.items() if traded(r, label)}
    # Quotient graph over labels.
    edges: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for n in graph.nodes:
        for src in n.input_names():
            a, b = label[src], label[n.name]
            if a != b and (src, n.name) not in exchanged:
                edges.setdefault((a, b), []).append((src, n.name))
    order = _topological_labels(sorted(set(label.values())), edges)
    index_of = {lab: i for i, lab in enumerate(order)}
    node_index = {n.name: index_of[label[n.name]] for n in graph.nodes}
    subdags = _subdags(graph, order, node_index)
    for v, r in lookups.items():
        if traded(r, node_index):
            subdags[node_index[v]].row_serves.append(v)
            subdags[node_index[r.lookup]].row_reads.append(v)
    node_users = {n.name: sorted({node_index[u] for u in n.users}) for n in graph.nodes}
    return Partition(subdags=subdags, assignment=node_index, node_users=node_users)


def _labels(graph: IRGraph, assignment: Mapping[str, int]) -> dict[str, int]:
    """The caller's label of every node, checked; the output goes with the producer of its last input."""
    unknown = sorted(set(assignment) - {n.name for n in graph.nodes})
    if unknown:
        raise PartitionError(f"assignment names unknown nodes {unknown[:5]}")
    label: dict[str, int] = {}
    for n in graph.nodes:
        if n.kind == "output":
            # The output lives with the producer of its last input so results leave from one place.
            inputs = n.input_names()
            label[n.name] = assignment.get(n.name, label[inputs[-1]] if inputs else 0)
            continue
        if n.name not in assignment:
            raise PartitionError(f"node {n.name!r} is not assigned to any compnode")
        value = assignment[n.name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PartitionError(f"node {n.name!r}: compnode label must be a non-negative int, got {value!r}")
        label[n.name] = value
    return label


def _subdags(graph: IRGraph, order: list[int], node_index: Mapping[str, int]) -> list[SubDag]:
    """Table 3's rows: each sub-DAG's nodes, required data, outwards data and users."""
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    subdags = [
        SubDag(
            index=i,
            compnode=lab,
            nodes=[],
            inner_required=[],
            outer_required=[],
            outwards=[],
            compnode_users=[],
        )
        for i, lab in enumerate(order)
    ]
    for n in graph.nodes:
        s = subdags[node_index[n.name]]
        s.nodes.append(n.name)
        if n.kind == "placeholder":
            s.placeholders.append(n.name)
            s.outer_required.append(n.name)
        s.params.extend(k for k in n.param_keys() if k not in s.params)
        s.buffers.extend(k for k in n.buffer_keys() if k not in s.buffers)
        s.holds_loss |= n.kind == "loss"
        s.holds_output |= n.kind == "output"
        for f in COST_FIELDS:
            s.cost[f] = s.cost.get(f, 0) + int(n.cost.get(f, 0))
        for src in n.input_names():
            src_index = node_index[src]
            if src_index == s.index:
                # The output node is bookkeeping, not an operator: reading for it is not "required data".
                if n.kind != "output" and src not in s.inner_required:
                    s.inner_required.append(src)
                continue
            if src not in s.outer_required:
                s.outer_required.append(src)
                s.sources[src] = src_index
            producer = subdags[src_index]
            if src not in producer.outwards:
                producer.outwards.append(src)
            if s.index not in producer.consumers.setdefault(src, []):
                producer.consumers[src].append(s.index)
            if s.index not in producer.compnode_users:
                producer.compnode_users.append(s.index)
    for s in subdags:
        s.compnode_users.sort()
        s.inner_required.sort(key=position.__getitem__)
    return subdags


def _topological_labels(
    labels: list[int], edges: Mapping[tuple[int, int], list[tuple[str, str]]]
) -> list[int]:
    succ: dict[int, set[int]] = {lab: set() for lab in labels}
    indeg = dict.fromkeys(labels, 0)
    for a, b in edges:
        if b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    ready = deque(sorted(lab for lab in labels if indeg[lab] == 0))
    order: list[int] = []
    while ready:
        lab = ready.popleft()
        order.append(lab)
        for nxt in sorted(succ[lab]):
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                ready.append(nxt)
    if len(order) != len(labels):
        stuck = {lab for lab in labels if indeg[lab] > 0}
        crossing = sorted(
            f"{s} (compnode {a}) -> {d} (compnode {b})"
            for (a, b), pairs in edges.items()
            if a in stuck and b in stuck
            for s, d in pairs
        )
        raise PartitionError(
            f"assignment makes the sub-DAG graph cyclic among compnodes {sorted(stuck)}; edges involved: "
            + "; ".join(crossing[:8])
            + (" ..." if len(crossing) > 8 else "")
        )
    return order


def op_nodes(graph: IRGraph) -> list[IRNode]:
    """The graph's operators in topological order: every node but placeholders, variables and output."""
    return [n for n in graph.nodes if n.kind not in ("placeholder", "variable", "output")]


def balanced_assignment(graph: IRGraph, pieces: int) -> dict[str, int]:
    """Default policy: cuts the topological order into ``pieces`` contiguous runs of ops balanced by
    FP+BP FLOPs (min-max, exact for contiguous runs)."""
    ops = op_nodes(graph)
    if pieces < 1:
        raise PartitionError(f"cannot cut a graph into {pieces} pieces")
    if pieces > len(ops):
        raise PartitionError(f"cannot cut a graph of {len(ops)} ops into {pieces} pieces")
    # A tiny per-op floor so that runs of zero-FLOP ops (views) still spread instead of piling up.
    weights = [int(n.cost.get("flops_fwd", 0)) + int(n.cost.get("flops_bwd", 0)) + 1 for n in ops]
    cuts = _min_max_segments(weights, pieces)
    return contiguous_assignment(graph, cuts)


def contiguous_assignment(graph: IRGraph, starts: list[int]) -> dict[str, int]:
    """Every IR node -> its piece, for pieces that begin at the op positions ``starts`` (ascending,
    excluding 0) of the topological op order. Placeholders and variables go with their first user, as
    in Table 3 (labels are fed where the loss is computed)."""
    ops = op_nodes(graph)
    assignment: dict[str, int] = {}
    for i, n in enumerate(ops):
        assignment[n.name] = sum(1 for c in starts if c <= i)
    for n in graph.nodes:
        if n.kind in ("placeholder", "variable"):
            first_user = next((u for u in n.users if u in assignment), None)
            assignment[n.name] = assignment[first_user] if first_user else 0
    return assignment


def _min_max_segments(weights: list[int], pieces: int) -> list[int]:
    """Start indexes (excluding 0) of ``pieces`` contiguous non-empty segments minimising the max sum."""

    def greedy(limit: int) -> list[int] | None:
        cuts, total = [], 0
        for i, w in enumerate(weights):
            if total + w > limit and total > 0:
                cuts.append(i)
                total = 0
            total += w
        return cuts if len(cuts) + 1 <= pieces else None

    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    cuts = greedy(lo) or []
    # Fewer segments than asked: split the largest segments further (never raises the max).
    while len(cuts) + 1 < pieces:
        bounds = [0, *cuts, len(weights)]
        candidates = [
            (bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] > 1
        ]
        _, i = max(candidates)
        cuts = sorted([*cuts, bounds[i] + (bounds[i + 1] - bounds[i]) // 2])
    return cuts
