"""One broken job: how to make it from examples/mlp, and what the refusal must say."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
MLP = REPO / "examples" / "mlp"

# Model code that runs outside the job folder leaves this file behind: the sweep looks for it after every
# command (an entrypoint outside the folder must be refused, not imported).
MARKER = "OUTSIDE-CODE-RAN"
EVIL = f"""
from pathlib import Path
Path(__file__).with_name({MARKER!r}).write_text("ran")

def build(**kwargs):
    from torch import nn
    return nn.Sequential(nn.Linear(16, 4))
"""


class JobDir:
    """A fresh copy of examples/mlp in ``root/job`` plus a folder ``root/outside`` that holds a model file
    and a data file a job must not reach. Edits change ``doc`` (written by ``save``) or files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "job"
        self.outside = root / "outside"
        shutil.copytree(MLP, self.dir, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
        self.outside.mkdir()
        (self.outside / "evil.py").write_text(EVIL)
        shutil.copy(MLP / "data.safetensors", self.outside / "data.safetensors")
        self.doc: dict[str, Any] = yaml.safe_load((MLP / "job.yaml").read_text())
        self.doc["steps"] = 3
        self.raw: str | bytes | None = None
        self.written = False  # the edit wrote (or removed) the job file itself

    @property
    def job(self) -> Path:
        return self.dir / "job.yaml"

    def set(self, key: str, value: Any) -> None:
        *parents, last = key.split(".")
        node = self.doc
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def drop(self, key: str) -> None:
        *parents, last = key.split(".")
        node = self.doc
        for part in parents:
            node = node[part]
        del node[last]

    def text(self, text: str | bytes) -> None:
        """The job file's exact text (instead of ``doc``)."""
        self.raw = text

    def model(self, source: str) -> None:
        (self.dir / "model.py").write_text(source)

    def tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(self.dir / name))

    def data(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(MLP / "data.safetensors"))

    def state(self) -> dict[str, torch.Tensor]:
        """The MLP's initial state dict (as ``build()`` makes it)."""
        spec = importlib.util.spec_from_file_location("badinput_mlp_model", MLP / "model.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        return {k: v.clone() for k, v in module.build().state_dict().items()}

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    def link(self, name: str, target: Path | str) -> None:
        (self.dir / name).symlink_to(target)

    def save(self) -> None:
        if self.written:
            return
        if self.raw is None:
            self.job.write_text(yaml.safe_dump(self.doc, sort_keys=False))
        elif isinstance(self.raw, bytes):
            self.job.write_bytes(self.raw)
        else:
            self.job.write_text(self.raw)


Edit = Callable[[JobDir], None]


@dataclass(frozen=True)
class Variant:
    """``edit`` breaks a fresh ``JobDir``; every command must then exit 2 with one line
    ``fusionnet CMD: error: MESSAGE`` where MESSAGE starts with one of ``expect`` (the key or file; ``{job}``
    is the job file's path, ``{out}`` the output flag: ``--json`` for plan, ``--output`` otherwise) and,
    when ``says`` is set, contains it (the cause)."""

    name: str
    category: str
    expect: tuple[str, ...]
    edit: Callable[[JobDir], None]
    says: str = ""
    flags: tuple[str, ...] = ()  # more command-line flags (e.g. a short --load-timeout)
    # A bad --output (run, submit) or --json (plan) path, from the variant's root folder and the flag.
    output: Callable[[Path, str], str] | None = None
    job_path: Callable[[JobDir], Path] | None = None  # the path given to the command (default: job.yaml)
    tags: frozenset[str] = field(default_factory=frozenset)


def variant(
    category: str,
    name: str,
    expect: str | tuple[str, ...],
    edit: Callable[[JobDir], None],
    says: str = "",
    **kw: Any,
) -> Variant:
    expects = (expect,) if isinstance(expect, str) else expect
    return Variant(name=f"{category}/{name}", category=category, expect=expects, edit=edit, says=says, **kw)


def setter(**values: Any) -> Callable[[JobDir], None]:
    """An edit that sets dotted keys: ``setter(**{"data.batch_size": 0})``."""

    def edit(j: JobDir) -> None:
        for key, value in values.items():
            j.set(key, value)

    return edit


def dropper(*keys: str) -> Callable[[JobDir], None]:
    def edit(j: JobDir) -> None:
        for key in keys:
            j.drop(key)

    return edit


def text(content: str | bytes) -> Callable[[JobDir], None]:
    return lambda j: j.text(content)


def model(source: str, **values: Any) -> Callable[[JobDir], None]:
    """An edit that replaces model.py (and sets keys)."""

    def edit(j: JobDir) -> None:
        j.model(source)
        for key, value in values.items():
            j.set(key, value)

    return edit
