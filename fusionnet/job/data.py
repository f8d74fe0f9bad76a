"""The job's dataset: a safetensors file with ``inputs``/``labels``, or a text file read char by char.

safetensors is raw bytes plus a JSON header, so loading a dataset never unpickles anything. Text mode
is the classic char-level language-model set-up: the vocabulary is the sorted set of characters in the
file and sample ``k`` is the window starting at ``k*block_size``, with labels shifted by one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from fusionnet.errors import JobError
from fusionnet.job.schema import DataSpec


@dataclass
class Dataset:
    inputs: torch.Tensor  # first dim = sample
    labels: torch.Tensor | None  # None for infer jobs
    vocab: list[str] | None = None  # text data: token id -> character

    @property
    def n_samples(self) -> int:
        return int(self.inputs.shape[0])


def resolve_file(base_dir: Path, rel: str, key: str, *, allow_outside: bool = False) -> Path:
    """``rel`` against the job file's folder; JobError naming ``key`` and the path when it is missing,
    or when it leads outside the folder (after symlinks) and ``allow_outside`` is not set.

    A job folder is what the user reviewed and what ``submit`` may send to a broker: a path that
    escapes it (``../``, absolute, a symlink) would read or run files the user never meant to share.
    """
    shown = rel if len(rel) <= 80 else rel[:77] + "..."
    try:
        folder = base_dir.resolve()
        path = (folder / rel).resolve()
        exists, is_file = path.exists(), path.is_file()
    except (OSError, ValueError, RuntimeError) as e:  # name too long, NUL byte; RuntimeError: symlink loop
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:100]
        raise JobError(f"{key}: {shown}: not a usable path ({reason})") from None
    if not allow_outside and not path.is_relative_to(folder):
        raise JobError(
            f"{key}: {shown}: leads outside the job folder {folder} (to {path}); keep the job's files in its "
            "folder, or pass --allow-outside-paths"
        )
    if not exists:
        raise JobError(f"{key}: {shown}: file not found (looked at {path})")
    if not is_file:
        raise JobError(f"{key}: {shown}: not a file")
    return path


def text_dataset(path: Path, rel: str, block_size: int, task: str) -> Dataset:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise JobError(f"data.path: {rel}: text data must be UTF-8 ({e})") from e
    vocab = sorted(set(text))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    tokens = torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)
    n = (len(tokens) - 1) // block_size  # windows whose shifted labels still fit
    if n < 1:
        raise JobError(
            f"data.block_size: {rel} has {len(tokens)} characters, too few for one window of "
            f"{block_size} tokens plus its next-token label"
        )
    starts = torch.arange(n, dtype=torch.int64) * block_size
    offsets = torch.arange(block_size, dtype=torch.int64)
    windows = starts[:, None] + offsets[None, :]
    labels = None if task == "infer" else tokens[windows + 1]
    return Dataset(inputs=tokens[windows].contiguous(), labels=labels, vocab=vocab)


def tensor_dataset(path: Path, rel: str, task: str) -> Dataset:
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise JobError(f"data.path: {rel}: not a readable safetensors file ({e})") from e
    wanted = {"inputs"} if task == "infer" else {"inputs", "labels"}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise JobError(f"data.path: {rel}: missing tensor(s) {missing} (has {sorted(tensors)})")
    unexpected = sorted(set(tensors) - {"inputs", "labels"})
    if unexpected:
        raise JobError(f"data.path: {rel}: unexpected tensor(s) {unexpected}; only 'inputs' and 'labels'")
    inputs, labels = tensors["inputs"], tensors.get("labels")
    for name, t in (("inputs", inputs), ("labels", labels)):
        if t is not None and (t.dim() == 0 or t.shape[0] == 0):
            raise JobError(f"data.path: {rel}: {name!r} has no samples (shape {tuple(t.shape)})")
    if labels is not None and labels.shape[0] != inputs.shape[0]:
        raise JobError(
            f"data.path: {rel}: 'inputs' has {inputs.shape[0]} samples but 'labels' has {labels.shape[0]}"
        )
    return Dataset(inputs=inputs, labels=None if task == "infer" else labels)


def load_dataset(spec: DataSpec, base_dir: Path, task: str, *, allow_outside: bool = False) -> Dataset:
    """The dataset named by ``data.path`` (labels dropped for ``infer``)."""
    path = resolve_file(base_dir, spec.path, "data.path", allow_outside=allow_outside)
    if spec.path.lower().endswith(".txt"):
        assert spec.block_size is not None  # DataSpec's validator requires it for text
        return text_dataset(path, spec.path, spec.block_size, task)
    return tensor_dataset(path, spec.path, task)
