"""The split backward of zero-bubble schedules (``fusionnet.dag.split_backward``): I then W give the
gradients of one plain backward bit for bit, with torch's parameter groups where they apply and the
plain split where they do not (first stage, a parameter sent on as a value, a tied weight)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from fusionnet.dag.split_backward import input_gradients, weight_gradients

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


@pytest.mark.parametrize("case", sorted(CASES))
def test_i_then_w_equals_one_backward(case: str) -> None:
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
            if split:
                work = input_gradients(roots, seeds, leaves, list(params))
                weight_gradients(work)
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
