"""Per-operator cost metadata: forward/backward FLOPs and bytes moved, for one DAG node.

The tracer calls ``op_cost`` once per fx ``call_function``/``call_method`` node while it runs the
graph on the real example, passing the node's real input values and output. Nothing is re-run for
the common operators: FLOPs come from shapes through the rules in ``flop_rules.py``, which reuse
``torch.utils.flop_counter``'s formulas for what it counts (mm, bmm, addmm, conv, attention) and
add documented per-element constants for what it leaves at zero. Only operators without a rule are
run again, once, on *meta* tensors (no data, no compute) under ``FlopCounterMode``; if that finds
no matmul inside, they get the conservative default (``DEFAULT_FWD`` per output element).

Backward FLOPs cover the gradients w.r.t. every input that needs one. By default that is every
floating-point tensor input (the tracer runs under ``no_grad`` and parameters are folded in as
plain tensors); ``requires_grad`` narrows it, e.g. ``lambda t: t.requires_grad`` when the caller
runs with autograd on.

Bytes: ``bytes_read`` counts distinct input tensors (broadcast dims once), ``bytes_written`` the
output storage this op fills (0 for views), ``activation_bytes`` the logical output size, i.e.
what a user on another compnode receives and what backward may keep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from fusionnet.dag.op_call import FlopBreakdown, OpCall, logical_bytes, op_name
from fusionnet.errors import IRError, TraceError

__all__ = ["ZERO", "FlopBreakdown", "NodeCost", "flop_breakdown", "op_cost", "op_name"]


@dataclass(frozen=True)
class NodeCost:
    flops_fwd: int  # forward FLOPs (multiply-add = 2 FLOPs, torch.utils.flop_counter convention)
    flops_bwd: int  # backward FLOPs for gradients w.r.t. every input that requires grad (incl. params)
    bytes_read: int  # bytes of tensor inputs read (args + params/buffers)
    bytes_written: int  # bytes of tensor outputs (0 for views)
    param_bytes: int  # bytes of trainable parameters the op owns (passed in)
    activation_bytes: int  # bytes of the output that must be kept for backward / sent to users

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise IRError(f"cost field {f.name!r} must be a non-negative integer, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeCost:
        """Reads a cost record (e.g. from IR bytes); unknown keys are ignored for newer peers."""
        if not isinstance(d, dict):
            raise IRError(f"a node cost must be a mapping, got {type(d).__name__}")
        missing = [f.name for f in fields(cls) if f.name not in d]
        if missing:
            raise IRError(f"node cost is missing {', '.join(missing)}")
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def __add__(self, other: NodeCost) -> NodeCost:
        return NodeCost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


ZERO = NodeCost(0, 0, 0, 0, 0, 0)


def op_cost(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    *,
    param_bytes: int = 0,
    needs_grad: bool = True,
    requires_grad: Callable[[torch.Tensor], bool] | None = None,
) -> NodeCost:
    """Cost of one call ``target(*args, **kwargs) -> output`` on real values (see module doc)."""
    if not isinstance(param_bytes, int) or isinstance(param_bytes, bool) or param_bytes < 0:
        raise TraceError(f"param_bytes must be a non-negative integer, got {param_bytes!r}")
    call = OpCall(target, args, kwargs, output, needs_grad, requires_grad)
    if not call.outs:  # metadata (size, dim, shape arithmetic): nothing computed or stored
        return NodeCost(0, 0, 0, 0, param_bytes, 0)
    flops = call.flops()
    read, written = call.bytes_moved()
    activation = sum(logical_bytes(t) for t in call.outs)
    return NodeCost(flops.fwd, flops.bwd, read, written, param_bytes, activation)


def flop_breakdown(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: Any,
    *,
    needs_grad: bool = True,
    requires_grad: Callable[[torch.Tensor], bool] | None = None,
) -> FlopBreakdown:
    """The FLOPs of ``op_cost`` split into flop_counter-counted and rule-based parts."""
    call = OpCall(target, args, kwargs, output, needs_grad, requires_grad)
    return call.flops() if call.outs else FlopBreakdown()
