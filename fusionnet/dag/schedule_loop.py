"""One step of a sub-DAG's pipeline schedule (mixed into ``executor.SubDagExecutor``): the program of
its actions for the step (``fusionnet.schedules``: F, B, or B split into I and W, per micro-batch),
run in order by one loop, then the fp16 found-inf agreement and the Update; the step's report holds
its loss (the size-weighted sum of micro-batch losses) and, for infer, the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    hooks: HookChain
    activations: ActivationLedger
    outbox: Outbox
    scaler: LossScaler | None
    loss_name: str | None
    loss_reduction: str
    output_names: list[str]

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
    ) -> None:
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
        self.hooks.step_started(step)
        self.activations.start_step()
        self.outbox.reset()
        self._forget_step_values()
        try:
            report = await self._step(step, microbatches, sizes)
            await self.outbox.drain()
        finally:
            self.outbox.cancel()  # a failed step leaves no send behind
        timer = self.hooks.timer.seconds
        report.activation_peak_bytes = self.activations.peak
        report.fp_seconds, report.bp_seconds, report.update_seconds = (
            timer["fp"],
            timer["bp"],
            timer["update"],
        )
        self.hooks.step_finished(step, report)
        return report

    def program(self, microbatches: int) -> tuple[Action, ...]:
        """This sub-DAG's actions for a step of ``microbatches`` micro-batches."""
        try:
            if isinstance(self.schedule, Schedule):
                if (self.schedule.stages, self.schedule.microbatches) != (self.subdags, microbatches):
                    raise ScheduleError(
                        f"schedule {self.schedule.name!r} is for {self.schedule.stages} stages x "
                        f"{self.schedule.microbatches} micro-batches, this step has "
                        f"{self.subdags} x {microbatches}"
                    )
                plan = self.schedule.for_task(self.task)
            else:
                plan = make_schedule(self.schedule, self.subdags, microbatches, self.task)
        except ScheduleError as e:
            raise ExecutionError(f"sub-DAG {self.subdag.index}: {e}") from None
        return plan.program(self.subdag.index)

    async def _step(
        self, step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
        """Runs this sub-DAG's program of the schedule; the update (and fp16's found-inf agreement,
        which grad tasks need too) comes after the last backward."""
        report = StepReport(step=step)
        batch = sum(sizes)
        losses: list[float] = []
        program = self.program(len(microbatches))
        last_bp = max((i for i, a in enumerate(program) if a.kind in ("B", "W")), default=-1)
        last_seeded = max((i for i, a in enumerate(program) if a.kind in ("B", "I")), default=-1)
        self.zero_grad()
        if self.task != "infer":
            await self.trade_rows(step, microbatches)  # tied weights' rows, before any FP (``row_trade``)
        for i, action in enumerate(program):
            mb = action.mb
            if action.kind == "F":
                values = dict(zip(self.output_names, await self.forward(step, mb, microbatches[mb])))
                if self.subdag.holds_loss:
                    loss = float(values[self.loss_name].detach())
                    losses.append(loss * self._loss_weight(sizes[mb], batch))
                if self.task == "infer" and self.subdag.holds_output:
                    report.outputs.append(_detach(_rebuild_output(self.graph, values)))
            elif action.kind == "B":
                weight = self._loss_weight(sizes[mb], batch)
                await self.backward(step, mb, weight, last=i == last_bp, last_seeded=i == last_seeded)
            elif action.kind == "I":
                weight = self._loss_weight(sizes[mb], batch)
                await self.backward_input(step, mb, weight, last_seeded=i == last_seeded)
            elif action.kind == "W":
                await self.backward_weight(step, mb, last=i == last_bp)
        if self.task != "infer":
            await self.add_traded_grads(step)
            skip = await self._agree_found_inf(step) if self.scaler is not None else False
            if self.task == "train":
                await self._run("update", step, 0, partial(self.update, skip))
        self._forget_step_values()  # the step's leaves go with its graphs
        if losses:
            report.loss = sum(losses)
        return report

    def _loss_weight(self, size: int, batch: int) -> float:
        # A "mean" loss over the whole batch is the size-weighted sum of micro-batch means.
        return size / batch if self.loss_reduction == "mean" else 1.0


def _detach(value: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


def _rebuild_output(graph: IRGraph, values: Mapping[str, Any]) -> Any:
    """The job's output from a micro-batch's values, on the CPU (results travel and are kept there)."""
    from fusionnet.dag.rebuild import output_value

    return tree_map(lambda v: v.to(HOST) if isinstance(v, torch.Tensor) else v, output_value(graph, values))
