"""Refusing backward code of a model's own in a train/grad job.

FusionNet traces a model's *forward* ops into the IR; every compnode then gets its gradients from the
backward that autograd derives from those ops (``rebuild.py``, ``backward_pass.py``). Backward code the
model brings along is not an op of the forward, so no trace can keep it, and it silently never ran:

- an ``autograd.Function`` with a backward of its own (a straight-through estimator: forward rounds,
  backward passes the gradient through) was traced into its forward ops, whose derived gradient
  (``round``: zero) replaced the custom one;
- module backward hooks (``register_full_backward_hook``, ``register_backward_hook``,
  ``register_full_backward_pre_hook``, and their global forms), gradient hooks on parameters and
  ``Tensor.register_hook`` calls in ``forward`` (gradient reversal) were dropped.

Exactness is the bar (design.md): plain PyTorch runs that code, so such a job is refused by name instead.
Infer jobs have no backward and are not checked.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fusionnet.errors import TraceError

# Why it is safe to let these through: their backward is, by construction, the backward of standard ops.
# Reentrant activation checkpointing recomputes its forward in backward and differentiates that; a
# module backward hook's identity Function only exists where hooks do, and those are refused by name first.
_SAME_AS_FORWARD = ("torch.utils.checkpoint.CheckpointFunction",)

_WHY = (
    "FusionNet rebuilds the backward pass from the model's forward ops and cannot run backward code of "
    "the model's own, so its gradients would differ from plain PyTorch's; write it with standard ops "
    "instead (a straight-through estimator, for one: x + (f(x) - x).detach())"
)

# Shown in full up to this many; the count says how many in all.
_NAMED = 3


def refuse_backward_hooks(model: nn.Module, loss_fn: Callable[..., Any] | None, task: str) -> None:
    """Refuses a model (or a loss module) that carries backward hooks or parameter gradient hooks, naming
    the module or parameter paths. Static: checked before anything runs."""
    owners: list[tuple[str, nn.Module]] = [("", model)]
    if isinstance(loss_fn, nn.Module):
        owners.append(("loss", loss_fn))
    found: list[str] = []
    for prefix, owner in owners:
        for name, module in owner.named_modules(prefix=prefix):
            kinds = [
                kind
                for kind, hooks in (
                    ("backward hook", module._backward_hooks),
                    ("backward pre-hook", module._backward_pre_hooks),
                )
                if hooks
            ]
            if kinds:
                found.append(
                    f"module {name or '<root>'} ({type(module).__name__}) has a {' and a '.join(kinds)}"
                )
        for name, param in owner.named_parameters(prefix=prefix, remove_duplicate=True):
            if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
                found.append(f"parameter {name} has a gradient hook")
    registry = nn.modules.module
    for what, hooks in (
        ("register_module_full_backward_hook", getattr(registry, "_global_backward_hooks", None)),
        ("register_module_full_backward_pre_hook", getattr(registry, "_global_backward_pre_hooks", None)),
    ):
        if hooks:
            found.append(f"a global module backward hook is set ({what})")
    if found:
        _refuse(task, found)


def refuse_custom_functions(result: Any, task: str) -> None:
    """Refuses an eager result (computed with grad enabled) whose autograd graph holds a node of a custom
    ``autograd.Function``, naming the Function classes. Built-in nodes (``AddmmBackward0``) are C++ types;
    a Python Function's node is a ``BackwardCFunction``, which is what is looked for."""
    roots = [
        v.grad_fn
        for v in torch.utils._pytree.tree_flatten(result)[0]
        if isinstance(v, torch.Tensor) and v.grad_fn is not None
    ]
    seen: set[Any] = set()
    found: dict[str, None] = {}  # ordered, unique
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            cls = getattr(node, "_forward_cls", None)
            qualified = f"{cls.__module__}.{cls.__qualname__}" if cls is not None else type(node).__name__
            if qualified not in _SAME_AS_FORWARD:
                shown = cls.__qualname__ if cls is not None else type(node).__name__
                found[f"autograd.Function {shown} ({type(node).__name__} in the autograd graph)"] = None
        roots.extend(fn for fn, _ in node.next_functions)
    if found:
        _refuse(task, list(found))


class _HookCalls(TorchFunctionMode):
    """Records where the code run under it registers tensor gradient hooks. Why a mode: a hook put on an
    intermediate tensor in ``forward`` leaves no trace Python can see in the autograd graph afterwards,
    and ``Tensor.register_hook`` dispatches through ``__torch_function__`` whenever a mode is active."""

    _HOOKS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in self._HOOKS:
            self.calls.append(f"the forward calls Tensor.{func.__name__} ({_caller()})")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tensor_hooks_refused(task: str) -> Iterator[None]:
    """Runs its body (the eager forward) and refuses the job when that registered tensor gradient hooks.
    The refusal is raised after the body ends normally; an exception of the body's own goes first."""
    mode = _HookCalls()
    with mode:
        yield
    if mode.calls:
        _refuse(task, list(dict.fromkeys(mode.calls)))


_TORCH_DIR = Path(torch.__file__).parent
_OUR_DIR = Path(__file__).resolve().parent.parent


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and FusionNet: the model's own line."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if not (path.is_relative_to(_TORCH_DIR) or path.is_relative_to(_OUR_DIR)):
            return f"{path.name}:{frame.lineno}"
    return "unknown line"


def _refuse(task: str, found: list[str]) -> None:
    named = "; ".join(found[:_NAMED])
    more = f" and {len(found) - _NAMED} more" if len(found) > _NAMED else ""
    raise TraceError(f"a {task} job cannot run custom backward code: {named}{more}: {_WHY}")
