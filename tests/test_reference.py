"""run_reference follows interface.md's semantics, checked against loops written out by hand here."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file

from fusionnet.errors import ExecutionError, JobError
from fusionnet.job.loader import LoadedJob, load_job
from fusionnet.reference import run_reference

MODEL_PY = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, returns_loss=False, bad_loss=False):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.out = nn.Linear(6, 3)
        self.returns_loss, self.bad_loss = returns_loss, bad_loss

    def forward(self, x, y=None):
        logits = self.out(torch.relu(self.fc(x)))
        if self.bad_loss:
            return torch.nn.functional.cross_entropy(logits, y, reduction="none")
        if self.returns_loss:
            return torch.nn.functional.cross_entropy(logits, y) * 2.0
        return logits

def build(**kwargs):
    return Net(**kwargs)
"""

N, BATCH = 10, 4


def _job(tmp: Path, task: str = "train", **changes: Any) -> Path:
    (tmp / "model.py").write_text(MODEL_PY)
    g = torch.Generator().manual_seed(3)
    save_file(
        {"inputs": torch.randn(N, 5, generator=g), "labels": torch.randint(0, 3, (N,), generator=g)},
        str(tmp / "data.safetensors"),
    )
    doc: dict[str, Any] = {
        "name": "ref",
        "task": task,
        "model": {"entrypoint": "model.py:build"},
        "loss": {"name": "cross_entropy"},
        "data": {"path": "data.safetensors", "batch_size": BATCH, "microbatches": 2},
        "optimizer": {"name": "sgd", "lr": 0.1},
        "steps": 4,
        "seed": 1,
        **changes,
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _batch(step: int) -> list[int]:
    return [(step * BATCH + i) % N for i in range(BATCH)]


@pytest.mark.timeout(60)
def test_train_is_plain_sgd_over_full_batches_in_order(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path))
    initial = {k: v.clone() for k, v in job.model.state_dict().items()}
    result = run_reference(job)

    # By hand: w <- w - lr * dL/dw, batch s = samples [4s, 4s+4) mod 10, full-batch mean loss.
    params = {k: v.clone().requires_grad_(True) for k, v in initial.items()}
    losses = []
    for step in range(4):
        idx = _batch(step)
        x, y = job.inputs[idx], job.labels[idx]
        hidden = torch.relu(x @ params["fc.weight"].T + params["fc.bias"])
        loss = F.cross_entropy(hidden @ params["out.weight"].T + params["out.bias"], y)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= 0.1 * g
        losses.append(loss.item())
    assert result.losses == pytest.approx(losses, abs=1e-6)
    for key, value in params.items():
        torch.testing.assert_close(result.weights[key], value.detach(), rtol=0, atol=1e-6)
    assert result.grads is None and result.outputs is None
    # job.model itself is untouched, so the same LoadedJob can feed the distributed run.
    assert all(torch.equal(job.model.state_dict()[k], initial[k]) for k in initial)


@pytest.mark.timeout(60)
def test_grad_returns_last_batch_gradients_without_updating(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, task="grad", steps=3))
    result = run_reference(job)
    model = job.model
    idx = _batch(2)
    loss = F.cross_entropy(model(job.inputs[idx]), job.labels[idx])
    names = [n for n, _ in model.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
    assert result.grads is not None and sorted(result.grads) == sorted(names)
    for name in names:
        assert torch.equal(result.grads[name], expected[name])
        assert torch.equal(result.weights[name], model.state_dict()[name])
    assert len(result.losses) == 3


@pytest.mark.timeout(60)
def test_infer_returns_every_sample_in_order(tmp_path: Path) -> None:
    job = load_job(_job(tmp_path, task="infer", steps=7))
    result = run_reference(job)
    with torch.no_grad():
        expected = job.model.eval()(job.inputs)
    assert result.outputs is not None and result.outputs.shape == (N, 3)
    torch.testing.assert_close(result.outputs, expected, rtol=0, atol=1e-6)
    assert result.losses == [] and result.grads is None


@pytest.mark.timeout(60)
def test_model_computed_loss_and_momentum_optimizer(tmp_path: Path) -> None:
    path = _job(
        tmp_path,
        model={"entrypoint": "model.py:build", "kwargs": {"returns_loss": True}},
        optimizer={"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}},
    )
    doc = yaml.safe_load(path.read_text())
    del doc["loss"]
    path.write_text(yaml.safe_dump(doc))
    job = load_job(path)
    assert job.loss_fn is None
    result = run_reference(job)
    model = job.model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(4):
        idx = _batch(step)
        loss = model(job.inputs[idx], job.labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert result.losses == losses
    assert all(torch.equal(result.weights[k], v) for k, v in model.state_dict().items())


def test_non_scalar_loss_is_refused_at_load_and_at_run(tmp_path: Path) -> None:
    path = _job(tmp_path, model={"entrypoint": "model.py:build", "kwargs": {"bad_loss": True}})
    doc = yaml.safe_load(path.read_text())
    del doc["loss"]
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(
        JobError, match=r"^model\.entrypoint: model\(inputs, labels\) must return a scalar loss"
    ):
        load_job(path)
    job = _load_unchecked(path)
    with pytest.raises(ExecutionError, match=r"step 0: model\(inputs, labels\) must return a scalar tensor"):
        run_reference(job)


def _load_unchecked(path: Path) -> LoadedJob:
    """The job as load_job builds it, minus the preflight (to reach the runtime's own check)."""
    with mock.patch("fusionnet.job.loader.preflight"):
        return load_job(path)


def test_runs_are_deterministic(tmp_path: Path) -> None:
    path = _job(tmp_path, optimizer={"name": "adam", "lr": 0.01})
    a, b = run_reference(load_job(path)), run_reference(load_job(path))
    assert a.losses == b.losses and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
