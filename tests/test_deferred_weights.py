"""A whole BP's weight half left pending (``dag.schedule_loop.run_device_step``): it runs while the
stage would wait for a gradient, before the next FP and at the step's end; the parameters' gradients
stay bit-exact whatever the order, and a BP that runs whole after deferred ones runs their Ws first."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import fusionnet.dag.split_backward as split_backward
from fusionnet.runtime.local import InMemorySwarm
from tests.test_executor_hooks import Recorder
from tests.test_executor_hooks import _swarm as swarm_of

pytestmark = pytest.mark.timeout(120)


def _swarm(pieces: int, microbatches: int, schedule: str = "gpipe") -> tuple[InMemorySwarm, list[Any]]:
    return swarm_of(pieces, microbatches, samples=12, steps=2, schedule=schedule)


def _params(swarm: InMemorySwarm) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for ex in swarm.executors for name, p in ex.named_params.items()}


def _run(swarm: InMemorySwarm, steps: list[Any]) -> dict[str, torch.Tensor]:
    async def run() -> None:
        for s in steps:
            await swarm.step(s)

    asyncio.run(run())
    return _params(swarm)


def _bp_order(log: list[tuple[Any, ...]], step: int = 0) -> list[int]:
    """The micro-batches of one step's BP stretches (an I, a W or a whole BP each), in order."""
    return [e[4] for e in log if e[1:4] == ("before", "bp", step)]


@pytest.mark.parametrize("gradients_wait", [True, False])
def test_a_middle_stage_runs_a_pending_w_only_while_its_gradients_are_not_here(gradients_wait: bool) -> None:
    reference = _run(*_swarm(3, 3))
    swarm, steps = _swarm(3, 3)
    middle = swarm.executors[1]
    log: list[tuple[Any, ...]] = []
    middle.hooks.add(Recorder("middle", log))
    # The loop asks the channel whether a B's gradients are here; the answer decides the order only.
    middle.channel.arrived = lambda src, key: not gradients_wait  # type: ignore[method-assign]
    got = _run(swarm, steps)
    if gradients_wait:  # each wait is filled by the W before it: I2 W2 I1 W1 I0 W0
        assert _bp_order(log) == [2, 2, 1, 1, 0, 0]
    else:  # nothing to wait for: the Is first, then the Ws, oldest first
        assert _bp_order(log) == [2, 1, 0, 2, 1, 0]
    assert got.keys() == reference.keys()
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


def test_no_w_is_pending_when_a_forward_runs() -> None:
    """1F1B's stages alternate F and B: each W runs before the next F, so a stage holds no more
    micro-batches' activations than the written order has it hold."""
    swarm, steps = _swarm(3, 4, "1f1b")
    reference, _ = _swarm(3, 4, "1f1b")
    pending_at_forward: list[int] = []
    for ex in swarm.executors:
        real = ex.forward

        async def forward(step: int, mb: int, data: Any, ex: Any = ex, real: Any = real) -> Any:
            pending_at_forward.append(ex.weights_pending())
            return await real(step, mb, data)

        ex.forward = forward  # type: ignore[method-assign]
    _run(swarm, steps[:1])
    _run(reference, steps[:1])
    assert len(pending_at_forward) == 12 and not any(pending_at_forward)
    assert [ex.activations.peak for ex in swarm.executors] == [
        ex.activations.peak for ex in reference.executors
    ]


@pytest.mark.parametrize("inputs_there", [True, False])
def test_a_b_runs_whole_where_its_w_could_not_wait_and_its_producer_keeps_ahead(inputs_there: bool) -> None:
    """On 1F1B's last stage an F follows each B but the last: where that stage's F found its inputs
    already there (its producer keeps ahead), nobody waits for the B's input gradients, so it runs as
    one plain backward (one stretch); where the F waited, the B splits (I, then W before the next F)."""
    reference = _run(*_swarm(2, 4, "1f1b"))
    swarm, steps = _swarm(2, 4, "1f1b")
    last = swarm.executors[1]
    log: list[tuple[Any, ...]] = []
    last.hooks.add(Recorder("last", log))
    last.channel.arrived = lambda src, key: inputs_there  # type: ignore[method-assign]
    got = _run(swarm, steps)
    stretches = [(e[2], e[4]) for e in log if e[1] == "before" and e[3] == 0 and e[2] in ("fp", "bp")]
    split = [] if inputs_there else [("bp", 0), ("bp", 1), ("bp", 2)]  # the W halves
    want = [("fp", 0), ("bp", 0), ("fp", 1), ("bp", 1), ("fp", 2), ("bp", 2), ("fp", 3), ("bp", 3), ("bp", 3)]
    for w in split:
        want.insert(want.index(w) + 1, w)
    assert stretches == want  # the last B always splits: the first stage's last BP waits for its I
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


def test_a_bp_run_whole_after_deferred_ones_runs_their_ws_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a BP does not split (no parameter groups), the deferred Ws of the BPs before it run
    first, so the parameters' gradients are summed in the schedule's order: bit-exact."""
    reference = _run(*_swarm(2, 3))
    swarm, steps = _swarm(2, 3)
    last = swarm.executors[1]
    real = split_backward._param_groups
    calls = {"n": 0}

    def second_whole(*args: Any) -> Any:
        calls["n"] += 1
        return None if calls["n"] % 3 == 2 else real(*args)  # each step's second BP of the last stage

    monkeypatch.setattr(split_backward, "_param_groups", second_whole)
    log: list[tuple[Any, ...]] = []
    last.hooks.add(Recorder("last", log))
    got = _run(swarm, steps)
    # I2, then B1 whole (after W2 inside its stretch), then I0 and W0
    assert _bp_order(log) == [2, 1, 0, 0]
    assert last.weights_pending() == 0 and not last._weight_work
    for name in reference:
        assert torch.equal(got[name], reference[name]), name
