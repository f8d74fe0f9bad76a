"""The executor's half of row-served embeddings (``row_lookup``; mixed into ``executor.SubDagExecutor``).

Per step, for each tied weight ``V`` traded as rows between its owner and the sub-DAG of its lookup:

1. the lookup's sub-DAG sends ``("act", step, 0, V)``: the sorted unique ids of the step's placeholder
   values within ``0..rows-1`` (every id its lookups will read, whatever the micro-batches);
2. the owner answers ``("act", step, 0, V)``: ``V[ids]``, read before any FP of the step (after the
   last step's Update);
3. the lookup's sub-DAG places a leaf of those rows only as the step's value of ``V``, and its lookup
   reads positions among ``ids`` (``rebuild.compact_embedding``): no matrix the size of ``V`` exists on
   that side; its micro-batches' gradients sum on that leaf as before;
4. after its last seeding backward it sends ``("grad", step, 0, V)``: the leaf's gradient, one row per id;
5. the owner, after its own backwards and before Update, adds them into ``V``'s gradient at ``ids``
   (fp16: unscaled first, and an inf/nan among them counts in the found-inf agreement).

Step 1 goes out before the owner's rows are awaited, and each owner serves before it awaits rows
itself, so no two sub-DAGs wait on each other. The extra rows in the id set (a placeholder value its
lookups do not read) get a zero gradient, which adds nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import torch

from fusionnet.dag.channel import Channel
from fusionnet.dag.devices import host_ready, to_device, to_host
from fusionnet.dag.ir import IRGraph
from fusionnet.dag.outbox import Outbox
from fusionnet.dag.partition import SubDag
from fusionnet.dag.precision import LossScaler
from fusionnet.dag.row_lookup import RowLookup, row_lookups
from fusionnet.errors import ExecutionError

T = TypeVar("T")


class RowTrade:
    """Row trading state and steps; ``SubDagExecutor`` owns the attributes below."""

    graph: IRGraph
    subdag: SubDag
    channel: Channel
    outbox: Outbox
    compute: Executor | None
    device: torch.device
    scaler: LossScaler | None
    named_params: dict[str, torch.nn.Parameter]
    _step_inputs: dict[str, Any]
    _found_inf: bool

    def _init_row_trade(self) -> None:
        lookups = row_lookups(self.graph)
        self.row_reads: dict[str, RowLookup] = {v: lookups[v] for v in self.subdag.row_reads}
        self.row_serves: dict[str, RowLookup] = {v: lookups[v] for v in self.subdag.row_serves}
        self._row_ids: dict[str, torch.Tensor] = {}  # this step's ids per traded weight (on the CPU)
        self._row_ids_placed: dict[str, torch.Tensor] = {}  # those a lookup here reads, on the device

    def compact_lookups(self) -> dict[str, int]:
        """Lookup node -> the row count of its weight, for the weights this sub-DAG reads rows of (the
        module's extra inputs, in this order; ``row_ids_inputs`` gives their values)."""
        return {r.lookup: self._shape_of(v)[0] for v, r in self.row_reads.items()}

    def row_ids_inputs(self) -> list[torch.Tensor]:
        return [self._row_ids_placed[v] for v in self.row_reads]

    async def _off_loop(self, work: Callable[[], T]) -> T:
        """Tensor work of the exchange on the compute pool (not a hooked FP/BP stretch: fault points and
        phase timings stay with the real ones)."""
        if self.compute is None:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.compute, work)

    def _shape_of(self, v: str) -> tuple[int, ...]:
        target = self.graph.node(v).target
        assert target is not None
        return tuple(int(d) for d in self.graph.params[target]["shape"])

    async def trade_rows(self, step: int, microbatches: Sequence[Mapping[str, Any]]) -> None:
        """Steps 1-3 of the module docstring for this step, on both sides."""
        self._row_ids.clear()
        self._row_ids_placed.clear()
        if not self.row_reads and not self.row_serves:
            return
        for v, r in self.row_reads.items():  # 1: ids out, never awaited here
            target = self.graph.node(r.placeholder).target
            values = [mb[target] for mb in microbatches if target in mb]
            if not values:
                raise ExecutionError(
                    f"sub-DAG {self.subdag.index}: no data for placeholder {r.placeholder!r}"
                )
            rows = self._shape_of(v)[0]
            ids = torch.unique(torch.cat([t.reshape(-1) for t in values]).to(torch.long))
            ids = ids[(ids >= 0) & (ids < rows)].contiguous()
            self._row_ids[v] = ids
            self.outbox.start(self.channel.send(self.subdag.sources[v], ("act", step, 0, v), ids))
        for v in self.row_serves:  # 2: rows out, for each sub-DAG that looks this weight up
            for dst in self.subdag.consumers.get(v, ()):
                ids = self._checked_ids(
                    v, dst, await self.outbox.guard(self.channel.recv(dst, ("act", step, 0, v)))
                )
                self._row_ids[v] = ids
                param = self.named_params[self.graph.node(v).target or ""]
                host, ready = await self._off_loop(
                    lambda p=param, i=ids: to_host(
                        p.detach().index_select(0, to_device(i, p.device)), self.device
                    )
                )
                await host_ready(ready)
                self.outbox.start(self.channel.send(dst, ("act", step, 0, v), host))
        for v in self.row_reads:  # 3: the step's leaf
            src = self.subdag.sources[v]
            got = await self.outbox.guard(self.channel.recv(src, ("act", step, 0, v)))
            ids = self._row_ids[v]
            shape = self._shape_of(v)
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != (len(ids), *shape[1:]):
                have = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ExecutionError(
                    f"sub-DAG {self.subdag.index}: rows of {v!r} from sub-DAG {src} are {have}, "
                    f"expected {(len(ids), *shape[1:])}"
                )
            self._row_ids_placed[v] = to_device(ids, self.device)
            self._step_inputs[v] = await self._off_loop(
                lambda g=got: to_device(g, self.device).detach().requires_grad_(True)
            )

    def _checked_ids(self, v: str, src: int, ids: Any) -> torch.Tensor:
        rows = self._shape_of(v)[0]
        if (
            not isinstance(ids, torch.Tensor)
            or ids.dtype != torch.long
            or ids.dim() != 1
            or ids.numel() > rows
            or (ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows))
        ):
            raise ExecutionError(
                f"sub-DAG {self.subdag.index}: sub-DAG {src} asked for rows of {v!r} that are not "
                f"distinct int64 ids below {rows}"
            )
        return ids

    async def add_traded_grads(self, step: int) -> None:
        """Step 5: each lookup's row gradients added into the owned weight's gradient at their ids."""
        for v in self.row_serves:
            ids = self._row_ids.get(v)
            if ids is None:
                raise ExecutionError(f"sub-DAG {self.subdag.index}: no ids of {v!r} were traded this step")
            for src in self.subdag.consumers.get(v, ()):
                got = await self.outbox.guard(self.channel.recv(src, ("grad", step, 0, v)))
                parts = got if isinstance(got, list) else [got]
                if len(parts) == 1 and parts[0] is None:
                    continue  # nothing of the step read those rows
                grad = parts[0] if len(parts) == 1 else None
                shape = self._shape_of(v)
                if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != (len(ids), *shape[1:]):
                    raise ExecutionError(
                        f"sub-DAG {self.subdag.index}: row gradients of {v!r} from sub-DAG {src} do "
                        f"not match the {len(ids)} rows it was sent"
                    )
                param = self.named_params[self.graph.node(v).target or ""]
                await self._off_loop(lambda p=param, g=grad, i=ids: self._add_rows(p, g, i))

    def _add_rows(self, param: torch.nn.Parameter, grad: torch.Tensor, ids: torch.Tensor) -> None:
        grad = to_device(grad, param.device).to(param.dtype)
        if self.scaler is not None:
            self._found_inf = self.scaler.unscale_([grad]) or self._found_inf
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.index_add_(0, to_device(ids, param.device), grad)


def check_traded(graph: IRGraph, subdag: SubDag, src: int, kind: str, node: str, value: Any) -> bool:
    """A peer's value of a row trade (module docstring), checked before it reaches the executor: True when
    it is one and well-formed, False when it is no trade's (the caller checks it against the IR); raises
    ``ValueError`` saying what is wrong with a malformed one. Whether the rows match the ids sent is for
    the executor to check, which knows them."""
    target = graph.node(node).target if node in subdag.row_serves or node in subdag.row_reads else None
    if target is None:
        return False
    shape = tuple(int(d) for d in graph.params[target]["shape"])
    serving = node in subdag.row_serves and src in subdag.consumers.get(node, ())
    reading = node in subdag.row_reads and subdag.sources.get(node) == src
    if kind == "act" and serving:  # the ids a lookup asks rows for
        if not isinstance(value, torch.Tensor) or value.dtype != torch.long or value.dim() != 1:
            raise ValueError(f"ids of {node!r} must be a 1-D int64 tensor")
        if value.numel() > shape[0]:
            raise ValueError(f"{value.numel()} ids of {node!r}, which has {shape[0]} rows")
        return True
    if (kind == "act" and reading) or (kind == "grad" and serving):  # rows, or their gradient
        parts = value if kind == "grad" and isinstance(value, list) else [value]
        if kind == "grad" and (len(parts) != 1 or parts[0] is None):
            if len(parts) == 1:
                return True  # no gradient for those rows
            raise ValueError(f"row gradients of {node!r} must be one tensor")
        rows = parts[0]
        if (
            not isinstance(rows, torch.Tensor)
            or not rows.is_floating_point()
            or rows.dim() != len(shape)
            or tuple(rows.shape[1:]) != shape[1:]
            or rows.shape[0] > shape[0]
        ):
            got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"rows of {node!r} are {got}, expected (n <= {shape[0]}, *{shape[1:]})")
        return True
    return False
