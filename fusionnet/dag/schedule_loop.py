"""One step of a sub-DAG's pipeline schedule (mixed into ``executor.SubDagExecutor``): the program of
its actions for the step (``fusionnet.schedules``: F, B, or B split into I and W, per micro-batch),
run in order by one loop, then the fp16 found-inf agreement and the Update; the step's report holds
its loss (the size-weighted sum of micro-batch losses) and, for infer, the outputs.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map

from fusionnet.dag.activation_memory import ActivationLedger
from fusionnet.dag.devices import HOST
from fusionnet.dag.hooks import HookChain, Phase, StepReport
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.outbox import Outbox
from fusionnet.dag.partition import SubDag
from fusionnet.dag.precision import LossScaler
from fusionnet.errors import ExecutionError
from fusionnet.schedules import Action, Schedule, ScheduleError, make_schedule

T = TypeVar("T")


class ScheduleLoop:
    """The step loop of one sub-DAG; ``SubDagExecutor`` owns every attribute and the FP/BP below."""

    graph: IRGraph
    subdag: SubDag
    subdags: int
    task: str
    schedule: str | Schedule
    chunks: int  # sub-DAGs per device (interleaved schedules)
    hooks: HookChain
    activations: ActivationLedger
    outbox: Outbox
    scaler: LossScaler | None
    loss_name: str | None
    loss_reduction: str
    _targets: tuple[int, int] | None
    output_names: list[str]
    _weight_work: dict[int, Any]
    _deferred: list[tuple[int, bool]]
    waited_for_input: bool

    async def _run(self, phase: Phase, step: int, mb: int, work: Callable[[], T]) -> T:
        raise NotImplementedError

    def _forget_step_values(self, keep_resident: bool = True) -> None:
        raise NotImplementedError

    async def forward(self, step: int, mb: int, data: Mapping[str, Any]) -> tuple[Any, ...]:
        raise NotImplementedError

    async def backward(
        self,
        step: int,
        mb: int,
        loss_weight: float,
        *,
        last: bool | None = None,
        last_seeded: bool | None = None,
        defer_weight: bool = False,
        split: bool = True,
    ) -> None:
        raise NotImplementedError

    def weights_pending(self) -> int:
        raise NotImplementedError

    async def next_deferred_weight(self, step: int) -> None:
        raise NotImplementedError

    def grads_arrived(self, step: int, mb: int) -> bool:
        raise NotImplementedError

    async def backward_input(
        self, step: int, mb: int, loss_weight: float, *, last_seeded: bool = False
    ) -> None:
        raise NotImplementedError

    async def backward_weight(self, step: int, mb: int, *, last: bool) -> None:
        raise NotImplementedError

    async def _agree_found_inf(self, step: int) -> bool:
        raise NotImplementedError

    def update(self, skip: bool = False) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    async def trade_rows(self, step: int, microbatches: Sequence[Mapping[str, Any]]) -> None:
        raise NotImplementedError

    async def add_traded_grads(self, step: int) -> None:
        raise NotImplementedError

    # -- a whole step --------------------------------------------------------------------------
    async def run_step(
        self, step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
        """One step of the schedule: this sub-DAG's FPs and BPs in its program's order, then Update."""
        program = self.program(len(microbatches))
        reports = await run_device_step([self], [(a, 0) for a in program], step, microbatches, sizes)
        return reports[0]

    def program(self, microbatches: int) -> tuple[Action, ...]:
        """This sub-DAG's actions for a step of ``microbatches`` micro-batches."""
        return self.schedule_for(microbatches).program(self.subdag.index)

    def schedule_for(self, microbatches: int) -> Schedule:
        """The whole schedule of a step of ``microbatches`` micro-batches, cut down to the task."""
        try:
            if isinstance(self.schedule, Schedule):
                if (self.schedule.stages, self.schedule.microbatches) != (self.subdags, microbatches):
                    raise ScheduleError(
                        f"schedule {self.schedule.name!r} is for {self.schedule.stages} stages x "
                        f"{self.schedule.microbatches} micro-batches, this step has "
                        f"{self.subdags} x {microbatches}"
                    )
                return self.schedule.for_task(self.task)
            return make_schedule(self.schedule, self.subdags, microbatches, self.task, self.chunks)
        except ScheduleError as e:
            raise ExecutionError(f"sub-DAG {self.subdag.index}: {e}") from None

    def _open_step(self, step: int) -> None:
        self.hooks.step_started(step)
        self._weight_work.clear()  # a failed step's halves (their graphs) go
        self._deferred.clear()
        self.activations.start_step()
        self.outbox.reset()
        self._forget_step_values()

    def _close_step(self, step: int, report: StepReport) -> None:
        timer = self.hooks.timer.seconds
        report.activation_peak_bytes = self.activations.peak
        report.fp_seconds, report.bp_seconds, report.update_seconds = (
            timer["fp"],
            timer["bp"],
            timer["update"],
        )
        self.hooks.step_finished(step, report)

    async def _begin_actions(self, step: int, microbatches: Sequence[Mapping[str, Any]]) -> None:
        self.zero_grad()
        if self.task != "infer":
            await self.trade_rows(step, microbatches)  # tied weights' rows, before any FP (``row_trade``)

    async def _act(
        self,
        action: Action,
        step: int,
        microbatches: Sequence[Mapping[str, Any]],
        sizes: Sequence[int],
        report: StepReport,
        losses: list[float],
        *,
        last_bp: bool,
        last_seeded: bool,
        split: bool = True,
    ) -> None:
        """Runs one F, B, I or W of this sub-DAG (the update is ``_end_actions``'s); a B's W half is
        left to ``run_device_step`` (``defer_weight``), or the B runs whole (``split=False``)."""
        mb = action.mb
        if action.kind == "F":
            values = dict(zip(self.output_names, await self.forward(step, mb, microbatches[mb])))
            if self.subdag.holds_loss:
                loss = float(values[self.loss_name].detach())
                losses.append(loss * self._loss_weight(step, mb, sizes, microbatches))
            if self.task == "infer" and self.subdag.holds_output:
                report.outputs.append(_detach(_rebuild_output(self.graph, values)))
        elif action.kind == "B":
            weight = self._loss_weight(step, mb, sizes, microbatches)
            await self.backward(
                step, mb, weight, last=last_bp, last_seeded=last_seeded, defer_weight=True, split=split
            )
        elif action.kind == "I":
            weight = self._loss_weight(step, mb, sizes, microbatches)
            await self.backward_input(step, mb, weight, last_seeded=last_seeded)
        elif action.kind == "W":
            await self.backward_weight(step, mb, last=last_bp)

    async def _end_actions(self, step: int, report: StepReport, losses: list[float]) -> None:
        """After the last backward: traded rows' gradients, fp16's found-inf agreement (grad tasks need
        it too), the update (train), and the step's values forgotten."""
        if self.task != "infer":
            await self.add_traded_grads(step)
            skip = await self._agree_found_inf(step) if self.scaler is not None else False
            if self.task == "train":
                await self._run("update", step, 0, partial(self.update, skip))
        self._forget_step_values()  # the step's leaves go with its graphs
        if losses:
            report.loss = sum(losses)

    def _loss_weight(
        self, step: int, mb: int, sizes: Sequence[int], microbatches: Sequence[Mapping[str, Any]]
    ) -> float:
        """Micro-batch ``mb``'s share of the batch's loss (``runtime.loss_reduction``)."""
        if self.loss_reduction == "mean":  # over samples: the size-weighted sum of micro-batch means
            return sizes[mb] / sum(sizes)
        if not self.loss_reduction.startswith("targets:") or not self.subdag.holds_loss:
            return 1.0  # (only the loss's sub-DAG seeds a backward with it)
        # Over the batch's targets that are not ignore_index: the graph gives the micro-batch's sum.
        # Counted once per step, from the labels of every micro-batch (this sub-DAG holds the loss,
        # which reads them), before the first backward: 1F1B runs it before the last forward.
        if self._targets is None or self._targets[0] != step:
            ignore = int(self.loss_reduction.removeprefix("targets:"))
            try:
                count = sum(int((m["labels"] != ignore).sum()) for m in microbatches)
            except KeyError:
                raise ExecutionError(
                    f"sub-DAG {self.subdag.index} holds a per-target loss but not the labels"
                ) from None
            self._targets = (step, count)
        count = self._targets[1]
        return 1.0 / count if count else math.nan  # no target at all: NaN, as plain PyTorch's mean


async def together(calls: Sequence[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` of ``calls``, a single one awaited in place: most devices run one sub-DAG, and
    a gather wraps each call in a task that costs two turns of the event loop per step phase."""
    if len(calls) == 1:
        return [await calls[0]]
    return list(await asyncio.gather(*calls))


def _detach(value: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _rebuild_output(graph: IRGraph, values: Mapping[str, Any]) -> Any:
    """The job's output from a micro-batch's values, on the CPU (results travel and are kept there)."""
    from fusionnet.dag.rebuild import output_value

    return tree_map(lambda v: v.to(HOST) if isinstance(v, torch.Tensor) else v, output_value(graph, values))


async def _deferred_weights(executors: Sequence[ScheduleLoop], deferred: deque[int], step: int) -> None:
    while deferred:
        await executors[deferred.popleft()].next_deferred_weight(step)


async def run_device_step(
    executors: Sequence[ScheduleLoop],
    program: Sequence[tuple[Action, int]],
    step: int,
    microbatches: Sequence[Mapping[str, Any]],
    sizes: Sequence[int],
) -> list[StepReport]:
    """One step of one device: ``program`` is its actions in order, each with the index in
    ``executors`` of the sub-DAG it runs (one sub-DAG, or an interleaved device's chunks); one loop runs
    them all, so the device computes in the schedule's order. What every sub-DAG does before its first
    action and after its last (tied rows traded, found-inf agreed, the update) runs for all of them at
    once: those exchanges wait on the other sub-DAGs, some of which may be on this very device.

    A B runs its I half (its producers' gradients leave at its end) and leaves its W half pending; the
    device runs pending Ws, oldest first, while the next B or I would wait for its gradients, and all
    of them before its next F, W or the step's end. So the backward wave travels at I's speed where
    that is free: a stage that never waits (GPipe's last, the slowest) runs all its Is before its Ws
    and the earlier stages finish while it does; the activations held never exceed the written
    order's (every F finds no W pending), and each sub-DAG's Ws keep their order (exact sums).
    A B whose W could not wait (an F comes next) on a sub-DAG whose last F found its inputs already
    there runs whole instead: the producers keep ahead of it, so an early gradient buys nothing there,
    and a split costs 1-3 % more than a plain backward (1F1B's steady state on its slowest stage).
    ``perfmodel.simulator`` prices the same rules."""
    reports = [StepReport(step=step) for _ in executors]
    losses: list[list[float]] = [[] for _ in executors]
    last_bp, last_seeded = [-1] * len(executors), [-1] * len(executors)
    for i, (action, who) in enumerate(program):
        if action.kind in ("B", "W"):
            last_bp[who] = i
        if action.kind in ("B", "I"):
            last_seeded[who] = i
    for ex in executors:
        ex._open_step(step)
    try:
        await together([ex._begin_actions(step, microbatches) for ex in executors])
        deferred: deque[int] = deque()  # who owes the pending Ws, oldest first
        for i, (action, who) in enumerate(program):
            if action.kind == "U":
                continue  # every sub-DAG's update closes the step, below
            if action.kind in ("B", "I"):
                while deferred and not executors[who].grads_arrived(step, action.mb):
                    await executors[deferred.popleft()].next_deferred_weight(step)
            else:
                await _deferred_weights(executors, deferred, step)
            upcoming = program[i + 1][0].kind if i + 1 < len(program) else None
            split = not (action.kind == "B" and upcoming == "F" and not executors[who].waited_for_input)
            await executors[who]._act(
                action,
                step,
                microbatches,
                sizes,
                reports[who],
                losses[who],
                last_bp=i == last_bp[who],
                last_seeded=i == last_seeded[who],
                split=split,
            )
            if action.kind == "B":  # it left its W pending, or (a BP that ran whole) ran the sub-DAG's
                deferred = deque([w for w in deferred if w != who] + [who] * executors[who].weights_pending())
        await _deferred_weights(executors, deferred, step)
        await together([ex._end_actions(step, r, lost) for ex, r, lost in zip(executors, reports, losses)])
        await together([ex.outbox.drain() for ex in executors])
    finally:
        for ex in executors:
            ex.outbox.cancel()  # a failed step leaves no send behind
    for ex, report in zip(executors, reports):
        ex._close_step(step, report)
    return reports
