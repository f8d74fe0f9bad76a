"""``load_job``: a job file -> everything needed to run it (spec, model, data, loss).

Order matters for "nothing runs when validation fails": first the YAML and its schema, then every file
the job names is checked to exist, then the data is read (no user code), and only then is the user's
model code imported and called. The last checks (weights fit the model, ``per_op`` globs match some
parameter) need the built model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fusionnet.errors import JobError
from fusionnet.job.batches import batch_indices, infer_batches, split_microbatches
from fusionnet.job.data import Dataset, load_dataset
from fusionnet.job.entrypoint import build_model, check_entrypoint_file
from fusionnet.job.losses import make_loss_fn
from fusionnet.job.optim import unmatched_globs
from fusionnet.job.parse import load_job_spec
from fusionnet.job.preflight import check_data, preflight
from fusionnet.job.schema import JobSpec
from fusionnet.job.weights import load_weights, resolve_weights

__all__ = [
    "LoadedJob",
    "batch_indices",
    "check_job_without_model",
    "infer_batches",
    "load_job",
    "load_job_spec",
    "split_microbatches",
]


@dataclass
class LoadedJob:
    spec: JobSpec
    path: Path  # the job file
    base_dir: Path  # relative paths in the job file resolve against this folder
    model: torch.nn.Module  # built right after torch.manual_seed(spec.seed); weights loaded if given
    inputs: torch.Tensor  # first dim = sample
    labels: torch.Tensor | None  # None for infer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None  # None: model(x, y) is the loss
    vocab: list[str] | None = None  # text data: token id -> character

    @property
    def n_samples(self) -> int:
        return int(self.inputs.shape[0])


def _check_without_model(
    path: str | Path, allow_outside_paths: bool, deployment: bool = False
) -> tuple[JobSpec, Dataset]:
    spec = load_job_spec(path)
    if spec.task == "generate":
        if not deployment:
            raise JobError("task: generate is for deployments only (`fusionnet deploy`)")
        # A generating deployment runs its model's forward pass, exactly as infer does.
        spec = spec.model_copy(update={"task": "infer"})
    base_dir = Path(path).resolve().parent
    outside = allow_outside_paths
    check_entrypoint_file(spec.model.entrypoint, base_dir, allow_outside=outside)
    if spec.model.weights is not None:
        resolve_weights(base_dir, spec.model.weights, allow_outside=outside)
    dataset = load_dataset(spec.data, base_dir, spec.task, allow_outside=outside)
    check_data(spec, dataset.inputs, dataset.labels)
    return spec, dataset


def check_job_without_model(
    path: str | Path, *, allow_outside_paths: bool = False, deployment: bool = False
) -> JobSpec:
    """Every check of ``load_job`` that runs no user code (schema, paths, data): quick, and safe to do
    in the command's own process before the model is loaded in a child (``runtime.loadcheck``)."""
    return _check_without_model(path, allow_outside_paths, deployment)[0]


def load_job(path: str | Path, *, allow_outside_paths: bool = False, deployment: bool = False) -> LoadedJob:
    """Validates the job file and builds what it describes; one ``JobError`` naming the key otherwise.

    Every file the job names must lie in the job file's folder (after symlinks) unless
    ``allow_outside_paths`` (the commands' ``--allow-outside-paths``) says otherwise. ``deployment``
    (``fusionnet deploy``) admits task ``generate``, loaded as ``infer``.
    """
    spec, dataset = _check_without_model(path, allow_outside_paths, deployment)
    path = Path(path).resolve()
    base_dir = path.parent
    outside = allow_outside_paths
    loss_fn = None
    if spec.loss is not None and spec.task != "infer":
        loss_fn = make_loss_fn(spec.loss.name, spec.loss.kwargs)
    model = build_model(spec.model.entrypoint, spec.model.kwargs, base_dir, spec.seed, allow_outside=outside)
    if spec.model.weights is not None:
        load_weights(model, spec.model.weights, base_dir, allow_outside=outside)
    if spec.optimizer is not None and spec.task == "train":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise JobError(f"model.entrypoint: {spec.model.entrypoint} has no trainable parameters")
        bad = unmatched_globs(spec.optimizer, names)
        if bad:
            raise JobError(f"optimizer.per_op.{bad[0]}: matches no parameter of the model")
    job = LoadedJob(
        spec=spec,
        path=path,
        base_dir=base_dir,
        model=model,
        inputs=dataset.inputs,
        labels=dataset.labels,
        loss_fn=loss_fn,
        vocab=dataset.vocab,
    )
    preflight(job)
    return job
