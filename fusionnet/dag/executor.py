"""The execution plane's task executor: FP, BP and Update of one sub-DAG (FusionAI section 3.6).

- **FP** of a micro-batch fires once all outer required data has arrived (data placeholders are fed
  by the caller, the rest arrives through the channel); outwards data goes to every compnode user.
- **BP** runs the reversed edges: gradients for the outwards data arrive from the users (summed when
  several users read the same value), the loss is seeded with its share of the batch, and the
  gradients of received inputs go back to their producers (placeholders get none).
- **Update** applies the per-op optimizers of the job file to the parameters this sub-DAG owns.

A parameter read on another sub-DAG (a tied embedding: a ``variable`` node across a cut) is one
value for the whole step: it is sent at the owner's first FP (key micro-batch 0), placed once as a
leaf that every micro-batch of the reader uses, and its gradient, summed over the step by autograd on
that leaf, goes back once at the reader's last seeding BP (``backward_pass``).

Micro-batches follow the job's pipeline schedule (``fusionnet.schedules``; GPipe by default), one
loop running this sub-DAG's program action by action (``schedule_loop``). Gradients accumulate over
micro-batches and equal the full-batch gradients up to float rounding. A BP runs as I (the received
inputs' gradients, sent at once: the producers wait for them) and W (the parameters', maybe later),
by the ops a plain backward runs (``backward_pass``, ``split_backward``).

Compute never runs on the event loop (design decision): with a ``compute`` pool (a compnode's single
compute thread) every FP, BP and Update stretch runs there while the loop keeps serving heartbeats,
RPCs and the data path. Receives wait on the loop; sends start on the loop, not awaited, so the next
micro-batch computes while the last one's outputs travel; the step waits for its sends at its end,
and a failed send ends the step at its next receive. Without a pool (``run --local``) the stretches
run inline: the same code and op order, so the same bits. In a sandbox worker (one job per loop) a
reliably short stretch runs inline too when no send or pool work is pending (``short_stretches``):
a hand-off to the thread and back costs two wake-ups. Hooks (``dag.hooks``) run around every stretch.

Mixed precision (``fusionnet.dag.precision``): FP runs under the job's autocast, so activations and
their gradients travel in the compute dtype where autocast made them so. fp16 scales the loss seed;
the last BP unscales this sub-DAG's gradients and notes any inf/nan; before Update every executor
sends its flag to every other one (``FOUND_INF_NODE``), and all skip, or all step, together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map

from fusionnet.dag.activation_memory import ActivationLedger, SavedBytes, activation_key
from fusionnet.dag.backward_pass import BackwardPass, is_float
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
from fusionnet.dag.hooks import ExecutorHook, HookChain, Phase
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.outbox import Outbox
from fusionnet.dag.partition import SubDag
from fusionnet.dag.precision import FOUND_INF_NODE, autocast, make_scaler
from fusionnet.dag.rebuild import build_subdag_module
from fusionnet.dag.row_trade import RowTrade
from fusionnet.dag.schedule_loop import ScheduleLoop
from fusionnet.dag.short_stretches import ShortStretches, TrackedPool
from fusionnet.dag.split_backward import WeightWork
from fusionnet.errors import ComputeError, DeviceMemoryError, ExecutionError
from fusionnet.schedules import Schedule

T = TypeVar("T")


class SubDagExecutor(BackwardPass, RowTrade, ScheduleLoop):
    """Runs one sub-DAG. ``optimizers`` is a factory ``named_params -> list[Optimizer]`` (train only);
    ``compute`` the pool FP/BP/Update run on (None: inline); ``hooks`` run around each of them;
    ``precision`` the job's autocast (``subdags``, the job's sub-DAG count, is who shares fp16's flag);
    ``device`` where parameters, buffers, gradients and optimizer state live and FP/BP/Update run
    (``fusionnet.dag.devices``: values come in and go out as CPU tensors); ``chunks`` the sub-DAGs each
    device runs (an interleaved schedule: ``schedule_loop.run_device_step`` runs them together);
    ``own_state``: ``state``'s tensors are the executor's alone (a compnode's freshly unpacked slice), used
    as they are; otherwise they are copied (a local run's executors read one model's state)."""

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
        schedule: str | Schedule = "gpipe",
        device: torch.device = HOST,
        chunks: int = 1,
        own_state: bool = False,
    ) -> None:
        self.graph = graph
        self.subdag = subdag
        self.channel = channel
        self.task = task
        self.loss_reduction = loss_reduction
        self._targets: tuple[int, int] | None = None  # (step, its count of targets): ``_loss_weight``
        self.compute = compute
        # Which stretches may run inline on the loop (a sandbox worker's; None: all on ``compute``).
        self.short_stretches: ShortStretches | None = None
        self.hooks = HookChain(hooks)
        self.precision = precision
        if not 0 <= subdag.index < subdags:
            raise ExecutionError(f"sub-DAG {subdag.index} is not one of the job's {subdags} sub-DAGs")
        self.subdags = subdags  # the job's sub-DAG count: the stages of the schedule
        self.schedule = schedule
        self.chunks = chunks  # sub-DAGs per device: interleaved-1f1b's chunks (``schedule_loop``)
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
        self._init_row_trade()  # tied weights whose far side gets rows only (``row_trade``)
        self.module, self.root = build_subdag_module(
            graph,
            subdag.nodes,
            subdag.outer_required,
            outputs,
            {k: state[k] for k in subdag.params},
            {k: state[k] for k in subdag.buffers},
            self.device,
            self.compact_lookups(),
            copy_state=not own_state,
        )
        self.module.train(task != "infer")
        try:  # built on the CPU (the state, cloned unless owned), then moved: the device holds one copy
            self.module.to(self.device)
            self.root.to(self.device)
        except Exception as e:
            raise self._device_error("placing its state", e) from e
        self.named_params = {k: self.root.param(k) for k in subdag.params}
        self.optimizers = make_optimizers(self.named_params) if (task == "train" and make_optimizers) else []
        self._stash: dict[int, tuple[list[Any], tuple[Any, ...]]] = {}
        self._weight_work: dict[int, WeightWork] = {}  # micro-batches whose I ran and whose W has not
        self._deferred: list[tuple[int, bool]] = []  # Ws a whole BP left to the schedule loop
        self.waited_for_input = True  # whether the last FP found an input not yet arrived
        self.activations = ActivationLedger()  # bytes held between each micro-batch's F and its B / W
        self.outbox = Outbox()
        self._placeholder_target = {n: graph.node(n).target for n in subdag.placeholders}
        # Parameters read across a cut (a tied embedding, a shared layer) hold one value for the whole
        # step, so they cross once per step (key micro-batch 0) and their gradient comes back once,
        # summed over the step's micro-batches by autograd on one leaf (issue 16).
        self.step_wide = {
            n for n in (*subdag.outer_required, *subdag.outwards) if graph.node(n).kind == "variable"
        }
        # An infer sub-DAG's parameters never change, so those read across a cut stay where they went
        # for the sub-DAGs' whole life: a deployment's batches (each one a step) would otherwise ship a
        # tied embedding with every batch. Buffers still cross every step: a KV cache is written in place.
        self.resident = (
            {n for n in self.step_wide if graph.node(n).target in graph.params} if task == "infer" else set()
        )
        self._step_inputs: dict[str, Any] = {}  # step-wide inputs received and placed (this step or resident)
        self._step_sent: set[str] = set()  # step-wide outputs sent (this step or resident)

    async def _run(self, phase: Phase, step: int, mb: int, work: Callable[[], T]) -> T:
        """One compute stretch, between the hooks, on the compute pool (or inline without one, or inline
        when ``short_stretches`` says it is short and nothing is pending)."""
        await self.outbox.let_go()  # the last stretch's values leave before this one takes the core
        return await self.run_routed(phase, partial(self.hooks.run, phase, step, mb, work))

    async def run_routed(self, phase: str, call: Callable[[], T]) -> T:
        """``call`` where a stretch of ``phase`` runs: on the compute pool, or inline without one or
        when ``short_stretches`` says the phase is short and nothing is pending. Also for work beside
        the graph that the step waits for, such as packing a served batch's outputs (phase ``pack``):
        on the thread it costs the critical path two wake-ups, measured 0.7 ms of an 18 ms decode pass
        on a shared 2-core host, for 0.1 ms of work."""
        if self.compute is None:
            return call()
        short = self.short_stretches
        if short is None:
            return await asyncio.get_running_loop().run_in_executor(self.compute, call)
        # A sandbox worker: a short stretch runs here, saving two wake-ups (``short_stretches``).
        inline = (
            short.short(phase)
            and self.outbox.idle()
            and isinstance(self.compute, TrackedPool)
            and self.compute.idle()
        )
        short.count(inline)
        timed = partial(short.timed, phase, call)
        if inline:
            return timed()
        return await asyncio.get_running_loop().run_in_executor(self.compute, timed)

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
        return ComputeError(
            f"sub-DAG {self.subdag.index}: {what} of step {step} micro-batch {mb} "
            f"failed: {type(e).__name__}: {e}"
        )

    def drop_inflight(self) -> None:
        """Forgets a failed step's stashed activations and gradients (after a device OOM, the memory
        they hold is what the next attempt needs)."""
        self._stash.clear()
        self._weight_work.clear()
        self._deferred.clear()
        self.activations.start_step()
        self._forget_step_values(keep_resident=False)  # the broker places the job again: all afresh
        self.zero_grad()
        release_cached_memory(self.device)

    def _send_values(self, sends: list[tuple[int, Any, Any]], ready: Any) -> None:
        """Starts the sends ``(dst, key, value)`` of ``to_host``'s copies once they are on the host, one
        per receiver (one frame on the network: an FP whose outputs ``dst`` reads pays one frame's
        fixed cost, not one per output)."""
        per_dst: dict[int, list[tuple[Any, Any]]] = {}
        for dst, key, value in sends:
            per_dst.setdefault(dst, []).append((key, value))

        async def send(dst: int, items: list[tuple[Any, Any]]) -> None:
            await host_ready(ready)
            await self.channel.send_values(dst, items)

        for dst, items in per_dst.items():
            self.outbox.start(send(dst, items) if ready is not None else self.channel.send_values(dst, items))

    def _forget_step_values(self, keep_resident: bool = True) -> None:
        kept = self.resident if keep_resident else set()
        self._step_inputs = {k: v for k, v in self._step_inputs.items() if k in kept}
        self._step_sent &= kept

    # -- FP ------------------------------------------------------------------------------------
    async def forward(self, step: int, mb: int, data: Mapping[str, Any]) -> tuple[Any, ...]:
        inputs: list[Any] = []
        waited = False
        for name in self.subdag.outer_required:
            if name in self._placeholder_target:
                if self._placeholder_target[name] not in data:
                    raise ExecutionError(f"sub-DAG {self.subdag.index}: no data for placeholder {name!r}")
                inputs.append(data[self._placeholder_target[name]])
                continue
            if name in self._step_inputs:  # the step's one leaf: its gradient sums every micro-batch's
                inputs.append(self._step_inputs[name])
                continue
            key = ("act", step, 0 if name in self.step_wide else mb, name)
            waited = waited or not self.channel.arrived(self.subdag.sources[name], key)
            value = await self.outbox.guard(self.channel.recv(self.subdag.sources[name], key))
            inputs.append(value)
        self.waited_for_input = waited  # the schedule loop's choice of a whole BP (``run_device_step``)
        received = [n not in self._placeholder_target for n in self.subdag.outer_required]
        ready_leaves = set(self._step_inputs)  # placed in an earlier micro-batch of this step
        shapes = None if self.task == "infer" else activation_key(mb, inputs)
        first_sends = [
            n
            for n in self.step_wide & set(self.subdag.outwards)
            if n not in self._step_sent and n not in self.row_serves  # rows went at the step's start
        ]
        self._step_sent.update(first_sends)

        def work() -> tuple[tuple[Any, ...], list[Any], Any, int | None]:
            try:
                placed = [
                    v if name in ready_leaves else self._place_input(v, leaf)
                    for name, v, leaf in zip(self.subdag.outer_required, inputs, received)
                ]
                # Grad mode is per thread: set it on the thread that computes.
                with (
                    torch.set_grad_enabled(self.task != "infer"),
                    autocast(self.precision, self._device_type()),
                    self._counting(shapes, placed) as saved,
                ):
                    outs = self.module(*placed, *self.row_ids_inputs())
            except Exception as e:
                raise self._failed("FP", step, mb, e) from e
            if saved is not None:
                for value in outs:  # kept (in the stash) for the gradients that come back
                    saved.add(value)
            inputs[:] = placed  # the leaves BP reads the gradients of
            sent = {
                n: v
                for n, v in zip(self.output_names, outs)
                if self.subdag.consumers.get(n) and (n not in self.step_wide or n in first_sends)
            }
            host, ready = to_host(sent, self.device)
            return outs, host, ready, None if saved is None else saved.nbytes

        outs, host, ready, held = await self._run("fp", step, mb, work)
        if shapes is not None:
            self.activations.hold(mb, self.activations.learn(shapes, held))
        for name, value in zip(self.subdag.outer_required, inputs):
            if name in self.step_wide and name not in ready_leaves:  # placed by this FP: kept for the step
                self._step_inputs[name] = value
        self._send_values(
            [
                (dst, ("act", step, 0 if name in self.step_wide else mb, name), value)
                for name, value in host.items()
                for dst in self.subdag.consumers.get(name, ())
            ],
            ready,
        )
        if self.task != "infer":
            self._stash[mb] = (inputs, outs)
        return outs

    def _counting(
        self, key: tuple[Any, ...] | None, placed: Sequence[Any]
    ) -> AbstractContextManager[SavedBytes | None]:
        """What an FP saves for its BP, counted when its key is new; the state and step-wide values (a
        tied weight received) are not activations."""
        if key is None or self.activations.knows(key):
            return nullcontext()
        wide = [v for n, v in zip(self.subdag.outer_required, placed) if n in self.step_wide]
        return self.activations.saving([*self.named_params.values(), *self.root.buffers(), *wide])

    def _place_input(self, value: Any, received: bool) -> Any:
        """An FP input on this sub-DAG's device; received float tensors become leaves so their
        gradients can be returned in BP."""
        value = to_device(value, self.device)
        if received and self.task != "infer":
            value = tree_map(lambda v: v.detach().requires_grad_(True) if is_float(v) else v, value)
        return value

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
        self.zero_grad()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients, as CPU copies."""
        return host_copy({k: p.grad for k, p in self.named_params.items() if p.grad is not None})

    def zero_grad(self) -> None:
        for p in self.named_params.values():
            p.grad = None

    def live_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(parameters, buffers) by state key, detached, where they live: only an Update changes the
        parameters, while buffers (BatchNorm's statistics) change in FP too."""
        params = {k: self.root.param(k).detach() for k in self.subdag.params}
        buffers = {k: getattr(self.root, self.root.attr_of[k]).detach() for k in self.subdag.buffers}
        return params, buffers

    def state(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Current parameters and buffers of this sub-DAG by state key, as CPU copies (``copy=False``:
        on the CPU the live tensors, detached, for a caller that copies them before the next Update,
        as packing them on the compute thread does)."""
        out = {k: self.root.param(k) for k in self.subdag.params}
        for k in self.subdag.buffers:
            out[k] = getattr(self.root, self.root.attr_of[k])
        return host_copy(out) if copy else {k: v.detach().to(HOST) for k, v in out.items()}
