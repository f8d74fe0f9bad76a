"""``model.entrypoint`` -> the user's ``nn.Module`` (its initial weights: ``weights.py``).

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

from fusionnet.errors import JobError
from fusionnet.job.data import resolve_file
from fusionnet.job.preflight import short_error

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
        # short_error: torch errors carry a C++ backtrace that must not end up in the one-line message.
        raise JobError(f"model.entrypoint: {shown}: importing it raised {short_error(e)}") from e
    return module


def check_entrypoint_file(entrypoint: str, base_dir: Path, *, allow_outside: bool = False) -> Path | None:
    """The entry point's file (None for ``package.module:callable``, allowed only with ``allow_outside``);
    JobError when the file is missing, outside the job folder, or a module is named. Nothing is imported."""
    where = entrypoint.rpartition(":")[0]
    if where.endswith(".py") or "/" in where or "\\" in where:
        return resolve_file(base_dir, where, "model.entrypoint", allow_outside=allow_outside)
    if not allow_outside:
        raise JobError(
            f"model.entrypoint: {entrypoint[:80]!r} names an importable module; an entrypoint must be "
            "FILE.py:CALLABLE with FILE.py in the job folder (or pass --allow-outside-paths)"
        )
    return None


def resolve_entrypoint(entrypoint: str, base_dir: Path, *, allow_outside: bool = False) -> Callable[..., Any]:
    """``FILE.py:callable`` (a file in the job folder ``base_dir``, the callable defined in it; attributes may
    be dotted, ``models.py:Net.build``). ``package.module:callable`` and files outside the folder only with
    ``allow_outside``: otherwise a job file could run any installed function (``os:system``)."""
    where, _, attr = entrypoint.rpartition(":")
    path = check_entrypoint_file(entrypoint, base_dir, allow_outside=allow_outside)
    is_file = path is not None
    if path is not None:
        module = _import_file(path, where)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise JobError(f"model.entrypoint: module {where!r} not found ({e})") from e
        except Exception as e:
            raise JobError(f"model.entrypoint: importing {where!r} raised {short_error(e)}") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise JobError(f"model.entrypoint: {where} has no attribute {attr!r}")
        target = getattr(target, part)
        if not callable(target) and part == attr.split(".")[-1]:
            break  # named below as not a callable (``build = 42`` has no module to name)
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
        # A huge size in model.kwargs fails in torch's C++ code, whose message ends in a backtrace of
        # mangled frames: short_error keeps the one line that says what went wrong.
        raise JobError(f"model.entrypoint: {entrypoint} raised {short_error(e)}") from e
    if not isinstance(model, torch.nn.Module):
        got = type(model).__name__
        raise JobError(f"model.entrypoint: {entrypoint} returned {got}, not a torch.nn.Module")
    return model
