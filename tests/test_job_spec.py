"""Every way to get the figure3 job file wrong gives exactly one JobError that starts with the key."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from fusionnet.errors import JobError
from fusionnet.job.loader import load_job, load_job_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "figure3"

Doc = dict[str, Any]


def _copy_example(tmp: Path) -> Path:
    """A private copy of examples/figure3 (job.yaml, model.py, data) that a case may damage."""
    job_dir = tmp / "figure3"
    shutil.copytree(EXAMPLE, job_dir, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
    return job_dir


def _set(path: str, value: Any) -> Callable[[Doc, Path], None]:
    def mutate(doc: Doc, _: Path) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    return mutate


def _drop(path: str) -> Callable[[Doc, Path], None]:
    def mutate(doc: Doc, _: Path) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


def _write_file(name: str, text: str, then: Callable[[Doc, Path], None]) -> Callable[[Doc, Path], None]:
    def mutate(doc: Doc, job_dir: Path) -> None:
        (job_dir / name).write_text(text)
        then(doc, job_dir)

    return mutate


def _bad_lengths(doc: Doc, job_dir: Path) -> None:
    g = torch.Generator().manual_seed(0)
    save_file(
        {"inputs": torch.randn(10, 3, 8, 8, generator=g), "labels": torch.zeros(9, dtype=torch.int64)},
        str(job_dir / "uneven.safetensors"),
    )
    doc["data"]["path"] = "uneven.safetensors"


def _bad_weights(doc: Doc, job_dir: Path) -> None:
    save_file({"conv.weight": torch.zeros(3, 3, 3, 3)}, str(job_dir / "partial.safetensors"))
    doc["model"]["weights"] = "partial.safetensors"


def _bad_weight_shape(doc: Doc, job_dir: Path) -> None:
    state = {k: v.clone() for k, v in load_job(job_dir / "job.yaml").model.state_dict().items()}
    state["linear.bias"] = torch.zeros(5)
    save_file(state, str(job_dir / "wrong_shape.safetensors"))
    doc["model"]["weights"] = "wrong_shape.safetensors"


CASES: list[tuple[str, Callable[[Doc, Path], None], str]] = [
    ("name wrong type", _set("name", 123), "name: must be a string"),
    ("name empty", _set("name", ""), "name: must not be empty"),
    ("task unknown", _set("task", "fit"), "task: must be one of"),
    ("task missing", _drop("task"), "task: required key missing"),
    ("unknown top-level key", _set("epochs", 3), "epochs: unknown key"),
    ("model missing", _drop("model"), "model: required key missing"),
    ("model wrong type", _set("model", "model.py:build"), "model: must be a mapping"),
    ("model unknown key", _set("model.checkpoint", "x"), "model.checkpoint: unknown key"),
    ("entrypoint no colon", _set("model.entrypoint", "model.py"), "model.entrypoint: expected"),
    ("entrypoint file missing", _set("model.entrypoint", "nope.py:build"), "model.entrypoint: nope.py: file"),
    (
        "entrypoint attribute missing",
        _set("model.entrypoint", "model.py:make"),
        "model.entrypoint: model.py has",
    ),
    (
        "entrypoint module missing",
        _set("model.entrypoint", "no_such_pkg_xyz.models:build"),
        "model.entrypoint: 'no_such_pkg_xyz.models:build' names an importable module",
    ),
    (
        "entrypoint returns no Module",
        _write_file("bad.py", "def build(**kw):\n    return 3\n", _set("model.entrypoint", "bad.py:build")),
        "model.entrypoint: bad.py:build returned int, not a torch.nn.Module",
    ),
    (
        "entrypoint import fails",
        _write_file("broken.py", "raise RuntimeError('boom')\n", _set("model.entrypoint", "broken.py:build")),
        "model.entrypoint: broken.py: importing it raised RuntimeError: boom",
    ),
    (
        "entrypoint build raises",
        _write_file(
            "raises.py",
            "def build(**kw):\n    raise ValueError('no')\n",
            _set("model.entrypoint", "raises.py:build"),
        ),
        "model.entrypoint: raises.py:build raised ValueError: no",
    ),
    (
        "model kwargs unknown",
        _set("model.kwargs", {"colour": "red"}),
        "model.kwargs: model.py:build does not",
    ),
    ("model kwargs wrong type", _set("model.kwargs", [1, 2]), "model.kwargs: must be a mapping"),
    (
        "weights file missing",
        _set("model.weights", "init.safetensors"),
        "model.weights: init.safetensors: file",
    ),
    ("weights keys mismatch", _bad_weights, "model.weights: partial.safetensors: does not match the model"),
    (
        "weights shape mismatch",
        _bad_weight_shape,
        "model.weights: wrong_shape.safetensors: 'linear.bias' has shape (5,), the model expects (4,)",
    ),
    ("loss unknown", _set("loss.name", "focal_loss"), "loss.name: unknown or unsupported loss 'focal_loss'"),
    ("loss not a function", _set("loss.name", "relu"), "loss.name: unknown or unsupported loss"),
    ("loss unknown key", _set("loss.weight", 1.0), "loss.weight: unknown key"),
    (
        "loss kwarg unknown",
        _set("loss.kwargs", {"smoothing": 0.1}),
        "loss.kwargs: smoothing: cross_entropy()",
    ),
    ("loss reduction none", _set("loss.kwargs", {"reduction": "none"}), "loss.kwargs: reduction: must be"),
    ("loss kwarg bad value", _set("loss.kwargs", {"label_smoothing": 3.0}), "loss.kwargs: cross_entropy()"),
    ("loss kwarg tensor-like", _set("loss.kwargs", {"weight": [1, 2, 3, 4]}), "loss.kwargs: weight: must be"),
    ("data missing", _drop("data"), "data: required key missing"),
    (
        "data path missing file",
        _set("data.path", "nope.safetensors"),
        "data.path: nope.safetensors: file not",
    ),
    ("data path not safetensors", _set("data.path", "model.py"), "data.path: model.py: not a readable"),
    ("data lengths differ", _bad_lengths, "data.path: uneven.safetensors: 'inputs' has 10 samples"),
    ("batch_size zero", _set("data.batch_size", 0), "data.batch_size: must be > 0"),
    ("batch_size text", _set("data.batch_size", "eight"), "data.batch_size: must be an integer"),
    ("batch_size float", _set("data.batch_size", 8.5), "data.batch_size: must be an integer"),
    ("batch_size missing", _drop("data.batch_size"), "data.batch_size: required key missing"),
    ("microbatches > batch", _set("data.microbatches", 17), "data.microbatches: must be <= data.batch_size"),
    ("microbatches zero", _set("data.microbatches", 0), "data.microbatches: must be > 0"),
    ("block_size for tensors", _set("data.block_size", 8), "data.block_size: only allowed for text data"),
    ("data shuffle unsupported", _set("data.shuffle", True), "data.shuffle: unknown key"),
    ("optimizer missing for train", _drop("optimizer"), "optimizer: required when task is train"),
    (
        "optimizer unknown",
        _set("optimizer.name", "lbfgs"),
        "optimizer.name: unknown or unsupported optimizer",
    ),
    ("optimizer lr negative", _set("optimizer.lr", -0.1), "optimizer.lr: must be > 0"),
    ("optimizer lr text", _set("optimizer.lr", "fast"), "optimizer.lr: must be a number"),
    ("optimizer lr missing", _drop("optimizer.lr"), "optimizer.lr: required key missing"),
    (
        "optimizer kwarg unknown",
        _set("optimizer.kwargs", {"momentom": 0.9}),
        "optimizer.kwargs: Adam refuses",
    ),
    ("optimizer kwarg bad value", _set("optimizer.kwargs", {"betas": [2.0, 0.9]}), "optimizer.kwargs: Adam"),
    ("optimizer kwarg reserved", _set("optimizer.kwargs", {"foreach": True}), "optimizer.kwargs: 'foreach'"),
    (
        "per_op unknown optimizer",
        _set("optimizer.per_op", {"conv.*": {"name": "lbfgs"}}),
        "optimizer.per_op.conv.*.name",
    ),
    (
        "per_op bad kwarg",
        _set("optimizer.per_op", {"conv.*": {"name": "sgd", "kwargs": {"nesterov": True}}}),
        "optimizer.per_op.conv.*.kwargs: SGD refuses",
    ),
    (
        "per_op unknown key",
        _set("optimizer.per_op", {"conv.*": {"momentum": 0.9}}),
        "optimizer.per_op.conv.*.momentum",
    ),
    (
        "per_op bad lr",
        _set("optimizer.per_op", {"conv.*": {"lr": 0}}),
        "optimizer.per_op.conv.*.lr: must be > 0",
    ),
    (
        "per_op matches nothing",
        _set("optimizer.per_op", {"encoder.*": {"lr": 0.1}}),
        "optimizer.per_op.encoder.*",
    ),
    ("steps zero", _set("steps", 0), "steps: must be > 0"),
    ("seed negative", _set("seed", -1), "seed: must be >= 0"),
    ("seed text", _set("seed", "abc"), "seed: must be an integer"),
    ("placement unknown key", _set("placement.nodes", 3), "placement.nodes: unknown key"),
    ("compnodes zero", _set("placement.compnodes", 0), "placement.compnodes: must be > 0"),
    ("compnodes bool", _set("placement.compnodes", True), "placement.compnodes: must be an integer"),
    (
        "cuts for other sub-DAGs",
        _set("placement.cuts", ["linear"]),
        "placement.cuts: 1 cut(s) make 2 sub-DAGs, but placement.compnodes asks for 3",
    ),
    ("cut empty name", _set("placement.cuts", [""]), "placement.cuts[0]: "),
    ("cuts not a list", _set("placement.cuts", "blocks.1"), "placement.cuts: "),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("label,mutate,expected", CASES, ids=[c[0] for c in CASES])
def test_each_mistake_names_its_key(
    label: str, mutate: Callable[[Doc, Path], None], expected: str, tmp_path: Path
):
    job_dir = _copy_example(tmp_path)
    doc = yaml.safe_load((job_dir / "job.yaml").read_text())
    mutate(doc, job_dir)
    (job_dir / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(JobError) as info:
        load_job(job_dir / "job.yaml")
    assert str(info.value).startswith(expected), f"{label}: {info.value}"
    assert "(also:" not in str(info.value), f"{label}: one problem, one message: {info.value}"


@pytest.mark.timeout(60)
def test_the_unmodified_copy_loads(tmp_path: Path) -> None:
    job = load_job(_copy_example(tmp_path) / "job.yaml")
    assert job.spec.name == "figure3" and job.inputs.shape[0] == job.labels.shape[0]


@pytest.mark.timeout(60)
def test_nothing_runs_when_validation_fails(tmp_path: Path) -> None:
    """The model file would leave a marker when imported; an invalid job must never import it."""
    job_dir = _copy_example(tmp_path)
    marker = job_dir / "imported.marker"
    (job_dir / "spy.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\nfrom model import build  # noqa\n"
    )
    doc = yaml.safe_load((job_dir / "job.yaml").read_text())
    doc["model"]["entrypoint"] = "spy.py:build"
    for breakage in (_bad_lengths, _set("data.microbatches", 99), _set("optimizer.kwargs", {"bogus": 1})):
        bad = yaml.safe_load(yaml.safe_dump(doc))
        breakage(bad, job_dir)
        (job_dir / "job.yaml").write_text(yaml.safe_dump(bad))
        with pytest.raises(JobError):
            load_job(job_dir / "job.yaml")
        assert not marker.exists()


def test_several_problems_are_one_error_listing_all(tmp_path: Path) -> None:
    job_dir = _copy_example(tmp_path)
    doc = yaml.safe_load((job_dir / "job.yaml").read_text())
    doc["steps"] = 0
    doc["placement"]["nodes"] = 2
    (job_dir / "job.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(JobError) as info:
        load_job_spec(job_dir / "job.yaml")
    message = str(info.value)
    assert message.startswith("steps: must be > 0") and "placement.nodes: unknown key" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntask: train\nmodel: {entrypoint: m.py:build\ndata: {}\n")
    with pytest.raises(JobError) as info:
        load_job_spec(path)
    assert str(info.value).startswith(f"{path}:") and "YAML syntax error" in str(info.value)
    line = int(str(info.value).split(":")[1])
    assert line in (3, 4, 5)


def test_duplicate_key_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntask: train\nsteps: 2\nsteps: 3\n")
    with pytest.raises(
        JobError, match=r"job\.yaml:4: YAML syntax error: duplicate key 'steps' \(first on line 3\)"
    ):
        load_job_spec(path)


def test_not_a_mapping_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(JobError, match="must be a YAML mapping"):
        load_job_spec(path)
    with pytest.raises(JobError, match="job file not found"):
        load_job_spec(tmp_path / "absent.yaml")


def test_exponent_floats_are_numbers(tmp_path: Path) -> None:
    """PyYAML alone reads ``1e-3`` as a string (YAML 1.1); job files read it as a float."""
    job_dir = _copy_example(tmp_path)
    text = (job_dir / "job.yaml").read_text().replace("lr: 0.01", "lr: 1e-3")
    text = text.replace("kwargs: {}\n  per_op", "kwargs: {eps: 1E-7}\n  per_op")
    (job_dir / "job.yaml").write_text(text)
    spec = load_job_spec(job_dir / "job.yaml")
    assert spec.optimizer is not None
    assert spec.optimizer.lr == pytest.approx(1e-3) and spec.optimizer.kwargs == {"eps": pytest.approx(1e-7)}
