"""A job's durable state on the broker: the submission, and the latest step-boundary checkpoint.

The checkpoint is keyed by state key (``state::<key>``) and optimizer slot (``opt::<key>::<slot>``),
not by sub-DAG, so it can be cut again for any new placement: a replacement compnode, fewer survivors,
or a re-plan after a join. It is what FusionAI 3.5's "parameters synchronised to supernodes" buys:
here the broker (the swarm's first supernode) holds it, on disk, so it also survives a broker restart.

Layout under ``jobs/<id>/``: ``submission/`` (spec.json, ir.bin, state.safetensors, data.safetensors),
``ckpt-<step>.safetensors`` and ``ckpt.json`` (which checkpoint is current, the attempt counter, the
metrics rows so far). ``ckpt.json`` is replaced atomically after its tensors are on disk, so a crash at
any moment leaves a consistent pair.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fusionnet.messages.blobs import own_storage

STATE = "state::"


@dataclass
class Checkpoint:
    step: int  # the next step to run: everything before it is in this state
    state: dict[str, torch.Tensor]  # parameters and buffers by state key
    optim: dict[str, torch.Tensor] = field(default_factory=dict)  # opt::<key>::<slot>
    metrics: list[dict[str, Any]] = field(default_factory=list)  # rows of the steps before ``step``

    def for_subdag(self, params: list[str], buffers: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
        state = {k: self.state[k] for k in (*params, *buffers)}
        wanted = tuple(f"opt::{k}::" for k in params)
        optim = {k: v for k, v in self.optim.items() if k.startswith(wanted)}
        return state, optim


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class JobFiles:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.submission = folder / "submission"

    # ---- submission ------------------------------------------------------------------------------
    def save_submission(
        self, spec: dict[str, Any], ir: bytes, state: dict[str, torch.Tensor], data: dict[str, torch.Tensor]
    ) -> None:
        self.submission.mkdir(parents=True, exist_ok=True)
        _atomic(self.submission / "ir.bin", lambda p: p.write_bytes(ir))
        _atomic(self.submission / "state.safetensors", lambda p: save_file(_own(state), str(p)))
        _atomic(self.submission / "data.safetensors", lambda p: save_file(_own(data), str(p)))
        _atomic(
            self.submission / "spec.json", lambda p: p.write_text(json.dumps(spec))
        )  # last: marks complete

    def has_submission(self) -> bool:
        return (self.submission / "spec.json").is_file()

    def load_submission(
        self,
    ) -> tuple[dict[str, Any], bytes, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        spec = json.loads((self.submission / "spec.json").read_text())
        ir = (self.submission / "ir.bin").read_bytes()
        state = load_file(str(self.submission / "state.safetensors"))
        data = load_file(str(self.submission / "data.safetensors"))
        return spec, ir, state, data

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, ckpt: Checkpoint, attempt: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"ckpt-{ckpt.step}.safetensors"
        tensors = {STATE + k: v for k, v in ckpt.state.items()} | dict(ckpt.optim)
        _atomic(self.folder / name, lambda p: save_file(_own(tensors), str(p)))
        doc = {"step": ckpt.step, "file": name, "attempt": attempt, "metrics": ckpt.metrics}
        _atomic(self.folder / "ckpt.json", lambda p: p.write_text(json.dumps(doc)))
        for old in self.folder.glob("ckpt-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def load_checkpoint(self) -> tuple[Checkpoint, int] | None:
        meta = self.folder / "ckpt.json"
        if not meta.is_file():
            return None
        doc = json.loads(meta.read_text())
        tensors = load_file(str(self.folder / doc["file"]))
        state = {k[len(STATE) :]: v for k, v in tensors.items() if k.startswith(STATE)}
        optim = {k: v for k, v in tensors.items() if not k.startswith(STATE)}
        return Checkpoint(int(doc["step"]), state, optim, list(doc["metrics"])), int(doc["attempt"])


def _own(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return own_storage(tensors)
