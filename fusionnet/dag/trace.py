"""Tracing: an ``nn.Module`` (+ loss) and example inputs -> an ``IRGraph`` with shapes and costs.

Front ends, in order (design.md):

1. ``torch.fx`` symbolic tracing with *no leaf modules*, so ``nn.Linear`` becomes ``F.linear`` on
   explicit parameters: every parameter is then visible to the partitioner and the IR only needs
   functional operators;
2. ``torch.export.export(strict=False)`` where symbolic tracing cannot follow the model (Python
   control flow on shapes, recent ``transformers`` models) or where its graph does not reproduce
   the eager result on the example.

Both give an fx graph that ``_GraphBuilder`` normalises into the IR: data placeholders, parameters
folded into the single op that uses them (a *parametric* op) or kept as *variable* nodes when they
are root-level leaves (Table 2's Tensor A) or shared by several ops (tied embeddings, so that one
node owns each parameter and its gradient is summed by autograd exactly once), and buffers copied
to whoever reads them. The graph is run once on the real example to record shapes, dtypes and
per-node costs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fusionnet.dag.codec import validate_ir
from fusionnet.dag.costs import op_cost
from fusionnet.dag.ir import IRGraph, IRNode, encode_value, tensor_meta
from fusionnet.dag.registry import REGISTRY
from fusionnet.errors import IRError, TraceError

log = logging.getLogger("fusionnet.dag.trace")
_PREFIX = "model."


class _LossWrapper(nn.Module):
    """``forward(inputs, labels) -> loss``: the whole FP of a train/grad job as one module."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            return self.model(inputs, labels)
        return self.loss_fn(self.model(inputs), labels)


class _InferWrapper(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> Any:
        return self.model(inputs)


class _NoLeafTracer(fx.Tracer):
    """Traces through every module, so that parameters appear as explicit ``get_attr`` nodes."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return False


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


def trace_model(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    task: str,
    *,
    frontend: str = "auto",
) -> TracedModel:
    """Traces ``model`` for ``task`` on an example (one micro-batch) and returns its IR.

    ``frontend`` is ``auto`` (symbolic, then export), ``symbolic_trace`` or ``torch.export``.
    Raises ``TraceError`` naming both front ends' failures when neither works. The model's buffers are as
    they were when it returns (``buffers_kept``).
    """
    if task not in ("train", "grad", "infer"):
        raise ValueError(f"unknown task {task!r}")
    with buffers_kept(model):
        return _trace(model, inputs, labels, loss_fn, task, frontend)


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Puts the model's buffers back as they were on entry. Why: tracing runs the model (and the traced
    graph) in train mode, and a BatchNorm there updates its running statistics and batch count in place
    on every run, under ``no_grad`` too; the job's initial state is read from the model afterwards, so
    without this it would start from statistics plain PyTorch never saw (``traced.state`` holds the same
    tensors, so it is put back too)."""
    kept = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def _trace(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    task: str,
    frontend: str,
) -> TracedModel:
    wrapper: nn.Module = _InferWrapper(model) if task == "infer" else _LossWrapper(model, loss_fn)
    args = (inputs,) if task == "infer" else (inputs, labels)
    wrapper.train(task != "infer")
    expected = _eager_result(wrapper, args, task)
    errors: list[str] = []
    if frontend in ("auto", "symbolic_trace"):
        try:
            fx_graph = _NoLeafTracer().trace(wrapper)
            traced = _GraphBuilder(wrapper, fx_graph, None, task, "symbolic_trace").build(args)
            _check_reproduces(traced, expected, args)
            return traced
        except (TraceError, IRError) as e:
            errors.append(f"symbolic_trace: {e}")
        except Exception as e:  # fx raises arbitrary errors on data-dependent control flow
            errors.append(f"symbolic_trace: {type(e).__name__}: {e}")
        log.debug("symbolic tracing failed (%s); falling back to torch.export", errors[-1])
    if frontend in ("auto", "torch.export"):
        try:
            with _torch_export_quiet():
                exported = torch.export.export(wrapper, args, strict=False)
            traced = _GraphBuilder(wrapper, exported.graph, exported, task, "torch.export").build(args)
            _check_reproduces(traced, expected, args)
            return traced
        except (TraceError, IRError) as e:
            errors.append(f"torch.export: {e}")
        except Exception as e:
            errors.append(f"torch.export: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    raise TraceError("model cannot be traced: " + "; ".join(errors))


class ForwardFailed(TraceError):
    """The model itself (plain eager PyTorch, before any tracing) raised on the example micro-batch: the
    user's model or its settings are at fault, not the tracer. ``cause`` is what it raised."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


def _eager_result(wrapper: nn.Module, args: tuple[Any, ...], task: str) -> Any:
    """The wrapper's eager output on the example: the reference every front end must reproduce. Why
    guarded: the example is a whole micro-batch in the task's mode, which the job's one-row, eval-mode
    preflight never ran (a ``view(1, 16)``, a module that raises when training, a token id past the
    embedding), so user code may raise here; that is a ``ForwardFailed``, not an internal error."""
    try:
        with torch.no_grad():
            return wrapper(*args)
    except Exception as e:
        shapes = ", ".join(f"{name} {tuple(a.shape)}" for name, a in zip(("inputs", "labels"), args))
        mode = "train" if wrapper.training else "eval"
        with_loss = " with its loss" if task != "infer" else ""
        text = " ".join(str(e).split())[:300]
        raise ForwardFailed(
            f"the model's forward{with_loss} on the first micro-batch ({shapes}; {mode} mode) failed: "
            f"{type(e).__name__}: {text}",
            e,
        ) from e


# torch's own loggers (``torch``, ``torch._dynamo``, ``torch.fx.experimental.symbolic_shapes``, ...)
# write straight to stderr through handlers of their own, not through ours.
_TORCH_LOGGER = "torch"


@contextlib.contextmanager
def _torch_export_quiet() -> Iterator[None]:
    """Silences what ``torch.export`` prints while it fails: it logs warnings and errors through torch's
    loggers and prints the partial graph to ``sys.stderr`` itself (``torch/export/_trace.py``), 30 lines
    for one ``if tensor:``. Its failure reaches the user anyway, as one line of ``TraceError``.
    Process-wide while it lasts (stderr and logger levels are): tracing runs before any worker thread."""
    loggers = [logging.getLogger(_TORCH_LOGGER)] + [
        logger
        for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith(_TORCH_LOGGER + ".") and isinstance(logger, logging.Logger) and logger.level
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def reproduces_on(
    traced: TracedModel,
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    loss_fn: Callable[..., torch.Tensor] | None,
) -> str | None:
    """Whether ``traced`` (traced on another example) gives the model's result on this one: None if it
    does, else what went wrong. A graph traced by ``torch.export`` fixes every shape it saw, the batch's
    too (a ``view`` to ``[3, 16, 96]``), so it may fail or differ on a micro-batch of another size."""
    task = traced.graph.task
    wrapper: nn.Module = _InferWrapper(model) if task == "infer" else _LossWrapper(model, loss_fn)
    args = (inputs,) if task == "infer" else (inputs, labels)
    was_training = model.training
    wrapper.train(task != "infer")
    try:
        with torch.no_grad(), torch.random.fork_rng(), buffers_kept(model):
            torch.manual_seed(0)  # the same draws for both runs (dropout)
            expected = wrapper(*args)
            torch.manual_seed(0)
            _check_reproduces(traced, expected, args)
    except TraceError:
        return "its output differs from the model's"
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        model.train(was_training)
    return None


def _check_reproduces(traced: TracedModel, expected: Any, args: tuple[Any, ...]) -> None:
    """The traced graph must give the eager result on the example (catches control flow baked in)."""
    from fusionnet.dag.rebuild import run_whole_graph

    got = run_whole_graph(traced.graph, traced.state, dict(zip(("inputs", "labels"), args)))
    flat_got, _ = torch.utils._pytree.tree_flatten(got)
    flat_exp, _ = torch.utils._pytree.tree_flatten(expected)
    if len(flat_got) != len(flat_exp) or not all(
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)
        for a, b in zip(flat_got, flat_exp)
    ):
        raise TraceError("the traced graph does not reproduce the model's output on the example input")


class _GraphBuilder:
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
            path.removeprefix(_PREFIX) if path.startswith(_PREFIX) else f"const:{path}"
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
