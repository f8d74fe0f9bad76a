"""A reused output folder holds the last job's result files only, whoever writes them: ``run --local`` (and
the broker's job folder) through ``write_results``, as ``submit`` and ``results`` do through
``download_results``. ``run --local`` of an infer job left a grad job's weights and grads beside its
outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.results.assemble import RunResult
from fusionnet.results.files import write_results

pytestmark = pytest.mark.timeout(30)


def _result(task: str) -> RunResult:
    weights = {"w": torch.ones(2, 2)} if task != "infer" else {}
    grads = {"w": torch.full((2, 2), 0.5)} if task == "grad" else None
    outputs = torch.arange(6.0).reshape(3, 2) if task == "infer" else None
    return RunResult(weights, grads, outputs, [{"step": 0, "loss": 1.0}], {"subdags": []})


def test_write_results_removes_the_result_files_of_an_earlier_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_results(out, _result("grad"), "grad")
    assert sorted(p.name for p in out.iterdir()) == [
        "grads.safetensors", "metrics.jsonl", "plan.json", "weights.safetensors"
    ]  # fmt: skip
    (out / "notes.txt").write_text("the user's own")  # not a result file: kept
    write_results(out, _result("infer"), "infer")
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl", "notes.txt", "outputs.safetensors", "plan.json"
    ]  # fmt: skip
    assert load_file(out / "outputs.safetensors")["outputs"].shape == (3, 2)
    write_results(out, _result("train"), "train")
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl", "notes.txt", "plan.json", "weights.safetensors"
    ]  # fmt: skip
