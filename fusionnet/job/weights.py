"""``model.weights`` -> the model's initial state: one safetensors file, or a folder as ``save_pretrained``
writes it (``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` listed by
``model.safetensors.index.json``).

Only safetensors are read (raw bytes and a JSON header: nothing is unpickled); a folder holding only
``pytorch_model.bin`` is refused. A folder's tensor names may sit one prefix away from the model's
``state_dict`` keys: a checkpoint of ``LlamaForCausalLM`` (``model.layers.0...``) loads into a user module
holding it as ``self.lm`` (``lm.model.layers.0...``), and the other way round. Tied tensors that
``save_pretrained`` leaves out (``lm_head.weight`` tied to the input embedding) take the value of the
tensor they are tied to. Every mismatch is refused with the file and the tensor name.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fusionnet.errors import JobError
from fusionnet.job.data import resolve_file

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 16 << 20  # an index lists names only; anything bigger is not one


@dataclass
class WeightFiles:
    """Where each tensor of ``model.weights`` lies: tensor name -> the file holding it."""

    root: Path  # the file, or the folder
    rel: str  # as the job file names it, for messages
    files: dict[str, Path]


def resolve_weights(base_dir: Path, rel: str, *, allow_outside: bool = False) -> Path:
    """``rel`` against the job folder: a safetensors file, or a folder that must lie inside the job
    folder (after symlinks) unless ``allow_outside``."""
    folder = base_dir.resolve()
    try:
        path = (folder / rel).resolve()
        is_dir = path.is_dir()
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a symlink loop
        is_dir = False  # resolve_file names the problem
    if not is_dir:
        return resolve_file(base_dir, rel, "model.weights", allow_outside=allow_outside)
    if not allow_outside and not path.is_relative_to(folder):
        raise JobError(
            f"model.weights: {rel}: leads outside the job folder {folder} (to {path}); keep the job's "
            "files in its folder, or pass --allow-outside-paths"
        )
    return path


def _inside(folder: Path, name: str, rel: str, named_by: str) -> Path:
    """``name`` (a shard, ``model.safetensors`` or the index) as a file of ``folder``, symlinks resolved:
    one that leads out of the folder is refused like any path of the job that leads out of its folder."""
    try:
        path = (folder / name).resolve()
        is_file = path.is_file()
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: a symlink loop (before Python 3.13)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:100]
        raise JobError(f"model.weights: {rel}/{named_by}: {name!r} is not a usable path ({reason})") from None
    if not path.is_relative_to(folder):
        raise JobError(f"model.weights: {rel}/{named_by}: {name!r} lies outside the folder")
    if not is_file:
        raise JobError(f"model.weights: {rel}/{named_by}: {name!r} not found")
    return path


def _keys_of(path: Path, shown: str) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise JobError(f"model.weights: {shown}: not a readable safetensors file ({e})") from e


def _sharded(folder: Path, rel: str) -> dict[str, Path]:
    """Tensor name -> shard, from the index; each shard must hold exactly the names the index gives it."""
    index = _inside(folder, INDEX, rel, INDEX)  # read only from inside the folder, as the shards are
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise JobError(f"model.weights: {rel}/{INDEX}: larger than {MAX_INDEX_BYTES >> 20} MiB")
        text = index.read_text(encoding="utf-8")
    except OSError as e:
        raise JobError(f"model.weights: {rel}/{INDEX}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise JobError(f"model.weights: {rel}/{INDEX}: not valid JSON ({e})") from e
    try:
        doc = json.loads(text)
    except RecursionError:
        # ``[[[...`` nested past the interpreter's stack ends json's C decoder this way: the file is
        # still just bad input, named as such (not a failure of the model or of the loader).
        raise JobError(f"model.weights: {rel}/{INDEX}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, or any other refusal of the decoder
        raise JobError(f"model.weights: {rel}/{INDEX}: not valid JSON ({str(e)[:200]})") from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise JobError(f"model.weights: {rel}/{INDEX}: needs a 'weight_map' of tensor name -> shard file")
    files: dict[str, Path] = {}
    by_shard: dict[str, set[str]] = {}
    for key, name in weight_map.items():
        files[key] = _inside(folder, name, rel, INDEX)
        by_shard.setdefault(name, set()).add(key)
    for name, wanted in sorted(by_shard.items()):
        held = set(_keys_of(files[next(iter(wanted))], f"{rel}/{name}"))
        if wanted - held:
            raise JobError(
                f"model.weights: {rel}/{name}: lacks {sorted(wanted - held)[0]!r}, which {INDEX} puts there"
            )
        if held - wanted:
            raise JobError(
                f"model.weights: {rel}/{name}: holds {sorted(held - wanted)[0]!r}, which {INDEX} omits"
            )
    return files


def weight_files(path: Path, rel: str) -> WeightFiles:
    """The tensors ``model.weights`` offers and the file of each (headers only: nothing loaded yet)."""
    if not path.is_dir():
        return WeightFiles(path, rel, {k: path for k in _keys_of(path, rel)})
    if (path / INDEX).is_file():
        return WeightFiles(path, rel, _sharded(path, rel))
    if (path / SINGLE).is_file():
        single = _inside(path, SINGLE, rel, SINGLE)
        return WeightFiles(path, rel, {k: single for k in _keys_of(single, f"{rel}/{SINGLE}")})
    pickled = " (pytorch_model.bin is pickle, which is never read: save with safe_serialization)"
    found = pickled if (path / "pytorch_model.bin").exists() else ""
    raise JobError(f"model.weights: {rel}: a folder needs {INDEX} or {SINGLE}{found}")


def key_prefix(names: Iterable[str], model_keys: Iterable[str]) -> tuple[str, str]:
    """``(strip, add)`` that maps the most tensor ``names`` onto ``model_keys``, a name becoming
    ``add + name.removeprefix(strip)``: ``("", "")`` when the names are model keys already, else one prefix
    added or removed."""
    names, keys = sorted(set(names)), set(model_keys)
    candidates = {("", "")}
    for name in names[:16]:  # one prefix for all: a few names propose it (the model's keys may be many)
        for key in keys:
            if key.endswith("." + name):
                candidates.add(("", key[: -len(name)]))
            elif name.endswith("." + key):
                candidates.add((name[: -len(key)], ""))

    def hits(c: tuple[str, str]) -> int:
        return sum(1 for n in names if n.startswith(c[0]) and c[1] + n.removeprefix(c[0]) in keys)

    # Most names matched first; then the shortest change (deterministic on ties).
    return max(sorted(candidates, key=lambda c: (len(c[0]) + len(c[1]), c)), key=hits)


def _tied_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """state_dict key -> every key naming the same tensor (tied weights), in state_dict order."""
    by_tensor: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for key, tensor in state.items():
        by_tensor.setdefault(id(tensor), []).append(key)
    return {key: by_tensor[id(tensor)] for key, tensor in state.items()}


def _shown(source: WeightFiles, path: Path) -> str:
    """A file of ``model.weights`` as messages name it: the job file's value, plus the shard in a folder."""
    return f"{source.rel}/{path.relative_to(source.root)}" if source.root.is_dir() else source.rel


def _check(shown: str, name: str, key: str, want: torch.Tensor, got: torch.Tensor) -> None:
    what = repr(name) if name == key else f"{name!r} (the model's {key!r})"
    if tuple(want.shape) != tuple(got.shape):
        raise JobError(
            f"model.weights: {shown}: {what} has shape {tuple(got.shape)}, "
            f"the model expects {tuple(want.shape)}"
        )
    if want.dtype != got.dtype:
        raise JobError(
            f"model.weights: {shown}: {what} has dtype {got.dtype}, the model expects {want.dtype}"
        )


def _few(keys: list[str], shown: int = 8) -> str:
    return f"{keys[:shown]}" + (f" ({len(keys)} in all)" if len(keys) > shown else "")


def read_state(model: torch.nn.Module, source: WeightFiles) -> dict[str, torch.Tensor]:
    """The model's full ``state_dict`` from ``source``: names mapped onto its keys, tied keys filled,
    shapes and dtypes checked; missing or unexpected tensors are refused by name (and file)."""
    state = model.state_dict()
    strip, add = key_prefix(source.files, state)
    mapped = {add + n.removeprefix(strip): n for n in source.files if n.startswith(strip)}
    unexpected = sorted(
        {n for n in source.files if not n.startswith(strip)} | {mapped[k] for k in mapped if k not in state}
    )
    tied = _tied_groups(model)
    missing = [k for k in state if not any(t in mapped for t in tied[k])]
    if missing or unexpected:
        parts = [f"missing keys {_few(missing)}"] if missing else []
        if unexpected:
            where = (
                f" (the first in {_shown(source, source.files[unexpected[0]])})"
                if source.root.is_dir()
                else ""
            )
            parts.append(f"unexpected keys {_few(unexpected)}{where}")
        mapping = f" (names mapped as {strip!r} -> {add!r})" if strip or add else ""
        raise JobError(f"model.weights: {source.rel}: does not match the model{mapping}: {'; '.join(parts)}")
    loaded: dict[str, torch.Tensor] = {}
    for path in sorted(set(source.files.values())):
        with safe_open(str(path), framework="pt") as f:
            for key, name in mapped.items():
                if source.files[name] == path:
                    loaded[key] = f.get_tensor(name)
                    _check(_shown(source, path), name, key, state[key], loaded[key])
    return {k: loaded[next(t for t in tied[k] if t in loaded)] for k in state}


def load_weights(model: torch.nn.Module, rel: str, base_dir: Path, *, allow_outside: bool = False) -> None:
    """Loads ``model.weights`` (a safetensors file or a ``save_pretrained`` folder) into ``model``."""
    path = resolve_weights(base_dir, rel, allow_outside=allow_outside)
    state = read_state(model, weight_files(path, rel))
    model.load_state_dict(state, strict=True)
