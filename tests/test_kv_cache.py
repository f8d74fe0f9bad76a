"""KV-cached generation (issue 14): the ``SlotDecoder`` a generate deployment traces, through FusionNet's
IR, equals ``transformers``' ``generate()``; cache slots; sessions replay after losing their cache.

The swarm half (the decoder placed over compnodes, a compnode SIGKILLed mid-generation) is in
``tests/test_serving_swarm.py``."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import torch

from fusionnet.dag.rebuild import run_whole_graph
from fusionnet.dag.trace import trace_model
from fusionnet.job.kv_decode import SlotDecoder, example_rows, find_causal_lm
from fusionnet.serving.answers import Overloaded
from fusionnet.serving.batching import DynamicBatcher
from fusionnet.serving.kv_sessions import CacheLost, SlotPool, StaleRows, generate_cached
from fusionnet.serving.sampling import SamplingParams
from tests.serving_support import answer_rows

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)

WINDOW = 32
PROMPTS = [[5, 9, 3], [7, 1, 2, 8, 11], [4, 4, 4, 4, 4, 4, 4, 4]]


def _lm(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=WINDOW,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg).eval()
    if family == "mistral":  # every layer attends to the last 4 positions only: prompts + tokens outgrow it
        cfg = transformers.MistralConfig(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=WINDOW, sliding_window=4, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        return transformers.MistralForCausalLM(cfg).eval()
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=WINDOW, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _generate(lm: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = lm.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _decode(
    run, prompts: list[list[int]], slots: list[int], new: int, rows_per_batch: int
) -> list[list[int]]:
    """Continuous batching as the broker does it: every live session feeds one token per batch (its
    prompt first), batches padded with copies of their last row."""
    seqs, pos, outs = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts]
    while any(len(o) < new for o in outs):
        live = [i for i in range(len(prompts)) if len(outs[i]) < new]
        rows = [[seqs[i][pos[i]], pos[i], slots[i]] for i in live]
        rows += [rows[-1]] * (rows_per_batch - len(rows))
        logits = run(torch.tensor(rows))
        for r, i in enumerate(live):
            pos[i] += 1
            if pos[i] == len(seqs[i]):
                token = int(logits[r].argmax())
                seqs[i].append(token)
                outs[i].append(token)
    return outs


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_the_traced_decoder_equals_generate_with_slots_reused(family: str) -> None:
    lm = _lm(family)
    want = [_generate(lm, p, 8) for p in PROMPTS]
    decoder = SlotDecoder(lm, slots=4, window=WINDOW).eval()
    assert find_causal_lm(torch.nn.Sequential(lm)) is lm
    traced = trace_model(decoder, example_rows(4, torch.tensor([5, 6, 7]), 4), None, None, "infer")
    ops = {n.op for n in traced.graph.nodes}
    assert any("index_put_" in op for op in ops)  # the cache writes are in-place ops on the state
    state = {k: v.clone() for k, v in traced.job_state(decoder.state_dict()).items()}

    def run(rows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            (logits,) = run_whole_graph(traced.graph, state, {"inputs": rows})
        return logits

    assert _decode(run, PROMPTS, [1, 2, 3], 8, rows_per_batch=4) == want

    # Prefill: a whole prompt as rows of one batch (each layer writes every row before any row reads),
    # then one row per token; beside a stranger's row and padding, as batches are.
    def batch(rows: list[list[int]]) -> torch.Tensor:
        """Micro-batches of the traced 4 rows, in order, the last padded with copies of its last row."""
        rows = rows + [rows[-1]] * (-len(rows) % 4)
        return torch.cat([run(torch.tensor(rows[i : i + 4])) for i in range(0, len(rows), 4)])

    for prompt, expected in zip(PROMPTS, want):
        tokens = [
            int(batch([[t, p, 0] for p, t in enumerate(prompt)] + [[9, 0, 3]])[len(prompt) - 1].argmax())
        ]
        for _ in range(7):
            position = len(prompt) + len(tokens) - 1
            tokens.append(int(batch([[tokens[-1], position, 0]])[0].argmax()))
        assert tokens == expected
    # The same slots again, in another order: stale entries of the earlier sessions are masked out.
    again = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    assert _decode(run, again, [1, 2, 3], 8, rows_per_batch=4) == [want[2], want[0], want[1]]


def test_a_model_without_a_single_causal_lm_is_not_wrapped() -> None:
    assert find_causal_lm(torch.nn.Linear(3, 3)) is None
    two = torch.nn.ModuleList([_lm("gpt2"), _lm("gpt2")])
    assert find_causal_lm(two) is None  # ambiguous: deployed as it is


def test_sessions_wait_for_a_slot_and_the_queue_is_bounded() -> None:
    async def scenario() -> None:
        pool = SlotPool(1, waiting=1)
        order: list[str] = []

        async def session(name: str, hold: asyncio.Event) -> None:
            async with pool.session() as slot:
                order.append(f"{name}:{slot}")
                await hold.wait()

        async def until(condition: Any) -> None:
            async with asyncio.timeout(5):
                while not condition():
                    await asyncio.sleep(0)

        first_done, second_done = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(session("a", first_done))
        await until(lambda: order == ["a:0"])
        b = asyncio.ensure_future(session("b", second_done))
        await until(lambda: pool.waiting == 1)
        assert pool.in_use == 1 and pool.waiting == 1 and order == ["a:0"]
        with pytest.raises(Overloaded, match="slots are busy"):
            async with pool.session():
                pass
        first_done.set()
        await a
        await until(lambda: len(order) == 2)
        assert order == ["a:0", "b:0"]
        second_done.set()
        await b
        assert pool.in_use == 0 and pool.waiting == 0

    asyncio.run(scenario())


def test_a_freed_slot_goes_to_a_waiting_session_even_when_the_one_woken_leaves() -> None:
    """A slot freed while the waiter it wakes is cancelled in the same loop turn (its client left):
    another waiter takes it. With one notification per release, Python 3.11's ``Condition`` lost it
    that way, and the other waiter slept on beside a free slot."""

    async def scenario() -> None:
        pool = SlotPool(1, waiting=4)
        release = asyncio.Event()
        got: list[str] = []
        waiters: list[asyncio.Future[None]] = []

        async def session(name: str) -> None:
            async with pool.session():
                got.append(name)
                await release.wait()

        async def holder() -> None:
            await session("holder")
            waiters[0].cancel()  # in the very turn the slot came back and the first waiter was woken

        held = asyncio.ensure_future(holder())
        async with asyncio.timeout(5):
            while got != ["holder"]:
                await asyncio.sleep(0)
        waiters += [asyncio.ensure_future(session("first")), asyncio.ensure_future(session("second"))]
        async with asyncio.timeout(5):
            while pool.waiting < 2:
                await asyncio.sleep(0)
        release.set()
        await held
        async with asyncio.timeout(5):
            while got[-1:] != ["second"]:
                await asyncio.sleep(0)
        await asyncio.gather(waiters[0], return_exceptions=True)
        await waiters[1]
        assert got == ["holder", "second"] and pool.in_use == 0 and pool.waiting == 0

    asyncio.run(scenario())


def test_a_session_that_loses_its_cache_replays_and_yields_the_same_tokens() -> None:
    """A fake deployment: the next token is a function of the cache contents, which a 'placement'
    loses; the session replays from position 0 and samples nothing twice."""
    vocab = 50

    class Fake:
        def __init__(self, lose_at: set[int], stale_at: frozenset[int] | set[int] = frozenset()) -> None:
            self.epoch, self.calls, self.lose_at, self.stale_at = 0, 0, lose_at, stale_at
            self.rows: list[int] = []  # rows of each batch run
            self.kept: list[int] = []  # rows of each batch whose logits came back
            self.cache: dict[int, list[int]] = {}

        async def submit(self, rows: torch.Tensor, epochs: list[int] | None, keep: list[bool]) -> Any:
            self.calls += 1
            if self.calls in self.lose_at:  # the batch failed: placed again, caches gone
                self.epoch += 1
                self.cache = {}
                raise CacheLost("lost")
            assert epochs is not None
            if set(epochs) != {self.epoch} or self.calls in self.stale_at:  # as ``DeploymentRun`` refuses
                raise StaleRows("a row of an older placement")
            logits = torch.zeros(len(rows), vocab)
            for r, (token, position, slot) in enumerate(rows.tolist()):
                seen = self.cache.setdefault(slot, [])
                assert len(seen) == position, "a row must come at the next position of its slot"
                seen.append(token)
                logits[r, (sum(seen) * 7 + position) % vocab] = 1.0
            self.rows.append(len(rows))
            self.kept.append(sum(keep))
            return answer_rows(logits, keep)

    async def tokens(fake: Fake, logprobs: bool = True) -> list[int]:
        pool = SlotPool(2, waiting=4)
        seen: list[torch.Tensor] = []  # what each token was sampled from (for its logprob)
        gen = generate_cached(
            fake.submit, pool, lambda: fake.epoch, [3, 1, 4], 6, SamplingParams(0.0), None, 0,
            seen.append if logprobs else None,
        )  # fmt: skip
        out = [t async for t in gen]
        if logprobs:
            assert [int(row.argmax()) for row in seen] == out  # greedy: each token is its row's best
        return out

    clean = Fake(set())
    want = asyncio.run(tokens(clean))
    assert clean.rows == [3, 1, 1, 1, 1, 1]  # the prompt in one batch (prefill), then a row per token
    assert clean.kept == [1] * 6  # of the prefill's rows, only the last one's logits come back
    ids_only = Fake(set())
    assert asyncio.run(tokens(ids_only, logprobs=False)) == want  # greedy, no logprobs: argmax ids only
    assert ids_only.kept == [0] * 6
    lost = Fake({1, 4})
    assert asyncio.run(tokens(lost)) == want  # lost twice: in the prefill and mid-generation
    assert lost.rows == [3, 1, 5, 1, 1, 1]  # each loss: everything again in one batch, nothing resampled
    with pytest.raises(CacheLost):
        asyncio.run(tokens(Fake({2, 3, 4, 5})))  # lost on every placement: the session gives up
    # batches refused unrun because another session's row was stale (rows left queued across a failover):
    # this session's own rows stand, so they are asked again, neither replayed nor counted as replays
    crowded = Fake(set(), stale_at={2, 3, 4, 5})
    assert asyncio.run(tokens(crowded)) == want
    assert crowded.rows == [3, 1, 1, 1, 1, 1] and crowded.calls == 10


def test_a_session_that_stops_early_withdraws_the_row_it_asked_for_ahead() -> None:
    """Each token's next row goes to the batcher before the token is handed on (``ask_ahead``). A
    session that stops there takes it back: out of the queue if no batch took it, its answer dropped if
    one did; the slot is free at once and the batcher serves the next session as before."""

    async def scenario() -> None:
        gate, held, batches = asyncio.Event(), asyncio.Event(), []

        async def run_batch(rows: torch.Tensor, pick: list[int] | None, keep: list[bool]) -> Any:
            batches.append([tuple(r) for r in rows[:, 1:].tolist()])  # (position, slot) per row
            if len(batches) == 2:
                held.set()
                await gate.wait()  # the first session's asked-ahead row, held in the pipeline
            logits = torch.zeros(len(rows), 10)
            logits[:, 3] = 1.0
            return answer_rows(logits, keep)

        batcher = DynamicBatcher(run_batch, max_batch=4, max_wait=0.001, queue_limit=16)
        batcher.start()
        pool = SlotPool(1, waiting=2)
        greedy = SamplingParams(0.0)
        try:
            async with batcher.caller() as submit:
                first = generate_cached(submit, pool, lambda: 0, [1, 2], 5, greedy, None, 0)
                assert await first.__anext__() == 3
                await asyncio.wait_for(held.wait(), 5)
                assert batches == [[(0, 0), (1, 0)], [(2, 0)]]  # the prefill, then the next row already
                await first.aclose()
                assert pool.in_use == 0 and batcher.queued_rows == 0
            gate.set()
            async with batcher.caller() as submit:  # the slot again, from position 0
                second = generate_cached(submit, pool, lambda: 0, [4], 3, greedy, None, 0)
                async with asyncio.timeout(5):
                    assert [t async for t in second] == [3, 3, 3]
            assert batches[2:] == [[(0, 0)], [(1, 0)], [(2, 0)]]  # nothing asked ahead after the last token
        finally:
            gate.set()
            await batcher.close()

    asyncio.run(scenario())


class _Logits(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, bias: float = 0.0) -> None:
        super().__init__()
        self.lm, self.bias = lm, bias

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=inputs).logits + self.bias


def test_deploy_wraps_a_model_only_when_it_answers_its_lms_logits() -> None:
    import io
    from pathlib import Path

    from fusionnet.job.loader import LoadedJob
    from fusionnet.runtime.deploy import with_kv_cache

    inputs = torch.randint(1, 300, (4, 16))

    def job(model: torch.nn.Module) -> LoadedJob:
        spec: Any = None
        return LoadedJob(spec, Path("job.yaml"), Path("."), model, inputs, labels=None, loss_fn=None)

    said = io.StringIO()
    llama = _Logits(_lm("llama"))  # its rotary frequencies are a buffer the check must not touch
    inv_freq = llama.lm.model.rotary_emb.inv_freq.clone()
    wrapped, kv = with_kv_cache(job(llama), 8, said)
    assert torch.equal(llama.lm.model.rotary_emb.inv_freq, inv_freq)
    assert isinstance(wrapped.model, SlotDecoder) and kv is not None and (kv.slots, kv.window) == (8, 16)
    assert wrapped.inputs.shape == (4, 3) and said.getvalue() == ""
    assert all(float(c.abs().max()) == 0.0 for c in wrapped.model.caches())  # the check left no trace
    biased = job(_Logits(_lm("gpt2"), bias=0.5))  # more than its LM's logits: served as it is
    same, kv = with_kv_cache(biased, 8, said)
    assert same is biased and kv is None and "differ from its causal LM's logits" in said.getvalue()


def test_scoring_a_sequence_is_one_prefill_in_a_slot_of_its_own_retried_on_a_new_placement() -> None:
    from fusionnet.serving.kv_sessions import score_cached

    calls: list[tuple[list[list[int]], list[int]]] = []
    epoch = [0]

    async def submit(rows: torch.Tensor, epochs: list[int] | None) -> torch.Tensor:
        calls.append((rows.tolist(), list(epochs or [])))
        if len(calls) == 1:  # the first placement fails under it
            epoch[0] += 1
            raise CacheLost("lost")
        return rows[:, :1].float() * 10 + rows[:, 1:2].float()

    async def scenario() -> torch.Tensor:
        pool = SlotPool(2, waiting=2)
        async with pool.session() as busy:  # another session holds slot 0
            assert busy == 0
            return await score_cached(submit, pool, lambda: epoch[0], [7, 8, 9])

    logits = asyncio.run(scenario())
    assert logits.tolist() == [[70.0], [81.0], [92.0]]  # one row per position, in order
    assert calls[0] == ([[7, 0, 1], [8, 1, 1], [9, 2, 1]], [0, 0, 0])  # all rows in one request, slot 1
    assert calls[1][1] == [1, 1, 1]  # run again on the new placement


def test_end_of_text_ids_come_from_the_causal_lm_and_stay_inside_the_vocabulary() -> None:
    from fusionnet.broker.deployment_windows import end_of_text
    from fusionnet.runtime.deploy import end_of_text_ids
    from fusionnet.serving.generation import Window

    class Wrapper(torch.nn.Module):
        def __init__(self, lm: torch.nn.Module) -> None:
            super().__init__()
            self.lm = lm

    lm = _lm("llama")
    assert end_of_text_ids(Wrapper(lm)) == [0]
    lm.generation_config.eos_token_id = [2, 7]
    assert end_of_text_ids(lm) == [2, 7]
    assert end_of_text_ids(torch.nn.Linear(2, 2)) == []
    window = Window(context=WINDOW, vocab=300)

    class Tokenizer:
        eos_token_id = 5

    # GPT2Config's default 50256 in a toy config of 300 tokens can never come: dropped
    assert end_of_text([50256, 7], Tokenizer(), window) == (5, 7)
    assert end_of_text([7], None, None) == ()


def test_a_sliding_window_goes_into_the_mask_and_mixed_layers_are_refused() -> None:
    from fusionnet.errors import JobError
    from fusionnet.job.kv_decode import sliding_span

    lm = _lm("mistral")
    assert sliding_span(lm, WINDOW) == 4 and sliding_span(lm, 4) is None  # a span covering the window
    assert sliding_span(_lm("llama"), WINDOW) is None
    lm.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(JobError, match="mix full attention and a sliding window of 4"):
        sliding_span(lm, WINDOW)
    lm.config.layer_types = ["full_attention", "full_attention"]
    assert sliding_span(lm, WINDOW) is None
