"""Optimizer settings per parameter, and the optimizers built from them.

Shared by the plain-PyTorch reference and the distributed executor, so a compnode that owns only some
parameters steps them exactly as a single process stepping the whole model would. That holds because
every allowed optimizer updates each parameter from that parameter's own gradient and state only, and
because ``build_optimizers`` forces ``foreach=False`` (the single-tensor code path): the multi-tensor
path may fuse arithmetic differently depending on which tensors share a group.
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fusionnet.errors import JobError
from fusionnet.job.kwargs_check import KwargProblem, check_finite_numbers


# What this module reads of the job file's ``optimizer`` section (``schema.OptimizerSpec``, which
# validates itself with the functions below: spelled as protocols so that schema imports optim and
# never the other way round).
class OverrideSettings(Protocol):
    name: str | None
    lr: float | None
    kwargs: dict[str, Any]
    model_fields_set: set[str]


class OptimizerSettings(Protocol):
    name: str
    lr: float
    kwargs: dict[str, Any]

    @property
    def per_op(self) -> Mapping[str, OverrideSettings]: ...


# What an executor is given to build its optimizers once it holds its parameters.
OptimizerFactory = Callable[[Mapping[str, torch.nn.Parameter]], list[torch.optim.Optimizer]]

# Lower-case job-file name -> torch.optim class name. LBFGS (needs a closure that re-runs the whole
# model) and SparseAdam (sparse gradients only) are deliberately absent.
OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "rmsprop": "RMSprop",
    "adagrad": "Adagrad",
    "adadelta": "Adadelta",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
}

# Keyword arguments FusionNet sets itself (exactness needs the single-tensor path) or that are spelled
# elsewhere in the job file.
_RESERVED_KWARGS = {
    "lr": "set optimizer.lr (or per_op.<glob>.lr) instead",
    "params": "parameters are chosen by FusionNet",
    "foreach": "FusionNet always uses foreach=False so that split parameters step exactly",
    "fused": "FusionNet always uses the single-tensor implementation",
    "capturable": "CUDA-graph capture is not supported",
    "differentiable": "differentiating through the optimizer step is not supported",
}


@dataclass(frozen=True)
class ResolvedOptim:
    """The optimizer settings that apply to one parameter."""

    cls_name: str  # canonical torch.optim class name, e.g. "AdamW"
    lr: float
    kwargs: dict[str, Any] = field(default_factory=dict)

    def group_key(self) -> str:
        """Equal keys <=> identical settings (so the parameters can share one optimizer)."""
        return json.dumps([self.cls_name, self.lr, self.kwargs], sort_keys=True, default=repr)

    def __hash__(self) -> int:  # kwargs is a dict, so the generated field hash would fail
        return hash(self.group_key())


def canonical_name(name: str) -> str:
    """``"AdamW"``/``"adamw"`` -> ``"AdamW"``; ValueError naming the allowed set otherwise."""
    cls_name = OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if cls_name is None:
        allowed = ", ".join(sorted(OPTIMIZERS))
        raise ValueError(f"unknown or unsupported optimizer {name!r} (allowed: {allowed})")
    return cls_name


# Arguments whose range torch does not check (it refuses a negative momentum, and takes 1e300) though
# a value outside it makes no optimizer at all: key -> (low, high, high included), every allowed optimizer
# that takes the key giving it this meaning (SGD's and RMSprop's momentum: the share of the previous
# update kept; SGD's dampening: the share of the gradient left out).
_UNIT_RANGES: dict[str, tuple[float, float, bool]] = {
    "momentum": (0.0, 1.0, False),
    "dampening": (0.0, 1.0, True),
}


def _check_ranges(cls_name: str, kwargs: Mapping[str, Any]) -> None:
    """``KwargProblem`` for an argument of ``cls_name`` outside ``_UNIT_RANGES`` (one the class does not
    take is left to torch, whose message says so)."""
    takes = inspect.signature(getattr(torch.optim, cls_name)).parameters
    for key, (low, high, closed) in _UNIT_RANGES.items():
        value = kwargs.get(key)
        if key not in takes or isinstance(value, bool) or not isinstance(value, int | float):
            continue  # not a number: torch's own check names the type
        if not (low <= value <= high if closed else low <= value < high):
            bounds = f"[{low:g}, {high:g}{']' if closed else ')'}"
            raise KwargProblem(key, f"must lie in {bounds} (got {value!r})")


def normalize_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """YAML lists -> tuples (``betas: [0.9, 0.999]``), keys sorted; reserved keys refused, and numbers
    that are not finite (``KwargProblem`` naming the argument): torch would take some of them (a NaN
    momentum) and the job would train on NaN."""
    out: dict[str, Any] = {}
    for key in sorted(kwargs):
        if key in _RESERVED_KWARGS:
            raise ValueError(f"{key!r} is not allowed here: {_RESERVED_KWARGS[key]}")
        value = kwargs[key]
        out[key] = tuple(value) if isinstance(value, list) else value
    check_finite_numbers(out)
    return out


@contextlib.contextmanager
def _dynamo_left_unimported() -> Iterator[None]:
    """Lets torch's optimizer methods run without importing ``torch._dynamo`` (1-2 s of CPU).

    ``Optimizer.add_param_group`` and ``zero_grad`` are wrapped by ``torch._compile._disable_dynamo``,
    which imports dynamo on the first call only to wrap the method in ``dynamo.disable`` and caches
    that wrapper on the function as ``__dynamo_disable``. A job-file check never compiles, so for its
    duration the cache names the plain function itself; afterwards it is removed again so that a
    later real call wraps as torch intends. Where torch's layout differs (another release), nothing
    is changed and dynamo is simply imported. (``step`` imports dynamo for a graph break in its
    ``_use_grad`` wrapper: ``_step_once`` calls the unwrapped step instead.)
    """
    seeded: list[Callable[..., Any]] = []
    if "torch._dynamo" not in sys.modules:
        for name in ("add_param_group", "zero_grad"):
            plain = getattr(getattr(torch.optim.Optimizer, name, None), "__wrapped__", None)
            if callable(plain) and getattr(plain, "__dynamo_disable", None) is None:
                setattr(plain, "__dynamo_disable", plain)
                seeded.append(plain)
    try:
        yield
    finally:
        for plain in seeded:
            if getattr(plain, "__dynamo_disable", None) is plain:
                delattr(plain, "__dynamo_disable")


def _step_once(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` without its wrappers (profiling hooks, and ``_use_grad``, which imports dynamo):
    the same update under ``no_grad``, which is what ``_use_grad`` sets for a non-differentiable one."""
    if opt.defaults.get("differentiable"):
        opt.step()
        return
    with torch.no_grad():
        inspect.unwrap(type(opt).step)(opt)


def check_optimizer(cls_name: str, lr: float, kwargs: Mapping[str, Any]) -> None:
    """Builds the optimizer on a dummy parameter and steps it once, so a bad keyword or value is
    reported at load time instead of in the middle of a distributed run. ValueError on problems
    (``KwargProblem`` for an argument outside the range it has a meaning in, which torch may take)."""
    _check_ranges(cls_name, kwargs)
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.full((2,), 0.5)
    try:
        with _dynamo_left_unimported():
            opt = getattr(torch.optim, cls_name)([param], lr=lr, foreach=False, **kwargs)
            _step_once(opt)
    except Exception as e:  # TypeError (unknown keyword), ValueError (bad range), ...
        raise ValueError(f"{cls_name} refuses these arguments: {e}") from e
    if not torch.isfinite(param).all():
        raise ValueError(f"{cls_name} with these arguments produces non-finite parameters")


def resolve_override(
    default: ResolvedOptim, name: str | None, lr: float | None, kwargs: Mapping[str, Any] | None
) -> ResolvedOptim:
    """One ``per_op`` entry over the defaults. ``kwargs`` is ``None`` when the entry does not give it.

    Same optimizer class: the entry's kwargs are merged over the default kwargs (so ``{lr: 0.01}`` or
    ``{kwargs: {weight_decay: 0}}`` changes just that). Another class: the default kwargs belong to a
    different optimizer, so only the entry's own kwargs apply.
    """
    cls_name = canonical_name(name) if name is not None else default.cls_name
    own = normalize_kwargs(kwargs or {})
    merged = {**default.kwargs, **own} if cls_name == default.cls_name else own
    return ResolvedOptim(cls_name, float(lr if lr is not None else default.lr), dict(sorted(merged.items())))


def resolve_param_optimizers(spec: OptimizerSettings, param_names: Sequence[str]) -> dict[str, ResolvedOptim]:
    """Parameter name -> its settings. ``per_op`` globs (``fnmatch``, case-sensitive) are tried in
    file order and the first match wins; unmatched parameters get the defaults. Names are
    ``state_dict`` style (``layers.0.weight``); a compnode passes just the names it owns."""
    default = ResolvedOptim(canonical_name(spec.name), float(spec.lr), normalize_kwargs(spec.kwargs))
    overrides = [
        (
            glob,
            resolve_override(default, o.name, o.lr, o.kwargs if "kwargs" in o.model_fields_set else None),
        )
        for glob, o in spec.per_op.items()
    ]
    out: dict[str, ResolvedOptim] = {}
    for name in param_names:
        out[name] = next((r for glob, r in overrides if fnmatch.fnmatchcase(name, glob)), default)
    return out


def unmatched_globs(spec: OptimizerSettings, param_names: Sequence[str]) -> list[str]:
    """``per_op`` globs that match no parameter of the whole model: almost always a typo."""
    return [g for g in spec.per_op if not any(fnmatch.fnmatchcase(n, g) for n in param_names)]


def build_optimizers(
    named_params: Mapping[str, torch.nn.Parameter], resolved: Mapping[str, ResolvedOptim]
) -> list[torch.optim.Optimizer]:
    """One optimizer per distinct setting, over the parameters that need gradients.

    Parameters are taken in sorted name order and optimizers in order of their first parameter, so
    the result does not depend on the caller's iteration order. ``foreach=False`` always (module
    docstring). A parameter object listed under two names (tied weights) is stepped once.
    """
    groups: dict[str, tuple[ResolvedOptim, list[torch.nn.Parameter]]] = {}
    seen: set[int] = set()
    for name in sorted(named_params):
        param = named_params[name]
        if not param.requires_grad or id(param) in seen:
            continue
        if name not in resolved:
            raise JobError(f"optimizer: no settings resolved for parameter {name!r}")
        seen.add(id(param))
        setting = resolved[name]
        groups.setdefault(setting.group_key(), (setting, []))[1].append(param)
    return [
        getattr(torch.optim, s.cls_name)(params, lr=s.lr, foreach=False, **s.kwargs)
        for s, params in groups.values()
    ]


def make_optimizers(
    spec: OptimizerSettings, named_params: Mapping[str, torch.nn.Parameter]
) -> list[torch.optim.Optimizer]:
    """The job file's optimizer section over ``named_params`` (a whole model or one sub-DAG's part)."""
    return build_optimizers(named_params, resolve_param_optimizers(spec, list(named_params)))


def optimizer_factory(task: str, spec: OptimizerSettings | None) -> OptimizerFactory | None:
    """The factory an executor calls with the parameters it owns; None where nothing is stepped
    (``grad`` and ``infer`` jobs). The one way the reference, ``run --local`` and compnodes build them."""
    if task != "train" or spec is None:
        return None
    return lambda named: make_optimizers(spec, named)
