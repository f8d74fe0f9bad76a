"""``model.weights`` naming a folder as ``save_pretrained`` writes it (sharded safetensors + index, or one
``model.safetensors``): loaded with safetensors only, names mapped onto the model's keys, tied tensors
filled, and every mismatch refused with the file and the tensor name. Nothing is downloaded: each test
writes its folder first from a tiny random-init model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

import transformers

from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.job.weights import key_prefix
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from tests.dag_models import hf_decoder_config, token_data
from tests.jobfiles import write_job

pytestmark = pytest.mark.timeout(120)


def _pretrained(
    folder: Path, family: str = "llama", layers: int = 2, shard: str = "20KB", seed: int = 7
) -> dict:
    """A ``save_pretrained`` folder of a tiny random model (seeded apart from the job's own seed)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_decoder_config(family, 40, 32, layers, 4, 2))
    model.save_pretrained(folder, max_shard_size=shard)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _job(
    tmp_path: Path, weights: str | None = "pretrained", family: str = "llama", task: str = "train"
) -> Path:
    ids, labels = token_data(8)
    path = write_job(
        tmp_path,
        model_class="HFDecoder",
        model_kwargs={"family": family},
        inputs=ids,
        labels=None if task == "infer" else labels,
        task=task,
        loss=False,
        batch_size=4,
        steps=2,
        optimizer={"name": "sgd", "lr": 0.1},
    )
    if weights is not None:
        doc = yaml.safe_load(path.read_text())
        doc["model"]["weights"] = weights
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_sharded_folder_loads_under_the_wrapper_prefix(tmp_path: Path) -> None:
    saved = _pretrained(tmp_path / "pretrained")
    shards = sorted(p.name for p in (tmp_path / "pretrained").glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "pretrained" / "model.safetensors.index.json").is_file()
    state = load_job(_job(tmp_path)).model.state_dict()
    assert sorted(state) == sorted("lm." + k for k in saved)  # HFDecoder holds the HF model as self.lm
    assert all(torch.equal(state["lm." + k], v) for k, v in saved.items())
    # The job's own seed would have built different weights: the folder's really are the ones in use.
    assert not torch.equal(
        load_job(_job(tmp_path / "plain", None)).model.state_dict()["lm.lm_head.weight"],
        state["lm.lm_head.weight"],
    )


def test_tied_embedding_left_out_by_save_pretrained_is_filled(tmp_path: Path) -> None:
    saved = _pretrained(tmp_path / "pretrained", family="gemma", shard="1GB")
    assert (tmp_path / "pretrained" / "model.safetensors").is_file()
    assert "lm_head.weight" not in load_file(tmp_path / "pretrained" / "model.safetensors")
    model = load_job(_job(tmp_path, family="gemma")).model
    assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    assert torch.equal(model.lm.lm_head.weight, saved["model.embed_tokens.weight"])


def test_run_from_a_pretrained_folder_equals_plain_pytorch(tmp_path: Path) -> None:
    _pretrained(tmp_path / "pretrained")
    path = _job(tmp_path)
    ref = run_reference(load_job(path))
    got = run_local(load_job(path), 2)
    assert max((got.weights[k] - ref.weights[k]).abs().max().item() for k in ref.weights) <= 1e-5


def _refused(tmp_path: Path, match: str) -> None:
    with pytest.raises(JobError, match=match):
        load_job(_job(tmp_path))


def test_mismatches_are_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    folder = tmp_path / "pretrained"
    _pretrained(folder, layers=1)  # the job's model has 2 layers
    _refused(
        tmp_path,
        r"model.weights: pretrained: does not match the model \(names mapped as '' -> 'lm.'\): "
        r"missing keys \['lm.model.layers.1",
    )
    for p in folder.iterdir():
        p.unlink()
    _pretrained(folder, layers=3)
    _refused(
        tmp_path,
        r"unexpected keys \['model.layers.2.*\(the first in pretrained/model-\d+-of-\d+.safetensors\)",
    )
    for p in folder.iterdir():
        p.unlink()
    _pretrained(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(folder / shard)
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, str(folder / shard))
    _refused(
        tmp_path,
        rf"pretrained/{shard}: 'model.norm.weight' \(the model's 'lm.model.norm.weight'\) has shape "
        r"\(31,\), the model expects \(32,\)",
    )


def test_bad_folders_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    _refused(tmp_path, "a folder needs model.safetensors.index.json or model.safetensors .*pickle")
    (folder / "pytorch_model.bin").unlink()
    _pretrained(folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key, shard = next(iter(index["weight_map"].items()))
    escaped = {**index, "weight_map": {**index["weight_map"], key: f"../{shard}"}}
    save_file(load_file(folder / shard), str(tmp_path / shard))  # a real file, outside the folder
    index_path.write_text(json.dumps(escaped))
    _refused(tmp_path, rf"pretrained/model.safetensors.index.json: '\.\./{shard}' lies outside the folder")
    moved = {
        **index,
        "weight_map": {
            **index["weight_map"],
            key: next(s for s in index["weight_map"].values() if s != shard),
        },
    }
    index_path.write_text(json.dumps(moved))
    _refused(tmp_path, rf"lacks '{key}', which model.safetensors.index.json puts there")
    index_path.write_text("{not json")
    _refused(tmp_path, "model.safetensors.index.json: not valid JSON")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    _pretrained(outside)
    (tmp_path / "linked").symlink_to(outside, target_is_directory=True)
    with pytest.raises(JobError, match="leads outside the job folder"):
        load_job(_job(tmp_path, weights="linked"))
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "model.safetensors").symlink_to(tmp_path / shard)
    with pytest.raises(
        JobError, match=r"single/model\.safetensors: 'model\.safetensors' lies outside the folder"
    ):
        load_job(_job(tmp_path, weights="single"))


def test_key_prefix_goes_either_way() -> None:
    model = ["lm.model.embed.weight", "lm.lm_head.weight"]
    assert key_prefix(["model.embed.weight", "lm_head.weight"], model) == ("", "lm.")
    assert key_prefix(["lm.model.embed.weight"], ["model.embed.weight"]) == ("lm.", "")
    assert key_prefix(model, model) == ("", "")
    assert key_prefix(["unrelated"], model) == ("", "")
