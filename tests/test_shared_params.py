"""A parameter read on both sides of a cut (a tied embedding) crosses once per step each way (issue 16),
and only as the rows the step looks up (``dag.row_lookup``).

Before, the tied GPT-2 embedding travelled with every micro-batch (92% of the bytes across the cut), then
whole once per step each way; now the lookup's side sends the step's distinct token ids, the owner (the
output projection's side) answers with those rows, and their gradient comes back once, summed over the
step's micro-batches, for every schedule; gradients and trained weights still equal plain PyTorch's to
float rounding.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from fusionnet.dag.channel import Channel, MessageKey
from fusionnet.job.batches import batch_indices
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import InMemorySwarm
from fusionnet.runtime.prepare import prepare_job
from fusionnet.schedules import NAMES
from tests.dag_models import token_data
from tests.jobfiles import write_job

pytestmark = pytest.mark.timeout(300)
MICROBATCHES = 4
VOCAB = 400


class CountingChannel(Channel):
    """Passes everything through and notes each send's key (and, in ``values``, what it carried)."""

    def __init__(self, inner: Channel, sent: list[MessageKey], values: list[Any] | None = None) -> None:
        self.inner, self.sent, self.values = inner, sent, values

    async def send(self, dst: int, key: MessageKey, value: Any) -> None:
        self.sent.append(key)
        if self.values is not None:
            self.values.append((key, value))
        await self.inner.send(dst, key, value)

    async def recv(self, src: int, key: MessageKey) -> Any:
        return await self.inner.recv(src, key)


@pytest.fixture(scope="module")
def tied_gpt2_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    ids, labels = token_data(16, seq=8, vocab=VOCAB)  # 128 tokens a step: fewer distinct ones than rows
    return write_job(
        tmp_path_factory.mktemp("tied") / "job", model_class="HFCausalLM", inputs=ids, labels=labels,
        loss=False, batch_size=16, microbatches=MICROBATCHES, steps=2, compnodes=2, task="grad",
        model_kwargs={"vocab": VOCAB},
    )  # fmt: skip


@pytest.mark.parametrize("schedule", [s for s in NAMES if s != "auto"])
def test_tied_embedding_crosses_once_per_step_with_exact_gradients(
    tied_gpt2_job: Path, schedule: str
) -> None:
    job = load_job(tied_gpt2_job)
    prepared = prepare_job(job, 2)
    graph = prepared.traced.graph
    tied = [n.name for n in graph.nodes if n.kind == "variable"]
    crossing = [n for s in prepared.partition.subdags for n in s.outer_required if n in tied]
    assert crossing, "the tied embedding's users should sit on both sides of the cut"
    swarm = InMemorySwarm(prepared, schedule)
    sent: list[MessageKey] = []
    values: list[Any] = []
    for ex in swarm.executors:
        ex.channel = CountingChannel(ex.channel, sent, values)

    async def run() -> None:
        for data in swarm.steps():
            await swarm.step(data)

    asyncio.run(run())
    for name in crossing:
        acts = [(k, v) for k, v in values if k[0] == "act" and k[3] == name]
        assert sorted(k[1] for k, _ in acts) == [0, 0, 1, 1], f"act of {name}: {[k for k, _ in acts]}"
        grads = [(k, v) for k, v in values if k[0] == "grad" and k[3] == name]
        assert sorted(k[1] for k, _ in grads) == [0, 1], f"grad of {name}: once per step"
        for step in (0, 1):
            ids = next(v for k, v in acts if k[1] == step and v.dtype == torch.long)
            rows = next(v for k, v in acts if k[1] == step and v.is_floating_point())
            back = next(v for k, v in grads if k[1] == step)[0]
            want_ids = torch.unique(job.inputs[batch_indices(step, 16, job.n_samples)])
            assert torch.equal(ids, want_ids)  # the step's distinct tokens, no more
            assert rows.shape == back.shape == (len(want_ids), 32) and len(want_ids) < VOCAB
    # Ordinary activations still travel per micro-batch.
    per_mb = {k[2] for k in sent if k[0] == "act" and k[3] not in crossing}
    assert per_mb == set(range(MICROBATCHES))
    want = run_reference(load_job(tied_gpt2_job)).grads
    got: dict[str, torch.Tensor] = {}
    for ex in swarm.executors:
        got |= ex.gradients()
    assert want is not None and set(got) <= set(want)  # the reference names a tied tensor twice
    for k, g in got.items():
        assert (g - want[k]).abs().max().item() <= 1e-5 * max(1.0, want[k].abs().max().item()), k


def test_infer_keeps_a_tied_embedding_where_it_went(tmp_path: Path) -> None:
    """An infer job's parameters never change: the tied embedding crosses at the first step only, the
    later steps (a deployment's batches) reuse it, and the outputs still equal plain PyTorch's."""
    pytest.importorskip("transformers")
    ids, _ = token_data(12, seq=8)
    folder = write_job(
        tmp_path / "job", model_class="HFCausalLM", inputs=ids, labels=None, loss=False,
        batch_size=4, microbatches=2, steps=3, compnodes=2, task="infer",
    )  # fmt: skip
    prepared = prepare_job(load_job(folder), 2)
    tied = {n.name for n in prepared.traced.graph.nodes if n.kind == "variable"}
    crossing = {n for s in prepared.partition.subdags for n in s.outer_required if n in tied}
    assert crossing, "the tied embedding's users should sit on both sides of the cut"
    swarm = InMemorySwarm(prepared, "gpipe")
    sent: list[MessageKey] = []
    for ex in swarm.executors:
        ex.channel = CountingChannel(ex.channel, sent)

    async def run() -> list[torch.Tensor]:
        outputs = []
        for data in swarm.steps():
            for report in await swarm.step(data):
                outputs.extend(o[0] if isinstance(o, tuple) else o for o in report.outputs)
        return outputs

    outputs = asyncio.run(run())
    for name in crossing:
        assert [k[1] for k in sent if k[0] == "act" and k[3] == name] == [0], name
    assert {k[1] for k in sent if k[0] == "act" and k[3] not in crossing} == {0, 1, 2}
    want = run_reference(load_job(folder)).outputs
    assert want is not None
    torch.testing.assert_close(torch.cat(outputs), want, rtol=0, atol=1e-5)
