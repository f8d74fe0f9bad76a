"""The parameter groups of a split backward: where each parameter's branch of the autograd graph joins
the path from the received inputs to the roots (the nodes whose incoming gradients I keeps for W).

The same walk as torch's pipelining (``torch.distributed.pipelining._backward``: ``reverse_closure``,
``construct_reverse_graph``, ``get_param_groups``; BSD licence, Meta Platforms), kept here because
importing that package takes 1-1.5 s (it pulls in ``torch.distributed`` and its tracer), which every
sandbox worker would pay at its first split backward, and since GPipe's and 1F1B's BPs split too
(``split_backward.input_gradients_first``), that is every training job of more than one sub-DAG.
Pure graph walks over ``torch.autograd.graph.Node`` objects; no tensor is touched.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import Node

ReverseGraph = dict[Node, list[Node]]


def node_of(t: torch.Tensor) -> Node | None:
    """A tensor's autograd node: its ``grad_fn``, or for a leaf that requires a gradient its gradient
    accumulator (created lazily, hence the throwaway view that makes it exist)."""
    if t.requires_grad and t.grad_fn is None:
        viewed = t.view_as(t).grad_fn
        if viewed is None:
            raise RuntimeError("a leaf that requires a gradient has no accumulator (made under no_grad?)")
        return viewed.next_functions[0][0]
    return t.grad_fn


def _start(nodes: Iterable[Node | None]) -> tuple[set[Node], deque[Node]]:
    """A breadth-first walk's start: the distinct nodes given, as the seen set and the queue."""
    seen: set[Node] = set()
    queue: deque[Node] = deque()
    for node in nodes:
        if node is not None and node not in seen:
            seen.add(node)
            queue.append(node)
    return seen, queue


def reverse_graph(roots: Iterable[Node | None]) -> ReverseGraph:
    """Every node reachable from ``roots``, mapped to the nodes that feed it gradients (its users in
    the forward)."""
    edges: ReverseGraph = defaultdict(list)
    _, queue = _start(roots)
    while queue:
        node = queue.popleft()
        for fn, _ in node.next_functions:
            if fn is not None:
                if not edges[fn]:
                    queue.append(fn)
                edges[fn].append(node)
    return edges


def closure(
    starts: Iterable[Node | None], stop_at: set[Node], edges: ReverseGraph
) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``starts`` along ``edges`` without entering ``stop_at``, and the nodes
    of ``stop_at`` met on the way."""
    reached, queue = _start(starts)
    met: set[Node] = set()
    while queue:
        for fn in edges[queue.popleft()]:
            if fn is None or fn in reached:
                continue
            if fn in stop_at:
                met.add(fn)
                continue
            reached.add(fn)
            queue.append(fn)
    return reached, met


def param_groups(inputs: list[Node], params: list[Node], edges: ReverseGraph) -> list[dict[str, Any]]:
    """Groups ``{"params": set of accumulators, "intermediates": set of join nodes}``: a parameter's
    walk towards the roots stops where it meets the inputs' closure; parameters meeting it at a common
    node share a group."""
    on_input_path, _ = closure(inputs, set(), edges)
    by_join: dict[Node, dict[str, set[Node]]] = {}
    for param in params:
        _, joins = closure([param], on_input_path, edges)
        group: dict[str, set[Node]] = {"params": {param}, "intermediates": joins}
        for join in joins:
            existing = by_join.get(join)
            if existing is not None:
                existing["params"] |= group["params"]
                existing["intermediates"] |= group["intermediates"]
                group = existing
            else:
                by_join[join] = group
    unique: dict[int, dict[str, Any]] = {}
    for group in by_join.values():
        unique.setdefault(id(group), group)
    return list(unique.values())
