"""Executor overhead: ``fusionnet run --local 1`` against plain PyTorch on the same job, one thread each.

With one compnode the whole model is one sub-DAG, so the difference between the two step times is what
FusionNet's execution costs on top of PyTorch: the rebuilt GraphModule (one Python call per IR node,
each through its argument checks), the step loop, the mailbox and the optimizer wrappers. Issue 13
asks for at most 1.05x on the bundled GPT and on a ``transformers`` GPT-2.

Both sides run the same job in this process, in alternating rounds (plain, FusionNet, plain, ...) so
that a noisy neighbour hits both; each round's figure is the median step after a warm-up step, and
the ratio is taken from the medians over rounds. Prints a table, then one JSON line.

    python benchmarks/executor_overhead.py [--rounds 3] [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from fusionnet.job.batches import batch_indices  # noqa: E402
from fusionnet.job.loader import LoadedJob, load_job  # noqa: E402
from fusionnet.job.optim import make_optimizers  # noqa: E402
from fusionnet.runtime.local import run_local  # noqa: E402

HF_MODEL = '''"""A transformers GPT-2 (random init) whose forward returns the LM loss."""
import torch
import transformers


class GPT2Loss(torch.nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_positions=seq,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        cfg._attn_implementation = "eager"
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(**kwargs):
    torch.manual_seed(0)
    return GPT2Loss(**kwargs)
'''


def hf_gpt2_job(folder: Path, *, quick: bool, steps: int) -> Path:
    """A job folder for a transformers GPT-2 (4 layers, d 256: 5.7M parameters; --quick: 2 layers, d 128)."""
    from safetensors.torch import save_file

    vocab, width, layers, heads, seq = (1000, 128, 2, 4, 32) if quick else (2000, 256, 4, 4, 64)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(HF_MODEL)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (64, seq), generator=g)
    save_file({"inputs": tokens, "labels": torch.roll(tokens, -1, 1)}, str(folder / "data.safetensors"))
    kwargs = f"{{vocab: {vocab}, width: {width}, layers: {layers}, heads: {heads}, seq: {seq}}}"
    (folder / "job.yaml").write_text(
        f"name: hf-gpt2\ntask: train\nmodel:\n  entrypoint: model.py:build\n  kwargs: {kwargs}\n"
        "data:\n  path: data.safetensors\n  batch_size: 8\n  microbatches: 1\n"
        f"optimizer:\n  name: sgd\n  lr: 0.01\nsteps: {steps}\nseed: 0\nplacement:\n  compnodes: 1\n"
    )
    return folder / "job.yaml"


def plain_steps(job: LoadedJob) -> list[float]:
    """Seconds per step of plain PyTorch on the job, micro-batched as the job says (as the executor is)."""
    import copy

    spec = job.spec
    model = copy.deepcopy(job.model).train()
    assert spec.optimizer is not None and job.labels is not None
    optimizers = make_optimizers(spec.optimizer, dict(model.named_parameters()))
    seconds = []
    for step in range(spec.steps):
        started = time.perf_counter()
        idx = batch_indices(step, spec.data.batch_size, job.n_samples)
        model.zero_grad(set_to_none=True)
        for part in idx.chunk(spec.data.microbatches):
            x, y = job.inputs[part], job.labels[part]
            loss = job.loss_fn(model(x), y) if job.loss_fn is not None else model(x, y)
            (loss * (len(part) / len(idx))).backward()
        for opt in optimizers:
            opt.step()
        seconds.append(time.perf_counter() - started)
    return seconds


def fusionnet_steps(job: LoadedJob) -> list[float]:
    result = run_local(job, 1)
    return [row["seconds"] for row in result.metrics]


def steady(seconds: list[float]) -> float:
    return statistics.median(seconds[1:])


def measure(name: str, job_file: Path, rounds: int) -> dict[str, Any]:
    job = load_job(job_file)
    plain, ours = [], []
    for _ in range(rounds):
        plain.append(steady(plain_steps(job)))
        ours.append(steady(fusionnet_steps(job)))
    p, f = statistics.median(plain), statistics.median(ours)
    params = sum(t.numel() for t in job.model.parameters())
    return {"job": name, "params": params, "plain_ms": p * 1e3, "fusionnet_ms": f * 1e3, "ratio": f / p}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="smaller GPT-2, 2 rounds (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusionnet-overhead-") as tmp:
        bundled = REPO / "examples" / "gpt" / "job.yaml"
        rows.append(measure("bundled GPT (examples/gpt)", bundled, rounds))
        hf = hf_gpt2_job(Path(tmp) / "hf", quick=args.quick, steps=args.steps)
        rows.append(measure("transformers GPT-2", hf, rounds))
    print(f"{'job':30} {'params':>10} {'plain ms/step':>14} {'run --local 1':>14} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['job']:30} {r['params']:>10,} {r['plain_ms']:>14.2f} {r['fusionnet_ms']:>14.2f} "
            f"{r['ratio']:>7.3f}"
        )
    print(json.dumps({"benchmark": "executor_overhead", "rounds": rounds, "rows": rows}))


if __name__ == "__main__":
    main()
