"""How a job's loss combines over micro-batches, and the loss its graph computes per micro-batch.

A batch's loss is one number; the schedule runs it as micro-batches and adds their losses, each
weighted (``dag.schedule_loop``): by its share of the samples for a mean over samples, by 1 for a sum,
and, for a class loss averaging over its non-ignored targets (``job.losses``), by one over the batch's
count of such targets, with the graph computing that micro-batch's sum.
"""

from __future__ import annotations

from fusionnet.errors import JobError
from fusionnet.job.loader import LoadedJob
from fusionnet.job.losses import LossFn, per_target_ignore_index, per_target_loss

TARGETS = "targets:"  # ``targets:I``: the mean over the targets that are not ignore_index I


def loss_reduction_of(job: LoadedJob) -> str:
    """How the job's loss reduces over a batch (decides how micro-batch losses are weighted):
    ``mean`` (over samples), ``sum``, or ``targets:I`` (a class loss's mean over the targets that are
    not ``ignore_index`` I, traced as a sum: ``job.losses``)."""
    loss = job.spec.loss
    if loss is None:
        return "mean"
    ignore = per_target_ignore_index(loss.name, loss.kwargs, job.labels)
    if ignore is not None:
        return f"{TARGETS}{ignore}"
    return str(loss.kwargs.get("reduction", "mean"))


def traced_loss_fn(job: LoadedJob) -> LossFn | None:
    """The loss the graph computes per micro-batch: the job's, or its sum over targets (``targets:``)."""
    loss = job.spec.loss
    if loss is not None and job.loss_fn is not None and loss_reduction_of(job).startswith(TARGETS):
        return per_target_loss(loss.name, loss.kwargs)
    return job.loss_fn


OWN_LOSS_IGNORE_INDEX = -100  # what transformers' losses and torch's class losses skip by default


def check_own_loss_combines(job: LoadedJob) -> None:
    """A model that computes its own loss from labels holding -100 (padding, unmasked tokens: what
    transformers' collators write) averages over the non-ignored targets of whatever it is given, and
    how it counts them (a causal LM shifts its labels first) is inside the model: several micro-batches'
    means could not be combined into the batch's mean exactly (a padded GPT-2's gradient came out
    off by more than its own size). Such a job must run whole batches, or name its loss in the job
    file, which FusionNet then weights by targets (``per_target_loss``)."""
    spec, labels = job.spec, job.labels
    if spec.loss is not None or spec.task == "infer" or labels is None or labels.is_floating_point():
        return
    if spec.data.microbatches == 1 or not bool((labels == OWN_LOSS_IGNORE_INDEX).any()):
        return
    raise JobError(
        f"data.microbatches: the model computes its own loss and 'labels' hold {OWN_LOSS_IGNORE_INDEX} "
        "(ignored targets): its mean over each micro-batch's own count of targets cannot be combined "
        "into the batch's mean exactly; set data.microbatches: 1, or have the model return logits and "
        "name the loss in the job file (loss: {name: cross_entropy}), which is weighted by targets"
    )
