"""A real swarm on CUDA (issue 11): two compnodes started with ``--device cuda`` beside one on the CPU,
the bundled GPT and MLP trained through ``fusionnet submit`` across all three, so activations and
gradients cross between device and host memory at every cut. The broker places FLOP-balanced pieces
(``--placement balanced``): its performance model would rightly keep jobs this small on one GPU. The
weights equal plain PyTorch on the GPU and on the CPU to float rounding, each compnode announces its
device, and the sub-DAGs' state was placed on the device the compnode was started with. Skipped
without CUDA (marker ``gpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.process_swarm import BlockingObserver, running_swarm
from tests.jobfiles import REPO, example_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.swarm,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
TOL = 1e-5
CUDA_NODE = {"extra": ("--device", "cuda")}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _submit(job: Path, initial_peers: list[str], out: Path, logs: str) -> None:
    cmd = [
        sys.executable, "-m", "fusionnet.cli.main", "submit", str(job),
        "--initial-peers", *initial_peers, "--output", str(out), "--timeout", "240",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs[-6000:]}"


@pytest.mark.timeout(600)
def test_a_swarm_of_cuda_and_cpu_compnodes_trains_exactly(tmp_path: Path) -> None:
    sgd = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}
    jobs = {
        "gpt": example_job("gpt", tmp_path, steps=3, compnodes=3, optimizer=sgd),
        "mlp-bf16": example_job("mlp", tmp_path, steps=3, compnodes=3, precision="bf16"),
    }
    try:
        balanced = {"extra": ("--placement", "balanced")}
        with running_swarm(tmp_path / "swarm", [CUDA_NODE, CUDA_NODE, {}], broker_kw=balanced) as sw:
            observer = BlockingObserver(sw.initial_peers)
            try:
                observer.wait_online(3, 120)
                kinds = {peer: r.hardware.device_kind for peer, r in observer.records().items()}
                assert sorted(kinds.values()) == ["cpu", "cuda", "cuda"]
                gpus = [r.hardware.d_gpu for r in observer.records().values() if r.hardware.d_gpu]
                assert len(gpus) == 2 and min(gpus) > 1 << 30  # D_gpu: the device's memory
                for name, path in jobs.items():
                    _submit(path, sw.initial_peers, tmp_path / name, sw.dump_logs())
                logs = sw.dump_logs()
            finally:
                observer.close()
        refs = {name: load_job(path) for name, path in jobs.items()}
    finally:
        for path in jobs.values():
            path.unlink()
    # Every compnode got work, and each put its state where it was told to.
    for name in jobs:
        plan = json.loads((tmp_path / name / "plan.json").read_text())
        assert sorted(kinds[p] for p in plan["compnodes"].values()) == ["cpu", "cuda", "cuda"]
    assert logs.count(" parameters on cuda") >= 4 and logs.count(" parameters on cpu") >= 2
    gpt_weights = load_file(tmp_path / "gpt" / "weights.safetensors")
    for device in ("cuda", "cpu"):
        assert _max_diff(gpt_weights, run_reference(refs["gpt"], device).weights) <= TOL
    # bf16: the same autocast on the GPU; micro-batching changes only the rounding of the sums.
    ref = run_reference(refs["mlp-bf16"], "cuda").weights
    got = load_file(tmp_path / "mlp-bf16" / "weights.safetensors")
    eps = torch.finfo(torch.bfloat16).eps
    for k, want in ref.items():
        assert _max_diff({k: got[k]}, {k: want}) <= 8 * eps * float(want.abs().max()) + 1e-12, k
