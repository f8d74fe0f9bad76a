"""Penalties, biases and top-k before a token is chosen (``serving.sampling``): their arithmetic, and
greedy generation with a repetition penalty equal to ``transformers``' ``generate()``."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from fusionnet.serving.answers import RowAnswers
from fusionnet.serving.completion_request import parse_completion
from fusionnet.serving.generation import Window, generate
from fusionnet.serving.sampling import SamplingParams, adjusted_logits, generator_for, next_token
from fusionnet.serving.served import ApiError
from tests.serving_support import answer_rows

pytestmark = pytest.mark.timeout(120)


def test_each_adjustment_moves_the_logits_it_names_and_nothing_else() -> None:
    logits = torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0])
    prompt, answer = [0, 1], [2, 2, 3]
    tokens = prompt + answer
    same = adjusted_logits(logits, SamplingParams(), tokens, len(prompt))
    assert torch.equal(same, logits)
    biased = adjusted_logits(logits, SamplingParams(logit_bias={4: -100.0, 1: 5.0, 99: 1.0}), tokens, 2)
    assert biased.tolist() == [1.0, 3.0, 3.0, 0.5, -96.0]  # id 99 is not in the vocabulary: ignored
    # transformers' repetition penalty: over the prompt and the answer; positive / p, negative * p
    rep = adjusted_logits(logits, SamplingParams(repetition_penalty=2.0), tokens, 2)
    assert rep.tolist() == [0.5, -4.0, 1.5, 0.25, 4.0]
    # OpenAI's: over the answer only; presence once, frequency per occurrence
    pen = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert adjusted_logits(logits, pen, tokens, 2).tolist() == [1.0, -2.0, 2.0, -0.25, 4.0]
    assert torch.equal(logits, torch.tensor([1.0, -2.0, 3.0, 0.5, 4.0]))  # the input is left alone


def test_penalties_steer_the_choice_and_top_k_bounds_the_draws() -> None:
    logits = torch.tensor([0.0, 2.0, 1.9, 1.8, -1.0])
    greedy = SamplingParams(temperature=0.0)
    g = generator_for(0, 0)
    assert next_token(logits, greedy, g, [1, 1], 1) == 1
    assert next_token(logits, SamplingParams(temperature=0.0, frequency_penalty=0.2), g, [1, 1], 1) == 2
    assert next_token(logits, SamplingParams(temperature=0.0, logit_bias={4: 10.0}), g, [], 0) == 4
    top2 = SamplingParams(temperature=2.0, top_k=2)
    assert {next_token(logits, top2, g) for _ in range(300)} == {1, 2}
    assert len({next_token(logits, SamplingParams(temperature=2.0), g) for _ in range(300)}) > 2
    for bad in (
        {"top_k": -1},
        {"repetition_penalty": 0.0},
        {"presence_penalty": 2.5},
        {"logit_bias": {1: 101.0}},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_the_request_fields_become_sampling_params_or_a_400_naming_the_field() -> None:
    req = parse_completion(
        {"prompt": [1], "top_k": -1, "logit_bias": {"50256": -100}, "presence_penalty": 1.0,
         "frequency_penalty": -0.5, "repetition_penalty": 1.2}
    )  # fmt: skip
    params = req.sampling()
    assert (params.top_k, params.logit_bias, params.presence_penalty) == (0, {50256: -100.0}, 1.0)
    assert (params.frequency_penalty, params.repetition_penalty) == (-0.5, 1.2)
    for field, value in (
        ("logit_bias", {"the": 1}),
        ("logit_bias", {"7": 200}),
        ("presence_penalty", 3),
        ("top_k", -2),
        ("repetition_penalty", 0),
    ):
        with pytest.raises(ApiError) as err:
            parse_completion({"prompt": [1], field: value})
        assert err.value.status == 400 and err.value.param == field


def test_greedy_generation_with_a_repetition_penalty_equals_transformers_generate() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=2, n_positions=40)
    lm = transformers.GPT2LMHeadModel(cfg).eval()
    window = Window(context=40, vocab=50)

    async def submit(rows: torch.Tensor, picks: list[int] | None, keep: list[bool]) -> RowAnswers:
        assert picks is not None
        with torch.no_grad():
            return answer_rows(lm(rows).logits[torch.arange(len(picks)), picks], keep)

    async def ours(prompt: list[int], params: SamplingParams) -> list[int]:
        return [t async for t in generate(submit, window, prompt, 20, params, None, 0)]

    for prompt in ([3, 1, 4, 1, 5], [7], [2, 2, 2, 9, 9, 9, 2]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = lm.generate(
                torch.tensor([prompt]), max_new_tokens=20, do_sample=False, repetition_penalty=1.8,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()  # fmt: skip
            plain = lm.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        got = asyncio.run(ours(prompt, SamplingParams(temperature=0.0, repetition_penalty=1.8)))
        assert got == want
        assert got != plain[0, len(prompt) :].tolist()  # the penalty changed the answer
