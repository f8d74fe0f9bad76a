"""Which micro-batch sizes a job runs (``prepare.microbatch_sizes``), and that a graph that runs every one
of them is accepted: a symbolic trace (the bundled MLP) keeps the batch dimension free, so an uneven split
and a short last infer batch run and equal plain PyTorch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fusionnet.errors import PlanError
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.runtime.microbatch_sizes import microbatch_sizes
from tests.jobfiles import example_job


def _job(task: str, batch_size: int, microbatches: int, samples: int) -> SimpleNamespace:
    data = SimpleNamespace(batch_size=batch_size, microbatches=microbatches)
    spec = SimpleNamespace(task=task, data=data, placement=SimpleNamespace(compnodes=2))
    return SimpleNamespace(spec=spec, n_samples=samples)


@pytest.mark.parametrize(
    "task,b,m,n,want",
    [
        ("train", 8, 2, 100, {4}),
        ("train", 5, 2, 100, {3, 2}),
        ("grad", 7, 3, 3, {3, 2}),  # batches wrap around a dataset smaller than a batch
        ("infer", 6, 2, 12, {3}),
        ("infer", 5, 1, 12, {5, 2}),  # 5, 5 and the last 2
        ("infer", 5, 2, 11, {3, 2, 1}),  # 3+2, 3+2, then 1 sample in 1 micro-batch
        ("infer", 8, 4, 3, {1}),  # the only batch holds 3 samples: 3 micro-batches of 1
    ],
)
def test_every_size_a_job_runs(task: str, b: int, m: int, n: int, want: set[int]) -> None:
    sizes = microbatch_sizes(_job(task, b, m, n))  # type: ignore[arg-type]
    assert set(sizes) == want
    if task == "infer" and n % b and n > b:
        assert any("the last batch" in why for why in sizes.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("task", ["train", "infer"])
def test_a_symbolic_graph_runs_uneven_micro_batches_exactly(task: str, tmp_path: Path) -> None:
    path = example_job("mlp", tmp_path, task=task, batch_size=7, microbatches=3, steps=2)
    try:
        ref, got = run_reference(load_job(path)), run_local(load_job(path), 2)
        if task == "infer":
            assert ref.outputs is not None and got.outputs is not None
            assert (got.outputs - ref.outputs).abs().max().item() <= 1e-5
        else:
            assert max((got.weights[k] - ref.weights[k]).abs().max().item() for k in ref.weights) <= 1e-5
            assert torch.isfinite(torch.tensor([r["loss"] for r in got.metrics])).all()
    finally:
        path.unlink()


# ---- data.microbatches: auto, priced by the performance model (pure: a traced graph and device specs) ----
BATCH = 32


@pytest.fixture(scope="module")
def two_stages() -> tuple[Any, Any]:
    """A 4-block MLP traced on a micro-batch of 8 samples (32 in 4), cut in two balanced halves."""
    from torch import nn

    from fusionnet.dag.partition import balanced_assignment, build_partition
    from fusionnet.dag.trace import trace_model

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.Sequential(*layers)
    x, y = torch.randn(BATCH // 4, 256), torch.randint(0, 256, (BATCH // 4,))
    traced = trace_model(model, x, y, torch.nn.functional.cross_entropy, "train")
    return traced.graph, build_partition(traced.graph, balanced_assignment(traced.graph, 2))


def _choose(two_stages: tuple[Any, Any], dev: Any, schedule: str = "auto") -> Any:
    from fusionnet.job.batches import microbatch_candidates
    from fusionnet.planning.pipeline_schedule import choose_schedule

    graph, partition = two_stages
    return choose_schedule(
        schedule,
        graph,
        partition,
        microbatches=4,
        devices=[dev],
        batch_size=BATCH,
        optimizer="sgd",
        microbatch_choices=microbatch_candidates(BATCH, 2),
    )


def test_auto_takes_more_micro_batches_where_compute_dominates(two_stages: tuple[Any, Any]) -> None:
    """Without fixed costs (pure eq. (1)) a step is compute over the pipeline's fill: the bubble, (p - 1)
    micro-batches of p + m - 1, shrinks with m, so the most micro-batches win: 8 of 1, 2, 4, 8."""
    from tests.planning_support import device

    choice = _choose(two_stages, device(flops=1e9))
    assert sorted(choice.by_microbatches) == [1, 2, 4, 8]
    assert choice.microbatches == 8
    times = [choice.by_microbatches[m] for m in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)  # each doubling shortens the predicted step
    assert choice.to_dict()["microbatches"] == 8


def test_auto_takes_fewer_micro_batches_where_fixed_costs_per_micro_batch_dominate(
    two_stages: tuple[Any, Any],
) -> None:
    """A sub-DAG call that costs 50 ms per micro-batch, against microseconds of arithmetic: every extra
    micro-batch costs more than the bubble it saves, so one micro-batch wins."""
    from fusionnet.perfmodel.types import Overheads
    from tests.planning_support import device

    slow_calls = Overheads(stage_fp=0.05, stage_bp=0.05)
    choice = _choose(two_stages, device(flops=1e12, overheads=slow_calls))
    assert choice.microbatches == 1
    assert choice.by_microbatches[1] < choice.by_microbatches[8]


def test_auto_keeps_within_memory(two_stages: tuple[Any, Any]) -> None:
    """Fixed costs that favour few micro-batches, and a memory that cannot hold the activations of the
    whole batch under 1F1B: the count chosen is the smallest whose live micro-batches fit, not 1."""
    from fusionnet.perfmodel.types import Overheads
    from tests.planning_support import device

    slow_calls = Overheads(stage_fp=0.05, stage_bp=0.05)
    roomy = _choose(two_stages, device(flops=1e12, overheads=slow_calls), "1f1b")
    assert roomy.microbatches == 1
    for memory in range(1 << 20, 1 << 28, 1 << 16):  # the smallest memory that fits any count
        try:
            tight = _choose(two_stages, device(flops=1e12, memory=memory, overheads=slow_calls), "1f1b")
        except PlanError:
            continue
        break
    else:
        pytest.fail("no memory up to 256 MiB fits the job")
    assert tight.microbatches is not None and tight.microbatches > 1
    assert set(tight.by_microbatches) < {1, 2, 4, 8}  # counts that do not fit are not offered


def test_an_infer_output_without_a_row_per_sample_needs_whole_batches(tmp_path: Path) -> None:
    """A batch's mean cut into micro-batches would come back as one mean per micro-batch (the results
    said [m] where plain PyTorch says one value per batch): refused naming the output and the key; with
    whole batches it runs and equals plain PyTorch, output by output."""
    from fusionnet.errors import JobError
    from fusionnet.runtime.prepare import trace_job
    from tests.jobfiles import write_job

    torch.manual_seed(0)
    inputs = torch.randn(12, 8)
    split = write_job(tmp_path / "split", model_class="WithBatchMean", inputs=inputs, labels=None,
                      task="infer", microbatches=2, batch_size=4, loss=False)  # fmt: skip
    with pytest.raises(JobError, match=r"^data.microbatches: the model's output outputs.1 \(shape \[\]"):
        trace_job(load_job(split))
    whole = write_job(tmp_path / "whole", model_class="WithBatchMean", inputs=inputs, labels=None,
                      task="infer", microbatches=1, batch_size=4, loss=False)  # fmt: skip
    job = load_job(whole)
    ref, got = run_reference(job), run_local(load_job(whole), 2)
    assert got.outputs is not None and ref.outputs is not None
    assert (got.outputs - ref.outputs).abs().max().item() <= 1e-6
    assert got.more_outputs["outputs.1"].shape == ref.more_outputs["outputs.1"].shape == (3,)
    assert (got.more_outputs["outputs.1"] - ref.more_outputs["outputs.1"]).abs().max().item() <= 1e-6
