"""FusionAI section 4: the analytic models and the 50 x RTX 3080 vs 4 x H100 finding."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from fusionnet.perfmodel.models import BERT_LARGE, GPT3_24L_4096, transformer_blocks, transformer_fine
from fusionnet.perfmodel.section4 import analyse, figure4_assignments, main, plot, summary


def test_bert_large_blocks_graph_matches_figure4():
    g = transformer_blocks(BERT_LARGE)
    subdags = [op for op in g.ops if op.kind != "placeholder"]
    assert len(subdags) == 50 and g.is_chain
    params = sum(op.param_bytes for op in g.ops) / 4
    assert 330e6 < params < 370e6  # Bert-Large with an untied MLM decoder: ~335M + 31M
    layer = [op for op in g.ops if op.name.startswith("layer0.")]
    h, s = BERT_LARGE.hidden, BERT_LARGE.seq
    # attention: 8sh^2 (QKV + output) + 4s^2h; FFN: 16sh^2 — the matmul terms dominate
    assert layer[0].flops_fwd == pytest.approx(8 * s * h * h + 4 * s * s * h, rel=0.05)
    assert layer[1].flops_fwd == pytest.approx(16 * s * h * h, rel=0.02)
    assert all(op.flops_bwd == 2 * op.flops_fwd for op in subdags)
    a, b = figure4_assignments(g)
    assert len(set(a.values())) == 50
    counts = [list(b.values()).count(k) for k in range(4)]
    assert counts == [2, 24, 24, 1]  # tokens + embedding | 2-25 | 26-49 | head


def test_fine_graph_is_a_thousand_op_dag_with_the_same_flops():
    fine, blocks = transformer_fine(BERT_LARGE), transformer_blocks(BERT_LARGE)
    assert 850 <= len(fine.ops) <= 1100 and not fine.is_chain
    ratio = sum(op.flops_fwd for op in fine.ops) / sum(op.flops_fwd for op in blocks.ops)
    assert ratio == pytest.approx(1.0, rel=0.05)


@pytest.mark.timeout(60)
def test_similar_throughput_higher_latency_and_simulator_agrees():
    rows = []
    for name, cfg, causal in (("bert", BERT_LARGE, False), ("gpt", replace(GPT3_24L_4096, seq=512), True)):
        rows += analyse(
            name, cfg, causal=causal, n_batches=512, bandwidths=(1e8, 1e9, 1e10), latencies=(1e-3, 1e-2)
        )
    res = summary(rows)
    for model in ("bert", "gpt"):
        assert 0.8 <= res[model]["median_throughput_ratio_3080_vs_h100"] <= 1.25
        assert res[model]["min_latency_ratio"] > 5
    assert res["max_simulator_vs_eq4_rel_diff"] < 1e-9


@pytest.mark.timeout(60)
def test_main_prints_table_and_json(tmp_path, capsys):
    args = [
        "--n-batches",
        "64",
        "--gpt-seq",
        "256",
        "--json",
        str(tmp_path / "rows.json"),
        "--no-simulate",
        "--no-plot",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("model")
    final = json.loads(out[-1])
    assert "bert-large" in final and "gpt3-24l-4096" in final
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows) == 2 * 2 * 9 * 3
    assert final["plot"] is None


@pytest.mark.timeout(60)
def test_plot_is_written_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    rows = analyse(
        "bert",
        BERT_LARGE,
        causal=False,
        n_batches=8,
        bandwidths=(1e8, 1e9),
        latencies=(1e-3,),
        simulate=False,
    )
    assert plot(rows, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
