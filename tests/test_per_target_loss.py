"""Class losses averaged over their non-ignored targets (``ignore_index``: padding, unmasked tokens) stay
exact over micro-batches (``runtime.loss_reduction``): each micro-batch's sum over one batch-wide count,
not its own mean weighted by its share of the samples, which gave a padded batch a different gradient."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.messages.jobwire import RunSpec
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.runtime.loss_reduction import loss_reduction_of
from tests.dag_models import token_data
from tests.jobfiles import write_job

pytestmark = pytest.mark.timeout(300)


def _padded(n: int = 8, seq: int = 6, *, all_of_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids, _ = token_data(n, seq)
    labels = torch.randint(0, 12, (n, seq), generator=torch.Generator().manual_seed(3))
    labels[n // 2 :, 2:] = -100  # the second half of the batch holds far fewer targets
    if all_of_last:
        labels[-2:] = -100  # a micro-batch of padding only
    return ids, labels


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(
    "loss", [{"name": "cross_entropy"}, {"name": "cross_entropy", "kwargs": {"ignore_index": 3}}]
)
def test_uneven_ignored_targets_match_the_whole_batch_mean(schedule: str, loss: dict, tmp_path: Path) -> None:
    ids, labels = _padded()
    if loss.get("kwargs"):
        labels[labels == -100] = 3
    path = write_job(
        tmp_path,
        model_class="TokenTagger",
        inputs=ids,
        labels=labels,
        task="grad",
        microbatches=4,
        batch_size=8,
        steps=1,
        compnodes=2,
        loss=loss,
        schedule=schedule,
    )
    job = load_job(path)
    assert loss_reduction_of(job) == f"targets:{loss.get('kwargs', {}).get('ignore_index', -100)}"
    got, ref = run_local(job, 2), run_reference(load_job(path))
    assert got.grads is not None and ref.grads is not None
    assert _max_diff(got.grads, ref.grads) <= 1e-6
    assert got.metrics[0]["loss"] == pytest.approx(ref.losses[0], rel=1e-6)


def test_a_micro_batch_of_padding_only_adds_nothing_not_nan(tmp_path: Path) -> None:
    ids, labels = _padded(all_of_last=True)
    path = write_job(
        tmp_path,
        model_class="TokenTagger",
        inputs=ids,
        labels=labels,
        task="train",
        microbatches=4,
        batch_size=8,
        steps=2,
        compnodes=2,
        optimizer={"name": "sgd", "lr": 0.1},
    )
    got, ref = run_local(load_job(path), 2), run_reference(load_job(path))
    assert all(math.isfinite(row["loss"]) for row in got.metrics)
    assert _max_diff(got.weights, ref.weights) <= 1e-6


def test_a_model_computing_its_own_loss_over_ignored_labels_runs_whole_batches_only(tmp_path: Path) -> None:
    ids, labels = token_data(6)
    labels[3:, 4:] = -100  # masked-LM style: most tokens are not targets
    path = write_job(
        tmp_path,
        model_class="HFMaskedLM",
        inputs=ids,
        labels=labels,
        task="grad",
        microbatches=2,
        batch_size=6,
        steps=1,
        compnodes=2,
        loss=False,  # type: ignore[arg-type]
    )
    with pytest.raises(JobError, match=r"data.microbatches: the model computes its own loss .* -100"):
        run_local(load_job(path), 2)
    whole = write_job(
        tmp_path / "whole",
        model_class="HFMaskedLM",
        inputs=ids,
        labels=labels,
        task="grad",
        microbatches=1,
        batch_size=6,
        steps=1,
        compnodes=2,
        loss=False,  # type: ignore[arg-type]
    )
    got, ref = run_local(load_job(whole), 2), run_reference(load_job(whole))
    assert got.grads is not None and ref.grads is not None
    assert _max_diff(got.grads, ref.grads) <= 1e-5


def test_the_run_spec_carries_the_ignore_index_and_refuses_anything_else() -> None:
    fields = {
        "name": "j",
        "task": "grad",
        "batch_size": 2,
        "microbatches": 1,
        "steps": 1,
        "n_samples": 2,
        "compnodes": 1,
    }
    assert RunSpec(**fields, loss_reduction="targets:-100").loss_reduction == "targets:-100"
    for bad in ("targets:", "targets:x", "max", "targets:1; drop"):
        with pytest.raises(ValueError):
            RunSpec(**fields, loss_reduction=bad)
