"""Optimizer state of a sub-DAG as flat named tensors, and back (FusionAI 3.5, state safety).

A checkpoint of a sub-DAG is its parameters and buffers (``SubDagExecutor.state()``) plus the state
of its per-op optimizers, so that a replacement compnode resumes exactly where the lost one stood.
``torch.optim`` keeps state by parameter position; on the wire it is keyed by the parameter's state
key instead (``opt::<state key>::<slot>``), so any compnode can load it into freshly built optimizers
whatever their grouping. Plain numbers (some optimizers keep ``step`` as a float) travel as float64
scalars marked ``#num``. Pure functions: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fusionnet.errors import ExecutionError

PREFIX = "opt::"
NUMBER_MARK = "#num"


def _param_keys(optimizer: torch.optim.Optimizer, named: Mapping[str, torch.nn.Parameter]) -> list[str]:
    key_of = {id(p): k for k, p in named.items()}
    keys = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in key_of:
                raise ExecutionError("an optimizer holds a parameter that is not in its sub-DAG")
            keys.append(key_of[id(p)])
    return keys


def optimizer_tensors(
    optimizers: Sequence[torch.optim.Optimizer], named: Mapping[str, torch.nn.Parameter], copy: bool = True
) -> dict[str, torch.Tensor]:
    """Every optimizer's per-parameter state as ``{opt::<key>::<slot>: tensor}``: copies, or with
    ``copy=False`` the live tensors (detached, where they live) for a caller that copies them before
    the next Update."""
    out: dict[str, torch.Tensor] = {}
    for optimizer in optimizers:
        keys = _param_keys(optimizer, named)
        state = optimizer.state_dict()["state"]
        for index, slots in state.items():
            for slot, value in slots.items():
                name = f"{PREFIX}{keys[index]}::{slot}"
                if isinstance(value, torch.Tensor):
                    out[name] = value.detach().clone() if copy else value.detach()
                elif isinstance(value, bool | int | float):
                    out[name + NUMBER_MARK] = torch.tensor(float(value), dtype=torch.float64)
                else:
                    raise ExecutionError(
                        f"optimizer state {name} of type {type(value).__name__} cannot travel"
                    )
    return out


def load_optimizer_tensors(
    optimizers: Sequence[torch.optim.Optimizer],
    named: Mapping[str, torch.nn.Parameter],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Loads what ``optimizer_tensors`` produced into freshly built optimizers of the same sub-DAG."""
    by_key: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        if not name.startswith(PREFIX):
            continue
        key, sep, slot = name[len(PREFIX) :].rpartition("::")
        if not sep or key not in named:
            raise ExecutionError(f"optimizer state {name!r} names no parameter of this sub-DAG")
        if slot.endswith(NUMBER_MARK):
            by_key.setdefault(key, {})[slot[: -len(NUMBER_MARK)]] = float(value.item())
        else:
            by_key.setdefault(key, {})[slot] = value
    used: set[str] = set()
    for optimizer in optimizers:
        keys = _param_keys(optimizer, named)
        current = optimizer.state_dict()
        state = {i: dict(by_key[k]) for i, k in enumerate(keys) if k in by_key}
        used.update(k for k in keys if k in by_key)
        optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    unused = sorted(set(by_key) - used)
    if unused:
        raise ExecutionError(f"optimizer state for parameters no optimizer holds: {unused[:5]}")
