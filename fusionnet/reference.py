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
import time
from dataclasses import dataclass, field

import torch

from fusionnet.dag.precision import autocast, make_scaler
from fusionnet.errors import ExecutionError
from fusionnet.job.batches import batch_indices, infer_batches
from fusionnet.job.loader import LoadedJob
from fusionnet.job.optim import make_optimizers
from fusionnet.results.assemble import OUTPUTS, join_outputs, output_tensors


@dataclass
class ReferenceResult:
    weights: dict[str, torch.Tensor]  # state_dict after the run
    grads: dict[str, torch.Tensor] | None  # grad task: last batch's gradients, keyed like state_dict
    outputs: torch.Tensor | None  # infer task: the model's output (its first tensor), one row per sample
    losses: list[float]  # one per step (train/grad)
    # Wall seconds of each step (forward, backward, update; the device synchronised at its end): the
    # benchmarks' plain-PyTorch figure, without the model copy and device placement before step 0.
    step_seconds: list[float] = field(default_factory=list)
    # infer, a model returning several tensors: the others, "outputs.1", "outputs.2", ... (RunResult's)
    more_outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def output_files(self) -> dict[str, torch.Tensor]:
        """The tensors a run writes to ``outputs.safetensors``, under the same names."""
        if self.outputs is None:
            return {}
        return {OUTPUTS: self.outputs, **self.more_outputs}


def _batch_loss(
    job: LoadedJob, model: torch.nn.Module, idx: torch.Tensor, step: int, device: torch.device
) -> torch.Tensor:
    assert job.labels is not None
    x, y = job.inputs[idx].to(device), job.labels[idx].to(device)
    with autocast(job.spec.precision, device.type):
        loss = job.loss_fn(model(x), y) if job.loss_fn is not None else model(x, y)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"
        source = "the loss function" if job.loss_fn is not None else "model(inputs, labels)"
        raise ExecutionError(f"step {step}: {source} must return a scalar tensor (got {what})")
    return loss


def _infer(job: LoadedJob, model: torch.nn.Module, device: torch.device) -> ReferenceResult:
    """Each batch's output (a tensor, or a tuple/list/dict of them) flattened and joined exactly as the
    distributed run's results are (``results.assemble``: one whole batch here where it has micro-batches,
    which joins to the same rows), so a multi-output model compares leaf by leaf, name by name."""
    model.eval()
    per_batch: list[dict[str, torch.Tensor]] = []
    with torch.no_grad(), autocast(job.spec.precision, device.type):
        for i, idx in enumerate(infer_batches(job.n_samples, job.spec.data.batch_size)):
            out = model(job.inputs[idx].to(device))
            leaves = output_tensors([out])
            if not leaves:
                raise ExecutionError(
                    f"infer batch {i}: model returned {type(out).__name__} holding no tensor"
                )
            per_batch.append({k: v.cpu() for k, v in leaves.items()})
    joined = join_outputs(per_batch)
    first = joined.pop(OUTPUTS, None)
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return ReferenceResult(weights=weights, grads=None, outputs=first, losses=[], more_outputs=joined)


def run_reference(job: LoadedJob, device: str | torch.device = "cpu") -> ReferenceResult:
    """Runs ``job`` on a private copy of its model (``job.model`` is left as loaded) on ``device``
    (the comparison for ``compnode --device cuda`` swarms); results come back on the CPU."""
    spec = job.spec
    device = torch.device(device)
    model = copy.deepcopy(job.model)  # deepcopy keeps tied parameters tied
    model.to(device)  # in place: tied parameters stay tied
    torch.manual_seed(spec.seed)
    if spec.task == "infer":
        return _infer(job, model, device)
    if job.labels is None:
        raise ExecutionError(f"task {spec.task} needs labels, the loaded job has none")
    model.train()
    optimizers: list[torch.optim.Optimizer] = []
    if spec.task == "train":
        assert spec.optimizer is not None  # JobSpec requires it for train
        optimizers = make_optimizers(spec.optimizer, dict(model.named_parameters()))
    losses: list[float] = []
    scaler = make_scaler(spec.precision)
    step_seconds: list[float] = []
    for step in range(spec.steps):
        started = time.perf_counter()
        idx = batch_indices(step, spec.data.batch_size, job.n_samples)
        loss = _batch_loss(job, model, idx, step, device)
        model.zero_grad(set_to_none=True)
        (loss if scaler is None else loss * scaler.scale).backward()
        losses.append(float(loss.detach()))
        skip = False
        if scaler is not None:
            skip = scaler.unscale_(p.grad for p in model.parameters())
            scaler.update(skip)
        for opt in optimizers if not skip else ():
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_seconds.append(time.perf_counter() - started)
    state = model.state_dict(keep_vars=True)
    grads = None
    if spec.task == "grad":
        grads = {
            k: v.grad.detach().cpu().clone()
            for k, v in state.items()
            if isinstance(v, torch.nn.Parameter) and v.grad is not None
        }
    weights = {k: v.detach().cpu().clone() for k, v in state.items()}
    return ReferenceResult(
        weights=weights, grads=grads, outputs=None, losses=losses, step_seconds=step_seconds
    )
