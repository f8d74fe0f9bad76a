"""Checks of a loaded job that need its data and model, done before anything is traced or sent.

The tracer and the runtimes run the model many times in places where a user error surfaces as a
traceback from deep inside torch (``mat1 and mat2 shapes cannot be multiplied``, ``Target 7 is out of
bounds``) or as the wrong cause ("cannot be traced" for NaN inputs). Here the same mistakes are found
once, on one sample, with a message that names the key, the tensor, and what was expected:

- inputs and labels have a dtype the wire carries (no float8, uint16/32/64 or complex);
- inputs, labels and weights hold only finite numbers;
- one batch's inputs fit in memory many times over (``batch_size: 10**9`` is refused, not allocated);
- one forward pass on ``data.inputs[0:1]`` succeeds and returns what the task needs, and succeeds again
  under the job's ``precision`` (bf16/fp16 autocast);
- the loss accepts that output with ``data.labels[0:1]``, and class labels lie in the output's range;
- a model that normalises with batch statistics (BatchNorm) trains on one micro-batch per step.

The dry run leaves no trace: the RNG state is restored, the model runs in eval mode without autograd
(BatchNorm statistics and dropout untouched) and its train/eval mode is put back afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten

from fusionnet.errors import JobError
from fusionnet.job.schema import JobSpec


class LoadedJob(Protocol):
    """What the preflight reads of ``fusionnet.job.loader.LoadedJob`` (which calls it: no import back)."""

    spec: JobSpec
    model: torch.nn.Module
    inputs: torch.Tensor
    labels: torch.Tensor | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None


# A batch's inputs may use at most this share of the machine's memory: activations, gradients and
# optimizer state come on top of them.
_BATCH_MEMORY_SHARE = 0.25
_CLASS_LOSSES = {"cross_entropy", "nll_loss", "multi_margin_loss"}

# The dtypes a data tensor may have: those the wire carries (``fusionnet.wire.header.ALLOWED_DTYPES``; the
# job package sits beside the wire in the layers and does not import it), because every micro-batch's
# inputs and labels travel to compnodes as frames. The other dtypes torch has (float8, uint16/32/64,
# complex, quantized) would otherwise fail later, deep inside torch or at the first send.
_DATA_DTYPE_ORDER = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
DATA_DTYPES: frozenset[torch.dtype] = frozenset(_DATA_DTYPE_ORDER)
_DATA_DTYPE_NAMES = [str(d).removeprefix("torch.") for d in _DATA_DTYPE_ORDER]  # in messages, this order
# Float dtypes ``torch.isfinite`` is implemented for (on CPU); any other float is widened first.
_ISFINITE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


# Where torch's C++ errors (c10::Error) start the backtrace they append to the message: frame after frame
# of mangled symbols and library addresses, which would swamp the one line a user is shown.
_CPP_BACKTRACE_MARKERS = ("Exception raised from ", "frame #0: ")


def short_error(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line of at most ``limit`` characters, for an error raised by user code or
    by torch inside it: a C++ backtrace is cut off, and the first line kept (the rest of a multi-line
    message is detail, a traceback or a backtrace, not what went wrong)."""
    text = str(e)
    for marker in _CPP_BACKTRACE_MARKERS:
        text = text.split(marker, 1)[0]
    text = text.strip().splitlines()[0].strip() if text.strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"Tensor of shape {tuple(t.shape)} and dtype {str(t.dtype).removeprefix('torch.')}"
    if isinstance(t, dict):
        return f"dict with keys {sorted(map(str, t))[:5]}"
    return type(t).__name__


def _machine_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        return 8 << 30


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` elementwise, also for the float dtypes it is not implemented for (float8, which
    a model's own parameters or outputs may use): those widen to float32 exactly, NaN and inf included."""
    if t.is_floating_point() and t.dtype not in _ISFINITE_DTYPES:
        t = t.to(torch.float32)
    return torch.isfinite(t)


def check_data(spec: JobSpec, inputs: torch.Tensor, labels: torch.Tensor | None) -> None:
    """The checks that need the data but not the model (no user code): dtypes, finite values, one batch's
    size."""
    for name, t in (("inputs", inputs), ("labels", labels)):
        # First, so that no check below (nor the model, nor the wire) meets a dtype torch half supports:
        # float8_e4m3fn has no isfinite, uint64 no min, and neither can be sent to a compnode.
        if t is not None and t.dtype not in DATA_DTYPES:
            dtype = str(t.dtype).removeprefix("torch.")
            raise JobError(
                f"data.path: {spec.data.path}: {name!r} has dtype {dtype}, which FusionNet does not carry; "
                f"save it as one of {', '.join(_DATA_DTYPE_NAMES)} (e.g. tensor.float(), tensor.long())"
            )
    for name, t in (("inputs", inputs), ("labels", labels)):
        if t is not None and t.is_floating_point() and not bool(_finite(t).all()):
            first = int((~_finite(t)).reshape(t.shape[0], -1).any(dim=1).nonzero()[0, 0])
            where = f"data.path: {spec.data.path}"
            raise JobError(f"{where}: '{name}' holds NaN or inf (first in sample {first})")
    per_sample = inputs[0].nbytes + (labels[0].nbytes if labels is not None else 0)
    need = per_sample * spec.data.batch_size
    have = _machine_memory_bytes()
    if need > _BATCH_MEMORY_SHARE * have:
        gib, total = need / 2**30, have / 2**30
        raise JobError(
            f"data.batch_size: {spec.data.batch_size} samples need {gib:.1f} GiB for one batch's inputs "
            f"alone; this machine has {total:.1f} GiB (at most a quarter of it for inputs)"
        )


def _check_weights_finite(job: LoadedJob) -> None:
    key = "model.weights" if job.spec.model.weights is not None else "model.entrypoint"
    for name, t in job.model.state_dict().items():
        if t.is_floating_point() and not bool(_finite(t).all()):
            raise JobError(f"{key}: {name!r} holds NaN or inf")


def _check_labels_range(job: LoadedJob, out: torch.Tensor, y: torch.Tensor) -> None:
    """Class losses index the output with the labels: every label must be a class the output has."""
    assert job.spec.loss is not None and job.labels is not None
    if job.spec.loss.name not in _CLASS_LOSSES or job.labels.is_floating_point() or out.dim() < 1:
        return
    classes = out.shape[1] if out.dim() >= 2 else out.shape[0]
    ignore = job.spec.loss.kwargs.get("ignore_index", -100)
    labels = job.labels[job.labels != ignore]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        low, high, loss = int(labels.min()), int(labels.max()), job.spec.loss.name
        raise JobError(
            f"data.path: {job.spec.data.path}: 'labels' range from {low} to {high}, but the model outputs "
            f"{classes} classes ({loss} expects 0..{classes - 1})"
        )


# Losses whose target holds class indices; every other loss compares its target element by element with
# the output, and torch would broadcast a target of another shape (a wrong loss, with only a warning).
_INDEX_LOSSES = _CLASS_LOSSES | {"multilabel_margin_loss"}


def _check_label_form(job: LoadedJob, out: torch.Tensor, y: torch.Tensor) -> None:
    assert job.spec.loss is not None
    name, where = job.spec.loss.name, f"data.path: {job.spec.data.path}"
    if name in _INDEX_LOSSES:
        return
    if tuple(y.shape) != tuple(out.shape):
        raise JobError(
            f"{where}: 'labels' of one sample have shape {tuple(y.shape[1:])}, but loss {name} compares "
            f"them element by element with the model output of shape {tuple(out.shape[1:])}"
        )
    if not y.is_floating_point():
        dtype = str(y.dtype).removeprefix("torch.")
        raise JobError(f"{where}: 'labels' are {dtype}, but loss {name} needs floating-point labels")


def _check_batch_statistics(job: LoadedJob) -> None:
    """Training normalises BatchNorm's inputs with the statistics of the rows it sees at once, and counts
    one running-statistics update per call: with several micro-batches each one is normalised by its own
    statistics, which is not what the whole batch computes (the gradients would differ from plain
    PyTorch's, not by rounding). Refused, naming the module, unless a step is one micro-batch."""
    m = job.spec.data.microbatches
    if job.spec.task == "infer" or m == 1:
        return
    for name, module in job.model.named_modules():
        batchwise = isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        instance = isinstance(module, torch.nn.modules.instancenorm._InstanceNorm)
        counted = instance and bool(module.track_running_stats)
        if batchwise or counted:
            what = "batch statistics" if batchwise else "running statistics updated once per call"
            raise JobError(
                f"data.microbatches: model.{name} ({type(module).__name__}) trains with {what}, so "
                f"{m} micro-batches per step would not compute what the whole batch does; set "
                "data.microbatches: 1, or use a norm of each sample alone (LayerNorm, GroupNorm)"
            )


def _dry_forward(job: LoadedJob) -> None:
    where = "model.entrypoint: forward on data.inputs[0:1]"
    x = job.inputs[0:1]
    y = job.labels[0:1] if job.labels is not None else None
    uses_loss = job.spec.task != "infer"
    try:
        if uses_loss and job.loss_fn is None:
            out = job.model(x, y)
        else:
            out = job.model(x)
    except Exception as e:
        raise JobError(f"{where} ({_describe(x)}) failed: {short_error(e)}") from None
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if any(not bool(_finite(t).all()) for t in leaves):
        raise JobError(f"{where} ({_describe(x)}) returned NaN or inf from finite inputs and weights")
    if not uses_loss:
        # Infer results are every tensor the output holds (fusionnet.results.assemble.output_tensors).
        if not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(out)[0]):
            raise JobError(f"{where} returned a {_describe(out)}; task infer needs at least one Tensor")
        return
    assert y is not None
    if job.loss_fn is None:
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise JobError(
                f"model.entrypoint: model(inputs, labels) must return a scalar loss, got {_describe(out)}"
            )
        return
    loss_name = job.spec.loss.name if job.spec.loss is not None else "loss"
    if not isinstance(out, torch.Tensor):
        raise JobError(f"{where} returned a {_describe(out)}; loss {loss_name} needs a Tensor")
    _check_labels_range(job, out, y)
    _check_label_form(job, out, y)
    try:
        loss = job.loss_fn(out, y)
    except Exception as e:
        raise JobError(
            f"loss: {loss_name} of the model's output ({_describe(out)}) and data.labels[0:1] "
            f"({_describe(y)}) failed: {short_error(e)}"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise JobError(f"loss: {loss_name} must give one number per batch, got {_describe(loss)}")
    if not bool(_finite(loss)):
        raise JobError(f"loss: {loss_name} of the model's output and data.labels[0:1] is {float(loss)}")


# ``precision`` -> the autocast dtype of the forward pass, as ``fusionnet.dag.precision.COMPUTE_DTYPES``
# has it (the job and dag packages are independent layers: neither imports the other).
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _dry_forward_autocast(job: LoadedJob) -> None:
    """The dry forward (model and loss) again under the job's ``precision``, as every executor runs it
    (``torch.autocast`` with float32 parameters): ops that fail on mixed dtypes (a bf16 activation
    scattered into a float32 tensor) or on the compute dtype itself fail here, naming ``precision``,
    instead of at step 0. Run after the fp32 dry forward, so that a failure here is the precision's."""
    dtype = _AUTOCAST_DTYPES.get(job.spec.precision)
    if dtype is None:
        return
    x = job.inputs[0:1]
    y = job.labels[0:1] if job.labels is not None else None
    try:
        with torch.autocast("cpu", dtype=dtype):
            if job.spec.task == "infer":
                job.model(x)
            elif job.loss_fn is None:
                job.model(x, y)
            else:
                job.loss_fn(job.model(x), y)
    except Exception as e:
        what = "forward" if job.spec.task == "infer" else "forward and loss"
        raise JobError(
            f"precision: {job.spec.precision}: the model's {what} on data.inputs[0:1] fails under "
            f"{job.spec.precision} autocast (it runs in fp32): {short_error(e)}"
        ) from None


def preflight(job: LoadedJob) -> None:
    """One JobError for the first problem found; nothing about the job or the RNG changes."""
    check_data(job.spec, job.inputs, job.labels)
    _check_weights_finite(job)
    _check_batch_statistics(job)
    was_training = job.model.training
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            job.model.eval()
            _dry_forward(job)
            _dry_forward_autocast(job)
        finally:
            job.model.train(was_training)
