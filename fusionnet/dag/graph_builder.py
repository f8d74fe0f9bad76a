"""The second half of tracing: an fx graph (symbolic or exported) -> an ``IRGraph`` with shapes and costs.

``GraphBuilder`` folds each parameter into the single op that uses it (a *parametric* op), keeps
root-level leaves and tensors shared by several ops (tied embeddings) as *variable* nodes so that one
node owns each parameter and autograd sums its gradient exactly once, copies buffers to whoever reads
them, and runs the graph once on the real example to record shapes, dtypes and per-node costs.
``trace.py`` chooses the front end and checks the result; this module only normalises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fusionnet.dag.codec import validate_ir
from fusionnet.dag.costs import op_cost
from fusionnet.dag.ir import IRGraph, IRNode, encode_value, tensor_meta
from fusionnet.dag.registry import REGISTRY
from fusionnet.errors import TraceError

MODEL_PREFIX = "model."  # the wrappers hold the user's model as ``model``


@dataclass
class TracedModel:
    graph: IRGraph
    # The tensors the IR reads by IR key: state_dict keys, non-persistent buffers (their module path,
    # e.g. rotary ``inv_freq``) and constants torch.export lifted (``const:...``).
    state: dict[str, torch.Tensor]

    def job_state(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A job's initial state: the model's ``state_dict`` plus every tensor the IR reads that it leaves
        out (non-persistent buffers, lifted constants), which the compnodes need as much as parameters."""
        return {**state_dict, **{k: v for k, v in self.state.items() if k not in state_dict}}


class GraphBuilder:
    """Normalises an fx graph (symbolic or exported) into an ``IRGraph`` and runs it on the example."""

    def __init__(self, wrapper: nn.Module, graph: fx.Graph, exported: Any, task: str, frontend: str) -> None:
        self.wrapper = wrapper
        self.graph = graph
        self.exported = exported
        self.task = task
        self.frontend = frontend
        self.state: dict[str, torch.Tensor] = {}
        self.trainable: set[str] = set()
        self.refs: dict[
            fx.Node, tuple[str, str]
        ] = {}  # fx node -> ("attr", key) for tensors held by the model
        # Tied tensors (one Parameter under several state_dict keys) get one canonical key, the first
        # in state_dict order, so exactly one node owns them; the other keys become aliases.
        self.canonical: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        for key, tensor in wrapper.model.state_dict(keep_vars=True).items():
            first = self.canonical.setdefault(id(tensor), key)
            if first != key:
                self.aliases[key] = first

    # -- attribute resolution ------------------------------------------------------------------
    def _attr_key(self, path: str) -> str:
        """Registers the tensor at ``path`` (relative to the wrapper) and returns its IR key."""
        value: Any = self.wrapper
        for part in path.split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            raise TraceError(f"attribute {path!r} is a {type(value).__name__}, not a tensor")
        key = self.canonical.get(id(value)) or (
            path.removeprefix(MODEL_PREFIX) if path.startswith(MODEL_PREFIX) else f"const:{path}"
        )
        self.state[key] = value.detach()
        if isinstance(value, nn.Parameter) and value.requires_grad:
            self.trainable.add(key)
        return key

    def _classify_placeholders(self) -> dict[fx.Node, Any]:
        """Data placeholders -> dataset field; exported parameter/buffer placeholders -> attr refs."""
        data: dict[fx.Node, Any] = {}
        specs = {}
        if self.exported is not None:
            specs = {s.arg.name: s for s in self.exported.graph_signature.input_specs}
        user_inputs = iter(("inputs", "labels"))
        for node in self.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = specs.get(node.name)
            kind = getattr(getattr(spec, "kind", None), "name", "USER_INPUT")
            if kind == "USER_INPUT":
                data[node] = next(user_inputs)
            elif kind in ("PARAMETER", "BUFFER"):
                self.refs[node] = ("attr", self._attr_key(spec.target))
            elif kind == "CONSTANT_TENSOR":
                key = f"const:{spec.target}"
                self.state[key] = self.exported.constants[spec.target].detach()
                self.refs[node] = ("attr", key)
            else:
                raise TraceError(f"exported input {node.name!r} of kind {kind} is not supported")
        return data

    # -- main ----------------------------------------------------------------------------------
    def build(self, example: tuple[Any, ...]) -> TracedModel:
        data_fields = self._classify_placeholders()
        for node in self.graph.nodes:
            if node.op == "get_attr":
                self.refs[node] = ("attr", self._attr_key(node.target))
        ops = [n for n in self.graph.nodes if n.op in ("call_function", "call_method")]
        if any(n.op == "call_module" for n in self.graph.nodes):
            raise TraceError("graph still contains module calls")
        # How many ops read each trainable parameter decides whether it is folded or a variable.
        readers: dict[str, set[fx.Node]] = {}
        for op in ops:
            for inp in op.all_input_nodes:
                if inp in self.refs and self.refs[inp][1] in self.trainable:
                    readers.setdefault(self.refs[inp][1], set()).add(op)
        variables = {
            key
            for key, users in readers.items()
            if len(users) > 1 or "." not in key or key.startswith("const:")
        }
        ir_nodes: list[IRNode] = []
        ref_of: dict[fx.Node, Any] = {}
        for node, field_name in data_fields.items():
            ir_nodes.append(IRNode(name=field_name, kind="placeholder", op="placeholder", target=field_name))
            ref_of[node] = {"$node": field_name}
        for key in sorted(variables, key=lambda k: list(self.state).index(k)):
            name = "var_" + key.replace(".", "_")
            ir_nodes.append(IRNode(name=name, kind="variable", op="variable", target=key))
        var_node = {key: "var_" + key.replace(".", "_") for key in variables}
        for node, (_, key) in self.refs.items():
            if key in variables:
                ref_of[node] = {"$node": var_node[key]}
            elif key in self.trainable:
                ref_of[node] = {"$param": key}
            else:
                ref_of[node] = {"$buffer": key}
        output_node = next(n for n in self.graph.nodes if n.op == "output")
        loss_src = None
        if self.task != "infer":
            out = output_node.args[0]
            out = out[0] if isinstance(out, tuple | list) and len(out) == 1 else out
            if not isinstance(out, fx.Node) or out.op not in ("call_function", "call_method"):
                raise TraceError("a train/grad model must return a single loss tensor")
            loss_src = out
        for node in ops:
            op_name = REGISTRY.node_op_name(node)
            args = [self._encode(a, ref_of, node) for a in node.args]
            kwargs = self._encode(dict(node.kwargs), ref_of, node)["$dict"]
            has_param = any(isinstance(a, dict) and "$param" in a for a in _walk((args, kwargs)))
            kind = "loss" if node is loss_src else ("parametric" if has_param else "non_parametric")
            ir_nodes.append(
                IRNode(name=node.name, kind=kind, op=op_name, args=args, kwargs={k: v for k, v in kwargs})
            )
            ref_of[node] = {"$node": node.name}
        out_args = self._encode(output_node.args[0], ref_of, output_node)
        if self.task != "infer" and isinstance(out_args, dict) and "$tuple" in out_args:
            out_args = out_args["$tuple"][0]
        ir_nodes.append(IRNode(name="output", kind="output", op="output", args=[out_args]))
        return self._finish(ir_nodes, example)

    def _encode(self, value: Any, ref_of: dict[fx.Node, Any], where: fx.Node) -> Any:
        if isinstance(value, fx.Node):
            if value not in ref_of:
                raise TraceError(f"node {where.name!r} reads {value.name!r}, which is not an op or input")
            return ref_of[value]
        if isinstance(value, tuple):
            return {"$tuple": [self._encode(v, ref_of, where) for v in value]}
        if isinstance(value, list):
            return [self._encode(v, ref_of, where) for v in value]
        if isinstance(value, dict):
            return {"$dict": [[k, self._encode(v, ref_of, where)] for k, v in value.items()]}
        if isinstance(value, slice):
            return {"$slice": [self._encode(v, ref_of, where) for v in (value.start, value.stop, value.step)]}
        try:
            return encode_value(value)
        except TypeError as e:
            raise TraceError(f"node {where.name!r}: {e}") from e

    def _finish(self, ir_nodes: list[IRNode], example: tuple[Any, ...]) -> TracedModel:
        users: dict[str, list[str]] = {n.name: [] for n in ir_nodes}
        for n in ir_nodes:
            for src in n.input_names():
                users[src].append(n.name)
        for n in ir_nodes:
            n.users = users[n.name]
        # Drop parameters/buffers that no op reads (e.g. dead attributes) from the state we ship.
        used_params = {k for n in ir_nodes for k in n.param_keys()}
        used_buffers = {k for n in ir_nodes for k in n.buffer_keys()}
        model_keys = list(self.wrapper.model.state_dict().keys())
        graph = IRGraph(
            nodes=ir_nodes,
            task=self.task,
            params={k: _spec(self.state[k]) for k in self.state if k in used_params},
            buffers={k: _spec(self.state[k]) for k in self.state if k in used_buffers},
            state_keys=model_keys,
            aliases={k: v for k, v in self.aliases.items() if v in used_params or v in used_buffers},
            frontend=self.frontend,
        )
        state = {k: v for k, v in self.state.items() if k in used_params or k in used_buffers}
        _annotate(graph, state, dict(zip(("inputs", "labels"), example)))
        validate_ir(graph)
        return TracedModel(graph=graph, state=state)


def _spec(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _walk(tree: Any) -> Any:
    yield tree
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _walk(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _walk(v)


def _annotate(graph: IRGraph, state: dict[str, torch.Tensor], data: dict[str, Any]) -> None:
    """Runs the graph once on the example, recording each node's output meta and cost."""
    from fusionnet.dag.rebuild import run_whole_graph

    def record(n: IRNode, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> None:
        n.meta = tensor_meta(out)
        if n.kind in ("variable", "placeholder"):
            size = out.numel() * out.element_size()
            n.cost = {
                "flops_fwd": 0,
                "flops_bwd": 0,
                "bytes_read": 0,
                "bytes_written": size if n.kind == "placeholder" else 0,
                "param_bytes": size if n.kind == "variable" else 0,
                "activation_bytes": size,
            }
            return
        param_bytes = sum(state[k].numel() * state[k].element_size() for k in n.param_keys())
        n.cost = op_cost(
            _cost_target(n.op),
            tuple(args),
            dict(kwargs),
            out,
            param_bytes=param_bytes,
            needs_grad=graph.task != "infer",
        ).to_dict()

    with torch.no_grad():
        run_whole_graph(graph, state, data, on_node=record)


def _cost_target(op: str) -> Any:
    return op if op.startswith("method:") else REGISTRY.resolve(op)
