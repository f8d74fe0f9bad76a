"""What one request of the HTTP API gets, beyond the happy path: a request of several sessions is admitted
as one (its prompts never refuse each other as "overloaded"), text that is not text is a 400, the prompt
is counted once per prompt in ``usage`` whatever ``n`` is, and the answer's text is decoded after the
prompt, each token's logprob entry being the text it adds there (a SentencePiece-style tokenizer decodes
a word alone without its space: "again" for the answer "▁again" to "Hello world")."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient

from fusionnet.serving.answers import Overloaded
from fusionnet.serving.batching import DynamicBatcher
from fusionnet.serving.logprobs import text_after
from tests.serving_support import answer_rows
from tests.test_serving import _kv_deployment, _Local, _with_app

pytestmark = pytest.mark.timeout(60)


class _Words:
    """A word-level tokenizer that decodes as SentencePiece ones do: words joined by spaces, a word
    decoded alone without the space before it."""

    words = ["Hello", "world", "again", "and", "more", "w5", "w9"]

    def encode(self, text: str) -> list[int]:
        return [self.words.index(w) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def test_a_tokens_text_is_what_it_adds_after_the_tokens_before_it() -> None:
    tok = _Words()
    hello, world, again = tok.encode("Hello world again")
    assert text_after(tok, [], hello) == "Hello"
    assert text_after(tok, [hello], world) == " world"  # decoded alone: "world"
    assert text_after(tok, [hello, world], again) == " again"
    assert text_after(None, [hello], world) == f"token_id:{world}"


def test_sessions_of_one_request_are_admitted_together() -> None:
    """Two sessions of 21 rows each under a queue limit of 40: alone, the second is refused as
    overloaded (the first one's rows wait); in one group both get in, and a third session outside the
    group is refused while they wait."""

    async def scenario() -> None:
        async def never(rows: torch.Tensor, pick: Any, keep: Any = None) -> Any:
            await asyncio.Event().wait()

        b = DynamicBatcher(never, max_batch=64, max_wait=0.0, queue_limit=40)  # not started: rows stay
        rows = torch.zeros(21, 3, dtype=torch.long)
        async with b.caller() as one, b.caller() as two:
            first = one(rows)
            with pytest.raises(Overloaded, match="21 rows already wait"):
                two(rows)
            first.cancel()
        group = object()
        async with b.caller(group) as one, b.caller(group) as two, b.caller() as other:
            futures = [one(rows), two(rows)]
            assert b.queued_rows == 42
            with pytest.raises(Overloaded):
                other(torch.zeros(1, 3, dtype=torch.long))
            for f in futures:
                f.cancel()
        assert not b._admitted_groups and not b._group_of  # nothing of the request stays behind
        await b.close()

    asyncio.run(scenario())


def _decoder_deployment(queue_limit: int, tokenizer: Any = None) -> tuple[_Local, Any, list[int]]:
    """A KV deployment whose next token is each row's token + 1 (every row's logits when asked without
    ``keep``: a prompt scored for ``echo``)."""
    vocab, batches = len(_Words.words), []

    async def run_batch(rows: torch.Tensor, pick: Any, keep: list[bool] | None = None) -> Any:
        batches.append(len(rows))
        logits = torch.nn.functional.one_hot((rows[:, 0] + 1) % vocab, vocab).float()
        return logits if keep is None else answer_rows(logits, keep)

    batcher = DynamicBatcher(run_batch, max_batch=64, max_wait=0.001, queue_limit=queue_limit)
    local, model = _kv_deployment(batcher, vocab)
    model.tokenizer = tokenizer
    return local, model, batches


def test_a_request_whose_prompts_together_exceed_the_queue_limit_is_served() -> None:
    """n=2 of a 21-token prompt, and two 21-token prompts, under --queue-limit 40: each prompt fits, so
    the request is served (it used to get a 503 "retry later" on an idle deployment, every time)."""
    local, _, batches = _decoder_deployment(queue_limit=40)
    prompt = [1] * 21

    async def body(client: TestClient) -> None:
        for request in ({"prompt": prompt, "n": 2}, {"prompt": [prompt, [2] * 21]}):
            r = await client.post("/v1/completions", json=request | {"max_tokens": 2, "temperature": 0})
            doc = await r.json()
            assert r.status == 200, doc
            assert doc["choices"][0]["token_ids"] == [2, 3]
        assert max(batches) == 42  # both prompts' prefills rode in one batch

    asyncio.run(_with_app(local, body))


def test_text_that_is_not_text_usage_counted_once_and_offsets_into_the_text() -> None:
    local, _, _ = _decoder_deployment(queue_limit=64, tokenizer=_Words())

    async def body(client: TestClient) -> None:
        for prompt in ("w5 \ud800", ["w5", "\udfff"]):  # lone surrogates: JSON allows them, UTF-8 not
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            doc = await r.json()
            assert r.status == 400 and doc["error"]["param"] == "prompt", doc
            assert "surrogate" in doc["error"]["message"], doc
        request = {"prompt": "Hello world", "max_tokens": 2, "temperature": 0, "n": 3, "logprobs": 0}
        r = await client.post("/v1/completions", json=request | {"echo": True})
        doc = await r.json()
        assert r.status == 200, doc
        assert doc["usage"]["prompt_tokens"] == 2  # once, not once per choice
        assert doc["usage"]["completion_tokens"] == 6
        for choice in doc["choices"]:
            text, lp = choice["text"], choice["logprobs"]
            assert text == "Hello world" + " again and"  # the answer decoded after the prompt: its space
            assert "".join(lp["tokens"]) == text  # each token the text it adds
            for token, at in zip(lp["tokens"], lp["text_offset"], strict=True):
                assert text[at:].startswith(token), (text, lp)
        stream = request | {"stream": True, "prompt": "Hello"}
        r = await client.post("/v1/completions", json=stream)
        chunks = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: {")]
        offsets = [o for c in map(json.loads, chunks) for ch in c["choices"] if ch["logprobs"]
                   for o in ch["logprobs"]["text_offset"] if ch["index"] == 0]  # fmt: skip
        assert offsets == [0, 6]  # " world again": each token with the space before it

    asyncio.run(_with_app(local, body))
