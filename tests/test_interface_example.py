"""The job file printed in interface.md (the user contract) is a valid job, as written there.

The example names ``models/fig3.py``, ``init.safetensors`` and ``data.safetensors``: the test puts
the Figure 3 example's model and data there, writes the model's initial weights, and loads the job
with the YAML copied verbatim from the contract (comments included), so a key the contract shows and
the schema refuses (``precision``, ``placement.schedule``, ...) fails here.
"""

# ruff: noqa: E501 (the contract's job file, verbatim)
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from fusionnet.job.loader import load_job

FIGURE3 = Path(__file__).resolve().parent.parent / "examples" / "figure3"

# Verbatim from interface.md, "Job definition file (YAML)".
CONTRACT_JOB = """\
name: figure3                  # free label
task: train                    # train = FP+BP+Update | grad = FP+BP (returns gradients) | infer = FP (returns outputs) | generate (deployments only)
model:
  entrypoint: models/fig3.py:build   # FILE.py:callable: a file inside the job file's folder that defines callable
                                     # (package.module:callable of an installed package only with --allow-outside-paths)
  kwargs: {}                         # keyword arguments for the callable, which returns a torch.nn.Module
  weights: init.safetensors          # optional initial state_dict: a .safetensors file, or a folder of safetensors
                                     # shards as `save_pretrained` writes it; default: as built after torch.manual_seed(seed)
loss:                                # optional: omit when the model's forward returns the loss itself
  name: cross_entropy                # a torch.nn.functional loss name: cross_entropy, mse_loss, nll_loss, ...
  kwargs: {}
data:
  path: data.safetensors             # tensors "inputs" and (except infer) "labels"; first dim = sample
  batch_size: 8
  microbatches: 2                    # each batch is split into this many micro-batches for pipelining
optimizer:                           # train only
  name: sgd                          # a torch.optim class name, case-insensitive
  lr: 0.1
  kwargs: {}                         # momentum, weight_decay, betas, ...
  per_op: {}                         # optional: parameter-name glob -> {name, lr, kwargs}
steps: 10                            # number of batches; batch s holds samples [s*B, (s+1)*B) modulo the dataset size
seed: 0
precision: fp32                      # fp32 | bf16 | fp16 (fp16: fp32 master weights + loss scaling)
placement:
  compnodes: 3                       # number of sub-DAGs / compnodes to use
  schedule: auto                     # gpipe | 1f1b | interleaved-1f1b | zero-bubble | auto (the performance model picks)
"""


def test_the_contracts_example_job_loads(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    shutil.copy(FIGURE3 / "model.py", tmp_path / "models" / "fig3.py")
    shutil.copy(FIGURE3 / "data.safetensors", tmp_path / "data.safetensors")
    # The model as built with its default kwargs, perturbed so that loading the weights is observable.
    spec = importlib.util.spec_from_file_location("fig3_for_test", tmp_path / "models" / "fig3.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.build()
    init = {k: v.detach() + 0.5 for k, v in model.state_dict().items()}
    save_file(init, str(tmp_path / "init.safetensors"))
    (tmp_path / "job.yaml").write_text(CONTRACT_JOB)

    job = load_job(tmp_path / "job.yaml")

    assert job.spec.name == "figure3" and job.spec.steps == 10 and job.spec.placement.compnodes == 3
    assert job.spec.precision == "fp32"
    for key, value in job.model.state_dict().items():
        assert torch.equal(value, init[key]), key
