"""Broken model code, forward passes, losses and optimizers: found only by loading the model (in the child
process of ``fusionnet.runtime.loadcheck``), except where the path alone tells."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.badinput.variant import MLP, Edit, JobDir, Variant, model, setter, variant

ORIGINAL = (MLP / "model.py").read_text()
EP = "model.entrypoint"
FWD = "model.entrypoint: forward on data.inputs[0:1]"
BUILD = (
    "\n\ndef build(**kwargs):\n    from torch import nn\n"
    "    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n"
)
WRAP = "\n_b = build\n\ndef build(**kwargs):\n    m = _b()\n    {}\n    return m\n"
QUICK = ("--load-timeout", "4")  # for code that never returns: the refusal must come in under 10 s


def _forward(body: str) -> str:
    """A model whose forward is ``body`` (indented under ``def forward(self, x):``)."""
    return (
        "import torch\nfrom torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(16, 4)\n\n"
        "    def forward(self, x):\n" + "".join(f"        {line}\n" for line in body.splitlines()) + "\n"
        "def build(**kwargs):\n    return Net()\n"
    )


def _outside_entry(kind: str) -> Edit:
    def edit(j: JobDir) -> None:
        if kind == "relative":
            j.set(EP, "../outside/evil.py:build")
        elif kind == "absolute":
            j.set(EP, f"{j.outside / 'evil.py'}:build")
        elif kind == "symlink":
            j.link("linked.py", j.outside / "evil.py")
            j.set(EP, "linked.py:build")
        elif kind == "symlinked-folder":
            j.link("lib", j.outside)
            j.set(EP, "lib/evil.py:build")
        j.set("model.kwargs", {})

    return edit


def _module_form(entry: str, **kwargs: object) -> Edit:
    return setter(**{EP: entry, "model.kwargs": kwargs})


ENTRYPOINT = [
    variant("entry", "missing-file", EP, setter(**{EP: "nope.py:build"}), says="not found"),
    variant("entry", "missing-callable", EP, setter(**{EP: "model.py:nobuild"}), says="no attribute"),
    variant("entry", "missing-nested-attr", EP, setter(**{EP: "model.py:MLP.nope"}), says="no attribute"),
    variant("entry", "outside-relative", EP, _outside_entry("relative"), says="outside the job folder"),
    variant("entry", "outside-absolute", EP, _outside_entry("absolute"), says="outside the job folder"),
    variant("entry", "outside-symlink", EP, _outside_entry("symlink"), says="outside the job folder"),
    variant("entry", "outside-symlinked-folder", EP, _outside_entry("symlinked-folder"), says="outside"),
    variant(
        "entry", "module-os-system", EP, _module_form("os:system", command="touch OUTSIDE"), says="module"
    ),
    variant(
        "entry", "module-torch-linear", EP, _module_form("torch.nn:Linear", in_features=16, out_features=4)
    ),
    variant("entry", "module-subprocess", EP, _module_form("subprocess:run", args=["true"]), says="module"),
    variant("entry", "yaml-file-as-module", EP, setter(**{EP: "job.yaml:build"})),
    variant("entry", "a-folder", EP, lambda j: (j.file("pkg/x.py", ""), j.set(EP, "pkg/:build"))[-1]),
    variant("entry", "data-file-as-code", EP, setter(**{EP: "data.safetensors/x.py:build"})),
    variant(
        "entry",
        "binary-file-as-code",
        EP,
        lambda j: (j.file("bin.py", b"\x00\xff" * 64), j.set(EP, "bin.py:build"))[-1],
    ),
    variant("entry", "imported-system", EP, model("from os import system as build\n"), says="imported"),
    variant(
        "entry",
        "imported-linear",
        EP,
        model("from torch.nn import Linear\n", **{EP: "model.py:Linear"}),
        says="imported",
    ),
    variant("entry", "syntax-error", EP, model("def build(:\n    pass\n"), says="SyntaxError"),
    variant(
        "entry", "import-raises", EP, model("raise ValueError('no GPU here')\n" + BUILD), says="ValueError"
    ),
    variant("entry", "import-keyboard-interrupt", EP, model("raise KeyboardInterrupt\n" + BUILD)),
    variant(
        "entry",
        "import-missing-module",
        EP,
        model("import not_a_module_xyz\n" + BUILD),
        says="not_a_module_xyz",
    ),
    variant(
        "entry", "sys-exit-0-at-import", EP, model("import sys\nsys.exit(0)\n" + BUILD), says="SystemExit"
    ),
    variant(
        "entry",
        "sys-exit-3-in-build",
        EP,
        model("def build(**kwargs):\n    raise SystemExit(3)\n"),
        says="SystemExit",
    ),
    variant(
        "entry", "os-exit-at-import", EP, model("import os\nos._exit(0)\n" + BUILD), says="ended the process"
    ),
    variant(
        "entry",
        "segfault-at-import",
        EP,
        model("import ctypes\nctypes.string_at(0)\n" + BUILD),
        says="killed",
    ),
    variant(
        "entry",
        "loop-at-import",
        EP,
        model("while True:\n    pass\n" + BUILD),
        says="did not finish",
        flags=QUICK,
    ),
    variant(
        "entry",
        "loop-in-build",
        EP,
        model("def build(**kwargs):\n    while True:\n        pass\n"),
        says="did not finish",
        flags=QUICK,
    ),
    variant(
        "entry",
        "sleep-at-import",
        EP,
        model("import time\ntime.sleep(3600)\n" + BUILD),
        says="did not finish",
        flags=QUICK,
    ),
    variant(
        "entry",
        "returns-string",
        EP,
        model("def build(**kwargs):\n    return 'net'\n"),
        says="not a torch.nn.Module",
    ),
    variant(
        "entry", "returns-none", EP, model("def build(**kwargs):\n    pass\n"), says="not a torch.nn.Module"
    ),
    variant(
        "entry",
        "returns-class",
        EP,
        model("from torch import nn\n\ndef build(**kwargs):\n    return nn.Linear\n"),
        says="not a torch.nn.Module",
    ),
    variant(
        "entry",
        "returns-dict",
        EP,
        model("from torch import nn\n\ndef build(**kwargs):\n    return {'a': nn.Linear(16, 4)}\n"),
        says="not a torch.nn.Module",
    ),
    variant("entry", "not-callable", EP, model("build = 42\n"), says="not a callable"),
    variant(
        "entry",
        "kwargs-misspelt",
        "model.kwargs",
        setter(**{"model.kwargs": {"feature": 16, "hidden": 32, "classes": 4}}),
    ),
    variant(
        "entry",
        "kwargs-extra",
        "model.kwargs",
        setter(**{"model.kwargs": {"features": 16, "hidden": 32, "classes": 4, "depth": 3}}),
    ),
    variant(
        "entry",
        "kwargs-wrong-type",
        EP,
        setter(**{"model.kwargs": {"features": "16", "hidden": 32, "classes": 4}}),
        says="TypeError",
    ),
    variant(
        "entry",
        "kwargs-huge-string",
        EP,
        setter(**{"model.kwargs": {"features": "x" * 100_000}}),
        says="TypeError",
    ),
    variant(
        "entry",
        "build-raises-memoryerror",
        EP,
        model("def build(**kwargs):\n    raise MemoryError('too big')\n"),
        says="MemoryError",
    ),
    variant(
        "entry",
        "build-recursion",
        EP,
        model("def build(**kwargs):\n    return build(**kwargs)\n"),
        says="RecursionError",
    ),
    variant(
        "entry",
        "no-parameters",
        EP,
        model("from torch import nn\n\ndef build(**kwargs):\n    return nn.ReLU()\n"),
        says="no trainable",
    ),
    variant(
        "entry",
        "frozen-parameters",
        EP,
        model(BUILD + WRAP.format("m.requires_grad_(False)")),
        says="no trainable",
    ),
    variant(
        "entry",
        "nan-initial-weights",
        EP,
        model(BUILD + WRAP.format("m[0].weight.data[0, 0] = float('nan')")),
        says="NaN",
    ),
]

FORWARD = [
    variant("forward", "returns-dict", FWD, model(_forward("return {'logits': self.fc(x)}")), says="dict"),
    variant("forward", "returns-tuple", FWD, model(_forward("return self.fc(x), x")), says="tuple"),
    variant("forward", "returns-none", FWD, model(_forward("self.fc(x)")), says="NoneType"),
    variant("forward", "returns-string", FWD, model(_forward("return 'logits'")), says="str"),
    variant(
        "forward",
        "raises",
        FWD,
        model(_forward("raise RuntimeError('broken forward')")),
        says="broken forward",
    ),
    variant("forward", "sys-exit", EP, model(_forward("raise SystemExit(0)")), says="exit"),
    variant(
        "forward", "loops", EP, model(_forward("while True:\n    pass")), says="did not finish", flags=QUICK
    ),
    variant(
        "forward",
        "wrong-input-width",
        FWD,
        setter(**{"model.kwargs": {"features": 8, "hidden": 32, "classes": 4}}),
        says="shape",
    ),
    variant(
        "forward",
        "wrong-input-rank",
        FWD,
        lambda j: j.tensors(
            "data.safetensors",
            {"inputs": j.data()["inputs"].reshape(256, 4, 4), "labels": j.data()["labels"]},
        ),
    ),
    variant(
        "forward",
        "int-inputs",
        FWD,
        lambda j: j.tensors(
            "data.safetensors", {"inputs": j.data()["inputs"].long(), "labels": j.data()["labels"]}
        ),
    ),
    variant(
        "forward",
        "float64-inputs",
        FWD,
        lambda j: j.tensors(
            "data.safetensors", {"inputs": j.data()["inputs"].double(), "labels": j.data()["labels"]}
        ),
    ),
    variant(
        "forward",
        "one-dim-inputs",
        FWD,
        lambda j: j.tensors(
            "data.safetensors", {"inputs": j.data()["inputs"][:, 0], "labels": j.data()["labels"]}
        ),
    ),
    variant(
        "forward",
        "text-data-into-mlp",
        FWD,
        lambda j: (
            j.file("t.txt", "hello world " * 50),
            j.set("data.path", "t.txt"),
            j.set("data.block_size", 16),
        )[-1],
    ),
    variant(
        "forward",
        "nan-output",
        ("model.entrypoint", "loss"),
        model(_forward("return self.fc(x) * float('nan')")),
        says="NaN",
    ),
]


def _labels(make: Callable[[Any], Any]) -> Edit:
    return lambda j: j.tensors(
        "data.safetensors", {"inputs": j.data()["inputs"], "labels": make(j.data()["labels"])}
    )


LOSS = [
    variant("loss", "float-labels", "loss", _labels(lambda y: y.float())),
    variant("loss", "labels-out-of-range", "data.path", _labels(lambda y: y + 7), says="labels"),
    variant("loss", "labels-negative", "data.path", _labels(lambda y: y - 5), says="labels"),
    variant("loss", "labels-2d", "loss", _labels(lambda y: y[:, None].repeat(1, 3))),
    variant("loss", "labels-nan", "data.path", _labels(lambda y: y.float() * float("nan")), says="NaN"),
    variant(
        "loss",
        "fewer-classes-than-labels",
        "data.path",
        setter(**{"model.kwargs": {"features": 16, "hidden": 32, "classes": 2}}),
        says="classes",
    ),
    variant("loss", "unknown-loss", "loss.name", setter(**{"loss.name": "crossentropy"})),
    variant("loss", "bad-reduction", "loss.kwargs", setter(**{"loss.kwargs": {"reduction": "avg"}})),
    variant("loss", "unknown-loss-kwarg", "loss.kwargs", setter(**{"loss.kwargs": {"foo": 1}})),
    variant("loss", "ignore-index-string", "loss.kwargs", setter(**{"loss.kwargs": {"ignore_index": "x"}})),
    variant("loss", "no-loss-model-not-a-loss", (EP, FWD), lambda j: j.doc.pop("loss")),
    variant("loss", "mse-with-int-labels", "data.path", setter(**{"loss.name": "mse_loss"})),
    variant(
        "loss",
        "mse-int-labels-of-output-shape",
        "data.path",
        lambda j: (
            j.set("loss.name", "mse_loss"),
            j.tensors(
                "data.safetensors",
                {"inputs": j.data()["inputs"], "labels": torch.ones(256, 4, dtype=torch.int64)},
            ),
        )[-1],
        says="floating-point",
    ),
    variant(
        "loss",
        "l1-float-labels-broadcast",
        "data.path",
        lambda j: (j.set("loss.name", "l1_loss"), _labels(lambda y: y.float())(j))[-1],
        says="shape",
    ),
    variant("loss", "reduction-none", "loss", setter(**{"loss.kwargs": {"reduction": "none"}})),
]

OPTIMIZER = [
    variant("optim", "unknown-name", "optimizer.name", setter(**{"optimizer.name": "sgdd"})),
    variant("optim", "unknown-kwarg", "optimizer.kwargs", setter(**{"optimizer.kwargs": {"momentun": 0.9}})),
    variant(
        "optim",
        "adam-betas-string",
        "optimizer.kwargs",
        setter(**{"optimizer.name": "adam", "optimizer.kwargs": {"betas": "x"}}),
    ),
    variant(
        "optim",
        "adam-betas-out-of-range",
        "optimizer.kwargs",
        setter(**{"optimizer.name": "adam", "optimizer.kwargs": {"betas": [2.0, 0.9]}}),
    ),
    variant(
        "optim",
        "per-op-glob-matches-nothing",
        "optimizer.per_op.nothing.*",
        setter(**{"optimizer.per_op": {"nothing.*": {"lr": 0.01}}}),
        says="matches no parameter",
    ),
    variant(
        "optim",
        "per-op-unknown-name",
        "optimizer.per_op.fc1.*.name",
        setter(**{"optimizer.per_op": {"fc1.*": {"name": "nope"}}}),
    ),
    variant(
        "optim", "per-op-empty-glob", "optimizer.per_op", setter(**{"optimizer.per_op": {"": {"lr": 0.1}}})
    ),
    variant(
        "optim",
        "per-op-not-mapping",
        "optimizer.per_op.fc1.*",
        setter(**{"optimizer.per_op": {"fc1.*": 0.1}}),
    ),
    variant(
        "optim",
        "weight-decay-negative",
        "optimizer.kwargs",
        setter(**{"optimizer.kwargs": {"weight_decay": -1}}),
    ),
    variant("optim", "kwargs-lr-twice", "optimizer.kwargs", setter(**{"optimizer.kwargs": {"lr": 0.5}})),
]

CASES: list[Variant] = ENTRYPOINT + FORWARD + LOSS + OPTIMIZER
