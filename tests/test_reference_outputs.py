"""The reference of an infer job whose model returns several tensors (a tuple or a dict) flattens and names
them as ``run --local`` writes them (``outputs``, ``outputs.1``, ...), so multi-output infer can be checked
against plain PyTorch; a model returning one tensor keeps ``outputs`` as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.cli.main import main
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from tests.jobfiles import write_job

pytestmark = pytest.mark.timeout(120)

# What each model returns, and the result names run --local writes for it.
RETURNS = {
    "tuple": ("(self.cls(h), h)", ["outputs", "outputs.1"]),
    "dict": ('{"logits": self.cls(h), "hidden": h}', ["outputs", "outputs.1"]),
    "tensor": ("self.cls(h)", ["outputs"]),
    # leaves that are no tensors are no results: a model may return them (it used to be "untraceable")
    "dict with None": ('{"logits": self.cls(h), "cache": None, "layers": 2}', ["outputs"]),
}

MODEL = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 6)
        self.cls = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {returns}

def build():
    return M()
"""


@pytest.mark.parametrize("returns", sorted(RETURNS))
def test_reference_outputs_equal_run_local(returns: str, tmp_path: Path) -> None:
    expression, names = RETURNS[returns]
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    path = write_job(
        tmp_path / "job", model_class="TwoHeads", inputs=x, labels=None, task="infer", batch_size=4
    )
    (path.parent / "model.py").write_text(MODEL.format(returns=expression))
    out = tmp_path / "out"
    assert main(["run", str(path), "--local", "2", "--output", str(out), "--quiet", "--no-predict"]) == 0
    written = load_file(out / "outputs.safetensors")
    ref = run_reference(load_job(path))
    files = ref.output_files()
    assert sorted(files) == sorted(written) == names
    for name, tensor in written.items():
        assert files[name].shape == tensor.shape, name
        assert (files[name] - tensor).abs().max().item() <= 1e-6, name
    assert ref.outputs is not None and ref.outputs.shape == (10, 3)
    assert sorted(ref.more_outputs) == names[1:]
