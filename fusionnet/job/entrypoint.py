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
    except Exception as e:
        del sys.modules[name]
        raise JobError(f"model.entrypoint: {shown}: importing it raised {type(e).__name__}: {e}") from e
    return module


def resolve_entrypoint(entrypoint: str, base_dir: Path) -> Callable[..., Any]:
    """``FILE.py:callable`` (relative to ``base_dir``) or ``package.module:callable``; attributes may be
    dotted (``models.py:Net.build``)."""
    where, _, attr = entrypoint.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _import_file(resolve_file(base_dir, where, "model.entrypoint"), where)
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
    if not callable(target):
        raise JobError(f"model.entrypoint: {where}:{attr} is a {type(target).__name__}, not a callable")
    return target


def build_model(entrypoint: str, kwargs: Mapping[str, Any], base_dir: Path, seed: int) -> torch.nn.Module:
    """Calls the entry point with ``kwargs`` right after ``torch.manual_seed(seed)``."""
    fn = resolve_entrypoint(entrypoint, base_dir)
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        raise JobError(f"model.kwargs: {entrypoint} does not accept them: {e}") from e
    except ValueError:  # some builtins have no signature; the call below will tell
        pass
    torch.manual_seed(seed)
    try:
        model = fn(**kwargs)
    except Exception as e:
        raise JobError(f"model.entrypoint: {entrypoint} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        got = type(model).__name__
        raise JobError(f"model.entrypoint: {entrypoint} returned {got}, not a torch.nn.Module")
    return model
