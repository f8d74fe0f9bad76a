"""Tiny GPT-2 and BERT from ``transformers`` trace through the torch.export fallback and train exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from fusionnet.dag.trace import trace_model
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from tests.dag_models import HFCausalLM, HFMaskedLM, token_data
from tests.jobfiles import write_job


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_class", [HFCausalLM, HFMaskedLM])
def test_uses_the_export_fallback(model_class) -> None:
    torch.manual_seed(0)
    ids, labels = token_data(4)
    traced = trace_model(model_class(), ids, labels, None, "train")
    assert traced.graph.frontend == "torch.export"
    assert traced.graph.aliases, "tied input/output embeddings must be recorded as aliases"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_class", ["HFCausalLM", "HFMaskedLM"])
@pytest.mark.parametrize("pieces,microbatches", [(2, 1), (3, 2)])
def test_trains_exactly(model_class: str, pieces: int, microbatches: int, tmp_path: Path) -> None:
    ids, labels = token_data(16)
    path = write_job(
        tmp_path / "job",
        model_class=model_class,
        inputs=ids,
        labels=labels,
        loss=False,
        microbatches=microbatches,
        batch_size=8,
        steps=2,
        optimizer={"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}},
    )
    ref = run_reference(load_job(path))
    got = run_local(load_job(path), pieces)
    assert list(got.weights) == list(ref.weights)
    diff = max((got.weights[k] - ref.weights[k]).abs().max().item() for k in ref.weights)
    assert diff <= (0.0 if microbatches == 1 else 1e-5)
    assert max(abs(r["loss"] - loss) for r, loss in zip(got.metrics, ref.losses)) <= 1e-5
