"""The execution plane's task executor: FP, BP and Update of one sub-DAG (FusionAI section 3.6).

- **FP** of a micro-batch fires once all outer required data has arrived (data placeholders are fed
  by the caller, the rest arrives through the channel); outwards data goes to every compnode user.
- **BP** runs the reversed edges: gradients for the outwards data arrive from the users (summed when
  several users read the same value), the loss is seeded with its share of the batch, and the
  gradients of received inputs go back to their producers (placeholders get none).
- **Update** applies the per-op optimizers of the job file to the parameters this sub-DAG owns.

Micro-batches follow GPipe: all FPs, then all BPs (reverse order), then one Update, so gradients
accumulate over micro-batches and equal the full-batch gradients up to float rounding.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fusionnet.dag.channel import Channel
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import SubDag
from fusionnet.dag.rebuild import build_subdag_module
from fusionnet.errors import ExecutionError


@dataclass
class StepReport:
    """What one sub-DAG did in one step."""

    step: int
    loss: float | None = None  # full-batch loss (only on the sub-DAG holding the loss)
    outputs: list[Any] = field(default_factory=list)  # infer: output value per micro-batch
    fp_seconds: float = 0.0
    bp_seconds: float = 0.0
    update_seconds: float = 0.0


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _detach(value: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


class SubDagExecutor:
    """Runs one sub-DAG. ``optimizers`` is a factory ``named_params -> list[Optimizer]`` (train only)."""

    def __init__(
        self,
        graph: IRGraph,
        subdag: SubDag,
        state: Mapping[str, torch.Tensor],
        channel: Channel,
        *,
        task: str,
        make_optimizers: Any = None,
        loss_reduction: str = "mean",
    ) -> None:
        self.graph = graph
        self.subdag = subdag
        self.channel = channel
        self.task = task
        self.loss_reduction = loss_reduction
        self.loss_name = graph.loss_node().name if graph.loss_node() else None
        self.output_refs = graph.output.input_names() if subdag.holds_output else []
        outputs = list(subdag.outwards)
        if subdag.holds_loss:
            outputs.append(self.loss_name)
        outputs.extend(r for r in self.output_refs if r not in outputs)
        self.output_names = outputs
        missing = [k for k in (*subdag.params, *subdag.buffers) if k not in state]
        if missing:
            raise ExecutionError(f"sub-DAG {subdag.index}: missing state tensors {missing[:5]}")
        self.module, self.root = build_subdag_module(
            graph,
            subdag.nodes,
            subdag.outer_required,
            outputs,
            {k: state[k] for k in subdag.params},
            {k: state[k] for k in subdag.buffers},
        )
        self.module.train(task != "infer")
        self.named_params = {k: self.root.param(k) for k in subdag.params}
        self.optimizers = make_optimizers(self.named_params) if (task == "train" and make_optimizers) else []
        self._stash: dict[int, tuple[list[Any], tuple[Any, ...]]] = {}

    # -- FP ------------------------------------------------------------------------------------
    async def forward(self, step: int, mb: int, data: Mapping[str, Any]) -> tuple[Any, ...]:
        inputs: list[Any] = []
        placeholder_target = {n: self.graph.node(n).target for n in self.subdag.placeholders}
        for name in self.subdag.outer_required:
            if name in placeholder_target:
                if placeholder_target[name] not in data:
                    raise ExecutionError(f"sub-DAG {self.subdag.index}: no data for placeholder {name!r}")
                inputs.append(data[placeholder_target[name]])
                continue
            value = await self.channel.recv(self.subdag.sources[name], ("act", step, mb, name))
            if self.task != "infer":
                # Received float tensors become leaves so their gradients can be returned in BP.
                value = tree_map(lambda v: v.detach().requires_grad_(True) if _is_float(v) else v, value)
            inputs.append(value)
        started = time.perf_counter()
        with torch.set_grad_enabled(self.task != "infer"):
            try:
                outs = self.module(*inputs)
            except Exception as e:
                raise ExecutionError(
                    f"sub-DAG {self.subdag.index}: FP of step {step} micro-batch {mb} "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
        self._fp_time += time.perf_counter() - started
        for name, value in zip(self.output_names, outs):
            for dst in self.subdag.consumers.get(name, ()):
                await self.channel.send(dst, ("act", step, mb, name), _detach(value))
        if self.task != "infer":
            self._stash[mb] = (inputs, outs)
        return outs

    # -- BP ------------------------------------------------------------------------------------
    async def backward(self, step: int, mb: int, loss_weight: float) -> None:
        inputs, outs = self._stash.pop(mb)
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor] = []
        for name, value in zip(self.output_names, outs):
            # Consumers return gradients exactly for values with a float part (see the send below).
            consumers = self.subdag.consumers.get(name, ()) if self.expects_grad(value) else ()
            leaves, _ = tree_flatten(value)
            total: list[torch.Tensor | None] = [None] * len(leaves)
            # Latest consumer first: eager autograd accumulates a value's gradients in reverse execution
            # order, and sub-DAGs are contiguous in that order, so this grouping keeps sums bit-exact.
            for dst in sorted(consumers, reverse=True):
                grads = await self.channel.recv(dst, ("grad", step, mb, name))
                flat, _ = tree_flatten(grads)
                if len(flat) != len(leaves):
                    raise ExecutionError(
                        f"sub-DAG {self.subdag.index}: gradient for {name!r} from sub-DAG "
                        f"{dst} has {len(flat)} parts, expected {len(leaves)}"
                    )
                for i, g in enumerate(flat):
                    if g is None:
                        continue
                    if not isinstance(g, torch.Tensor) or g.shape != leaves[i].shape:
                        got = getattr(g, "shape", type(g).__name__)
                        raise ExecutionError(
                            f"sub-DAG {self.subdag.index}: gradient for {name!r} from sub-DAG {dst} "
                            f"has shape {got}, expected {tuple(leaves[i].shape)}"
                        )
                    total[i] = g if total[i] is None else total[i] + g
            for leaf, g in zip(leaves, total):
                if g is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    roots.append(leaf)
                    seeds.append(g.to(leaf.dtype))
            if name == self.loss_name and self.subdag.holds_loss:
                roots.append(value)
                seeds.append(torch.full_like(value, loss_weight))
        started = time.perf_counter()
        if roots:
            try:
                torch.autograd.backward(roots, seeds)
            except Exception as e:
                raise ExecutionError(
                    f"sub-DAG {self.subdag.index}: BP of step {step} micro-batch {mb} "
                    f"failed: {type(e).__name__}: {e}"
                ) from e
        self._bp_time += time.perf_counter() - started
        for name, value in zip(self.subdag.outer_required, inputs):
            if name in self.subdag.placeholders:
                continue  # placeholders need no gradient (section 3.6)
            leaves, _spec = tree_flatten(value)
            if not self.expects_grad(value):
                continue  # nothing differentiable was received, so the producer expects nothing
            grads = [v.grad if _is_float(v) else None for v in leaves]
            await self.channel.send(self.subdag.sources[name], ("grad", step, mb, name), grads)

    def expects_grad(self, value: Any) -> bool:
        return any(_is_float(v) for v in tree_flatten(value)[0])

    # -- Update --------------------------------------------------------------------------------
    def update(self) -> None:
        started = time.perf_counter()
        for opt in self.optimizers:
            opt.step()
        for p in self.named_params.values():
            p.grad = None
        self._update_time += time.perf_counter() - started

    def gradients(self) -> dict[str, torch.Tensor]:
        return {k: p.grad.detach().clone() for k, p in self.named_params.items() if p.grad is not None}

    def zero_grad(self) -> None:
        for p in self.named_params.values():
            p.grad = None

    # -- a whole step --------------------------------------------------------------------------
    async def run_step(
        self, step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
        """GPipe step: FP of every micro-batch, BP in reverse order, then Update (train)."""
        self._fp_time = self._bp_time = self._update_time = 0.0
        report = StepReport(step=step)
        batch = sum(sizes)
        losses: list[float] = []
        for mb, data in enumerate(microbatches):
            outs = await self.forward(step, mb, data)
            values = dict(zip(self.output_names, outs))
            if self.subdag.holds_loss:
                losses.append(float(values[self.loss_name].detach()) * self._loss_weight(sizes[mb], batch))
            if self.task == "infer" and self.subdag.holds_output:
                report.outputs.append(_detach(_rebuild_output(self.graph, values)))
        if self.task != "infer":
            self.zero_grad()
            for mb in reversed(range(len(microbatches))):
                await self.backward(step, mb, self._loss_weight(sizes[mb], batch))
            if self.task == "train":
                self.update()
        if losses:
            report.loss = sum(losses)
        report.fp_seconds, report.bp_seconds, report.update_seconds = (
            self._fp_time,
            self._bp_time,
            self._update_time,
        )
        return report

    def _loss_weight(self, size: int, batch: int) -> float:
        # A "mean" loss over the whole batch is the size-weighted sum of micro-batch means.
        return size / batch if self.loss_reduction == "mean" else 1.0

    def state(self) -> dict[str, torch.Tensor]:
        """Current parameters and buffers of this sub-DAG by state key."""
        out = {k: self.root.param(k).detach().clone() for k in self.subdag.params}
        for k in self.subdag.buffers:
            out[k] = getattr(self.root, self.root.attr_of[k]).detach().clone()
        return out


def _rebuild_output(graph: IRGraph, values: Mapping[str, Any]) -> Any:
    from fusionnet.dag.rebuild import output_value

    return output_value(graph, values)
