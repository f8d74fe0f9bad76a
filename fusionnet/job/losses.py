"""The job file's ``loss:``: an allowlisted ``torch.nn.functional`` loss with its keyword arguments bound.

Only two-argument ``(input, target)`` losses are allowed, because the DAG feeds a loss exactly the
model output and the labels. Keyword values must be plain scalars or strings: they travel in the IR
as constants, which cannot hold tensors (so ``cross_entropy``'s class ``weight`` is not available).
The batch loss must be one number (``reduction`` ``mean`` or ``sum``): micro-batch losses are
combined into it.

``cross_entropy`` and ``nll_loss`` over class indices average over the targets that are not
``ignore_index`` (-100 by default: padding, unmasked tokens), not over the samples: the mean of a
micro-batch is over its own count of such targets, which differs from micro-batch to micro-batch, so
micro-batch means weighted by their share of the samples are not the batch's mean (a padded causal LM's
gradient was off by more than its own size). Such a loss is traced with ``reduction="sum"`` instead
(``per_target_loss``) and each micro-batch is weighted by one over the whole batch's count of targets
(``schedule_loop``): the batch's mean exactly, and a micro-batch of padding only adds 0, not NaN.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from fusionnet.job.kwargs_check import check_finite_numbers


def _x() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12).reshape(4, 3)


def _classes() -> torch.Tensor:
    return torch.tensor([0, 2, 1, 0])


# name -> (example input, example target) makers, used to check the kwargs by a real call.
_SAMPLES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "cross_entropy": lambda: (_x(), _classes()),
    "nll_loss": lambda: (F.log_softmax(_x(), -1), _classes()),
    "multi_margin_loss": lambda: (_x(), _classes()),
    "multilabel_margin_loss": lambda: (_x(), torch.tensor([[0, -1, -1], [1, 2, -1], [2, -1, -1], [0, 1, 2]])),
    "multilabel_soft_margin_loss": lambda: (_x(), (_x() > 0).float()),
    "binary_cross_entropy": lambda: (torch.sigmoid(_x()), (_x() > 0).float()),
    "binary_cross_entropy_with_logits": lambda: (_x(), (_x() > 0).float()),
    "mse_loss": lambda: (_x(), _x().flip(0)),
    "l1_loss": lambda: (_x(), _x().flip(0)),
    "smooth_l1_loss": lambda: (_x(), _x().flip(0)),
    "huber_loss": lambda: (_x(), _x().flip(0)),
    "soft_margin_loss": lambda: (_x(), torch.where(_x() > 0, 1.0, -1.0)),
    "hinge_embedding_loss": lambda: (_x(), torch.where(_x() > 0, 1.0, -1.0)),
    "kl_div": lambda: (F.log_softmax(_x(), -1), F.softmax(_x().flip(0), -1)),
    "poisson_nll_loss": lambda: (_x(), _x().abs()),
}
LOSSES: tuple[str, ...] = tuple(sorted(_SAMPLES))

# Arguments that are the loss's positional inputs or deprecated spellings of ``reduction``.
_REFUSED_KWARGS = {
    "input": "the model output is the loss input",
    "target": "the labels are the loss target",
    "size_average": "deprecated: use reduction",
    "reduce": "deprecated: use reduction",
}


def check_loss_name(name: str) -> str:
    if name not in _SAMPLES:
        raise ValueError(f"unknown or unsupported loss {name!r} (allowed: {', '.join(LOSSES)})")
    return name


def check_loss_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """ValueError naming the first bad keyword: unknown to the function, not a scalar, a reduction
    that does not give one number, a NaN or infinity (``KwargProblem``), or a value the function itself
    refuses."""
    fn = getattr(F, name)
    params = inspect.signature(fn).parameters
    for key in sorted(kwargs):
        value = kwargs[key]
        if key in _REFUSED_KWARGS:
            raise ValueError(f"{key}: not allowed ({_REFUSED_KWARGS[key]})")
        if key not in params:
            takes = ", ".join(p for p in list(params)[2:] if p not in _REFUSED_KWARGS)
            raise ValueError(f"{key}: {name}() has no such argument (it takes {takes})")
        if value is not None and not isinstance(value, bool | int | float | str):
            raise ValueError(f"{key}: must be a number, string, boolean or null (got {type(value).__name__})")
        if key == "reduction" and value not in ("mean", "sum"):
            raise ValueError(f"reduction: must be 'mean' or 'sum' (got {value!r}); one number per batch")
    # torch only compares them with bounds, which NaN passes (label_smoothing: .nan trains as 0)
    check_finite_numbers(kwargs)
    inputs, target = _SAMPLES[name]()
    try:
        with warnings.catch_warnings():  # kl_div warns about 'mean' on every call; not ours to say here
            warnings.simplefilter("ignore")
            out = fn(inputs, target, **kwargs)
    except Exception as e:
        raise ValueError(f"{name}() refuses these arguments: {e}") from e
    if out.dim() != 0 or not torch.isfinite(out):
        raise ValueError(f"{name}() with these arguments does not give one finite number")


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_TARGET_MEAN_LOSSES = frozenset({"cross_entropy", "nll_loss"})


def per_target_ignore_index(name: str, kwargs: Mapping[str, Any], labels: torch.Tensor | None) -> int | None:
    """The ``ignore_index`` of a loss that averages over its non-ignored class targets (see above), or
    None for a loss whose mean is over samples (or a sum)."""
    if name not in _TARGET_MEAN_LOSSES or kwargs.get("reduction", "mean") != "mean":
        return None
    if labels is None or labels.is_floating_point():  # class probabilities: a mean over the samples
        return None
    return int(kwargs.get("ignore_index", -100))


def per_target_loss(name: str, kwargs: Mapping[str, Any]) -> LossFn:
    """The loss summed over its targets, for a run that divides by the batch's count of targets."""
    return make_loss_fn(name, {**kwargs, "reduction": "sum"})


def make_loss_fn(name: str, kwargs: Mapping[str, Any]) -> LossFn:
    """``F.<name>`` with ``kwargs`` bound (a ``functools.partial``, which torch.fx traces through)."""
    check_loss_name(name)
    check_loss_kwargs(name, kwargs)
    return functools.partial(getattr(F, name), **dict(sorted(kwargs.items())))
