"""A backward pass split in two (zero-bubble schedules): I, the gradients of a sub-DAG's received
inputs (the earlier stages wait for them), then W, later, the gradients of its parameters.

I runs ``torch.autograd.grad`` to the input leaves on a retained graph and keeps (pre-hooks) the
gradients that reach the nodes where the parameters' branches join the input's path (the parameter
groups of torch's pipelining, ``param_groups``); W runs only those
parameter branches from the kept gradients into ``.grad`` (what torch's ``stage_backward_weight`` does,
through autograd's own accumulation: ``_grouped_weight_gradients``). Both
halves run the ops a plain backward runs, so the gradients are the same (bit-exact on the models
tested). Where that split does not apply (nothing received needs a gradient: the first stage; a
parameter's branch never joins the inputs' path, so it would get no gradient; or joins it at several
nodes: a tied weight) I computes the input gradients alone and W runs the backward again into the
parameters only: the same ops again, exact, at the price of recomputing the input side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from fusionnet.dag.param_groups import closure, node_of, param_groups, reverse_graph


@dataclass
class WeightWork:
    """What W needs: torch's parameter groups, or (without them) the roots and seeds again."""

    params: list[torch.Tensor]
    groups: list[dict[str, Any]] | None = None
    roots: list[torch.Tensor] | None = None
    seeds: list[torch.Tensor] | None = None


Tensors = Sequence[torch.Tensor]


def _param_groups(roots: Tensors, leaves: Tensors, params: Tensors) -> list[dict[str, Any]] | None:
    """torch's parameter groups (parameters + the nodes where their branches join the inputs' path),
    or None where they would leave a reachable parameter without its gradient."""
    if not leaves or not roots:
        return None
    root_fns = [f for f in map(node_of, roots) if f is not None]
    reverse = reverse_graph(root_fns)
    leaf_fns = [f for f in map(node_of, leaves) if f is not None]
    # Every root must depend on the received inputs: then each path from a root to a parameter meets
    # the inputs' path, where I keeps the gradient. (A root that does not, e.g. a parameter sent on
    # as a value, would seed a parameter directly, and that seed would be lost.)
    on_input_path, _ = closure(leaf_fns, set(), reverse)
    if not all(f in on_input_path for f in root_fns):
        return None
    reachable = [f for f in map(node_of, params) if f is not None and f in reverse]
    groups = param_groups(leaf_fns, reachable, reverse)
    covered: set[Any] = set()
    for group in groups:
        if len(group["intermediates"]) != 1:
            # A parameter whose branches join the inputs' path at several nodes (a tied weight): torch's
            # W pass for such groups gave wrong gradients here, so the plain split handles them.
            return None
        covered |= group["params"]
        group["intermediates"] = list(group["intermediates"])
    return groups if all(f in covered for f in reachable) else None


def _capture(groups: list[dict[str, Any]]) -> list[Any]:
    """Pre-hooks that keep the gradients arriving at each group's join nodes during I."""

    def hook_for(group: dict[str, Any], i: int) -> Any:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            group["grads"][i] = grad_outputs

        return hook

    handles = []
    for group in groups:
        group["grads"] = [None] * len(group["intermediates"])
        for i, node in enumerate(group["intermediates"]):
            handles.append(node.register_prehook(hook_for(group, i)))
    return handles


def input_gradients(
    roots: list[torch.Tensor], seeds: list[torch.Tensor], leaves: Tensors, params: list[torch.Tensor]
) -> WeightWork:
    """I: adds to ``leaf.grad`` of every input leaf (a leaf read by every micro-batch of a step sums
    them, as a plain backward would) and returns W's work."""
    return _input_gradients(roots, seeds, leaves, params, _param_groups(roots, leaves, params))


def input_gradients_first(
    roots: list[torch.Tensor],
    seeds: list[torch.Tensor],
    leaves: Tensors,
    params: list[torch.Tensor],
    before_whole: Callable[[], None] | None = None,
    split: bool = True,
) -> WeightWork | None:
    """A whole BP whose input gradients the producers wait for (GPipe's or 1F1B's B on a stage after
    the first): I now, so they can leave while W runs, and W's work returned; or, where the split
    would cost more than it saves (no input leaves, or no parameter groups, so W would run the
    input side again), the BP whole, and None. I then W is the plain BP's ops in two passes: on a
    4-block GPT-2 stage I took 0.57 of a plain BP and I + W 1.00-1.03 of it. ``split=False``: the BP
    whole anyway (the caller knows nobody waits for its input gradients); ``before_whole`` runs just
    before a whole BP (the caller's deferred Ws, which must accumulate first)."""
    groups = _param_groups(roots, leaves, params) if split else None  # None without leaves or roots too
    if groups is None:
        if before_whole is not None:
            before_whole()
        if roots:
            torch.autograd.backward(roots, seeds)
        return None
    return _input_gradients(roots, seeds, leaves, params, groups)


def _input_gradients(
    roots: list[torch.Tensor],
    seeds: list[torch.Tensor],
    leaves: Tensors,
    params: list[torch.Tensor],
    groups: list[dict[str, Any]] | None,
) -> WeightWork:
    handles = _capture(groups) if groups else []
    try:
        if roots and leaves:
            grads = torch.autograd.grad(roots, list(leaves), seeds, retain_graph=True, allow_unused=True)
            for leaf, g in zip(leaves, grads):
                if g is not None:
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
    finally:
        for handle in handles:
            handle.remove()
    if groups is not None and all(g is not None for group in groups for g in group["grads"]):
        return WeightWork(params, groups=groups)
    return WeightWork(params, roots=roots, seeds=seeds)  # W runs the backward again, params only


def weight_gradients(work: WeightWork) -> None:
    """W: accumulates the parameters' gradients of one micro-batch into ``.grad``; frees the graph."""
    if work.groups is not None:
        _grouped_weight_gradients(work.params, work.groups)
        return
    if work.roots and work.params:
        torch.autograd.backward(work.roots, work.seeds, inputs=work.params)


def _grouped_weight_gradients(params: list[torch.Tensor], groups: list[dict[str, Any]]) -> None:
    """Each group's branch from the gradient kept at its join node into its parameters' ``.grad``, one
    backward per group (a group's branch never reaches another group's join node, so nothing is counted
    twice). What torch's ``stage_backward_weight`` computes, but accumulated by autograd itself
    (``AccumulateGrad``, as a plain backward does) instead of ``torch.autograd.grad`` then ``.grad +=``:
    the same sums in the same order, bit for bit, and on the pipeline benchmark's MLP (1024 x 4096
    linears, 16 rows) W took 36-45 ms a micro-batch against 71-84 ms torch's way."""
    param_of = {node_of(p): p for p in params}
    for group in groups:
        edges, seeds = [], []
        for grads, node in zip(group.pop("grads"), group.pop("intermediates")):
            for i, grad in enumerate(grads):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(grad)
        targets = [param_of[n] for n in group["params"] if n in param_of]
        if edges and targets:
            torch.autograd.backward(edges, seeds, inputs=targets)
