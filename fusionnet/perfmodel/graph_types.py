"""The performance model's graph input, as plain frozen data: each op's costs (``OpCost``) and the DAG
of them (``CostGraph``), both for ONE micro-batch (the traced example batch).

Units: FLOPs, bytes. Validation happens in ``__post_init__``, so a bad value is refused where it is
built with a message naming the op or field (``IRError``: the cost graph is the IR seen through costs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from fusionnet.errors import IRError, PlanError
from fusionnet.perfmodel.optimizers import optimizer_profile

OP_KINDS = ("placeholder", "variable", "parametric", "non_parametric", "loss", "output")
# Families of ops with their own fixed costs and efficiency (``Overheads``): views move no data;
# matmul-like and conv ops run at their own fraction of the FLOP peak; the rest is memory-bound, with
# per-family fixed costs (a max-pool launches more work than a relu). "other": ops without a rule.
OP_CLASSES = ("view", "elementwise", "norm", "pool", "loss", "gather", "copy", "matmul", "conv", "other")
_INT_FIELDS = ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written", "param_bytes", "activation_bytes")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_finite(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@dataclass(frozen=True)
class OpCost:
    """One DAG operator's cost for one micro-batch (FusionAI Table 2 kinds)."""

    name: str
    kind: str  # placeholder | variable | parametric | non_parametric | loss | output
    flops_fwd: int
    flops_bwd: int
    bytes_read: int
    bytes_written: int
    param_bytes: int  # trainable parameters this op owns
    activation_bytes: int  # output size: what backward keeps and what a user on another device receives
    optimizer: str | None = None  # torch.optim class name, lower-case, for ops owning params
    op_class: str = "other"  # one of OP_CLASSES: which fixed overhead and efficiency apply
    param_tensors: int = 0  # parameter tensors the op owns (0 with param_bytes > 0 counts as one)
    input_grad: bool = True  # False: its data input needs no gradient (a first layer), a cheaper backward

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise IRError(f"op name must be a non-empty string, got {self.name!r}")
        if self.kind not in OP_KINDS:
            raise IRError(f"op {self.name!r}: kind {self.kind!r} is not one of {', '.join(OP_KINDS)}")
        if self.op_class not in OP_CLASSES:
            raise IRError(
                f"op {self.name!r}: op_class {self.op_class!r} is not one of {', '.join(OP_CLASSES)}"
            )
        if not is_int(self.param_tensors) or self.param_tensors < 0:
            raise IRError(f"op {self.name!r}: param_tensors must be a non-negative integer")
        for f in _INT_FIELDS:
            value = getattr(self, f)
            if not is_int(value) or value < 0:
                raise IRError(f"op {self.name!r}: {f} must be a non-negative integer, got {value!r}")
        if self.optimizer is not None:
            try:
                optimizer_profile(self.optimizer)
            except PlanError as e:
                raise PlanError(f"op {self.name!r}: {e}") from e

    @property
    def tensors(self) -> int:
        """Parameter tensors one optimizer step updates for this op."""
        return self.param_tensors or (1 if self.param_bytes else 0)


@dataclass(frozen=True)
class CostGraph:
    """The DAG to place: ops in a topological order and data edges with their size per micro-batch."""

    ops: tuple[OpCost, ...]
    edges: tuple[tuple[str, str, int], ...]  # (producer, consumer, bytes per micro-batch)
    # Edges among ``edges`` whose value holds for a whole step (a parameter read across a cut): it
    # crosses once per step, at the first FP, and its gradient once, at the last BP. (producer,
    # consumer, bytes per step); ``edges`` lists them with those bytes spread over the micro-batches,
    # which is what the searches price; ``evaluate_assignment`` times them as they run.
    step_edges: tuple[tuple[str, str, int], ...] = ()
    # Inference: those parameters never change, so they cross once for the placement's life and are
    # then held where they went: no time per step (and nothing in ``edges``), but memory on both ends.
    resident_step_edges: bool = False

    def __post_init__(self) -> None:
        if not self.ops:
            raise IRError("a cost graph needs at least one op")
        object.__setattr__(self, "ops", tuple(self.ops))
        object.__setattr__(self, "edges", tuple(tuple(e) for e in self.edges))
        object.__setattr__(self, "step_edges", tuple(tuple(e) for e in self.step_edges))
        pairs = {(e[0], e[1]) for e in self.edges}
        for k, edge in enumerate(self.step_edges):
            if len(edge) != 3 or (edge[0], edge[1]) not in pairs or not is_int(edge[2]) or edge[2] < 0:
                raise IRError(f"step_edges[{k}] must be (producer, consumer, bytes) of one of the edges")
        index: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if not isinstance(op, OpCost):
                raise IRError(f"ops[{i}] is a {type(op).__name__}, not an OpCost")
            if op.name in index:
                raise IRError(f"op name {op.name!r} appears twice (ops[{index[op.name]}] and ops[{i}])")
            index[op.name] = i
        for k, edge in enumerate(self.edges):
            if len(edge) != 3:
                raise IRError(f"edges[{k}] must be (producer, consumer, bytes), got {edge!r}")
            src, dst, nbytes = edge
            for end in (src, dst):
                if end not in index:
                    raise IRError(f"edges[{k}] ({src!r} -> {dst!r}) names unknown op {end!r}")
            if not is_int(nbytes) or nbytes < 0:
                raise IRError(f"edges[{k}] ({src!r} -> {dst!r}): bytes must be a non-negative int")
            if index[src] >= index[dst]:
                raise IRError(
                    f"edges[{k}] ({src!r} -> {dst!r}) goes against the op order: ops must be listed "
                    "in a topological order (this also rules out cycles)"
                )

    @cached_property
    def index(self) -> Mapping[str, int]:
        """Op name -> position in ``ops``."""
        return MappingProxyType({op.name: i for i, op in enumerate(self.ops)})

    @cached_property
    def out_bytes(self) -> tuple[int, ...]:
        """Bytes one op sends to a consumer on another device (largest edge it feeds; one tensor)."""
        out = [0] * len(self.ops)
        for src, _dst, nbytes in self.edges:
            i = self.index[src]
            out[i] = max(out[i], nbytes)
        return tuple(out)

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        """Predecessor positions of each op (sorted, deduplicated)."""
        ps: list[set[int]] = [set() for _ in self.ops]
        for src, dst, _ in self.edges:
            ps[self.index[dst]].add(self.index[src])
        return tuple(tuple(sorted(p)) for p in ps)

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        """Successor positions of each op (sorted, deduplicated)."""
        ss: list[set[int]] = [set() for _ in self.ops]
        for src, dst, _ in self.edges:
            ss[self.index[src]].add(self.index[dst])
        return tuple(tuple(sorted(s)) for s in ss)

    @cached_property
    def needs_grad(self) -> tuple[bool, ...]:
        """Whether a gradient flows back into each op's output (it depends on some trainable parameter).

        Ops upstream of every parameter (data placeholders, mask preprocessing) need no backward pass
        and their outputs' gradients are never sent between devices.
        """
        flags = [False] * len(self.ops)
        for i, op in enumerate(self.ops):
            flags[i] = op.param_bytes > 0 or any(flags[p] for p in self.preds[i])
        return tuple(flags)

    @cached_property
    def is_chain(self) -> bool:
        """True when every op but the first feeds exactly from its predecessor in ``ops`` (a path)."""
        n = len(self.ops)
        return all(self.preds[i] == ((i - 1,) if i else ()) for i in range(n)) and all(
            self.succs[i] == ((i + 1,) if i + 1 < n else ()) for i in range(n)
        )
