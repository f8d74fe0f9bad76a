"""The activation bytes a sub-DAG holds between F and B, measured as it runs (``dag.activation_memory``):
counted without changing a number, and per schedule what the schedule's theory says (GPipe holds every
micro-batch's, 1F1B at most p - s, zero-bubble up to its W), through ``run --local`` and metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusionnet.dag.activation_memory import ActivationLedger, activation_key
from fusionnet.job.loader import load_job
from fusionnet.runtime.local import run_local
from fusionnet.schedules import NAMES, chain_edges, check, make_schedule
from tests.dag_models import make_data
from tests.jobfiles import write_job

pytestmark = pytest.mark.timeout(300)


def test_the_ledger_counts_saved_storages_once_without_parameters_and_changes_no_gradient() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)

    def run(ledger: ActivationLedger | None) -> tuple[torch.Tensor, int]:
        layer.zero_grad()
        x.grad = None
        if ledger is None:
            y = torch.tanh(layer(x)).sum()
            nbytes = 0
        else:
            with ledger.saving(layer.parameters()) as saved:
                h = torch.tanh(layer(x))
                y = h.sum()
            saved.add(h)  # an output kept: its storage was saved by tanh already, not counted twice
            nbytes = saved.nbytes
        y.backward()
        return torch.cat([x.grad.flatten(), layer.weight.grad.flatten()]), nbytes

    plain, _ = run(None)
    ledger = ActivationLedger()
    counted, nbytes = run(ledger)
    assert torch.equal(plain, counted)  # the hooks hand autograd the same storages
    assert nbytes == (4 * 8 + 4 * 16) * 4  # linear saves x, tanh its output; the weight is left out
    ledger.hold(0, 100)
    ledger.hold(1, 50)
    ledger.release(0)
    ledger.hold(2, 70)
    assert (ledger.peak, ledger.held) == (150, 120)
    ledger.start_step()
    assert (ledger.peak, ledger.held) == (0, 0)
    # an FP of a shape already counted is not counted again (the hooks cost a small model's step a few %)
    key = activation_key(0, [torch.zeros(2, 3), (torch.zeros(4),)])
    assert key == (0, (2, 3), (4,)) and not ledger.knows(key)
    assert ledger.learn(key, 96) == 96 and ledger.knows(key) and ledger.learn(key, None) == 96
    assert ledger.learn(activation_key(1, [torch.zeros(1, 3)]), None) == 0  # never counted: nothing


def test_each_schedule_holds_what_its_theory_says_per_stage(tmp_path: Path) -> None:
    p, m = 3, 6
    x, y = make_data("skip", n=24)
    peaks = {}
    for name in NAMES:
        path = write_job(
            tmp_path / name, model_class="SkipEverywhere", inputs=x, labels=y, batch_size=12,
            microbatches=m, steps=2, compnodes=p, schedule=name,
        )  # fmt: skip
        got = run_local(load_job(path), p)
        rows = [r["activation_peak_bytes"] for r in got.metrics]
        assert rows[0] == rows[1] and all(b > 0 for b in rows[0])  # the same every step
        peaks[name] = rows[0]
    per_mb = [b // m for b in peaks["gpipe"]]
    assert [b % m for b in peaks["gpipe"]] == [0] * p  # every micro-batch holds the same
    for name in NAMES:
        inflight = check(make_schedule(name, p, m, "train"), chain_edges(p)).peak_inflight
        assert peaks[name] == [n * b for n, b in zip(inflight, per_mb)], name
    assert [a / g for a, g in zip(peaks["1f1b"], peaks["gpipe"])] == [(p - s) / m for s in range(p)]
