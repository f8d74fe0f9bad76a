"""The execution plane's front half: IR nodes -> callables, and a sub-DAG -> ``torch.fx.GraphModule``.

A compnode never imports user code: it resolves each IR operator name against the registry and
builds a GraphModule whose parameters are the ones its sub-DAG owns. ``run_whole_graph`` is the
same machinery for a whole graph, used by the tracer to check that a trace reproduces the model.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fusionnet.dag.ir import IRGraph, IRNode, decode_kwargs, decode_value
from fusionnet.dag.registry import REGISTRY
from fusionnet.errors import ExecutionError


def resolve_args(
    node: IRNode, values: Mapping[str, Any], state: Mapping[str, torch.Tensor]
) -> tuple[list[Any], dict[str, Any]]:
    def resolve(tag: str, name: str) -> Any:
        return values[name] if tag == "$node" else state[name]

    return decode_value(node.args, resolve), decode_kwargs(node.kwargs, resolve)


def call_op(op: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    fn = REGISTRY.executable(op)  # the op behind its argument checks
    if fn is None:
        return getattr(args[0], op[len("method:") :])(*args[1:], **kwargs)
    return fn(*args, **kwargs)


# Called by ``run_whole_graph`` after each node with (node, resolved args, resolved kwargs, its value);
# placeholders and variables get empty args. The tracer records meta and costs through it.
NodeHook = Callable[[IRNode, Sequence[Any], Mapping[str, Any], Any], None]


def run_whole_graph(
    graph: IRGraph,
    state: Mapping[str, torch.Tensor],
    data: Mapping[str, Any],
    on_node: NodeHook | None = None,
) -> Any:
    """Runs the entire IR graph in-process (no partitioning) and returns the output node's value.

    The one IR interpreter: the tracer checks a trace against the model and annotates each node with it.
    """
    values: dict[str, Any] = {}
    for n in graph.nodes:
        args: Sequence[Any] = ()
        kwargs: Mapping[str, Any] = {}
        if n.kind == "placeholder":
            values[n.name] = data[n.target]
        elif n.kind == "variable":
            values[n.name] = state[n.target]
        elif n.kind == "output":
            return decode_value(n.args[0], lambda tag, name: values[name] if tag == "$node" else state[name])
        else:
            args, kwargs = resolve_args(n, values, state)
            values[n.name] = call_op(n.op, args, kwargs)
        if on_node is not None:
            on_node(n, args, kwargs, values[n.name])
    raise ExecutionError("graph has no output node")


def _attr_name(key: str) -> str:
    """A state key as a valid Python attribute name (GraphModule attributes can't contain dots)."""
    return "s_" + "".join(c if c.isalnum() else "_" for c in key) + f"_{zlib.crc32(key.encode()):08x}"


class SubDagModule(nn.Module):
    """Holds a sub-DAG's parameters (trainable) and buffers; the GraphModule's root."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], copy: bool = True
    ) -> None:
        super().__init__()
        self.attr_of: dict[str, str] = {}

        def own(value: torch.Tensor) -> torch.Tensor:
            return value.detach().clone() if copy else value.detach()

        for key, value in params.items():
            self.attr_of[key] = _attr_name(key)
            self.register_parameter(self.attr_of[key], nn.Parameter(own(value), requires_grad=True))
        for key, value in buffers.items():
            self.attr_of[key] = _attr_name(key)
            self.register_buffer(self.attr_of[key], own(value))

    def param(self, key: str) -> nn.Parameter:
        return getattr(self, self.attr_of[key])


def build_subdag_module(
    graph: IRGraph,
    node_names: Sequence[str],
    input_names: Sequence[str],
    output_names: Sequence[str],
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    device: torch.device | None = None,
    compact_lookups: Mapping[str, int] | None = None,
    copy_state: bool = True,
) -> tuple[fx.GraphModule, SubDagModule]:
    """Rebuilds the sub-DAG ``node_names`` as a GraphModule whose constant devices are ``device`` (the
    executor's; default the CPU): the IR's ``device=cpu`` arguments were the tracer's, not the model's.

    Its positional inputs are ``input_names`` (outer required data, in that order) and it returns a
    tuple with the values of ``output_names`` (outwards data, plus the loss/output if held here).

    ``compact_lookups`` (embedding node -> the full weight's row count): lookups whose weight input holds
    only the step's rows (``row_trade``); each gets one more positional input after ``input_names``, in
    that mapping's order: the sorted ids of the rows it holds (``compact_embedding``).

    ``copy_state=False``: ``params`` and ``buffers`` are the caller's to give away (freshly unpacked from
    an assignment), so the module uses them as they are instead of holding a second copy.
    """
    root = SubDagModule(params, buffers, copy=copy_state)
    where = device if device is not None else torch.device("cpu")
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for name in input_names:
        env[name] = g.placeholder(_safe(name))
    compact = dict(compact_lookups or {})
    row_ids = {name: g.placeholder(_safe(f"row_ids_of_{name}")) for name in compact}
    attr_nodes: dict[str, fx.Node] = {}

    def attr(key: str) -> fx.Node:
        if key not in attr_nodes:
            attr_nodes[key] = g.get_attr(root.attr_of[key])
        return attr_nodes[key]

    def resolve(tag: str, name: str) -> Any:
        if tag == "$node":
            if name not in env:
                raise ExecutionError(f"sub-DAG reads {name!r} which is neither local nor an input")
            return env[name]
        return attr(name)

    wanted = set(node_names)
    for n in graph.nodes:
        if n.name not in wanted or n.name in env:
            continue
        if n.kind == "placeholder":
            raise ExecutionError(f"placeholder {n.name!r} must be fed as an input of its sub-DAG")
        if n.kind == "variable":
            env[n.name] = attr(n.target)
            continue
        if n.kind == "output":
            continue
        args = decode_value(n.args, resolve, where)
        kwargs = decode_kwargs(n.kwargs, resolve, where)
        fn = REGISTRY.executable(n.op)  # the op behind its argument checks
        if n.name in compact and fn is not None:
            lookup = _compact_lookup(fn, n.op.startswith("aten."), compact[n.name])
            env[n.name] = g.call_function(lookup, (row_ids[n.name], *args), kwargs)
        elif fn is None:
            env[n.name] = g.call_method(n.op[len("method:") :], tuple(args), kwargs)
        else:
            env[n.name] = g.call_function(fn, tuple(args), kwargs)
        env[n.name].name = _safe(n.name)
    g.output(tuple(env[name] for name in output_names))
    gm = fx.GraphModule(root, g, class_name="SubDag")
    return gm, root


def _compact_lookup(fn: Callable[..., Any], aten: bool, rows: int) -> Callable[..., Any]:
    def compact_lookup(ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return compact_embedding(fn, aten, rows, ids, *args, **kwargs)

    return compact_lookup  # a named function: fx calls it from its generated code


def compact_embedding(
    fn: Callable[..., Any], aten: bool, rows: int, ids: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """An embedding lookup in a weight that holds only rows ``ids`` (sorted, distinct) of a ``rows``-row
    matrix: the indices and ``padding_idx`` become positions in ``ids``; the same values and gradients as
    the lookup in the whole matrix, whose other rows it never read. ``fn`` is ``aten.embedding(weight,
    indices, padding_idx=-1, ...)`` or ``F.embedding(input, weight, padding_idx=None, ...)``."""
    call = list(args)
    i = 1 if aten else 0
    indices = call[i] if len(call) > i else kwargs["indices" if aten else "input"]
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= rows):
        raise IndexError(f"embedding: an index outside 0..{rows - 1}")
    positions = torch.searchsorted(ids, indices)
    if not bool((ids[positions.clamp(max=max(len(ids) - 1, 0))] == indices).all()):
        raise ExecutionError("embedding: an index among no rows the step traded")  # ids cover every index
    if len(call) > i:
        call[i] = positions
    else:
        kwargs["indices" if aten else "input"] = positions
    # padding_idx: aten's -1 (any negative) is none; F.embedding's None is, and it counts a negative one
    # from the end. Its row's gradient stays zero: the same row, at its position among ``ids``.
    none = -1 if aten else None
    pad = call[2] if len(call) > 2 else kwargs.get("padding_idx", none)
    if pad is not None and (pad >= 0 or not aten):
        full = pad + rows if pad < 0 else pad
        hit = (ids == full).nonzero()
        new_pad = int(hit[0, 0]) if len(hit) else none  # a row no index reads: nothing to keep at zero
        if len(call) > 2:
            call[2] = new_pad
        else:
            kwargs["padding_idx"] = new_pad
    return fn(*call, **kwargs)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "n"


def output_value(graph: IRGraph, values: Mapping[str, Any]) -> Any:
    """The value of the graph's output node given the values of the nodes it reads."""
    return decode_value(graph.output.args[0], lambda tag, name: values[name])


__all__ = [
    "SubDagModule",
    "build_subdag_module",
    "call_op",
    "output_value",
    "resolve_args",
    "run_whole_graph",
]
