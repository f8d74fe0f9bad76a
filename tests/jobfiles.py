"""Writes job directories (model file, data, job.yaml) for tests, so every test goes through load_job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("mlp", "figure3", "gpt")


def write_job(
    directory: Path,
    *,
    model_class: str,
    inputs: torch.Tensor,
    labels: torch.Tensor | None,
    task: str = "train",
    microbatches: int = 2,
    batch_size: int = 8,
    steps: int = 3,
    compnodes: int = 2,
    optimizer: dict[str, Any] | None = None,
    loss: dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    schedule: str | None = None,
    chunks: int | None = None,
) -> Path:
    """A job whose model is ``tests.dag_models.<model_class>(**model_kwargs)``."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"inputs": inputs.contiguous()}
    if labels is not None:
        tensors["labels"] = labels.contiguous()
    save_file(tensors, str(directory / "data.safetensors"))
    (directory / "model.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        f"from tests.dag_models import {model_class}\n\n"
        f"def build(**kwargs):\n    return {model_class}(**kwargs)\n"
    )
    doc: dict[str, Any] = {
        "name": f"test-{model_class.lower()}",
        "task": task,
        "model": {"entrypoint": "model.py:build", "kwargs": model_kwargs or {}},
        "data": {"path": "data.safetensors", "batch_size": batch_size, "microbatches": microbatches},
        "steps": steps,
        "seed": 0,
        "placement": {"compnodes": compnodes},
    }
    if schedule is not None:
        doc["placement"]["schedule"] = schedule
    if chunks is not None:
        doc["placement"]["chunks"] = chunks
    if loss is not False:
        doc["loss"] = loss or {"name": "cross_entropy"}
    if task == "train":
        doc["optimizer"] = optimizer or {"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def example_job(name: str, tmp: Path, **overrides: Any) -> Path:
    """The bundled example's job file, with top-level/data keys overridden (written next to the original
    so that relative paths still resolve)."""
    src = REPO / "examples" / name / "job.yaml"
    doc = yaml.safe_load(src.read_text())
    for key, value in overrides.items():
        if key in ("batch_size", "microbatches"):
            doc["data"][key] = value
        elif key in ("compnodes", "schedule", "chunks", "cuts"):
            doc.setdefault("placement", {})[key] = value
        else:
            doc[key] = value
    if doc["task"] != "train":
        doc.pop("optimizer", None)
    path = src.parent / f".test-{tmp.name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def write_token_job(directory: Path, model_class: str, task: str = "train", **model_kwargs: object) -> Path:
    """A 12-sample token job for a ``tests.dag_models`` language model (its forward computes the loss):
    2 steps of 6 samples in 2 micro-batches on 2 compnodes, SGD with momentum; labels dropped for infer."""
    from tests.dag_models import token_data

    ids, labels = token_data(12)
    return write_job(
        directory,
        model_class=model_class,
        model_kwargs=dict(model_kwargs),
        inputs=ids,
        labels=None if task == "infer" else labels,
        task=task,
        loss=False,  # type: ignore[arg-type]  # False: no loss key, the model returns its loss
        microbatches=2,
        batch_size=6,
        steps=2,
        compnodes=2,
        optimizer={"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}},
    )
