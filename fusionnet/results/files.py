"""The result files of interface.md: weights/grads/outputs (safetensors), metrics.jsonl, plan.json.

Every file is written to a temporary name and renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fusionnet.dag.partition import Partition
from fusionnet.results.assemble import RunResult
from fusionnet.results.stream_safetensors import save_streaming

TENSOR_FILES = ("weights.safetensors", "grads.safetensors", "outputs.safetensors")  # a job writes 1 or 2
RESULT_FILES = (*TENSOR_FILES, "metrics.jsonl", "plan.json")


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    # A tensor at a time (``stream_safetensors``): ``tensors`` may read lazily from disk (the broker's
    # checkpoint), and no copy of the whole set is made; tensors sharing storage are written apart.
    _atomic_write(path, lambda p: save_streaming(tensors, p))


def write_metrics(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    _atomic_write(
        path, lambda p: p.write_text("".join(json.dumps(dict(r), sort_keys=True) + "\n" for r in rows))
    )


def plan_document(
    partition: Partition,
    *,
    predicted: Mapping[int, float] | None = None,
    measured: Mapping[int, float] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """plan.json: per sub-DAG its compnode, Table 3 fields, predicted and measured time."""
    subdags = []
    for s in partition.subdags:
        subdags.append(
            {
                "subdag": s.index,
                "compnode": s.compnode,
                "nodes": s.nodes,
                "inner_required_data": s.inner_required,
                "outer_required_data": s.outer_required,
                "outwards_data": s.outwards,
                "compnode_users": s.compnode_users,
                "params": s.params,
                "rows_served": s.row_serves,  # tied weights whose lookup's side gets rows only
                "rows_read": s.row_reads,
                "cost": s.cost,
                "predicted_seconds": None if predicted is None else predicted.get(s.index),
                "measured_seconds": None if measured is None else measured.get(s.index),
            }
        )
    return {"subdags": subdags, **(extra or {})}


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n"))


def write_results(output_dir: Path, result: RunResult, task: str) -> None:
    """``output_dir`` as interface.md's "Results" table describes it, for ``task``: this job's result files
    only. Those of an earlier job in a reused folder (the weights of a train job beside an infer job's
    outputs) are removed, as ``fusionnet submit`` and ``results`` do (``runtime.jobcontrol``)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Mapping[str, torch.Tensor]] = {}
    if task in ("train", "grad"):
        tensors["weights.safetensors"] = result.weights
    if task == "grad" and result.grads is not None:
        tensors["grads.safetensors"] = result.grads
    if task == "infer" and result.outputs is not None:
        tensors["outputs.safetensors"] = result.output_files()
    for name, values in tensors.items():
        write_tensors(output_dir / name, values)
    write_metrics(output_dir / "metrics.jsonl", result.metrics)
    write_json(output_dir / "plan.json", result.plan)
    for name in set(RESULT_FILES) - {*tensors, "metrics.jsonl", "plan.json"}:
        stale = output_dir / name
        if stale.is_file() or stale.is_symlink():  # a directory there was refused before the job ran
            stale.unlink()
