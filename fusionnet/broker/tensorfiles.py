"""Tensors by key, read from safetensors files on disk when asked for: how the broker keeps a job's
submitted state and its checkpoints without holding the model in memory (issue 11: the broker's memory
stays independent of model size).

A ``TensorFiles`` is an index key -> file; a tensor is read (``safe_open``, a memory map) only when a
caller asks for it, and ``select`` reads a set of keys opening each file once: an assignment reads
one sub-DAG's slice, never the whole model. A blob a compnode sent is written to disk as it came and
indexed from its header, which ``safe_open`` checks (a header that lies about its sizes is refused).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from fusionnet.errors import WireError
from fusionnet.results.stream_safetensors import NAMES, TensorMeta


class TensorFiles(Mapping[str, torch.Tensor]):
    """A read-only mapping key -> tensor over safetensors files (a later file wins a key)."""

    def __init__(self, index: Mapping[str, Path] | None = None) -> None:
        self.index: dict[str, Path] = dict(index or {})

    @classmethod
    def of_files(cls, paths: Iterable[Path], what: str = "tensors") -> TensorFiles:
        index: dict[str, Path] = {}
        for path in paths:
            try:
                with safe_open(str(path), framework="pt") as f:
                    index.update(dict.fromkeys(f.keys(), path))
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise WireError(f"{what}: {path.name} is not a valid safetensors file ({e})") from None
        return cls(index)

    def merged(self, newer: TensorFiles) -> TensorFiles:
        """Keys of ``newer`` replace this one's."""
        return TensorFiles({**self.index, **newer.index})

    def without_prefix(self, prefix: str) -> TensorFiles:
        return TensorFiles({k: p for k, p in self.index.items() if not k.startswith(prefix)})

    @property
    def files(self) -> set[Path]:
        return set(self.index.values())

    def select(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` (each file opened once), in the order given."""
        keys = list(keys)
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.index[k], []).append(k)
        found: dict[str, torch.Tensor] = {}
        for path, wanted in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for k in wanted:
                    found[k] = f.get_tensor(k)
        return {k: found[k] for k in keys}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.select([key])[key]

    def meta(self, key: str) -> TensorMeta:
        """``key``'s dtype and shape, from its file's header (no tensor bytes read)."""
        with safe_open(str(self.index[key]), framework="pt") as f:
            piece = f.get_slice(key)
            return NAMES[piece.get_dtype()], tuple(piece.get_shape())

    def restricted(self, keys: Iterable[str]) -> TensorFiles:
        """The same files, only ``keys`` (in that order)."""
        return TensorFiles({k: self.index[k] for k in keys})

    def byte_ranges(self, keys: Iterable[str]) -> dict[str, tuple[Path, int, int]]:
        """Where each key's bytes lie: ``(file, offset, length)``, from the files' headers (which
        ``safe_open`` checked when the file was indexed). Lets a caller copy a tensor's bytes from
        disk without making a tensor of them first."""
        keys = list(keys)
        found: dict[str, tuple[Path, int, int]] = {}
        for path in {self.index[k] for k in keys}:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                doc = json.loads(f.read(size))
            for k in keys:
                if self.index[k] == path:
                    start, stop = doc[k]["data_offsets"]
                    found[k] = (path, 8 + size + start, stop - start)
        return {k: found[k] for k in keys}

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def select(tensors: Mapping[str, torch.Tensor], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """``keys`` of an in-memory dict or of a ``TensorFiles`` (reading each file once)."""
    if isinstance(tensors, TensorFiles):
        return tensors.select(keys)
    return {k: tensors[k] for k in keys}


def write_blob(path: Path, blob: bytes, what: str) -> TensorFiles:
    """A safetensors blob from a peer, written as it came (atomically), then indexed from its header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    try:
        return TensorFiles.of_files([path], what)
    except WireError:
        path.unlink(missing_ok=True)
        raise


class StreamedFile:
    """A safetensors file a peer sends as consecutive byte ranges (``results.slice_stream``): appended
    to a temporary file as they come, indexed from its header once the last one is in (a file whose
    header lies is removed and refused, as ``write_blob``'s)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._tmp = path.with_name(path.name + ".tmp")
        self._file = self._tmp.open("wb")

    def append(self, data: bytes) -> None:
        self._file.write(data)

    def finish(self, what: str) -> TensorFiles:
        self._file.close()
        os.replace(self._tmp, self.path)
        try:
            return TensorFiles.of_files([self.path], what)
        except WireError:
            self.path.unlink(missing_ok=True)
            raise

    def abandon(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)
