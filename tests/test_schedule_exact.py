"""Every pipeline schedule (``placement.schedule``) equals plain PyTorch on N virtual compnodes.

Tolerance as in test_exactness.py (1e-5; SGD for trained weights). Schedules change the order in which
micro-batch gradients accumulate (GPipe: last micro-batch first; 1F1B and zero-bubble: first first),
so they agree with each other to rounding only; zero-bubble's split backward (I then W) accumulates
in 1F1B's order with the ops of a plain backward, so those two agree bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fusionnet.errors import JobError, PlanError
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.schedules import NAMES
from tests.dag_models import figure3_data, make_data
from tests.jobfiles import EXAMPLES, example_job, write_job

TOL = 1e-5
SGD = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


def _check(path: Path, pieces: int) -> None:
    job = load_job(path)
    ref = run_reference(load_job(path))
    got = run_local(job, pieces)
    assert got.plan["schedule"]["name"] == job.spec.placement.schedule
    assert _max_diff(got.weights, ref.weights) <= TOL
    losses = [row["loss"] for row in got.metrics]
    assert max(abs(a - b) for a, b in zip(losses, ref.losses, strict=True)) <= 1e-5
    if job.spec.task == "grad":
        assert got.grads is not None and ref.grads is not None
        assert _max_diff(got.grads, ref.grads) <= TOL


def _skip_job(tmp_path: Path, model_class: str, **kw: object) -> Path:
    x, y = (
        figure3_data(24)
        if model_class == "Figure3"
        else make_data("skip" if model_class == "SkipEverywhere" else "split", n=24)
    )
    kw.setdefault("batch_size", 12)
    return write_job(tmp_path / "job", model_class=model_class, inputs=x, labels=y, **kw)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", NAMES)
@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.parametrize("pieces", [2, 3, 4])
def test_examples_every_schedule(schedule: str, example: str, pieces: int, tmp_path: Path) -> None:
    task = "grad" if pieces != 3 else "train"
    over = {"task": task, "steps": 2, "microbatches": 4, "schedule": schedule}
    if task == "train":
        over["optimizer"] = SGD
    path = example_job(example, tmp_path, **over)
    try:
        _check(path, pieces)
    finally:
        path.unlink()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", NAMES)
@pytest.mark.parametrize("model_class", ["SkipEverywhere", "SplitMerge", "Figure3"])
@pytest.mark.parametrize("pieces", [2, 3, 4])
def test_skip_edges_every_schedule(schedule: str, model_class: str, pieces: int, tmp_path: Path) -> None:
    path = _skip_job(tmp_path, model_class, microbatches=4, steps=2, optimizer=SGD, schedule=schedule)
    _check(path, pieces)


def _grads(path: Path, pieces: int) -> dict[str, torch.Tensor]:
    got = run_local(load_job(path), pieces)
    assert got.grads is not None
    return got.grads


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_class", ["SkipEverywhere", "SplitMerge", "Figure3", "mlp", "gpt"])
@pytest.mark.parametrize("pieces", [3, 4])
def test_split_backward_is_bit_exact(model_class: str, pieces: int, tmp_path: Path) -> None:
    """Zero-bubble's I + W gives exactly 1F1B's gradients (same accumulation order, same ops)."""
    got = {}
    for schedule in ("1f1b", "zero-bubble"):
        if model_class in EXAMPLES:
            path = example_job(model_class, tmp_path, task="grad", steps=1, microbatches=4, schedule=schedule)
            try:
                got[schedule] = _grads(path, pieces)
            finally:
                path.unlink()
        else:
            path = _skip_job(
                tmp_path / schedule, model_class, task="grad", microbatches=4, steps=1, schedule=schedule
            )
            got[schedule] = _grads(path, pieces)
    assert list(got["1f1b"]) == list(got["zero-bubble"])
    for k, v in got["1f1b"].items():
        assert torch.equal(v, got["zero-bubble"][k]), k


@pytest.mark.timeout(300)
def test_auto_and_plan_json(tmp_path: Path) -> None:
    path = _skip_job(tmp_path, "SplitMerge", microbatches=4, steps=1, schedule="auto")
    got = run_local(load_job(path), 3, tmp_path / "out")
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert doc["schedule"]["name"] == "1f1b" and doc["schedule"]["why"].startswith("auto")
    assert got.plan["schedule"] == doc["schedule"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", EXAMPLES)
@pytest.mark.parametrize(("compnodes", "chunks"), [(2, 2), (2, 3), (3, 2)])
def test_interleaved_examples_exact(example: str, compnodes: int, chunks: int, tmp_path: Path) -> None:
    """Interleaved 1F1B: ``compnodes`` virtual compnodes each running ``chunks`` sub-DAGs in one loop."""
    task = "train" if compnodes == 2 else "grad"
    over = {"task": task, "steps": 2, "microbatches": 2 * compnodes, "schedule": "interleaved-1f1b"}
    over["compnodes"] = compnodes
    over["chunks"] = chunks
    if task == "train":
        over["optimizer"] = SGD
    path = example_job(example, tmp_path, **over)
    try:
        job = load_job(path)
        got = run_local(job, compnodes)
        assert len(got.plan["subdags"]) == compnodes * chunks
        _check(path, compnodes)
    finally:
        path.unlink()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_class", ["SkipEverywhere", "SplitMerge", "Figure3"])
@pytest.mark.parametrize("compnodes", [2, 4])
def test_interleaved_skip_edges_exact(model_class: str, compnodes: int, tmp_path: Path) -> None:
    """Skip edges across any cut, also from a compnode's chunk to its own later chunk."""
    path = _skip_job(
        tmp_path,
        model_class,
        microbatches=compnodes,
        steps=2,
        optimizer=SGD,
        schedule="interleaved-1f1b",
        batch_size=12 if compnodes == 2 else 8,
    )
    _check(path, compnodes)


@pytest.mark.timeout(300)
def test_interleaved_infer_exact(tmp_path: Path) -> None:
    path = example_job("mlp", tmp_path, task="infer", microbatches=2, schedule="interleaved-1f1b", chunks=2)
    try:
        got = run_local(load_job(path), 2)
        ref = run_reference(load_job(path))
        assert got.outputs is not None and ref.outputs is not None
        assert got.outputs.shape == ref.outputs.shape
        assert (got.outputs - ref.outputs).abs().max().item() <= TOL
    finally:
        path.unlink()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("microbatches", "batch_size"), [(3, 10), (4, 7)])
def test_interleaved_infer_runs_any_microbatch_count(
    microbatches: int, batch_size: int, tmp_path: Path
) -> None:
    """Forwards alone run any count on 2 compnodes: 3 per batch, or 4 and a last batch of 3 samples
    (24 = 3 x 7 + 3), which used to stop the run at that batch, after the others had run."""
    path = _skip_job(
        tmp_path, "SkipEverywhere", task="infer", microbatches=microbatches, batch_size=batch_size,
        schedule="interleaved-1f1b",
    )  # fmt: skip
    got = run_local(load_job(path), 2)
    ref = run_reference(load_job(path))
    assert got.outputs is not None and ref.outputs is not None and got.outputs.shape[0] == 24
    assert (got.outputs - ref.outputs).abs().max().item() <= TOL


def test_interleaved_is_refused_clearly(tmp_path: Path) -> None:
    """Bad settings name the key; deployments refuse it before tracing, saying why; a micro-batch count
    the compnodes do not divide is refused at load (``plan`` and ``run`` alike), and ``run --local N``
    checks it against its N; ``auto`` micro-batches take a multiple of the compnodes, or say there is
    none."""
    from fusionnet.runtime.microbatch_sizes import traced_count, with_compnodes
    from fusionnet.runtime.submit import submission_payload

    path = _skip_job(tmp_path / "a", "SplitMerge", schedule="interleaved-1f1b", microbatches=3)
    with pytest.raises(JobError, match=r"^data.microbatches: .*multiple of placement.compnodes \(2\).*got 3"):
        load_job(path)  # at load, so plan and run refuse it alike, before tracing
    path = _skip_job(tmp_path / "d", "SplitMerge", schedule="interleaved-1f1b", microbatches=4)
    with pytest.raises(JobError, match=r"a deployment runs forwards only.*interleaved-1f1b"):
        submission_payload(load_job(path), deployment=True)
    with pytest.raises(PlanError, match=r"multiple of the devices \(3\)"):  # --local 3 overrides compnodes
        run_local(load_job(path), 3)
    with pytest.raises(
        JobError, match=r"^data.microbatches: .*placement.compnodes \(3\).*got 4 \(--local 3\)"
    ):
        with_compnodes(load_job(path), 3)  # what ``fusionnet run --local 3`` does first
    auto = _skip_job(
        tmp_path / "f", "SplitMerge", schedule="interleaved-1f1b", microbatches="auto", batch_size=15
    )
    assert traced_count(with_compnodes(load_job(auto), 3).spec) == 3  # not 5, a count it cannot train on
    prime = _skip_job(
        tmp_path / "g", "SplitMerge", schedule="interleaved-1f1b", microbatches="auto", batch_size=7
    )
    with pytest.raises(JobError, match=r"^data.microbatches: auto finds no divisor of data.batch_size \(7\)"):
        traced_count(with_compnodes(load_job(prime), 3).spec)
    path = _skip_job(tmp_path / "b", "SplitMerge", schedule="1f1b", chunks=2)
    with pytest.raises(JobError, match=r"placement.chunks.*only schedule interleaved-1f1b"):
        load_job(path)
    path = _skip_job(tmp_path / "c", "SplitMerge", schedule="interleaved-1f1b", chunks=1)
    with pytest.raises(JobError, match=r"placement.chunks.*>= 2 chunks"):
        load_job(path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["gpt", "mlp"])
def test_auto_micro_batches_run_the_count_chosen_exactly(example: str, tmp_path: Path) -> None:
    """``data.microbatches: auto`` with ``placement.schedule: auto``: on a device without fixed costs
    (pure eq. (1)) the bubble decides, so the performance model takes the most micro-batches the batch
    divides into, not the count the job was traced with; every step runs that count, exactly."""
    from fusionnet.job.batches import microbatch_candidates
    from fusionnet.runtime.microbatch_sizes import traced_count
    from tests.planning_support import device

    path = example_job(example, tmp_path, microbatches="auto", schedule="auto", steps=2)
    try:
        job = load_job(path)
        pieces = job.spec.placement.compnodes
        got = run_local(job, pieces, tmp_path / "out", device=device(flops=1e9))
        ref = run_reference(load_job(path))
    finally:
        path.unlink()
    chosen = got.plan["schedule"]["microbatches"]
    assert chosen == max(microbatch_candidates(job.spec.data.batch_size, pieces))
    assert chosen != traced_count(job.spec)
    assert [row["microbatches"] for row in got.metrics] == [chosen] * 2
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["schedule"]["microbatches"] == chosen
    assert _max_diff(got.weights, ref.weights) <= TOL
    losses = [row["loss"] for row in got.metrics]
    assert max(abs(a - b) for a, b in zip(losses, ref.losses, strict=True)) <= 1e-5
