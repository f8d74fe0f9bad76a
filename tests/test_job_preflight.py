"""A job whose model, data or loss do not fit together is refused at load with one message that names
the key and the tensor, never with a traceback from inside torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.job.preflight import preflight

pytestmark = pytest.mark.timeout(60)

MODEL_PY = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, returns="tensor", poison=False):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.returns = returns
        if poison:
            with torch.no_grad():
                self.lin.weight[0, 0] = float("inf")

    def forward(self, x):
        y = self.lin(x)
        if self.returns == "dict":
            return {"logits": y}
        if self.returns == "tuple":
            return (y, y)
        if self.returns == "none":
            return None
        return y

def build(**kwargs):
    return Net(**kwargs)
"""


def _job(
    tmp: Path,
    *,
    inputs: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    kwargs: dict[str, Any] | None = None,
    **top: Any,
) -> Path:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 4, generator=g) if inputs is None else inputs
    y = torch.randint(0, 3, (x.shape[0],), generator=g) if labels is None else labels
    (tmp / "model.py").write_text(MODEL_PY)
    save_file({"inputs": x.contiguous(), "labels": y.contiguous()}, str(tmp / "data.safetensors"))
    doc: dict[str, Any] = {
        "name": "t",
        "task": "train",
        "model": {"entrypoint": "model.py:build", "kwargs": kwargs or {}},
        "loss": {"name": "cross_entropy"},
        "data": {"path": "data.safetensors", "batch_size": 4},
        "optimizer": {"name": "sgd", "lr": 0.1},
    }
    for key, value in top.items():
        section, _, field = key.partition("__")
        if field:
            doc[section][field] = value
        else:
            doc[section] = value
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "forward returns a dict",
        {"kwargs": {"returns": "dict"}},
        r"^model\.entrypoint: forward on data\.inputs\[0:1\] returned a dict",
    ),
    (
        "forward returns a tuple",
        {"kwargs": {"returns": "tuple"}},
        r"^model\.entrypoint: forward .* returned a tuple",
    ),
    (
        "forward returns None",
        {"kwargs": {"returns": "none"}},
        r"^model\.entrypoint: forward .* returned a NoneType",
    ),
    (
        "infer returns None",
        {"kwargs": {"returns": "none"}, "task": "infer"},
        r"infer needs at least one Tensor",
    ),
    (
        "inputs too wide",
        {"inputs": torch.randn(12, 7)},
        r"^model\.entrypoint: forward on data\.inputs\[0:1\] \(Tensor of shape \(1, 7\).*failed",
    ),
    (
        "inputs of wrong rank",
        {"inputs": torch.randn(12, 2, 2, 4)[:, :, :, :4].reshape(12, 4, 4)},
        r"^(model\.entrypoint|loss): ",
    ),
    (
        "inputs of wrong dtype",
        {"inputs": torch.randint(0, 5, (12, 4))},
        r"^model\.entrypoint: forward .* dtype int64.*failed",
    ),
    ("float labels", {"labels": torch.rand(12)}, r"^loss: cross_entropy of the model's output .* failed"),
    (
        "labels out of range",
        {"labels": torch.tensor([0, 1, 7] * 4)},
        r"^data\.path: data\.safetensors: 'labels' range from 0 to 7, but the model outputs 3 classes",
    ),
    ("negative labels", {"labels": torch.tensor([0, -2, 1] * 4)}, r"'labels' range from -2 to 1"),
    (
        "NaN inputs",
        {"inputs": torch.where(torch.arange(48).reshape(12, 4) == 21, float("nan"), 1.0)},
        r"^data\.path: data\.safetensors: 'inputs' holds NaN or inf \(first in sample 5\)",
    ),
    ("inf weights", {"kwargs": {"poison": True}}, r"^model\.entrypoint: 'lin\.weight' holds NaN or inf"),
    # 16M samples of 16 KB each: 250 GiB for one batch, within the schema's limits but not any machine's.
    (
        "huge batch",
        {"data__batch_size": 1 << 24, "inputs": torch.zeros(12, 4, 1000)},
        r"^data\.batch_size: 16777216 samples need 250\.\d GiB",
    ),
]


@pytest.mark.parametrize(("case", "change", "message"), CASES, ids=[c[0] for c in CASES])
def test_mismatch_is_refused_with_one_message(
    tmp_path: Path, case: str, change: dict[str, Any], message: str
) -> None:
    change = dict(change)
    path = _job(
        tmp_path,
        inputs=change.pop("inputs", None),
        labels=change.pop("labels", None),
        kwargs=change.pop("kwargs", None),
        **change,
    )
    with pytest.raises(JobError, match=message) as info:
        load_job(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 500


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    """The preflight forward leaves the RNG, the module's mode and its BatchNorm statistics untouched."""
    (tmp_path / "bn.py").write_text(
        "from torch import nn\n\ndef build():\n"
        "    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 3))\n"
    )
    path = _job(tmp_path, model={"entrypoint": "bn.py:build"})
    job = load_job(path)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    stats = {k: v.clone() for k, v in job.model.state_dict().items()}
    job.model.train()
    preflight(job)
    assert torch.equal(torch.get_rng_state(), before)
    assert job.model.training
    assert all(torch.equal(stats[k], v) for k, v in job.model.state_dict().items())


NORMS = {
    "bn": ("nn.BatchNorm1d(6)", "BatchNorm1d) trains with batch statistics"),
    "counted": ("nn.InstanceNorm1d(1, track_running_stats=True)", "once per call"),
}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_batch_statistics_train_on_one_microbatch_per_step(norm: str, tmp_path: Path) -> None:
    """Several micro-batches would each be normalised by their own statistics: not the whole batch's
    computation, so refused naming the key and the module; one micro-batch, or inference, runs."""
    layer, says = NORMS[norm]
    unflatten = "nn.Unflatten(1, (1, 6)), " if norm == "counted" else ""
    flatten = ", nn.Flatten()" if norm == "counted" else ""
    (tmp_path / "normed.py").write_text(
        "from torch import nn\n\ndef build():\n"
        f"    return nn.Sequential(nn.Linear(4, 6), {unflatten}{layer}{flatten}, nn.Linear(6, 3))\n"
    )
    for task in ("train", "grad"):
        path = _job(tmp_path, model={"entrypoint": "normed.py:build"}, task=task, data__microbatches=2)
        with pytest.raises(JobError, match=r"^data\.microbatches: model\.\d+ \(") as refused:
            load_job(path)
        assert says in str(refused.value) and "set data.microbatches: 1" in str(refused.value)
        with pytest.raises(JobError, match="micro-batches per step"):
            load_job(
                _job(tmp_path, model={"entrypoint": "normed.py:build"}, task=task, data__microbatches="auto")
            )
        load_job(_job(tmp_path, model={"entrypoint": "normed.py:build"}, task=task, data__microbatches=1))
    infer = _job(
        tmp_path, model={"entrypoint": "normed.py:build"}, task="infer", data__microbatches=2, loss=None
    )
    load_job(infer)
