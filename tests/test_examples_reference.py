"""The bundled examples: they load, learn under the plain-PyTorch reference, trace with both front ends,
keep their data small and regenerable, and have the shapes the brief and the paper ask for."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.fx as fx
from safetensors.torch import load_file

from fusionnet.job.loader import LoadedJob, load_job
from fusionnet.reference import run_reference

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = ("mlp", "figure3", "gpt")


class _NoLeaves(fx.Tracer):
    """Traces through every module, as FusionNet's front end does."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return False


def _load(name: str) -> LoadedJob:
    return load_job(EXAMPLES_DIR / name / "job.yaml")


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", EXAMPLES)
def test_reference_loss_decreases(name: str) -> None:
    job = _load(name)
    losses = run_reference(job).losses
    assert len(losses) == job.spec.steps and all(torch.isfinite(torch.tensor(losses)))
    head, tail = losses[:3], losses[-3:]
    assert sum(tail) / 3 < 0.85 * sum(head) / 3, losses
    assert min(losses[-3:]) < losses[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", EXAMPLES)
def test_traceable_by_fx_without_leaves_and_by_export(name: str) -> None:
    job = _load(name)
    model = job.model.train()
    x, y = job.inputs[:4], job.labels[:4]
    args = (x,) if job.loss_fn is not None else (x, y)
    graph = _NoLeaves().trace(model)
    assert not any(n.op == "call_module" for n in graph.nodes)  # every layer became functional ops
    traced = fx.GraphModule(model, graph)
    assert torch.equal(traced(*args), model(*args))
    exported = torch.export.export(model, args, strict=False)
    assert torch.equal(exported.module()(*args), model(*args))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_files_are_small(name: str) -> None:
    folder = EXAMPLES_DIR / name
    for required in ("job.yaml", "model.py", "make_data.py"):
        assert (folder / required).is_file()
    for path in folder.iterdir():
        if path.is_file():
            assert path.stat().st_size < 200_000, path


@pytest.mark.parametrize("name", ["mlp", "figure3"])
def test_make_data_regenerates_the_committed_data(name: str) -> None:
    made = _import(EXAMPLES_DIR / name / "make_data.py").make()
    committed = load_file(str(EXAMPLES_DIR / name / "data.safetensors"))
    assert sorted(made) == sorted(committed) == ["inputs", "labels"]
    for key in made:
        assert made[key].dtype == committed[key].dtype and torch.equal(made[key], committed[key])


def test_gpt_vocab_size_matches_the_corpus() -> None:
    job = _load("gpt")
    corpus = (EXAMPLES_DIR / "gpt" / "corpus.txt").read_text(encoding="utf-8")
    assert job.vocab == sorted(set(corpus))
    assert job.spec.model.kwargs["vocab_size"] == len(job.vocab)
    assert job.model.wte.weight.shape[0] == len(job.vocab)
    assert int(job.inputs.max()) < len(job.vocab) and int(job.labels.max()) < len(job.vocab)
    assert _import(EXAMPLES_DIR / "gpt" / "make_data.py").main(["--check"]) == 0
    assert 2_000 <= len(corpus.encode()) <= 20_000


def test_gpt_structure() -> None:
    job = _load("gpt")
    spec, model = job.spec, job.model
    assert spec.loss is None and spec.data.block_size == 32 and spec.model.kwargs["block_size"] == 32
    assert (spec.data.batch_size, spec.data.microbatches, spec.steps, spec.placement.compnodes) == (
        8,
        2,
        10,
        3,
    )
    assert len(model.blocks) == 2 and model.wte.weight.shape[1] == 64 and model.blocks[0].attn.n_head == 4
    assert "blocks.0.attn.causal_mask" in dict(model.named_buffers())
    # Tied embeddings: the head has no weight of its own, and the input embedding gets gradient from both.
    assert not any("head" in n for n, _ in model.named_parameters())
    graph = _NoLeaves().trace(model)
    uses = [n for n in graph.nodes if n.op == "get_attr" and n.target == "wte.weight"]
    assert len(uses) == 1 and len(uses[0].users) == 2
    assert {"softmax", "masked_fill"} <= {getattr(n.target, "__name__", n.target) for n in graph.nodes}
    # Causality: changing a later token never changes an earlier position's logits.
    x = job.inputs[:2].clone()
    with torch.no_grad():
        before = model(x)
        x[:, 20] = (x[:, 20] + 1) % len(job.vocab)
        after = model(x)
    assert torch.equal(before[:, :20], after[:, :20]) and not torch.equal(before[:, 20:], after[:, 20:])


def test_figure3_is_the_papers_dag() -> None:
    """Table 2: Input -> {Conv, Add}; Conv -> Add; Add -> {Pool, Multiply}; Tensor A -> Multiply;
    Concat(Multiply, Pool) -> Linear -> CrossEntropy(Label)."""
    job = _load("figure3")
    spec, model = job.spec, job.model
    assert isinstance(model.A, torch.nn.Parameter) and "A" in dict(model.named_parameters())
    assert (spec.data.batch_size, spec.data.microbatches, spec.placement.compnodes) == (16, 2, 3)
    assert spec.optimizer is not None and spec.optimizer.name == "adam" and spec.loss.name == "cross_entropy"
    graph = _NoLeaves().trace(model)
    x = next(n for n in graph.nodes if n.op == "placeholder")
    conv = next(n for n in graph.nodes if n.target is torch.conv2d)
    add = next(n for n in graph.nodes if getattr(n.target, "__name__", "") == "add" and x in n.args)
    assert set(x.users) == {conv, add} and conv in add.args
    a = next(n for n in graph.nodes if n.op == "get_attr" and n.target == "A")
    (mul,) = a.users
    assert add in mul.args
    pool = next(n for n in graph.nodes if n.target is torch.nn.functional.max_pool2d)
    assert set(add.users) == {pool, mul}
    (cat,) = [n for n in graph.nodes if n.target is torch.cat]
    assert list(cat.args[0]) == [mul, pool]  # Table 2's argument order for Concat
    n_samples, shape = job.inputs.shape[0], tuple(job.inputs.shape[1:])
    assert (
        64 <= n_samples <= 256 and shape == (3, 8, 8) and sorted(job.labels.unique().tolist()) == [0, 1, 2, 3]
    )


def test_mlp_is_what_the_brief_asks() -> None:
    job = _load("mlp")
    spec = job.spec
    assert job.inputs.shape == (256, 16) and sorted(job.labels.unique().tolist()) == [0, 1, 2, 3]
    assert (spec.data.batch_size, spec.data.microbatches, spec.steps, spec.placement.compnodes) == (
        32,
        2,
        20,
        2,
    )
    assert (
        spec.optimizer is not None and spec.optimizer.name == "sgd" and spec.optimizer.kwargs["momentum"] > 0
    )
    assert sum(isinstance(m, torch.nn.Linear) for m in job.model.modules()) == 3
