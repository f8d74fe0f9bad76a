"""The plain single-process PyTorch run that distributed results are checked against.

It follows interface.md's "Semantics" paragraph literally: step ``s`` takes batch ``s`` (no shuffling),
computes the loss over the whole batch with the loss function's own reduction (no micro-batching:
splitting the batch is the distributed side's business), backpropagates once and steps the optimizers
once. Optimizers come from ``fusionnet.job.optim`` exactly as each compnode builds them, so any
difference between the two runs is the distribution's doing.

``precision`` (``fusionnet.dag.precision``): bf16/fp16 run the forward pass and the loss under
``torch.autocast`` with float32 parameters; fp16 scales the loss and unscales, checks and skips as
``torch.amp.GradScaler`` does (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``),
with the one documented difference that an inf/nan skips every optimizer of the step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fusionnet.dag.precision import autocast, make_scaler
from fusionnet.errors import ExecutionError
from fusionnet.job.batches import batch_indices, infer_batches
from fusionnet.job.loader import LoadedJob
from fusionnet.job.optim import make_optimizers


@dataclass
class ReferenceResult:
    weights: dict[str, torch.Tensor]  # state_dict after the run
    grads: dict[str, torch.Tensor] | None  # grad task: last batch's gradients, keyed like state_dict
    outputs: torch.Tensor | None  # infer task: one row per sample, in order
    losses: list[float]  # one per step (train/grad)


def _batch_loss(job: LoadedJob, model: torch.nn.Module, idx: torch.Tensor, step: int) -> torch.Tensor:
    assert job.labels is not None
    x, y = job.inputs[idx], job.labels[idx]
    with autocast(job.spec.precision):
        loss = job.loss_fn(model(x), y) if job.loss_fn is not None else model(x, y)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
        source = "the loss function" if job.loss_fn is not None else "model(inputs, labels)"
        raise ExecutionError(f"step {step}: {source} must return a scalar tensor (got {what})")
    return loss


def _infer(job: LoadedJob, model: torch.nn.Module) -> ReferenceResult:
    model.eval()
    outputs = []
    with torch.no_grad(), autocast(job.spec.precision):
        for i, idx in enumerate(infer_batches(job.n_samples, job.spec.data.batch_size)):
            out = model(job.inputs[idx])
            if not isinstance(out, torch.Tensor):
                raise ExecutionError(f"infer batch {i}: model returned {type(out).__name__}, not a Tensor")
            outputs.append(out)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ReferenceResult(weights=weights, grads=None, outputs=torch.cat(outputs), losses=[])


def run_reference(job: LoadedJob) -> ReferenceResult:
    """Runs ``job`` on a private copy of its model (``job.model`` is left as loaded)."""
    spec = job.spec
    model = copy.deepcopy(job.model)  # deepcopy keeps tied parameters tied
    torch.manual_seed(spec.seed)
    if spec.task == "infer":
        return _infer(job, model)
    if job.labels is None:
        raise ExecutionError(f"task {spec.task} needs labels, the loaded job has none")
    model.train()
    optimizers: list[torch.optim.Optimizer] = []
    if spec.task == "train":
        assert spec.optimizer is not None  # JobSpec requires it for train
        optimizers = make_optimizers(spec.optimizer, dict(model.named_parameters()))
    losses: list[float] = []
    scaler = make_scaler(spec.precision)
    for step in range(spec.steps):
        idx = batch_indices(step, spec.data.batch_size, job.n_samples)
        loss = _batch_loss(job, model, idx, step)
        model.zero_grad(set_to_none=True)
        (loss if scaler is None else loss * scaler.scale).backward()
        losses.append(float(loss.detach()))
        skip = False
        if scaler is not None:
            skip = scaler.unscale_(p.grad for p in model.parameters())
            scaler.update(skip)
        for opt in optimizers if not skip else ():
            opt.step()
    state = model.state_dict(keep_vars=True)
    grads = None
    if spec.task == "grad":
        grads = {
            k: v.grad.detach().clone()
            for k, v in state.items()
            if isinstance(v, torch.nn.Parameter) and v.grad is not None
        }
    weights = {k: v.detach().clone() for k, v in state.items()}
    return ReferenceResult(weights=weights, grads=grads, outputs=None, losses=losses)
