"""``model.entrypoint`` -> the user's ``nn.Module``, and ``model.weights`` -> its initial state.

This is the one place where user code runs, and it runs only on the submitter's machine (design.md:
compnodes receive IR, never code). A file entry point is imported from its path under a fresh, unique
module name, so two jobs whose model files are both called ``model.py`` never see each other's module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fusionnet.errors import JobError
from fusionnet.job.data import resolve_file

_counter = itertools.count()


def _import_file(path: Path, shown: str) -> Any:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"fusionnet_user_{path.stem if path.stem.isidentifier() else 'model'}_{digest}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise JobError(f"model.entrypoint: {shown}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, typing and pickle-free introspection look modules up here
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a model file must not end the command silently
        del sys.modules[name]
        raise JobError(f"model.entrypoint: {shown}: importing it raised {type(e).__name__}: {e}") from e
    return module


def resolve_entrypoint(entrypoint: str, base_dir: Path, *, allow_outside: bool = False) -> Callable[..., Any]:
    """``FILE.py:callable`` (a file in the job folder ``base_dir``, the callable defined in it; attributes may
    be dotted, ``models.py:Net.build``). ``package.module:callable`` and files outside the folder only with
    ``allow_outside``: otherwise a job file could run any installed function (``os:system``)."""
    where, _, attr = entrypoint.rpartition(":")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    if not is_file and not allow_outside:
        raise JobError(
            f"model.entrypoint: {entrypoint[:80]!r} names an importable module; an entrypoint must be "
            "FILE.py:CALLABLE with FILE.py in the job folder (or pass --allow-outside-paths)"
        )
    if is_file:
        path = resolve_file(base_dir, where, "model.entrypoint", allow_outside=allow_outside)
        module = _import_file(path, where)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise JobError(f"model.entrypoint: module {where!r} not found ({e})") from e
        except Exception as e:
            raise JobError(f"model.entrypoint: importing {where!r} raised {type(e).__name__}: {e}") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise JobError(f"model.entrypoint: {where} has no attribute {attr!r}")
        target = getattr(target, part)
        if target is not module and part == attr.split(".")[0] and is_file and not allow_outside:
            # A name the file merely imported (``from os import system``) is not the user's model code.
            defined_in = getattr(target, "__module__", None)
            if defined_in != module.__name__:
                raise JobError(
                    f"model.entrypoint: {where}:{part} is imported from {defined_in!r}, not defined in "
                    f"{where}; define the builder in the file (or pass --allow-outside-paths)"
                )
    if not callable(target):
        raise JobError(f"model.entrypoint: {where}:{attr} is a {type(target).__name__}, not a callable")
    return target


def build_model(
    entrypoint: str, kwargs: Mapping[str, Any], base_dir: Path, seed: int, *, allow_outside: bool = False
) -> torch.nn.Module:
    """Calls the entry point with ``kwargs`` right after ``torch.manual_seed(seed)``."""
    fn = resolve_entrypoint(entrypoint, base_dir, allow_outside=allow_outside)
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise JobError(f"model.kwargs: {entrypoint} does not accept them: {e}") from e
    except ValueError:  # some builtins have no signature; the call below will tell
        pass
    torch.manual_seed(seed)
    try:
        model = fn(**kwargs)
    except (Exception, SystemExit) as e:
        raise JobError(f"model.entrypoint: {entrypoint} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        got = type(model).__name__
        raise JobError(f"model.entrypoint: {entrypoint} returned {got}, not a torch.nn.Module")
    return model


def load_weights(model: torch.nn.Module, rel: str, base_dir: Path, *, allow_outside: bool = False) -> None:
    """Loads a safetensors state_dict whose keys, shapes and dtypes match ``model.state_dict()``."""
    path = resolve_file(base_dir, rel, "model.weights", allow_outside=allow_outside)
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise JobError(f"model.weights: {rel}: not a readable safetensors file ({e})") from e
    state = model.state_dict()
    missing, unexpected = sorted(set(state) - set(tensors)), sorted(set(tensors) - set(state))
    if missing or unexpected:
        parts = ([f"missing keys {missing}"] if missing else []) + (
            [f"unexpected keys {unexpected}"] if unexpected else []
        )
        raise JobError(f"model.weights: {rel}: does not match the model: {'; '.join(parts)}")
    for key in sorted(state):
        want, got = state[key], tensors[key]
        if tuple(want.shape) != tuple(got.shape):
            raise JobError(
                f"model.weights: {rel}: {key!r} has shape {tuple(got.shape)}, "
                f"the model expects {tuple(want.shape)}"
            )
        if want.dtype != got.dtype:
            raise JobError(
                f"model.weights: {rel}: {key!r} has dtype {got.dtype}, the model expects {want.dtype}"
            )
    model.load_state_dict(tensors, strict=True)
