"""Tracing: an ``nn.Module`` (+ loss) and example inputs -> an ``IRGraph`` with shapes and costs.

Front ends, in order (design.md):

1. ``torch.fx`` symbolic tracing with *no leaf modules*, so ``nn.Linear`` becomes ``F.linear`` on
   explicit parameters: every parameter is then visible to the partitioner and the IR only needs
   functional operators;
2. ``torch.export.export(strict=False)`` where symbolic tracing cannot follow the model (Python
   control flow on shapes, recent ``transformers`` models) or where its graph does not reproduce
   the eager result on the example.

Both give an fx graph that ``graph_builder.GraphBuilder`` normalises into the IR: data placeholders,
parameters folded into the single op that uses them (a *parametric* op) or kept as *variable* nodes when they
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
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fusionnet.dag.custom_backward import refuse_backward_hooks, refuse_custom_functions, tensor_hooks_refused
from fusionnet.dag.graph_builder import GraphBuilder, TracedModel
from fusionnet.errors import IRError, TraceError

log = logging.getLogger("fusionnet.dag.trace")


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
    Raises ``TraceError`` naming both front ends' failures when neither works, and for a train/grad model
    that brings backward code of its own, which the rebuilt backward could not run (``custom_backward``).
    The model's buffers are as they were when it returns (``buffers_kept``).
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
    if task != "infer":
        _refuse_active_dropout(model, task)
        refuse_backward_hooks(model, loss_fn, task)
    expected = eager_result(model, inputs, labels, loss_fn, task)
    wrapper: nn.Module = _InferWrapper(model) if task == "infer" else _LossWrapper(model, loss_fn)
    args = (inputs,) if task == "infer" else (inputs, labels)
    wrapper.train(task != "infer")
    errors: list[str] = []
    differs = False  # some front end built a graph whose output is not the eager one
    if frontend in ("auto", "symbolic_trace"):
        try:
            fx_graph = _NoLeafTracer().trace(wrapper)
            traced = GraphBuilder(wrapper, fx_graph, None, task, "symbolic_trace").build(args)
            _check_reproduces(traced, expected, args)
            return traced
        except (TraceError, IRError) as e:
            differs |= isinstance(e, NotReproduced)
            errors.append(f"symbolic_trace: {e}")
        except Exception as e:  # fx raises arbitrary errors on data-dependent control flow
            errors.append(f"symbolic_trace: {type(e).__name__}: {e}")
        log.debug("symbolic tracing failed (%s); falling back to torch.export", errors[-1])
    if frontend in ("auto", "torch.export"):
        try:
            with _torch_export_quiet():
                exported = torch.export.export(wrapper, args, strict=False)
            traced = GraphBuilder(wrapper, exported.graph, exported, task, "torch.export").build(args)
            _check_reproduces(traced, expected, args)
            return traced
        except (TraceError, IRError) as e:
            differs |= isinstance(e, NotReproduced)
            errors.append(f"torch.export: {e}")
        except Exception as e:
            errors.append(f"torch.export: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    hint = f"; {_RANDOMNESS_HINT}" if differs and task != "infer" else ""
    raise TraceError("model cannot be traced: " + "; ".join(errors) + hint)


# Why a hint and not a diagnosis: a graph that differs from its own eager run is most often randomness
# the eager run and the graph drew apart, but fx can also bake in control flow; the message says which
# is common and what to change, the user knows which applies.
_RANDOMNESS_HINT = (
    "in train mode a common cause is randomness, such as functional dropout (F.dropout(training=True), "
    "scaled_dot_product_attention(dropout_p > 0), a transformers config's attention_dropout) or other random "
    "ops, whose draws cannot be reproduced exactly across compnodes: set their probability to 0"
)

# Shown when a train/grad model has more dropout modules than this; the count says how many in all.
_DROPOUT_NAMED = 3


def _refuse_active_dropout(model: nn.Module, task: str) -> None:
    """Refuses a train/grad model with a dropout-family module of ``p > 0`` (``_DropoutNd``: Dropout,
    Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout), before it is traced. Why: in train mode each
    draws a fresh random mask per call, so the eager run, the traced graph and every compnode draw
    different masks. Seeding them alike would not help: a compnode runs its piece of the graph on its
    own RNG stream and could never draw plain PyTorch's masks, and exactness is the bar (design.md).
    Without this the job failed later as "does not reproduce the model's output", naming no cause.
    Eval mode (infer) turns these modules off, so they are fine there."""
    active = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0
    ]
    if not active:
        return
    named = ", ".join(
        f"{name or '<root>'} ({type(m).__name__}, p={m.p:g})" for name, m in active[:_DROPOUT_NAMED]
    )
    more = f" and {len(active) - _DROPOUT_NAMED} more" if len(active) > _DROPOUT_NAMED else ""
    raise TraceError(
        f"a {task} job cannot use dropout: {named}{more}: randomness in train mode cannot be reproduced "
        "exactly across compnodes; set their p to 0 (in transformers configs: resid_pdrop, embd_pdrop, "
        "attn_pdrop for GPT-2; hidden_dropout_prob, attention_probs_dropout_prob for BERT; "
        "attention_dropout for Llama-style models)"
    )


class ForwardFailed(TraceError):
    """The model itself (plain eager PyTorch, before any tracing) raised on the example micro-batch: the
    user's model or its settings are at fault, not the tracer. ``cause`` is what it raised."""

    def __init__(self, message: str, cause: BaseException) -> None:
        super().__init__(message)
        self.cause = cause


class NotReproduced(TraceError):
    """The traced graph ran but its output is not the eager model's on the example (``_check_reproduces``):
    ``_trace`` adds a hint about randomness when that is why a train/grad job cannot be traced."""


def eager_result(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    task: str,
) -> Any:
    """The model's eager output on the example, as the task runs it (with its loss, in train mode, for
    train/grad): the reference every front end must reproduce. Leaves the model in the task's mode.

    Why guarded: the example is a whole micro-batch in the task's mode, which the job's one-row, eval-mode
    preflight never ran (a ``view(1, 16)``, a module that raises when training, a token id past the
    embedding), so user code may raise here; that is a ``ForwardFailed``, not an internal error.

    Why with grad for train/grad: only an autograd graph shows backward code of the model's own (a custom
    ``autograd.Function``, a hook put on a tensor in ``forward``), which FusionNet could not run
    (``custom_backward``): refused here as a ``TraceError``. The graph is dropped before returning.
    The load check (``runtime.loadcheck``) runs this too, in a child process, before the command does."""
    wrapper: nn.Module = _InferWrapper(model) if task == "infer" else _LossWrapper(model, loss_fn)
    args = (inputs,) if task == "infer" else (inputs, labels)
    wrapper.train(task != "infer")
    backward = task != "infer"
    try:
        with (
            torch.set_grad_enabled(backward),
            tensor_hooks_refused(task) if backward else contextlib.nullcontext(),
        ):
            result = wrapper(*args)
    except TraceError:
        raise
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
    if backward:
        refuse_custom_functions(result, task)
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, result)


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
    # Tensor leaves only: the others (None, Python numbers in a model's output dict) are no results
    # (``results.assemble.output_tensors`` drops them), and a graph may not keep them as they were.
    flat_got = [v for v in torch.utils._pytree.tree_flatten(got)[0] if isinstance(v, torch.Tensor)]
    flat_exp = [v for v in torch.utils._pytree.tree_flatten(expected)[0] if isinstance(v, torch.Tensor)]
    if len(flat_got) != len(flat_exp) or not all(
        a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)
        for a, b in zip(flat_got, flat_exp)
    ):
        raise NotReproduced("the traced graph does not reproduce the model's output on the example input")
