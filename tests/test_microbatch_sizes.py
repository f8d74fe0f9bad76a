"""Which micro-batch sizes a job runs (``prepare.microbatch_sizes``), and that a graph that runs every one
of them is accepted: a symbolic trace (the bundled MLP) keeps the batch dimension free, so an uneven split
and a short last infer batch run and equal plain PyTorch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.runtime.prepare import microbatch_sizes
from tests.jobfiles import example_job


def _job(task: str, batch_size: int, microbatches: int, samples: int) -> SimpleNamespace:
    data = SimpleNamespace(batch_size=batch_size, microbatches=microbatches)
    return SimpleNamespace(spec=SimpleNamespace(task=task, data=data), n_samples=samples)


@pytest.mark.parametrize(
    "task,b,m,n,want",
    [
        ("train", 8, 2, 100, {4}),
        ("train", 5, 2, 100, {3, 2}),
        ("grad", 7, 3, 3, {3, 2}),  # batches wrap around a dataset smaller than a batch
        ("infer", 6, 2, 12, {3}),
        ("infer", 5, 1, 12, {5, 2}),  # 5, 5 and the last 2
        ("infer", 5, 2, 11, {3, 2, 1}),  # 3+2, 3+2, then 1 sample in 1 micro-batch
        ("infer", 8, 4, 3, {1}),  # the only batch holds 3 samples: 3 micro-batches of 1
    ],
)
def test_every_size_a_job_runs(task: str, b: int, m: int, n: int, want: set[int]) -> None:
    sizes = microbatch_sizes(_job(task, b, m, n))  # type: ignore[arg-type]
    assert set(sizes) == want
    if task == "infer" and n % b and n > b:
        assert any("the last batch" in why for why in sizes.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["train", "infer"])
def test_a_symbolic_graph_runs_uneven_micro_batches_exactly(task: str, tmp_path: Path) -> None:
    path = example_job("mlp", tmp_path, task=task, batch_size=7, microbatches=3, steps=2)
    try:
        ref, got = run_reference(load_job(path)), run_local(load_job(path), 2)
        if task == "infer":
            assert ref.outputs is not None and got.outputs is not None
            assert (got.outputs - ref.outputs).abs().max().item() <= 1e-5
        else:
            assert max((got.weights[k] - ref.weights[k]).abs().max().item() for k in ref.weights) <= 1e-5
            assert torch.isfinite(torch.tensor([r["loss"] for r in got.metrics])).all()
    finally:
        path.unlink()
