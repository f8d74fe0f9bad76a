"""The pieces ``benchmarks/pipeline_vs_torch.py --model gpt2`` compares with: torch's pipeline stages of a
transformers GPT-2 must compute what the whole model computes, and FusionNet's plan must be mirrored only
where torch's stages can hold the same cut."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from pipeline_common import split_from_plan  # noqa: E402
from pipeline_model import GPT2Stage, build_gpt2, causal_lm_loss  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_gpt2_stages_compute_the_whole_models_loss_and_gradients() -> None:
    torch.manual_seed(0)
    model = build_gpt2(vocab=300, dim=32, hidden=64, layers=4, heads=4, seq=12)
    ids = torch.randint(0, 300, (3, 12), generator=torch.Generator().manual_seed(1))
    whole = model(ids, ids)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    stages = [GPT2Stage(model, a, b) for a, b in ((0, 0), (1, 2), (3, 3))]
    held = [{id(p) for p in s.parameters()} for s in stages]
    assert sum(len(h) for h in held) == len(list(model.parameters()))  # each parameter on one stage
    x = ids
    for stage in stages:
        x = stage(x)
    staged = causal_lm_loss(x, ids)
    staged.backward()
    torch.testing.assert_close(staged, whole, rtol=0, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _plan(*params: list[str]) -> dict:
    return {"subdags": [{"subdag": i, "nodes": [], "params": p} for i, p in enumerate(params)]}


def _block(k: int) -> list[str]:
    return [f"lm.transformer.h.{k}.attn.c_attn.weight", f"lm.transformer.h.{k}.mlp.c_fc.weight"]


EMBED = ["lm.transformer.wte.weight", "lm.transformer.wpe.weight"]
HEAD = ["lm.transformer.ln_f.weight", "lm.lm_head.weight"]


def test_gpt2_plans_are_mirrored_only_where_torchs_stages_can_hold_the_cut() -> None:
    plan = _plan(EMBED + _block(0) + _block(1), _block(2) + _block(3) + HEAD)
    assert split_from_plan(plan, 4, "gpt2") == [(0, 1), (2, 3)]

    inside = _plan(EMBED + _block(0) + _block(1)[:1], _block(1)[1:] + _block(2) + _block(3) + HEAD)
    with pytest.raises(ValueError, match="block 1 is cut"):
        split_from_plan(inside, 4, "gpt2")

    head_apart = _plan(EMBED + _block(0) + _block(1), _block(2) + _block(3), HEAD)
    with pytest.raises(ValueError, match="head"):
        split_from_plan(head_apart, 4, "gpt2")


def test_a_gpt2_cut_inside_a_block_moves_to_the_side_that_holds_its_mlp() -> None:
    attn_of_1 = ["lm.transformer.h.1.attn.c_attn.weight"]
    mlp_of_1 = ["lm.transformer.h.1.mlp.c_fc.weight"]
    plan = _plan(EMBED + _block(0) + attn_of_1, mlp_of_1 + _block(2) + _block(3) + HEAD)
    assert split_from_plan(plan, 4, "gpt2", round_cuts=True) == [(0, 0), (1, 3)]
    plan = _plan(EMBED + _block(0) + attn_of_1 + mlp_of_1, _block(2) + _block(3) + HEAD)
    assert split_from_plan(plan, 4, "gpt2", round_cuts=True) == [(0, 1), (2, 3)]


@pytest.mark.parametrize(("world", "microbatches"), [(2, 4), (3, 4), (3, 6)])
def test_torch_runs_fusionnets_zero_bubble_programs_action_for_action(world: int, microbatches: int) -> None:
    """``--schedule zero-bubble``: torch's runtime gets FusionNet's ZB-H1 programs, F, I and W of every
    micro-batch in the same order on each rank, and lowers them to sends and receives without a cycle."""
    from pipeline_torch import zero_bubble_actions
    from torch.distributed.pipelining.schedules import _add_send_recv

    from fusionnet.schedules import zero_bubble_h1

    actions = zero_bubble_actions(world, microbatches)
    programs = zero_bubble_h1(world, microbatches).programs
    for rank, program in enumerate(programs):
        ours = [f"{a.kind}{a.mb}" for a in program if a.kind != "U"]
        assert [str(a) for a in actions[rank]] == [f"{rank}{x}" for x in ours]
        assert {str(a)[1:] for a in actions[rank]} == {f"{k}{m}" for k in "FIW" for m in range(microbatches)}
    lowered = _add_send_recv(actions, stage_to_rank=lambda s: s, num_stages=world)
    sends = [str(a) for a in lowered[0] if "SEND" in str(a)]
    assert sends == [f"0SEND_F{m}" for m in range(microbatches)]  # each forward output leaves once


def test_schedules_side_by_side_are_each_over_the_first() -> None:
    """``--schedule 1f1b zero-bubble``: each schedule's FusionNet step over the first one's, per stage
    count, from the summaries of the same rounds; a failed contender gives no ratio, not a wrong one."""
    from pipeline_vs_torch import side_by_side

    summaries = {
        "1f1b": {"fusionnet_2_ms": 400.0, "torchpipe_2_ms": 500.0, "fusionnet_2_bubble": 0.27,
                 "fusionnet_2_beyond_path": 0.012, "fusionnet_3_ms": 450.0},
        "zero-bubble": {"fusionnet_2_ms": 360.0, "torchpipe_2_ms": 480.0, "fusionnet_2_bubble": 0.18,
                        "fusionnet_3_ms": None},
    }  # fmt: skip
    figures = side_by_side(summaries, [2, 3])
    assert figures["fusionnet_2_zero_bubble_over_1f1b"] == 0.9
    assert figures["fusionnet_3_zero_bubble_over_1f1b"] is None
    assert figures["fusionnet_2_1f1b_ms"] == 400.0 and figures["torchpipe_2_zero_bubble_ms"] == 480.0
    assert figures["fusionnet_2_zero_bubble_bubble"] == 0.18
    assert (
        figures["fusionnet_2_1f1b_beyond_path"] == 0.012
        and figures["fusionnet_2_zero_bubble_beyond_path"] is None
    )
    assert "fusionnet_2_1f1b_over_1f1b" not in figures
    assert figures["fusionnet_2_zero_bubble_over_1f1b_rounds_median"] is None  # no rounds kept: none paired


def test_schedules_side_by_side_pair_their_rounds() -> None:
    """Each round's zero-bubble step over the same round's 1F1B step, then their median; a round one of
    them did not time pairs with nothing."""
    from pipeline_vs_torch import side_by_side

    summaries = {
        "1f1b": {"fusionnet_2_ms": 500.0, "fusionnet_2_round_ms": [400.0, 600.0, 500.0, 450.0]},
        "zero-bubble": {"fusionnet_2_ms": 480.0, "fusionnet_2_round_ms": [360.0, 570.0, 475.0, None]},
    }
    figures = side_by_side(summaries, [2])
    assert figures["fusionnet_2_zero_bubble_over_1f1b"] == 0.96
    assert figures["fusionnet_2_zero_bubble_over_1f1b_rounds_median"] == 0.95  # of 0.90, 0.95, 0.95


def test_metrics_rows_give_each_step_its_bubble_and_what_lies_beyond_its_compute_path(tmp_path: Path) -> None:
    """A swarm's metrics.jsonl, out of step order: per step the stages' idle share (from
    ``compute_seconds``) and the share beyond the schedule run on that compute (``compute_path_seconds``)."""
    from pipeline_common import Result
    from pipeline_fusionnet import read_metrics

    rows = [
        {"step": 1, "seconds": 0.5, "loss": 2.0, "compute_seconds": [0.3, 0.4], "compute_path_seconds": 0.45},
        {"step": 0, "seconds": 0.8, "loss": 3.0, "compute_seconds": [0.4, 0.4], "compute_path_seconds": 0.8,
         "activation_peak_bytes": [10, 5]},
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = Result("fusionnet 2")
    read_metrics(res, path)
    assert res.times == [0.8, 0.5] and res.losses == [3.0, 2.0]
    assert res.bubbles == pytest.approx([0.5, 0.3])
    assert res.beyond_path == pytest.approx([0.0, 0.1])
    assert res.beyond(0) == pytest.approx(0.05) and res.beyond(1) == pytest.approx(0.1)


@pytest.mark.parametrize("model", ["mlp", "gpt2"])
@pytest.mark.parametrize("pieces", [2, 3])
def test_placement_blocks_cuts_fusionnet_where_torch_cuts(model: str, pieces: int, tmp_path: Path) -> None:
    """``--placement blocks``: the FusionNet job names its cuts at the balanced block split, and its plan
    is mirrored by torch's stages as it is, no cut moved."""
    from pipeline_common import Config, balanced_split, make_data
    from pipeline_fusionnet import write_job

    from fusionnet.job.loader import load_job
    from fusionnet.results.files import plan_document
    from fusionnet.runtime.prepare import prepare_job

    cfg = Config(
        dim=32, hidden=64, layers=6, batch_size=4, microbatches=2, steps=1, warmup=0, lr=0.1, seed=0,
        threads=1, data_path=str(tmp_path / "data.safetensors"), placement="blocks", model=model,
        vocab=300, seq=12, heads=4,
    )  # fmt: skip
    make_data(cfg, 8)
    job = load_job(write_job(tmp_path, cfg, pieces))
    assert len(job.spec.placement.cuts or ()) == pieces - 1
    plan = plan_document(prepare_job(job).partition)
    assert split_from_plan(plan, cfg.layers, model) == balanced_split(cfg.layers, pieces)


def test_paired_ratios_hold_each_round_against_the_same_round() -> None:
    from paired_ratio import fmt_interval, fmt_rounds, ratio_interval, round_ratios

    ours = [[1.0, 2.0, 3.0], [2.0, 2.0, 2.0], []]
    theirs = [[2.0, 2.0, 2.0], [4.0, 4.0, 4.0], [1.0]]
    assert round_ratios(ours, theirs) == [1.0, 0.5]  # a round one side did not time is left out
    assert fmt_rounds(round_ratios(ours, theirs)) == "1.00/0.50"
    assert ratio_interval([[]], theirs) is None and fmt_interval(None) == ""


def test_the_median_of_rounds_stays_with_the_rounds_where_pooling_drifts() -> None:
    """The machine slows down between two rounds for both sides alike: each round reads below par, and so
    does the median of the rounds; the pooled steps form two clusters, each side's pooled median is read
    at the clusters' edges (one stray step each), and their ratio is far above par."""
    import statistics

    from paired_ratio import median_of_rounds, round_ratios

    ours = [[0.66] * 8 + [0.76], [0.80] + [0.82] * 8]
    theirs = [[0.684] * 9, [0.70] + [0.833] * 8]
    rounds = round_ratios(ours, theirs)
    assert all(0.96 <= r <= 0.99 for r in rounds)
    assert median_of_rounds(rounds) == statistics.median(rounds)
    pooled = statistics.median([t for r in ours for t in r]) / statistics.median(
        [t for r in theirs for t in r]
    )
    assert pooled > 1.0 > median_of_rounds(rounds)
    assert median_of_rounds([1.1, 0.9, 0.95]) == 0.95  # one odd round does not move it
    assert median_of_rounds([]) is None


def test_the_ratio_interval_is_seeded_and_separates_what_differs() -> None:
    import random

    from paired_ratio import ratio_interval

    rng = random.Random(1)
    slow = [[1.0 + rng.random() * 0.1 for _ in range(9)] for _ in range(3)]
    same = [[1.0 + rng.random() * 0.1 for _ in range(9)] for _ in range(3)]
    fast = [[0.8 + rng.random() * 0.1 for _ in range(9)] for _ in range(3)]
    low, high = ratio_interval(same, slow)
    assert low < 1.0 < high  # one distribution against itself: par is inside
    assert ratio_interval(same, slow) == (low, high)  # seeded: the same steps give the same interval
    low, high = ratio_interval(fast, slow)
    assert high < 1.0 and low > 0.7  # clearly faster: the whole interval below par
    with pytest.raises(ValueError, match="level"):
        ratio_interval(same, slow, level=1.0)


def test_report_prints_and_keeps_the_rounds_and_the_interval(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline_common import Config, Result
    from pipeline_vs_torch import report

    def result(name: str, rounds: list[list[float]]) -> Result:
        return Result(name, times=[t for r in rounds for t in r], losses=[2.0, 1.0], round_times=rounds)

    results = [
        result("plain torch", [[2.0, 2.0], [2.0, 2.0]]),
        result("torch pipe 2", [[1.0, 1.0], [1.2, 1.2]]),
        result("fusionnet 2", [[0.9, 0.9], [1.2, 1.2]]),
    ]
    cfg = Config(dim=8, hidden=8, layers=2, batch_size=4, microbatches=2, steps=4, warmup=0, lr=0.1, seed=0,
                 threads=1, data_path="x")  # fmt: skip
    summary = report(results, cfg, [2], {})
    assert summary["fusionnet_2_over_torchpipe_2_rounds"] == [0.9, 1.0]
    assert summary["fusionnet_2_over_torchpipe_2_rounds_median"] == 0.95
    assert summary["fusionnet_2_round_ms"] == [900.0, 1200.0] and summary["torchpipe_2_round_ms"] == [
        1000.0,
        1200.0,
    ]
    low, high = summary["fusionnet_2_over_torchpipe_2_interval95"]
    assert 0.75 <= low <= high <= 1.0
    assert "0.90/1.00" in capsys.readouterr().out


def test_torch_contenders_are_spawned_with_their_allocators_huge_page_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--torch-allocator kept`` spawns torch's processes with the huge-page advice FusionNet's workers
    use, the default with torch's own default (off) whatever the caller's environment says; the caller's
    environment is left as it was."""
    import os

    from pipeline_common import HUGE_PAGES_ENV, torch_allocator_env

    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    with torch_allocator_env("default"):
        assert os.environ[HUGE_PAGES_ENV] == "0"
    assert os.environ[HUGE_PAGES_ENV] == "1"
    monkeypatch.delenv(HUGE_PAGES_ENV)
    with torch_allocator_env("kept"):
        assert os.environ[HUGE_PAGES_ENV] == "1"
    assert HUGE_PAGES_ENV not in os.environ
