"""A job's durable state on the broker: the submission, and the latest step-boundary checkpoint.

The checkpoint is keyed by state key (``state::<key>``) and optimizer slot (``opt::<key>::<slot>``),
not by sub-DAG, so it can be cut again for any new placement: a replacement compnode, fewer survivors,
or a re-plan after a join. It is what FusionAI 3.5's "parameters synchronised to supernodes" buys:
here the broker (the swarm's first supernode) holds it, on disk, so it also survives a broker restart.

The broker keeps it on disk only (``tensorfiles.TensorFiles``: tensors are read when an assignment or
the results need them), and a sync writes each compnode's blob to disk as it came: the broker's memory
does not grow with the model (issue 11).

Layout under ``jobs/<id>/``: ``submission/`` (spec.json, ir.bin, state.safetensors, data.safetensors),
``ckpt-<step>/`` (one state and one optimizer file per sub-DAG, as their compnodes sent them, and
``rest-*.safetensors`` for tensors of an earlier checkpoint that no file of this one holds) and
``ckpt.json`` (which checkpoint is current, the file of each of its tensors, the attempt counter, and
how many lines of ``rows-ckpt.<n>.jsonl`` are the metrics rows so far: ``step_rows``). ``ckpt.json`` is
replaced atomically after its tensors and rows are on disk, so a crash at any moment leaves a
consistent set.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fusionnet.broker.step_rows import StepRows
from fusionnet.broker.tensorfiles import StreamedFile, TensorFiles, select, write_blob
from fusionnet.dag.precision import SCALER_PREFIX
from fusionnet.errors import WireError
from fusionnet.messages.blobs import MAX_BLOB_BYTES, own_storage

CKPT_PREFIX = "ckpt-"
LEGACY_STATE = "state::"


@dataclass
class Checkpoint:
    step: int  # the next step to run: everything before it is in this state
    state: Mapping[str, torch.Tensor]  # parameters and buffers by state key (on the broker: on disk)
    optim: Mapping[str, torch.Tensor] = field(default_factory=dict)  # opt::<key>::<slot>
    metrics: list[dict[str, Any]] = field(default_factory=list)  # rows of the steps before ``step``

    def slice_keys(self, params: list[str], buffers: list[str]) -> tuple[list[str], list[str]]:
        """The state keys and the optimizer keys of a sub-DAG that owns ``params`` and ``buffers``."""
        wanted = (*(f"opt::{k}::" for k in params), SCALER_PREFIX)  # fp16's loss scale goes to every one
        return [*params, *buffers], [k for k in self.optim if k.startswith(wanted)]

    def for_subdag(self, params: list[str], buffers: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
        state_keys, optim_keys = self.slice_keys(params, buffers)
        return select(self.state, state_keys), select(self.optim, optim_keys)


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class JobFiles:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.submission = folder / "submission"
        # the metrics rows ``ckpt.json`` and ``replicas.json`` name (``step_rows``): each kept by one object
        # for the job's run, which recognises the rows it wrote and appends the rest
        self.ckpt_rows = StepRows(folder, "rows-ckpt")
        self.replica_rows = StepRows(folder, "rows-replicas")

    # ---- submission ------------------------------------------------------------------------------
    def save_submission(
        self,
        spec: dict[str, Any],
        ir: bytes,
        state: Mapping[str, torch.Tensor] | None,
        data: dict[str, torch.Tensor],
    ) -> None:
        """``state`` None: ``write_submitted_state`` wrote it already."""
        self.submission.mkdir(parents=True, exist_ok=True)
        _atomic(self.submission / "ir.bin", lambda p: p.write_bytes(ir))
        if state is not None:
            _atomic(self.submission / "state.safetensors", lambda p: save_file(_own(state), str(p)))
        _atomic(self.submission / "data.safetensors", lambda p: save_file(_own(data), str(p)))
        _atomic(
            self.submission / "spec.json", lambda p: p.write_text(json.dumps(spec))
        )  # last: marks complete

    def save_spec(self, spec: dict[str, Any]) -> None:
        """The spec as the broker settled it (``data.microbatches: auto`` chosen): a resumed job keeps it."""
        _atomic(self.submission / "spec.json", lambda p: p.write_text(json.dumps(spec)))

    def write_submitted_state(self, blob: bytes) -> TensorFiles:
        """The submitted state's safetensors blob, on disk as it came (refused if not valid)."""
        if len(blob) > MAX_BLOB_BYTES:
            raise WireError(f"submission: state: {len(blob)} bytes exceeds the {MAX_BLOB_BYTES}-byte bound")
        return write_blob(self.submission / "state.safetensors", blob, "submission: state")

    def adopt_submitted_state(self, move: Callable[[Path], None]) -> TensorFiles:
        """The submitted state uploaded in chunks: ``move`` puts the upload's file in place (refused, and
        removed, if it is not valid safetensors)."""
        path = self.submission / "state.safetensors"
        move(path)
        try:
            return TensorFiles.of_files([path], "submission: state")
        except WireError:
            path.unlink(missing_ok=True)
            raise

    def drop_working_files(self) -> None:
        """What only an unfinished job needs (its submission, checkpoints and replica pointer), removed
        once it ended; its result files stay (they go with the folder: how results expire)."""
        shutil.rmtree(self.submission, ignore_errors=True)
        for path in (
            *self.folder.glob(f"{CKPT_PREFIX}*"),
            *self.folder.glob("rows-*.jsonl"),
            self.folder / "ckpt.json",
            self.folder / "replicas.json",
        ):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def forget(self) -> None:
        """Removes what a refused submission left on disk."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def has_submission(self) -> bool:
        return (self.submission / "spec.json").is_file()

    def submitted_state(self) -> TensorFiles:
        """The submitted parameters and buffers, read from disk when asked for."""
        return TensorFiles.of_files([self.submission / "state.safetensors"], "submission: state")

    def load_submission(
        self,
    ) -> tuple[dict[str, Any], bytes, TensorFiles, dict[str, torch.Tensor]]:
        spec = json.loads((self.submission / "spec.json").read_text())
        ir = (self.submission / "ir.bin").read_bytes()
        data = load_file(str(self.submission / "data.safetensors"))
        return spec, ir, self.submitted_state(), data

    # ---- checkpoints -----------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.folder / f"{CKPT_PREFIX}{step}"

    def streamed_part(self, step: int, name: str) -> StreamedFile:
        """A compnode's part of the checkpoint after ``step`` that arrives in byte ranges."""
        return StreamedFile(self.checkpoint_dir(step) / f"{name}.safetensors")

    def write_part(self, step: int, name: str, blob: bytes, what: str) -> TensorFiles:
        """One compnode's blob of the checkpoint after ``step``, on disk as it came."""
        return write_blob(self.checkpoint_dir(step) / f"{name}.safetensors", blob, what)

    def save_checkpoint(self, ckpt: Checkpoint, attempt: int) -> None:
        """Makes ``ckpt`` the current checkpoint: tensors it holds in memory, or in files of another
        checkpoint (deleted below), are written to its folder first; then ``ckpt.json`` names its files."""
        folder = self.checkpoint_dir(ckpt.step)
        folder.mkdir(parents=True, exist_ok=True)
        kept = {self.submission / "state.safetensors"} | set(folder.glob("*.safetensors"))
        files = {}
        for kind, tensors in (("state", ckpt.state), ("optim", ckpt.optim)):
            index = dict(tensors.index) if isinstance(tensors, TensorFiles) else {}
            loose = [k for k in tensors if index.get(k) not in kept]
            if loose:
                rest = folder / f"rest-{kind}.safetensors"
                _atomic(rest, lambda p, t=tensors, ks=loose: save_file(_own(select(t, ks)), str(p)))
                index.update(dict.fromkeys(loose, rest))
            files[kind] = {k: str(p.relative_to(self.folder)) for k, p in index.items()}
        rows = self.ckpt_rows.sync(ckpt.metrics)
        doc = {"step": ckpt.step, "index": files, "attempt": attempt, "rows": rows}
        _atomic(self.folder / "ckpt.json", lambda p: p.write_text(json.dumps(doc)))
        self.ckpt_rows.prune()
        for old in self.folder.glob(f"{CKPT_PREFIX}*"):
            if old != folder:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)

    def load_checkpoint(self) -> tuple[Checkpoint, int] | None:
        meta = self.folder / "ckpt.json"
        if not meta.is_file():
            return None
        doc = json.loads(meta.read_text())
        if "index" not in doc:  # an earlier version's one file, ``state::`` before the state keys
            tensors = load_file(str(self.folder / doc["file"]))
            state = {k[len(LEGACY_STATE) :]: v for k, v in tensors.items() if k.startswith(LEGACY_STATE)}
            optim = {k: v for k, v in tensors.items() if not k.startswith(LEGACY_STATE)}
            return Checkpoint(int(doc["step"]), state, optim, list(doc["metrics"])), int(doc["attempt"])
        state, optim = (
            TensorFiles({k: self.folder / f for k, f in doc["index"][kind].items()})
            for kind in ("state", "optim")
        )
        # rows in a file of their own (``step_rows``); in the document itself before that
        rows = self.ckpt_rows.load(doc["rows"]) if "rows" in doc else list(doc["metrics"])
        return Checkpoint(int(doc["step"]), state, optim, rows), int(doc["attempt"])


def _own(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return own_storage(tensors)
