"""Optimizer settings -> the performance model's optimizer profile names (``perfmodel.optimizers``).

The planner prices an optimizer's Update by its profile (state bytes, kernels per tensor); a job names
torch.optim classes with their kwargs, per parameter (``job.optim``). These map one to the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusionnet.dag.ir import IRGraph
from fusionnet.job.optim import resolve_param_optimizers


def optimizer_profile_name(cls_name: str, kwargs: Mapping[str, Any]) -> str:
    """A torch.optim class and its kwargs -> the performance model's optimizer profile name."""
    name = cls_name.lower()
    if name == "sgd" and float(kwargs.get("momentum", 0) or 0) != 0:
        return "sgd_momentum"
    return name


def optimizer_profiles(spec: Any, graph: IRGraph) -> dict[str, str] | None:
    """Parameter key -> optimizer profile name from an ``OptimizerSpec`` (None: no optimizer)."""
    if spec is None or not graph.params:
        return None
    resolved = resolve_param_optimizers(spec, list(graph.params))
    return {k: optimizer_profile_name(r.cls_name, r.kwargs) for k, r in resolved.items()}


def job_optimizers(job: Any, graph: IRGraph) -> dict[str, str] | None:
    """Parameter key -> optimizer profile name from a loaded job's optimizer section (train only)."""
    if job.spec.task != "train":
        return None
    return optimizer_profiles(job.spec.optimizer, graph)
