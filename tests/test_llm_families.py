"""Causal and masked LMs from ``transformers`` configs (tiny, random init, seeded) on N virtual compnodes
(``run --local``) equal plain PyTorch: Llama, Mistral, Qwen2, Gemma, Phi3, GPT-2 and BERT; infer of a causal
LM with tied embeddings writes the same outputs file; non-persistent buffers travel with the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("transformers")

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from tests.dag_models import HF_DECODERS, token_data
from tests.jobfiles import write_job

TOL = 1e-5
SGD = {"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _job(tmp_path: Path, model_class: str, task: str = "train", **model_kwargs: object) -> Path:
    ids, labels = token_data(12)
    return write_job(
        tmp_path / "job",
        model_class=model_class,
        model_kwargs=dict(model_kwargs),
        inputs=ids,
        labels=None if task == "infer" else labels,
        task=task,
        loss=False,
        microbatches=2,
        batch_size=6,
        steps=2,
        optimizer=SGD,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", HF_DECODERS)
def test_decoder_family_trains_exactly(family: str, tmp_path: Path) -> None:
    path = _job(tmp_path, "HFDecoder", family=family)
    ref = run_reference(load_job(path))
    got = run_local(load_job(path), 2, tmp_path / "out")
    assert _max_diff(got.weights, ref.weights) <= TOL
    assert max(abs(r["loss"] - want) for r, want in zip(got.metrics, ref.losses)) <= TOL
    # weights.safetensors holds the state_dict's keys: non-persistent buffers (rotary inv_freq) are not in it.
    written = load_file(tmp_path / "out" / "weights.safetensors")
    assert sorted(written) == sorted(load_job(path).model.state_dict())


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model_class,kwargs", [("HFCausalLM", {}), ("HFMaskedLM", {}), ("HFDecoder", {"family": "gemma"})]
)
def test_infer_with_tied_embeddings_equals_plain_pytorch(
    model_class: str, kwargs: dict, tmp_path: Path
) -> None:
    """The model's single output (logits) reads the tied input/output embedding; ``run --local`` used to
    crash joining its outputs (torch.export returns them as a tuple)."""
    path = _job(tmp_path, model_class, task="infer", **kwargs)
    ref = run_reference(load_job(path))
    got = run_local(load_job(path), 2, tmp_path / "out")
    written = load_file(tmp_path / "out" / "outputs.safetensors")
    assert sorted(written) == ["outputs"]
    assert ref.outputs is not None and written["outputs"].shape == ref.outputs.shape
    assert (written["outputs"] - ref.outputs).abs().max().item() <= TOL
    assert got.outputs is not None and torch.equal(got.outputs, written["outputs"])
