"""LLM families on a real swarm (a broker and 2 compnodes as processes, jobs through ``fusionnet submit``):
results equal plain PyTorch (SGD, <= 1e-5). Llama (GQA, RMSNorm, rotary with its non-persistent
``inv_freq``) starts from a sharded ``save_pretrained`` folder; Gemma has tied embeddings and a
non-persistent ``embed_scale``; a GPT-2 infer job's single output reads its tied embedding (the case that
crashed ``run --local`` while the swarm assembled it elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytest.importorskip("transformers")

import transformers

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.runtime.process_swarm import BlockingObserver, ProcessSwarm, running_swarm
from tests.dag_models import hf_decoder_config
from tests.jobfiles import REPO, write_token_job

pytestmark = pytest.mark.swarm
TOL = 1e-5


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessSwarm]:
    with running_swarm(tmp_path_factory.mktemp("swarm"), [{}, {}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(2)
        finally:
            observer.close()
        yield sw


def _llama_from_pretrained(folder: Path) -> Path:
    torch.manual_seed(7)
    hf = transformers.AutoModelForCausalLM.from_config(hf_decoder_config("llama", 40, 32, 2, 4, 2))
    hf.save_pretrained(folder / "pretrained", max_shard_size="20KB")
    path = write_token_job(folder, "HFDecoder", "train", family="llama")
    doc = yaml.safe_load(path.read_text())
    doc["model"]["weights"] = "pretrained"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _submit(job: Path, sw: ProcessSwarm, out: Path) -> None:
    cmd = [
        sys.executable, "-m", "fusionnet.cli.main", "submit", str(job),
        "--initial-peers", *sw.initial_peers, "--output", str(out), "--timeout", "240",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert done.returncode == 0, f"submit failed:\n{done.stdout}\n{done.stderr}\n{sw.dump_logs()[-6000:]}"


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["llama-pretrained", "gemma", "gpt2-infer"])
def test_llm_on_the_swarm_equals_plain_pytorch(swarm: ProcessSwarm, case: str, tmp_path: Path) -> None:
    if case == "llama-pretrained":
        path = _llama_from_pretrained(tmp_path / "job")
    elif case == "gemma":
        path = write_token_job(tmp_path / "job", "HFDecoder", "train", family="gemma")
    else:
        path = write_token_job(tmp_path / "job", "HFCausalLM", "infer")
    out = tmp_path / "out"
    _submit(path, swarm, out)
    job = load_job(path)
    ref = run_reference(job)
    local = run_local(load_job(path), 2)
    if job.spec.task == "infer":
        got = load_file(out / "outputs.safetensors")
        assert sorted(got) == ["outputs"] and ref.outputs is not None
        assert (got["outputs"] - ref.outputs).abs().max().item() <= TOL
        assert local.outputs is not None and (got["outputs"] - local.outputs).abs().max().item() <= TOL
        return
    weights = load_file(out / "weights.safetensors")
    assert sorted(weights) == sorted(job.model.state_dict())  # non-persistent buffers are not results
    assert _max_diff(weights, ref.weights) <= TOL
    assert _max_diff(weights, local.weights) <= TOL
