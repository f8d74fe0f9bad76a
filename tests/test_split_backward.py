"""The split backward of zero-bubble schedules (``fusionnet.dag.split_backward``): I then W give the
gradients of one plain backward bit for bit, with torch's parameter groups where they apply and the
plain split where they do not (first stage, a parameter sent on as a value, a tied weight). A whole
BP that sends its input gradients first (``input_gradients_first``: GPipe's and 1F1B's B on a later
stage) splits only where W would not run the input side again, and equals one backward too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fusionnet.dag.split_backward import input_gradients, input_gradients_first, weight_gradients

Body = Callable[[list[torch.Tensor], list[torch.nn.Parameter]], list[torch.Tensor]]


def _mlp(xs: list[torch.Tensor], ps: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    h = torch.relu(F.linear(xs[0], ps[0], ps[1]))
    return [F.linear(h, ps[2]).sum()]


def _tied(xs: list[torch.Tensor], ps: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    h = F.gelu(F.linear(xs[0], ps[0], ps[1]))
    return [(F.linear(h, ps[0]) + xs[1]).square().sum()]


def _param_as_output(xs: list[torch.Tensor], ps: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [F.linear(xs[0], ps[0]).sum(), ps[1]]  # ps[1] is sent on: its gradient comes back


def _unused_param(xs: list[torch.Tensor], ps: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [F.linear(xs[0], ps[0]).sum()]


CASES: dict[str, tuple[Body, list[tuple[int, ...]], int]] = {
    # name: (body, parameter shapes, received inputs)
    "mlp": (_mlp, [(8, 8), (8,), (4, 8)], 1),
    "tied": (_tied, [(8, 8), (8,)], 2),
    "param_as_output": (_param_as_output, [(4, 8), (8,)], 1),
    "unused_param": (_unused_param, [(4, 8), (3,)], 1),
    "first_stage": (_mlp, [(8, 8), (8,), (4, 8)], 0),
}


# The cases where a whole BP is split (W runs from the kept gradients); elsewhere it runs whole.
SPLIT_FIRST = {"mlp", "unused_param"}


@pytest.mark.parametrize("mode", ["zero-bubble", "whole BP"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_i_then_w_equals_one_backward(case: str, mode: str) -> None:
    body, shapes, received = CASES[case]
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    data = [torch.randn(3, 8, generator=gen) for _ in range(2)]

    def run(split: bool) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        for p in params:
            p.grad = None
        input_grads: list[torch.Tensor | None] = []
        for _mb in range(2):  # two micro-batches accumulate into the parameters
            xs = [d.clone().requires_grad_(i < received) for i, d in enumerate(data)]
            roots = body(xs, params)
            seeds = [torch.ones_like(r) for r in roots]
            leaves = [x for x in xs if x.requires_grad]
            if split and mode == "zero-bubble":
                work = input_gradients(roots, seeds, leaves, list(params))
                weight_gradients(work)
            elif split:
                first = input_gradients_first(roots, seeds, leaves, list(params))
                assert (first is not None) == (case in SPLIT_FIRST)
                if first is not None:
                    assert first.groups is not None  # never the split that reruns the input side
                    weight_gradients(first)
            else:
                torch.autograd.backward(roots, seeds)
            input_grads += [x.grad for x in xs]
        return input_grads, [p.grad for p in params]

    plain, split = run(False), run(True)
    for a, b in zip(plain[0] + plain[1], split[0] + split[1]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_plain_mlp_uses_the_cheap_weight_pass() -> None:
    """Where torch's parameter groups apply, W does not run the backward from the roots again."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 8), (8,), (4, 8)]]
    x = torch.randn(3, 8, requires_grad=True)
    roots = _mlp([x], params)
    work = input_gradients(roots, [torch.ones_like(roots[0])], [x], params)
    assert work.groups and work.roots is None


def test_deferred_weight_passes_equal_plain_backwards_in_layout_too() -> None:
    """ZB-H1's order on a later stage: I of micro-batches 0 and 1, then their W's. The gradients equal two
    plain backwards bit for bit, in the parameters' layout."""
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(16, 8), (16,), (4, 16)]]
    data = [torch.randn(5, 8, generator=gen) for _ in range(2)]

    def body(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, params[0], params[1])), params[2]).square().sum()

    def grads(split: bool) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        works = []
        for d in data:
            x = d.clone().requires_grad_(True)
            root = body(x)
            if split:
                works.append(input_gradients([root], [torch.ones_like(root)], [x], list(params)))
            else:
                root.backward()
        for work in works:
            assert work.groups
            weight_gradients(work)
        return [p.grad for p in params]  # type: ignore[misc]

    for a, b, p in zip(grads(False), grads(True), params):
        assert torch.equal(a, b)
        assert b.stride() == p.stride()


@pytest.mark.parametrize("case", sorted(CASES))
def test_param_groups_walk_the_graph_as_torch_s_pipelining_does(case: str) -> None:
    """``param_groups`` keeps torch's walk (``torch.distributed.pipelining._backward``) without its
    import: the same reverse graph, closures and groups, node for node."""
    from torch.distributed.pipelining import _backward as torch_walk

    from fusionnet.dag.param_groups import closure, node_of, param_groups, reverse_graph

    body, shapes, received = CASES[case]
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    xs = [torch.randn(3, 8, generator=gen).requires_grad_(i < max(received, 1)) for i in range(2)]
    outs = body(xs, params)
    roots = [node_of(r) for r in outs]
    assert roots == [torch_walk._get_grad_fn_or_grad_acc(r) for r in outs]
    mine, theirs = reverse_graph(roots), torch_walk.construct_reverse_graph(roots)
    assert {k: list(v) for k, v in mine.items()} == {k: list(v) for k, v in theirs.items()}
    leaves = [node_of(x) for x in xs if x.requires_grad]
    assert closure(leaves, set(), mine) == torch_walk.reverse_closure(leaves, set(), theirs)
    nodes = [node_of(p) for p in params]
    reachable = [n for n in nodes if n in mine]

    def as_sets(groups: list[dict[str, Any]]) -> set[tuple[frozenset[Any], frozenset[Any]]]:
        return {(frozenset(g["params"]), frozenset(g["intermediates"])) for g in groups}

    assert as_sets(param_groups(leaves, reachable, mine)) == as_sets(
        torch_walk.get_param_groups(leaves, reachable, theirs)
    )
