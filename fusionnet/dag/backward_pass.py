"""BP of one sub-DAG (FusionAI section 3.6), the half of ``SubDagExecutor`` that runs the reversed edges.

Gradients for the outwards data arrive from the consumers (summed when several read the same value,
latest consumer first, as eager autograd accumulates), the loss is seeded with its share of the batch,
and the gradients of received inputs go back to their producers (placeholders get none). A split BP
(zero-bubble schedules) is I, the received inputs' gradients sent at once, then W, the parameters'
(``split_backward``); a whole BP with inputs to send gradients to runs I and W too, back to back,
sending between them, so the producers do not wait for W. Step-wide values (parameters read across
a cut) get their summed gradient once, at the step's last seeding BP. Every stretch runs on the
compute pool through ``SubDagExecutor._run``.

A whole BP run with ``defer_weight`` leaves its W pending (``_deferred``, oldest first): the schedule
loop runs it while this stage would otherwise wait for a gradient, and at the latest before the next
FP or the update (``schedule_loop.run_device_step``), so the Ws add no activation memory over the
schedule's order and accumulate the parameters' gradients in the same order, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten

from fusionnet.dag.activation_memory import ActivationLedger
from fusionnet.dag.channel import Channel, MessageKey
from fusionnet.dag.devices import to_device, to_host
from fusionnet.dag.hooks import Phase
from fusionnet.dag.outbox import Outbox
from fusionnet.dag.partition import SubDag
from fusionnet.dag.precision import LossScaler
from fusionnet.dag.split_backward import WeightWork, input_gradients, input_gradients_first, weight_gradients
from fusionnet.errors import ExecutionError

T = TypeVar("T")


def is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


class BackwardPass:
    """BP, I and W of one sub-DAG; mixed into ``SubDagExecutor``, which owns every attribute below."""

    subdag: SubDag
    channel: Channel
    outbox: Outbox
    device: torch.device
    compute: Executor | None
    scaler: LossScaler | None
    loss_name: str | None
    output_names: list[str]
    named_params: dict[str, torch.nn.Parameter]
    step_wide: set[str]
    row_serves: Mapping[str, Any]  # ``row_trade``: tied weights whose lookups get rows

    _stash: dict[int, tuple[list[Any], tuple[Any, ...]]]
    _weight_work: dict[int, WeightWork]
    _deferred: list[tuple[int, bool]]  # (micro-batch, last) of Ws left pending by ``defer_weight``
    activations: ActivationLedger
    _found_inf: bool

    async def _run(self, phase: Phase, step: int, mb: int, work: Callable[[], T]) -> T:
        raise NotImplementedError

    def _failed(self, what: str, step: int, mb: int, e: Exception) -> ExecutionError:
        raise NotImplementedError

    def _send_values(self, sends: list[tuple[int, Any, Any]], ready: Any) -> None:
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
        """The whole BP of micro-batch ``mb`` (``last``: the step's last BP, after which this sub-DAG's
        gradients are complete; by default micro-batch 0, GPipe's last; ``last_seeded``: the step's last
        BP that seeds gradients, which also seeds the step-wide ones; by default ``last``;
        ``defer_weight``: where the BP splits, leave its W to ``weights_pending``'s caller;
        ``split=False``: one plain backward, its gradients sent at its end)."""
        last = last if last is not None else mb == 0
        last_seeded = last if last_seeded is None else last_seeded
        inputs, outs = self._stash.pop(mb)
        received = await self._receive_grads(step, mb, outs, step_wide=last_seeded)
        flushed: list[int] = []

        def whole_after_deferred() -> None:
            # A BP that does not split after some that did: their Ws first, so the parameters'
            # gradients still accumulate in the schedule's order.
            flushed.extend(self._deferred_weights_now(step))

        def work() -> tuple[WeightWork | None, tuple[dict[str, list[Any]], Any]]:
            try:
                roots, seeds = self._seeds(self._placed(received), loss_weight)
                leaves = [v for v in self._grad_leaves(inputs) if v.requires_grad]
                params = [p for p in self.named_params.values() if p.requires_grad]
                pending = input_gradients_first(
                    roots, seeds, leaves, params, before_whole=whole_after_deferred, split=split
                )
            except ExecutionError:
                raise
            except Exception as e:
                raise self._failed("BP", step, mb, e) from e
            if last and pending is None:
                self._unscale()
            return pending, self._input_grads_to_host(inputs, step_wide=last_seeded)

        pending, (back, ready) = await self._run("bp", step, mb, work)
        for done in flushed:
            self.activations.release(done)
        if pending is None:
            self.activations.release(mb)
            self._send_input_grads(step, mb, back, ready)
            return
        # The producers' gradients leave now, while this stage computes its weights' gradients: each
        # hop of the backward wave waits for I only, not the whole BP (the order stays the schedule's).
        self._send_input_grads(step, mb, back, ready)
        self._weight_work[mb] = pending
        if defer_weight:
            self._deferred.append((mb, last))
            return
        await self.backward_weight(step, mb, last=last)

    def weights_pending(self) -> int:
        """How many Ws ``defer_weight`` left for the schedule loop to run."""
        return len(self._deferred)

    async def next_deferred_weight(self, step: int) -> None:
        """Runs the oldest deferred W."""
        mb, last = self._deferred.pop(0)
        await self.backward_weight(step, mb, last=last)

    def _deferred_weights_now(self, step: int) -> list[int]:
        """On the compute thread, inside a BP's stretch: every deferred W, oldest first; returns their
        micro-batches (whose activations the caller releases on the loop)."""
        done = []
        while self._deferred:
            mb, last = self._deferred.pop(0)
            try:
                weight_gradients(self._weight_work.pop(mb))
            except Exception as e:
                raise self._failed("BP (weight gradients)", step, mb, e) from e
            if last:
                self._unscale()
            done.append(mb)
        return done

    def grads_arrived(self, step: int, mb: int) -> bool:
        """Whether every gradient a BP (or I) of micro-batch ``mb`` waits for is here already (the
        step-wide ones, which only the step's last seeding BP takes, aside)."""
        stashed = self._stash.get(mb)
        if stashed is None:
            return True
        return all(
            self.channel.arrived(dst, key)
            for _, _, keys in self._grad_keys(step, mb, stashed[1], step_wide=False)
            for dst, key in keys
        )

    async def backward_input(
        self, step: int, mb: int, loss_weight: float, *, last_seeded: bool = False
    ) -> None:
        """I of a split BP: the received inputs' gradients, sent at once (``split_backward``);
        ``last_seeded``: the step's last I, which also seeds and sends the step-wide gradients."""
        inputs, outs = self._stash.pop(mb)
        received = await self._receive_grads(step, mb, outs, step_wide=last_seeded)

        def work() -> tuple[dict[str, list[Any]], Any]:
            leaves = [v for v in self._grad_leaves(inputs) if v.requires_grad]
            params = [p for p in self.named_params.values() if p.requires_grad]
            try:
                roots, seeds = self._seeds(self._placed(received), loss_weight)
                self._weight_work[mb] = input_gradients(roots, seeds, leaves, params)
            except ExecutionError:
                raise
            except Exception as e:
                raise self._failed("BP (input gradients)", step, mb, e) from e
            return self._input_grads_to_host(inputs, step_wide=last_seeded)

        back, ready = await self._run("bp", step, mb, work)
        self._send_input_grads(step, mb, back, ready)

    async def backward_weight(self, step: int, mb: int, *, last: bool) -> None:
        """W of a split BP: the parameters' gradients, accumulated as a plain backward would."""
        pending = self._weight_work.pop(mb)

        def work() -> None:
            try:
                weight_gradients(pending)
            except Exception as e:
                raise self._failed("BP (weight gradients)", step, mb, e) from e
            if last:
                self._unscale()

        await self._run("bp", step, mb, work)
        self.activations.release(mb)  # the weight half read the last of the saved inputs

    def _unscale(self) -> None:
        """After the step's last BP the gradients are complete: fp16 unscales them (and notes inf/nan)."""
        if self.scaler is not None:
            self._found_inf = self.scaler.unscale_(p.grad for p in self.named_params.values())

    async def _receive_grads(
        self, step: int, mb: int, outs: tuple[Any, ...], *, step_wide: bool
    ) -> list[tuple[str, Any, list[tuple[int, Any]]]]:
        """The gradients the consumers sent for this micro-batch's outputs; with ``step_wide``
        also the step's summed gradients of the step-wide outputs (which no other BP waits for)."""
        received: list[tuple[str, Any, list[tuple[int, Any]]]] = []
        for name, value, keys in self._grad_keys(step, mb, outs, step_wide=step_wide):
            grads = [(dst, await self.outbox.guard(self.channel.recv(dst, key))) for dst, key in keys]
            received.append((name, value, grads))
        return received

    def _grad_keys(
        self, step: int, mb: int, outs: tuple[Any, ...], *, step_wide: bool
    ) -> list[tuple[str, Any, list[tuple[int, MessageKey]]]]:
        """Per output whose gradients come back: its name, value and the (consumer, key) of each."""
        found = []
        for name, value in zip(self.output_names, outs):
            if (name in self.step_wide and not step_wide) or name in self.row_serves:
                continue  # a traded weight's row gradients are added before Update (``row_trade``)
            # Consumers return gradients exactly for values with a float part (see the send below).
            consumers = self.subdag.consumers.get(name, ()) if self.expects_grad(value) else ()
            key = ("grad", step, 0 if name in self.step_wide else mb, name)
            # Latest consumer first: eager autograd accumulates a value's gradients in reverse execution
            # order, and sub-DAGs are contiguous in that order, so this grouping keeps sums bit-exact.
            found.append((name, value, [(dst, key) for dst in sorted(consumers, reverse=True)]))
        return found

    def _grad_leaves(self, inputs: list[Any]) -> list[torch.Tensor]:
        """The float leaves of the received (non-placeholder) inputs: what the producers want back."""
        leaves: list[torch.Tensor] = []
        for name, value in zip(self.subdag.outer_required, inputs):
            if name not in self.subdag.placeholders:
                leaves.extend(v for v in tree_flatten(value)[0] if is_float(v))
        return leaves

    def _input_grads_to_host(self, inputs: list[Any], *, step_wide: bool) -> tuple[dict[str, list[Any]], Any]:
        """On the compute thread: the received inputs' gradients as host copies (``to_host``) and the
        event that marks them done, per input the producer expects a gradient for (the step-wide
        ones only with ``step_wide``: their leaves have summed the whole step by then)."""
        back = {}
        for name, value in zip(self.subdag.outer_required, inputs):
            if name in self.subdag.placeholders:
                continue  # placeholders need no gradient (section 3.6)
            if name in self.step_wide and not step_wide:
                continue
            if not self.expects_grad(value):
                continue  # nothing differentiable was received, so the producer expects nothing
            back[name] = [v.grad if is_float(v) else None for v in tree_flatten(value)[0]]
        return to_host(back, self.device)

    def _send_input_grads(self, step: int, mb: int, back: dict[str, list[Any]], ready: Any) -> None:
        sends = [
            (self.subdag.sources[name], ("grad", step, 0 if name in self.step_wide else mb, name), grads)
            for name, grads in back.items()
        ]
        self._send_values(sends, ready)  # one send (frame) per producer

    def _placed(
        self, received: list[tuple[str, Any, list[tuple[int, Any]]]]
    ) -> list[tuple[str, Any, list[tuple[int, Any]]]]:
        """Received gradients moved to this sub-DAG's device (on the compute thread)."""
        return [(n, v, to_device(g, self.device)) for n, v, g in received]

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
        if isinstance(value, torch.Tensor):  # most values: no tree to flatten
            return is_float(value)
        return any(is_float(v) for v in tree_flatten(value)[0])
