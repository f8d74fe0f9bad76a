"""Per-parameter optimizer settings, and optimizers over a split of the parameters stepping exactly like
one optimizer over all of them (what lets each compnode own just its parameters)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusionnet.errors import JobError
from fusionnet.job.optim import ResolvedOptim, build_optimizers, resolve_param_optimizers
from fusionnet.job.schema import OptimizerSpec


def _spec(**fields) -> OptimizerSpec:
    return OptimizerSpec.model_validate(fields)


NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "Head.bias"]


def test_per_op_globs_first_match_wins_in_file_order() -> None:
    spec = _spec(
        name="SGD",
        lr=0.1,
        kwargs={"momentum": 0.9, "weight_decay": 0.01},
        per_op={
            "fc1.*": {"lr": 0.5},  # same class: default kwargs kept
            "*.bias": {"name": "adam", "lr": 0.01},  # other class: SGD's kwargs do not carry over
            "fc*": {"kwargs": {"momentum": 0.0}},  # merged over the defaults
        },
    )
    got = resolve_param_optimizers(spec, NAMES)
    default = ResolvedOptim("SGD", 0.1, {"momentum": 0.9, "weight_decay": 0.01})
    assert got == {
        "fc1.weight": ResolvedOptim("SGD", 0.5, {"momentum": 0.9, "weight_decay": 0.01}),
        "fc1.bias": ResolvedOptim("SGD", 0.5, {"momentum": 0.9, "weight_decay": 0.01}),
        "fc2.weight": ResolvedOptim("SGD", 0.1, {"momentum": 0.0, "weight_decay": 0.01}),
        "fc2.bias": ResolvedOptim("Adam", 0.01, {}),
        "head.weight": default,
        "Head.bias": ResolvedOptim("Adam", 0.01, {}),
    }


def test_globs_are_case_sensitive_and_match_across_dots() -> None:
    spec = _spec(name="adamw", lr=1e-3, per_op={"head.*": {"lr": 1.0}, "fc?.weight": {"lr": 2.0}})
    got = resolve_param_optimizers(spec, NAMES)
    assert got["head.weight"].lr == 1.0 and got["Head.bias"].lr == 1e-3
    assert got["fc1.weight"].lr == got["fc2.weight"].lr == 2.0 and got["fc1.bias"].lr == 1e-3
    assert {r.cls_name for r in got.values()} == {"AdamW"}


def test_a_subset_of_names_resolves_like_the_whole() -> None:
    spec = _spec(name="sgd", lr=0.1, per_op={"*.bias": {"lr": 0.2}, "fc1.*": {"lr": 0.3}})
    whole = resolve_param_optimizers(spec, NAMES)
    for part in (NAMES[:2], NAMES[2:5], NAMES[5:]):
        assert resolve_param_optimizers(spec, part) == {n: whole[n] for n in part}


def test_names_are_case_insensitive_and_lists_become_tuples() -> None:
    spec = _spec(name="ADAM", lr=0.01, kwargs={"betas": [0.8, 0.9]})
    (setting,) = set(resolve_param_optimizers(spec, ["w"]).values())
    assert setting == ResolvedOptim("Adam", 0.01, {"betas": (0.8, 0.9)})


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)


OPTIMIZERS = [  # job-file name, the torch class it must mean, lr, kwargs
    ("sgd", torch.optim.SGD, 0.05, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", torch.optim.SGD, 0.05, {"momentum": 0.5, "dampening": 0.1}),
    ("adam", torch.optim.Adam, 0.01, {"amsgrad": True, "weight_decay": 0.001}),
    ("AdamW", torch.optim.AdamW, 0.01, {"betas": [0.8, 0.95]}),
    ("rmsprop", torch.optim.RMSprop, 0.01, {"centered": True, "momentum": 0.5}),
    ("adagrad", torch.optim.Adagrad, 0.1, {"lr_decay": 0.01}),
    ("adadelta", torch.optim.Adadelta, 1.0, {}),
    ("adamax", torch.optim.Adamax, 0.01, {}),
    ("nadam", torch.optim.NAdam, 0.01, {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("radam", torch.optim.RAdam, 0.01, {}),
]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name,cls,lr,kwargs", OPTIMIZERS, ids=[f"{o[0]}-{i}" for i, o in enumerate(OPTIMIZERS)]
)
def test_split_parameters_step_exactly_like_one_optimizer(
    name: str, cls: type, lr: float, kwargs: dict
) -> None:
    torch.manual_seed(0)
    whole = _Net()
    split = copy.deepcopy(whole)
    # The local reference: plain torch, one optimizer, the way a user writes it.
    plain_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    reference = cls(whole.parameters(), lr=lr, **plain_kwargs)

    spec = _spec(name=name, lr=lr, kwargs=kwargs)
    named = dict(split.named_parameters())
    resolved = resolve_param_optimizers(spec, list(named))
    # Three "compnodes", each with its own parameters and its own optimizers.
    parts = [["fc1.weight", "head.bias"], ["fc1.bias", "fc2.weight"], ["fc2.bias", "head.weight"]]
    optimizers = [build_optimizers({n: named[n] for n in part}, resolved) for part in parts]
    assert sum(len(opts) for opts in optimizers) == 3

    for step in range(4):
        for p, g in zip(whole.parameters(), _grads(list(whole.parameters()), step)):
            p.grad = g.clone()
        for p, g in zip(split.parameters(), _grads(list(split.parameters()), step)):
            p.grad = g.clone()
        reference.step()
        for opts in optimizers:
            for opt in opts:
                opt.step()
    for (key, a), (_, b) in zip(whole.named_parameters(), split.named_parameters()):
        assert torch.equal(a, b), f"{name}: {key} differs by {(a - b).abs().max().item()}"
    assert not torch.equal(whole.fc1.weight, _Net().fc1.weight)  # the optimizer did move the weights


def test_groups_by_identical_settings_in_a_deterministic_order() -> None:
    net = _Net()
    spec = _spec(name="sgd", lr=0.1, per_op={"*.bias": {"lr": 0.2}})
    named = dict(net.named_parameters())
    resolved = resolve_param_optimizers(spec, list(named))
    forward = build_optimizers(named, resolved)
    backward = build_optimizers(dict(reversed(list(named.items()))), resolved)
    assert [o.param_groups[0]["lr"] for o in forward] == [0.2, 0.1]  # "fc1.bias" sorts first
    for a, b in zip(forward, backward):
        assert [id(p) for p in a.param_groups[0]["params"]] == [id(p) for p in b.param_groups[0]["params"]]
        assert a.param_groups[0]["foreach"] is False


def test_tied_and_frozen_parameters() -> None:
    net = _Net()
    net.fc2.bias.requires_grad_(False)
    named = {**dict(net.named_parameters()), "tied.weight": net.fc1.weight}
    resolved = resolve_param_optimizers(_spec(name="sgd", lr=0.1), list(named))
    (opt,) = build_optimizers(named, resolved)
    params = opt.param_groups[0]["params"]
    assert len(params) == 5 and all(p is not net.fc2.bias for p in params)  # tied once, frozen skipped


def test_missing_settings_are_an_error() -> None:
    net = _Net()
    with pytest.raises(JobError, match=r"no settings resolved for parameter 'fc1\.bias'"):
        build_optimizers(dict(net.named_parameters()), {})
