"""Dropout in a train/grad job: its random masks cannot be reproduced across compnodes, so a dropout module
of ``p > 0`` is refused before tracing, naming the modules and their ``p`` (and, for ``transformers``, the
config fields to set to 0); functional dropout, which no module scan sees, fails the traced graph's check
and gets a hint at randomness. Eval mode (infer) turns dropout off, so the same models infer exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file
from torch import nn

from fusionnet.cli.main import EXIT_BAD_INPUT, main
from fusionnet.dag.trace import trace_model
from fusionnet.errors import TraceError
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local

pytestmark = pytest.mark.timeout(120)

MLP_DROPOUT = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))

def build():
    return M()
"""


def _job(tmp: Path, source: str, task: str) -> Path:
    folder = tmp / "job"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(source)
    g = torch.Generator().manual_seed(0)
    tensors = {"inputs": torch.randn(16, 16, generator=g)}
    if task != "infer":
        tensors["labels"] = torch.randint(0, 4, (16,), generator=g)
    save_file(tensors, str(folder / "data.safetensors"))
    doc = {
        "name": "drop",
        "task": task,
        "model": {"entrypoint": "model.py:build"},
        "data": {"path": "data.safetensors", "batch_size": 8, "microbatches": 2},
        "steps": 2,
        "seed": 0,
    }
    if task != "infer":
        doc["loss"] = {"name": "cross_entropy"}
    if task == "train":
        doc["optimizer"] = {"name": "sgd", "lr": 0.1}
    (folder / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / "job.yaml"


def _trace(model: nn.Module, task: str) -> None:
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    trace_model(model, x, None if task == "infer" else y, F.cross_entropy, task)


def test_train_with_a_dropout_module_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    """Through ``run --local``: bad input, one line naming model.entrypoint, the module path and its p."""
    job = _job(tmp_path, MLP_DROPOUT, "train")
    out = tmp_path / "out"
    assert main(["run", str(job), "--local", "2", "--output", str(out), "--no-predict"]) == EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("fusionnet run: error: model.entrypoint: model.py:build: "), line
    assert "drop (Dropout, p=0.5)" in line and "set their p to 0" in line, line
    assert "compnodes" in line and "does not reproduce" not in line and "internal error" not in line


@pytest.mark.parametrize(
    "layer", [nn.Dropout1d(0.2), nn.Dropout2d(0.2), nn.AlphaDropout(0.2), nn.FeatureAlphaDropout(0.2)]
)
@pytest.mark.parametrize("task", ["train", "grad"])
def test_every_dropout_family_module_is_refused(layer: nn.Module, task: str) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Unflatten(1, (1, 16)), layer, nn.Flatten(), nn.Linear(16, 4))
    with pytest.raises(
        TraceError, match=rf"^a {task} job cannot use dropout: 2 \({type(layer).__name__}, p=0\.2\)"
    ):
        _trace(model, task)


def test_zero_probability_dropout_trains() -> None:
    _trace(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.0), nn.Linear(16, 4)), "train")


def test_many_dropout_modules_are_counted() -> None:
    model = nn.Sequential(*[m for _ in range(5) for m in (nn.Linear(16, 16), nn.Dropout(0.1))])
    with pytest.raises(TraceError) as refused:
        _trace(model, "train")
    text = str(refused.value)
    assert "1 (Dropout, p=0.1), 3 (Dropout, p=0.1), 5 (Dropout, p=0.1) and 2 more:" in text
    assert "\n" not in text and len(text) < 500


@pytest.mark.timeout(180)
def test_the_same_model_infers_exactly(tmp_path: Path) -> None:
    """Eval mode turns dropout off: the infer job runs and equals plain PyTorch."""
    job = _job(tmp_path, MLP_DROPOUT, "infer")
    ref = run_reference(load_job(job))
    got = run_local(load_job(job), 2, tmp_path / "out")
    assert got.outputs is not None and ref.outputs is not None
    assert (got.outputs - ref.outputs).abs().max().item() <= 1e-6


class FunctionalDropout(nn.Module):
    """Dropout a module scan cannot see: F.dropout following the module's mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(torch.relu(self.fc1(x)), 0.5, training=self.training))


def test_functional_dropout_gets_a_randomness_hint() -> None:
    with pytest.raises(TraceError, match=r"^model cannot be traced: ") as refused:
        _trace(FunctionalDropout(), "train")
    text = str(refused.value)
    assert "does not reproduce" in text
    assert "in train mode a common cause is randomness" in text and "F.dropout(training=True)" in text
    _trace(FunctionalDropout(), "infer")  # eval mode: F.dropout is the identity


def test_an_untraceable_model_gets_no_randomness_hint() -> None:
    """The hint is for a graph that runs but differs, not for a front end that cannot follow the model."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if int(x.sum().abs().item() * 1000) % 2 else -self.fc(x)

    with pytest.raises(TraceError) as refused:
        _trace(Branchy(), "train")
    assert "randomness" not in str(refused.value)


class DefaultGPT2(nn.Module):
    """A tiny transformers GPT-2 with its config's default dropout (resid/embd/attn_pdrop 0.1)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=16)
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, labels=labels)
        return out.logits if labels is None else out.loss


def test_transformers_default_dropout_names_the_config_fields() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(1, 40, (4, 8))
    says = r"^a train job cannot use dropout: lm\.transformer\.drop "
    with pytest.raises(TraceError, match=says) as refused:
        trace_model(DefaultGPT2(), ids, ids.clone(), None, "train")
    text = str(refused.value)
    assert "(Dropout, p=0.1)" in text and "more:" in text
    assert all(field in text for field in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
