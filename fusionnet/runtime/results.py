"""The result files of interface.md: weights/grads/outputs (safetensors), metrics.jsonl, plan.json."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from fusionnet.dag.partition import Partition


def assemble_state(
    state_keys: Iterable[str],
    pieces: Iterable[Mapping[str, torch.Tensor]],
    fallback: Mapping[str, torch.Tensor] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Merges the sub-DAGs' tensors into one ``state_dict`` with the model's key order. Tied keys
    take their owner's value; keys no sub-DAG holds (tensors the graph never reads) keep their
    values from ``fallback``, or are left out when there is none (gradients)."""
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for k, v in piece.items():
            merged.setdefault(k, v)
    aliases = aliases or {}
    out: dict[str, torch.Tensor] = {}
    for k in state_keys:
        owner = aliases.get(k, k)
        if owner in merged:
            out[k] = merged[owner].detach().contiguous()
        elif fallback is not None and k in fallback:
            out[k] = fallback[k].detach().contiguous()
    return out


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    # safetensors refuses shared storage; clones make every tensor its own contiguous buffer.
    data = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    _atomic_write(path, lambda p: save_file(data, str(p)))


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
                "cost": s.cost,
                "predicted_seconds": None if predicted is None else predicted.get(s.index),
                "measured_seconds": None if measured is None else measured.get(s.index),
            }
        )
    return {"subdags": subdags, **(extra or {})}


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n"))


def join_step_outputs(per_step: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """A swarm job's micro-batch outputs (``"mb/leaf"`` keys) of every step, in order, concatenated along
    the sample dimension."""
    rows: list[torch.Tensor] = []
    for blob in per_step:
        keys = sorted(blob, key=lambda k: tuple(int(x) for x in k.split("/")))
        rows.extend(blob[k] for k in keys if k.endswith("/0"))
    return torch.cat(rows, dim=0) if rows else None
