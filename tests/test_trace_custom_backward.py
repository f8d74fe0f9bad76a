"""Backward code of a model's own in a train/grad job: FusionNet rebuilds the backward pass from the traced
forward ops, so a custom ``autograd.Function``'s backward, a module backward hook, a parameter's gradient
hook or a tensor hook put in ``forward`` would silently never run (a straight-through estimator's fc1
gradient came out exactly zero). Such a job is refused, naming the Function or the module; the same
models infer (no backward), and the same estimator written with standard ops trains exactly."""

from __future__ import annotations

import shutil
from collections.abc import Callable
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

pytestmark = pytest.mark.timeout(180)

WHY = "FusionNet rebuilds the backward pass from the model's forward ops and cannot run backward code"


class _STE(torch.autograd.Function):
    """Straight-through estimator: forward rounds, backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g


class MLP(nn.Module):
    def __init__(self, quantize: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.quantize = quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(self.quantize(h) if self.quantize is not None else h)


class TensorHook(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        h.register_hook(lambda g: -g)  # gradient reversal
        return self.fc2(h)


def _trace(model: nn.Module, task: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    trace_model(model, x, None if task == "infer" else y, F.cross_entropy, task)


def _gradient_reversal(module: nn.Module, grad_in: tuple[torch.Tensor, ...], grad_out: object) -> tuple:
    return (-grad_in[0],)


def _hooked(how: str) -> nn.Module:
    model = MLP()
    if how == "full backward hook":
        model.fc2.register_full_backward_hook(_gradient_reversal)
    elif how == "backward hook":
        model.fc2.register_backward_hook(_gradient_reversal)
    elif how == "backward pre-hook":
        model.fc2.register_full_backward_pre_hook(lambda m, g: (-g[0],))
    elif how == "parameter hook":
        model.fc1.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    return model


@pytest.mark.parametrize("task", ["train", "grad"])
def test_a_custom_autograd_function_is_refused_by_name(task: str) -> None:
    with pytest.raises(TraceError, match=rf"^a {task} job cannot run custom backward code: ") as refused:
        _trace(MLP(_STE.apply), task)
    text = str(refused.value)
    assert "autograd.Function _STE (_STEBackward in the autograd graph)" in text and WHY in text


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("full backward hook", "module fc2 (Linear) has a backward hook"),
        ("backward hook", "module fc2 (Linear) has a backward hook"),
        ("backward pre-hook", "module fc2 (Linear) has a backward pre-hook"),
        ("parameter hook", "parameter fc1.weight has a gradient hook"),
    ],
)
def test_backward_hooks_are_refused_naming_the_module(how: str, named: str) -> None:
    model = _hooked(how)
    with pytest.raises(TraceError, match=r"^a grad job cannot run custom backward code: ") as refused:
        _trace(model, "grad")
    assert named in str(refused.value) and WHY in str(refused.value)


def test_a_tensor_hook_in_forward_is_refused_naming_the_line() -> None:
    with pytest.raises(TraceError, match=r"^a train job cannot run custom backward code: ") as refused:
        _trace(TensorHook(), "train")
    assert "the forward calls Tensor.register_hook (test_trace_custom_backward.py:" in str(refused.value)


def test_a_global_module_backward_hook_is_refused() -> None:
    handle = nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        with pytest.raises(TraceError, match="register_module_full_backward_hook"):
            _trace(MLP(), "grad")
    finally:
        handle.remove()
    _trace(MLP(), "grad")


def test_infer_has_no_backward_and_is_not_refused() -> None:
    for model in (MLP(_STE.apply), _hooked("full backward hook"), _hooked("parameter hook")):
        _trace(model, "infer")


def test_reentrant_checkpointing_is_not_custom_backward() -> None:
    """Its backward is the recomputed forward's: no refusal for it (the trace may still fail otherwise)."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(h: torch.Tensor) -> torch.Tensor:
        return checkpoint(torch.tanh, h, use_reentrant=True)

    try:
        _trace(MLP(checkpointed), "grad")
    except TraceError as e:
        assert "custom backward" not in str(e)


SOURCE = """
import torch
from torch import nn

class _STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g

def quantize(x):
    return QUANTIZE

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(quantize(torch.relu(self.fc1(x))))

def build():
    return M()
"""


def _job(tmp: Path, quantize: str) -> Path:
    folder = tmp / "job"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(SOURCE.replace("QUANTIZE", quantize))
    g = torch.Generator().manual_seed(0)
    save_file(
        {"inputs": torch.randn(16, 16, generator=g), "labels": torch.randint(0, 4, (16,), generator=g)},
        str(folder / "data.safetensors"),
    )
    doc = {
        "name": "ste",
        "task": "grad",
        "model": {"entrypoint": "model.py:build"},
        "data": {"path": "data.safetensors", "batch_size": 8, "microbatches": 1},
        "loss": {"name": "cross_entropy"},
        "steps": 1,
        "seed": 0,
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return folder / "job.yaml"


def test_run_local_refuses_a_straight_through_estimator_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the fix this ran, exit 0, with fc1's gradient exactly zero instead of plain PyTorch's."""
    job = _job(tmp_path, "_STE.apply(x)")
    code = main(["run", str(job), "--local", "1", "--output", str(tmp_path / "out"), "--no-predict"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == EXIT_BAD_INPUT, err
    assert len(err) == 1, err
    assert err[0].startswith(
        "fusionnet run: error: model.entrypoint: model.py:build: a grad job cannot run "
    ), err
    assert "autograd.Function _STE" in err[0]


def test_the_estimator_in_standard_ops_runs_exactly(tmp_path: Path) -> None:
    """What the refusal suggests (x + (f(x) - x).detach()) gives plain PyTorch's gradients, fc1's nonzero."""
    job = _job(tmp_path, "x + (torch.round(x * 4) / 4 - x).detach()")
    ref = run_reference(load_job(job))
    got = run_local(load_job(job), 1, tmp_path / "out")
    assert got.grads is not None and ref.grads is not None
    assert ref.grads["fc1.weight"].abs().max() > 0
    for name, grad in ref.grads.items():
        assert torch.allclose(got.grads[name], grad, rtol=1e-5, atol=1e-7), name
