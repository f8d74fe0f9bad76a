"""``benchmarks/serving_infer.py``'s model rates: eq. (4) and eq. (3) in rows/s from the broker's figures
for a deployment, and nothing made up when the broker has none; its job file deploys as ``task: infer``
with the model the plain baseline runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from serving_infer import model_rates, write_job  # noqa: E402

from fusionnet.job.loader import load_job  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _status(model: dict | None) -> dict:
    deployment = {"max_batch": 32, "batch_seconds_mean": 0.06, "batch_rows_mean": 31.0, "model": model,
                  "stage_fp_seconds_mean": [0.045, 0.047]}  # fmt: skip
    return {"deployments": [deployment]}


def test_eq4_is_a_full_batch_per_slowest_stage_and_eq3_one_batch_with_the_call() -> None:
    figures = {
        "microbatch_rows": 16,  # 32 rows: two micro-batches per batch
        "stage_fp_seconds": [0.02, 0.025],
        "stage_comm_seconds": [0.0, 0.001],
        "call_seconds": 0.01,
    }
    rates = model_rates(_status(figures))
    assert rates["eq4_rows_per_s"] == pytest.approx(32 / (2 * 0.025))
    assert rates["eq3_rows_per_s"] == pytest.approx(32 / (0.01 + 2 * (0.02 + 0.025 + 0.001)))
    assert rates["max_batch"] == 32 and rates["call_seconds"] == 0.01
    none = model_rates(_status(None))  # hardware unknown: no prediction, the measured figures stay
    assert none["eq4_rows_per_s"] is None and none["eq3_rows_per_s"] is None
    assert none["batch_rows_mean"] == 31.0


def test_the_job_deploys_the_blocks_as_an_infer_job(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, dim=8, hidden=16, layers=2, batch=4, compnodes=2))
    assert job.spec.task == "infer" and job.spec.placement.compnodes == 2 and job.inputs.shape == (4, 8)
    x = torch.randn(3, 8)
    block = job.model.blocks[0]
    assert torch.allclose(job.model(x), job.model.blocks[1](block(x)))
