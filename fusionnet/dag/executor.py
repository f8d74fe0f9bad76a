"""The execution plane's task executor: FP, BP and Update of one sub-DAG (FusionAI section 3.6).

- **FP** of a micro-batch fires once all outer required data has arrived (data placeholders are fed
  by the caller, the rest arrives through the channel); outwards data goes to every compnode user.
- **BP** runs the reversed edges: gradients for the outwards data arrive from the users (summed when
  several users read the same value), the loss is seeded with its share of the batch, and the
  gradients of received inputs go back to their producers (placeholders get none).
- **Update** applies the per-op optimizers of the job file to the parameters this sub-DAG owns.

Micro-batches follow GPipe: all FPs, then all BPs (reverse order), then one Update, so gradients
accumulate over micro-batches and equal the full-batch gradients up to float rounding.

Compute never runs on the event loop (design decision): with a ``compute`` pool (a compnode's single
compute thread) every FP, BP and Update stretch runs there while the loop keeps serving heartbeats,
RPCs and the data path. Receives wait on the loop, and sends are started on the loop without being
awaited, so the next micro-batch computes while the last one's outputs travel; the step waits for its
sends at its end, and a failed send ends the step at its next receive. Without a pool (``run --local``,
the calibration) the stretches run inline: the same code and the same op order, so the same bits.
Hooks (``fusionnet.dag.hooks``) run around every stretch.

Mixed precision (``fusionnet.dag.precision``): FP runs under the job's autocast, so activations and
their gradients are in the compute dtype where autocast made them so, and travel as such. fp16 scales
the loss seed; the last BP unscales this sub-DAG's gradients and notes whether one is inf/nan; before
Update every executor sends its flag to every other one (key ``("grad", step, 0, FOUND_INF_NODE)``)
and all skip, or all step, together, as the single-process scaler would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten, tree_map

from fusionnet.dag.channel import Channel
from fusionnet.dag.devices import (
    HOST,
    host_copy,
    host_ready,
    is_out_of_memory,
    release_cached_memory,
    to_device,
    to_host,
)
from fusionnet.dag.hooks import ExecutorHook, HookChain, Phase, StepReport
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.partition import SubDag
from fusionnet.dag.precision import FOUND_INF_NODE, autocast, make_scaler
from fusionnet.dag.rebuild import build_subdag_module
from fusionnet.errors import DeviceMemoryError, ExecutionError

T = TypeVar("T")


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _detach(value: Any) -> Any:
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


class Outbox:
    """Sends in flight for one step: started on the loop, awaited together at the end of the step."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: asyncio.Future[None] | None = None

    def reset(self) -> None:
        self.cancel()
        self._failed = asyncio.get_running_loop().create_future()

    def start(self, send: Awaitable[None]) -> None:
        task = asyncio.ensure_future(send)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def guard(self, receive: Awaitable[T]) -> T:
        """Awaits ``receive``, or raises the error of a send that failed meanwhile (no peer would
        answer a step whose data never left)."""
        failed = self._failed
        if failed is None:
            return await receive
        if failed.done():
            failed.result()
        waiting = asyncio.ensure_future(receive)
        try:
            await asyncio.wait({waiting, failed}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the step was cancelled: the receive goes with it
            waiting.cancel()
            raise
        if not waiting.done():
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            failed.result()
        return waiting.result()

    async def drain(self) -> None:
        """Waits for every send; raises the first failure."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks))
        if self._failed is not None and self._failed.done():
            self._failed.result()

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._tasks.clear()
        failed = self._failed
        if failed is not None and not failed.done():
            failed.cancel()
        elif failed is not None and not failed.cancelled():
            failed.exception()  # retrieved: no "exception was never retrieved" warning


class SubDagExecutor:
    """Runs one sub-DAG. ``optimizers`` is a factory ``named_params -> list[Optimizer]`` (train only);
    ``compute`` the pool FP/BP/Update run on (None: inline); ``hooks`` run around each of them;
    ``precision`` the job's autocast (``subdags``, the job's sub-DAG count, is who shares fp16's flag);
    ``device`` where parameters, buffers, gradients and optimizer state live and FP/BP/Update run
    (``fusionnet.dag.devices``: values come in and go out as CPU tensors)."""

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
        compute: Executor | None = None,
        hooks: Sequence[ExecutorHook] = (),
        precision: str = "fp32",
        subdags: int = 1,
        device: torch.device = HOST,
    ) -> None:
        self.graph = graph
        self.subdag = subdag
        self.channel = channel
        self.task = task
        self.loss_reduction = loss_reduction
        self.compute = compute
        self.hooks = HookChain(hooks)
        self.precision = precision
        self.subdags = subdags
        self.device = torch.device(device)
        self.scaler = make_scaler(precision) if task != "infer" else None
        self._found_inf = False  # this sub-DAG's gradients of the current step held an inf/nan
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
        try:  # built on the CPU (cloned from the state), then moved: the device holds one copy
            self.module.to(self.device)
            self.root.to(self.device)
        except Exception as e:
            raise self._device_error("placing its state", e) from e
        self.named_params = {k: self.root.param(k) for k in subdag.params}
        self.optimizers = make_optimizers(self.named_params) if (task == "train" and make_optimizers) else []
        self._stash: dict[int, tuple[list[Any], tuple[Any, ...]]] = {}
        self.outbox = Outbox()
        self._placeholder_target = {n: graph.node(n).target for n in subdag.placeholders}

    async def _run(self, phase: Phase, step: int, mb: int, work: Callable[[], T]) -> T:
        """One compute stretch, between the hooks, on the compute pool (or inline without one)."""
        call = partial(self.hooks.run, phase, step, mb, work)
        if self.compute is None:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self.compute, call)

    def _device_type(self) -> str:
        """Where this sub-DAG computes (its parameters' device), for autocast."""
        return next((p.device.type for p in self.named_params.values()), self.device.type)

    def _device_error(self, what: str, e: Exception) -> ExecutionError:
        """A device OOM as ``DeviceMemoryError`` (the broker places the job again without this
        compnode), its cached blocks given back; anything else as it is."""
        if not is_out_of_memory(e):
            raise e
        release_cached_memory(self.device)
        return DeviceMemoryError(
            f"sub-DAG {self.subdag.index}: {what} ran out of memory on {self.device}: {str(e)[:300]}"
        )

    def _failed(self, what: str, step: int, mb: int, e: Exception) -> ExecutionError:
        if is_out_of_memory(e):
            return self._device_error(f"{what} of step {step} micro-batch {mb}", e)
        return ExecutionError(
            f"sub-DAG {self.subdag.index}: {what} of step {step} micro-batch {mb} "
            f"failed: {type(e).__name__}: {e}"
        )

    def drop_inflight(self) -> None:
        """Forgets a failed step's stashed activations and gradients (after a device OOM, the memory
        they hold is what the next attempt needs)."""
        self._stash.clear()
        self.zero_grad()
        release_cached_memory(self.device)

    def _send_out(self, dst: int, key: Any, value: Any, ready: Any) -> None:
        """Starts a send of ``to_host``'s copy, once its device-to-host copy is done."""

        async def send() -> None:
            await host_ready(ready)
            await self.channel.send(dst, key, value)

        self.outbox.start(send() if ready is not None else self.channel.send(dst, key, value))

    # -- FP ------------------------------------------------------------------------------------
    async def forward(self, step: int, mb: int, data: Mapping[str, Any]) -> tuple[Any, ...]:
        inputs: list[Any] = []
        for name in self.subdag.outer_required:
            if name in self._placeholder_target:
                if self._placeholder_target[name] not in data:
                    raise ExecutionError(f"sub-DAG {self.subdag.index}: no data for placeholder {name!r}")
                inputs.append(data[self._placeholder_target[name]])
                continue
            value = await self.outbox.guard(
                self.channel.recv(self.subdag.sources[name], ("act", step, mb, name))
            )
            inputs.append(value)
        received = [n not in self._placeholder_target for n in self.subdag.outer_required]

        def work() -> tuple[tuple[Any, ...], list[Any], Any]:
            try:
                placed = [self._place_input(v, leaf) for v, leaf in zip(inputs, received)]
                # Grad mode is per thread: set it on the thread that computes.
                with (
                    torch.set_grad_enabled(self.task != "infer"),
                    autocast(self.precision, self._device_type()),
                ):
                    outs = self.module(*placed)
            except Exception as e:
                raise self._failed("FP", step, mb, e) from e
            inputs[:] = placed  # the leaves BP reads the gradients of
            sent = {n: v for n, v in zip(self.output_names, outs) if self.subdag.consumers.get(n)}
            host, ready = to_host(sent, self.device)
            return outs, host, ready

        outs, host, ready = await self._run("fp", step, mb, work)
        for name, value in host.items():
            for dst in self.subdag.consumers.get(name, ()):
                self._send_out(dst, ("act", step, mb, name), value, ready)
        if self.task != "infer":
            self._stash[mb] = (inputs, outs)
        return outs

    def _place_input(self, value: Any, received: bool) -> Any:
        """An FP input on this sub-DAG's device; received float tensors become leaves so their
        gradients can be returned in BP."""
        value = to_device(value, self.device)
        if received and self.task != "infer":
            value = tree_map(lambda v: v.detach().requires_grad_(True) if _is_float(v) else v, value)
        return value

    # -- BP ------------------------------------------------------------------------------------
    async def backward(self, step: int, mb: int, loss_weight: float) -> None:
        inputs, outs = self._stash.pop(mb)
        received: list[tuple[str, Any, list[tuple[int, Any]]]] = []
        for name, value in zip(self.output_names, outs):
            # Consumers return gradients exactly for values with a float part (see the send below).
            consumers = self.subdag.consumers.get(name, ()) if self.expects_grad(value) else ()
            # Latest consumer first: eager autograd accumulates a value's gradients in reverse execution
            # order, and sub-DAGs are contiguous in that order, so this grouping keeps sums bit-exact.
            grads = [
                (dst, await self.outbox.guard(self.channel.recv(dst, ("grad", step, mb, name))))
                for dst in sorted(consumers, reverse=True)
            ]
            received.append((name, value, grads))

        def work() -> tuple[dict[str, list[Any]], Any]:
            try:
                placed = [(n, v, to_device(g, self.device)) for n, v, g in received]
                roots, seeds = self._seeds(placed, loss_weight)
                if roots:
                    torch.autograd.backward(roots, seeds)
            except ExecutionError:
                raise
            except Exception as e:
                raise self._failed("BP", step, mb, e) from e
            if mb == 0 and self.scaler is not None:  # the step's last BP: the gradients are complete
                self._found_inf = self.scaler.unscale_(p.grad for p in self.named_params.values())
            back = {}
            for name, value in zip(self.subdag.outer_required, inputs):
                if name in self.subdag.placeholders:
                    continue  # placeholders need no gradient (section 3.6)
                if not self.expects_grad(value):
                    continue  # nothing differentiable was received, so the producer expects nothing
                back[name] = [v.grad if _is_float(v) else None for v in tree_flatten(value)[0]]
            return to_host(back, self.device)

        back, ready = await self._run("bp", step, mb, work)
        for name, grads in back.items():
            self._send_out(self.subdag.sources[name], ("grad", step, mb, name), grads, ready)

    def _seeds(
        self, received: list[tuple[str, Any, list[tuple[int, Any]]]], loss_weight: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The roots and seed gradients of one BP: received gradients summed per output leaf (in the
        order received), plus the loss seeded with its share of the batch."""
        roots: list[torch.Tensor] = []
        seeds: list[torch.Tensor] = []
        for name, value, grads in received:
            leaves, _ = tree_flatten(value)
            total: list[torch.Tensor | None] = [None] * len(leaves)
            for dst, got in grads:
                flat, _ = tree_flatten(got)
                if len(flat) != len(leaves):
                    raise ExecutionError(
                        f"sub-DAG {self.subdag.index}: gradient for {name!r} from sub-DAG "
                        f"{dst} has {len(flat)} parts, expected {len(leaves)}"
                    )
                for i, g in enumerate(flat):
                    if g is None:
                        continue
                    if not isinstance(g, torch.Tensor) or g.shape != leaves[i].shape:
                        shape = getattr(g, "shape", type(g).__name__)
                        raise ExecutionError(
                            f"sub-DAG {self.subdag.index}: gradient for {name!r} from sub-DAG {dst} "
                            f"has shape {shape}, expected {tuple(leaves[i].shape)}"
                        )
                    total[i] = g if total[i] is None else total[i] + g
            for leaf, g in zip(leaves, total):
                if g is not None and isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    roots.append(leaf)
                    seeds.append(g.to(leaf.dtype))
            if name == self.loss_name and self.subdag.holds_loss:
                roots.append(value)
                seed = loss_weight if self.scaler is None else self.scaler.loss_seed(loss_weight)
                seeds.append(torch.full_like(value, seed))
        return roots, seeds

    def expects_grad(self, value: Any) -> bool:
        return any(_is_float(v) for v in tree_flatten(value)[0])

    # -- Update --------------------------------------------------------------------------------
    async def _agree_found_inf(self, step: int) -> bool:
        """fp16: whether any sub-DAG of the job found an inf/nan gradient this step (every executor
        sends its flag to every other one, then reads theirs), and the scale updated by it."""
        assert self.scaler is not None
        found = self._found_inf
        others = [i for i in range(self.subdags) if i != self.subdag.index]
        key = ("grad", step, 0, FOUND_INF_NODE)
        flag = torch.tensor([1.0 if found else 0.0])
        for dst in others:
            self.outbox.start(self.channel.send(dst, key, flag))
        for src in others:
            got = await self.outbox.guard(self.channel.recv(src, key))
            if not isinstance(got, torch.Tensor) or got.numel() != 1:
                raise ExecutionError(f"sub-DAG {self.subdag.index}: malformed found-inf flag from {src}")
            found = found or bool(got.item() != 0)
        self.scaler.update(found)
        return found

    def update(self, skip: bool = False) -> None:
        for opt in self.optimizers if not skip else ():
            opt.step()
        for p in self.named_params.values():
            p.grad = None

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients, as CPU copies."""
        return host_copy({k: p.grad for k, p in self.named_params.items() if p.grad is not None})

    def zero_grad(self) -> None:
        for p in self.named_params.values():
            p.grad = None

    # -- a whole step --------------------------------------------------------------------------
    async def run_step(
        self, step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
        """GPipe step: FP of every micro-batch, BP in reverse order, then Update (train)."""
        self.hooks.step_started(step)
        self.outbox.reset()
        try:
            report = await self._step(step, microbatches, sizes)
            await self.outbox.drain()
        finally:
            self.outbox.cancel()  # a failed step leaves no send behind
        timer = self.hooks.timer.seconds
        report.fp_seconds, report.bp_seconds, report.update_seconds = (
            timer["fp"],
            timer["bp"],
            timer["update"],
        )
        self.hooks.step_finished(step, report)
        return report

    async def _step(
        self, step: int, microbatches: Sequence[Mapping[str, Any]], sizes: Sequence[int]
    ) -> StepReport:
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
            skip = await self._agree_found_inf(step) if self.scaler is not None else False
            if self.task == "train":
                await self._run("update", step, 0, partial(self.update, skip))
        if losses:
            report.loss = sum(losses)
        return report

    def _loss_weight(self, size: int, batch: int) -> float:
        # A "mean" loss over the whole batch is the size-weighted sum of micro-batch means.
        return size / batch if self.loss_reduction == "mean" else 1.0

    def state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Current parameters and buffers of this sub-DAG by state key, as CPU copies (``copy=False``:
        on the CPU the live tensors, detached, for a caller that copies them before the next Update,
        as packing them on the compute thread does)."""
        out = {k: self.root.param(k) for k in self.subdag.params}
        for k in self.subdag.buffers:
            out[k] = getattr(self.root, self.root.attr_of[k])
        return host_copy(out) if copy else {k: v.detach().to(HOST) for k, v in out.items()}


def _rebuild_output(graph: IRGraph, values: Mapping[str, Any]) -> Any:
    """The job's output from a micro-batch's values, on the CPU (results travel and are kept there)."""
    from fusionnet.dag.rebuild import output_value

    return tree_map(lambda v: v.to(HOST) if isinstance(v, torch.Tensor) else v, output_value(graph, values))
