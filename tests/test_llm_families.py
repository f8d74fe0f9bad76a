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
from tests.dag_models import HF_DECODERS
from tests.jobfiles import write_token_job

TOL = 1e-5
SGD = {"name": "sgd", "lr": 0.1, "kwargs": {"momentum": 0.9}}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", HF_DECODERS)
def test_decoder_family_trains_exactly(family: str, tmp_path: Path) -> None:
    path = write_token_job(tmp_path / "job", "HFDecoder", family=family)
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
    path = write_token_job(tmp_path / "job", model_class, task="infer", **kwargs)
    ref = run_reference(load_job(path))
    got = run_local(load_job(path), 2, tmp_path / "out")
    written = load_file(tmp_path / "out" / "outputs.safetensors")
    assert sorted(written) == ["outputs"]
    assert ref.outputs is not None and written["outputs"].shape == ref.outputs.shape
    assert (written["outputs"] - ref.outputs).abs().max().item() <= TOL
    assert got.outputs is not None and torch.equal(got.outputs, written["outputs"])


@pytest.mark.timeout(120)
def test_submission_carries_the_non_persistent_buffers_the_ir_reads(tmp_path: Path) -> None:
    """Rotary ``inv_freq`` is a non-persistent buffer: not in ``state_dict()``, yet the IR reads it; the
    submission ships it and the broker's check accepts it (it refused the job before)."""
    from fusionnet.broker.submission import check_submission
    from fusionnet.dag.codec import decode_ir
    from fusionnet.errors import JobError
    from fusionnet.messages.blobs import unpack_tensors
    from fusionnet.runtime.submit import submission_payload

    job = load_job(write_token_job(tmp_path / "job", "HFDecoder", family="llama"))
    payload = submission_payload(job)
    graph = decode_ir(payload.ir)
    state = unpack_tensors(payload.state, "state")
    non_persistent = {n for n, _ in job.model.named_buffers() if n not in job.model.state_dict()}
    assert (
        "lm.model.rotary_emb.inv_freq" in non_persistent and "lm.model.rotary_emb.inv_freq" in graph.buffers
    )
    assert set(graph.buffers) <= set(state) and set(graph.params) <= set(state)
    assert set(job.model.state_dict()) <= set(state)
    torch.testing.assert_close(state["lm.model.rotary_emb.inv_freq"], job.model.lm.model.rotary_emb.inv_freq)
    check_submission(graph, state, unpack_tensors(payload.data, "data"), payload.spec)
    without = {k: v for k, v in state.items() if k in job.model.state_dict()}
    with pytest.raises(JobError, match="inv_freq"):
        check_submission(graph, without, unpack_tensors(payload.data, "data"), payload.spec)


def _token_job(tmp_path: Path, *, task: str, batch_size: int, microbatches: int, samples: int = 12) -> Path:
    from tests.dag_models import token_data
    from tests.jobfiles import write_job

    ids, labels = token_data(samples)
    return write_job(
        tmp_path / f"job-{task}-{batch_size}-{microbatches}-{samples}",
        model_class="HFCausalLM",
        inputs=ids,
        labels=None if task == "infer" else labels,
        task=task,
        loss=False,  # type: ignore[arg-type]
        microbatches=microbatches,
        batch_size=batch_size,
        steps=2,
        optimizer=SGD,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "task,batch_size,microbatches,samples,key,sizes",
    [
        ("train", 5, 2, 12, "data.microbatches", "micro-batches of 3 samples and does not run on 2"),
        ("infer", 5, 1, 12, "data.batch_size", "micro-batches of 5 samples and does not run on 2"),
    ],
)
def test_an_export_graph_is_refused_before_it_runs_a_micro_batch_size_it_cannot(
    task: str, batch_size: int, microbatches: int, samples: int, key: str, sizes: str, tmp_path: Path
) -> None:
    """A ``torch.export`` graph fixes the batch dimension it was traced with. An uneven split (5 samples in
    2 micro-batches: 3 and 2) or a short last infer batch (12 samples in batches of 5: 5, 5, 2) used to
    fail in the middle of the run with a reshape error from deep inside torch; now the job is refused
    before anything runs, naming the key and the fix. The same model with an even split runs exactly."""
    from fusionnet.errors import JobError

    job = load_job(_token_job(tmp_path, task=task, batch_size=batch_size, microbatches=microbatches))
    with pytest.raises(JobError, match=rf"^{key}: the model's graph \(torch.export\) was traced on {sizes} "):
        run_local(job, 2)
    even = _token_job(tmp_path, task=task, batch_size=4 if task == "train" else 6, microbatches=2)
    ref, got = run_reference(load_job(even)), run_local(load_job(even), 2)
    if task == "infer":
        assert ref.outputs is not None and got.outputs is not None
        assert (got.outputs - ref.outputs).abs().max().item() <= TOL
    else:
        assert _max_diff(got.weights, ref.weights) <= TOL
