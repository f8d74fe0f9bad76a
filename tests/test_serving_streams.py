"""Streams and requests as OpenAI clients send them: one finish chunk per streamed choice and nothing
after it, the real status for a stream refused before its first token, ``stream_options.include_usage``,
``null`` fields, the ``openai`` package's streams counted as served, and requests that can never get in
told so (400) rather than sent to retry. One process, the app over a local model (``test_serving``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, generate_latest

from fusionnet.metrics.serving import ServingMetrics
from fusionnet.serving.batching import DynamicBatcher
from fusionnet.serving.generation import Window
from fusionnet.serving.http import build_app, start_api
from fusionnet.serving.kv_sessions import SlotPool
from fusionnet.serving.sampling import SamplingParams, generator_for, next_token
from fusionnet.serving.tokenizers import CharTokenizer
from tests.test_serving import _gpt2, _kv_deployment, _Local, _next_token_decoder, _Requests, _run, _with_app

pytestmark = pytest.mark.timeout(120)

VOCAB = [chr(ord("a") + i) for i in range(26)] + [str(d) for d in range(10)] + [" ", ".", ",", "!"]


def _text_gpt() -> _Local:
    lm = _gpt2()
    local = _Local()
    local.add(
        "gpt", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    local.served["gpt"].tokenizer = CharTokenizer(VOCAB)
    return local


def _events(text: str) -> list[Any]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _by_choice(events: list[Any]) -> dict[int, list[dict[str, Any]]]:
    chunks: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        for c in e["choices"]:
            chunks.setdefault(c["index"], []).append(c)
    return chunks


def test_each_streamed_choice_ends_with_one_finish_chunk_and_nothing_after_it() -> None:
    """The finish reason travels with the piece that ended the choice: a stream reading it off the choice
    when it writes (its producer already further on) sent "length" twice, and with ``n`` > 1 and a stop
    string a token after its choice's "stop"."""

    async def body(client: TestClient) -> None:
        plain = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "n": 2}
        r = await client.post("/v1/completions", json=plain)
        doc = await r.json()
        assert r.status == 200, doc
        full = doc["choices"][0]["text"]
        for extra, reason in (({}, "length"), ({"stop": full[1:3]}, "stop"), ({"max_tokens": 1}, "length")):
            for _ in range(3):  # the order of two choices' pieces varies with the loop's turns
                r = await client.post("/v1/completions", json=plain | extra | {"stream": True})
                chunks = _by_choice(_events(await r.text()))
                assert sorted(chunks) == [0, 1]
                for index, seq in chunks.items():
                    finishes = [c["finish_reason"] for c in seq if c["finish_reason"] is not None]
                    assert finishes == [reason] and seq[-1]["finish_reason"] == reason, (extra, index, seq)
                    want = doc["choices"][index]
                    if extra.get("stop") is None:
                        ids = [t for c in seq for t in c["token_ids"]]
                        assert ids == want["token_ids"][: extra.get("max_tokens", 6)]

    _run(_with_app(_text_gpt(), body))


def test_include_usage_adds_a_last_chunk_and_null_fields_take_their_defaults() -> None:
    async def body(client: TestClient) -> None:
        base = {"prompt": [5, 9, 3], "max_tokens": 3, "temperature": 0}
        r = await client.post("/v1/completions", json=base)
        plain = await r.json()
        options = {"stream": True, "stream_options": {"include_usage": True}}
        r = await client.post("/v1/completions", json=base | options)
        events = _events(await r.text())
        assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
        assert all("usage" not in e for e in events[:-1]) and events[-2]["choices"][0]["finish_reason"]
        r = await client.post("/v1/completions", json=base | {"stream": True})
        assert all(e["choices"] for e in _events(await r.text()))  # not asked: no usage chunk
        nulls = dict.fromkeys(
            ("temperature", "top_p", "n", "stream", "echo", "presence_penalty", "logit_bias", "stop", "seed")
        )
        r = await client.post("/v1/completions", json={"prompt": [5, 9, 3], "max_tokens": None} | nulls)
        doc = await r.json()
        assert r.status == 200, doc
        assert len(doc["choices"]) == 1 and len(doc["choices"][0]["token_ids"]) == 16  # the defaults
        r = await client.post("/v1/completions", json={"prompt": None})
        assert (
            r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        )  # required: null is no value

    _run(_with_app(_text_gpt(), body))


def test_a_huge_logit_bias_key_and_a_tiny_top_p_are_not_internal_errors() -> None:
    async def body(client: TestClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "logit_bias": {"9" * 5000: 1}})
        doc = await r.json()
        assert r.status == 400 and doc["error"]["param"] == "logit_bias", doc
        r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "top_p": 1e-320})
        doc = await r.json()
        assert r.status == 200, doc

    _run(_with_app(_text_gpt(), body))
    logits = torch.randn(40, generator=torch.Generator().manual_seed(0))
    best = int(torch.argmax(logits))
    for top_p in (1e-46, 1e-320):  # below float32's smallest value: the most likely token, always
        assert next_token(logits, SamplingParams(temperature=1.0, top_p=top_p), generator_for(3, 0)) == best


def test_a_stream_refused_before_its_first_token_gets_the_status_a_plain_request_gets() -> None:
    """An overloaded deployment answers a stream 503, as a plain request: a 200 with an error chunk was
    neither retried by clients nor counted as a 503 by the overload alert. A request of more sessions
    than the slots and the waiting room could ever take is a 400, streamed or not."""
    gate, entered = asyncio.Event(), asyncio.Event()
    inner = _next_token_decoder(10, [], 0.0)

    async def gated(rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None) -> Any:
        entered.set()
        await gate.wait()
        return await inner(rows, pick, keep)

    batcher = DynamicBatcher(gated, max_batch=4, max_wait=0.005, queue_limit=4, in_flight=1)
    local, model = _kv_deployment(batcher, 10)
    model.kv = SlotPool(slots=8, waiting=8)
    requests = _Requests()

    async def scenario() -> None:
        batcher.start()
        client = TestClient(TestServer(build_app(local, requests)))
        await client.start_server()
        try:
            url = "/v1/completions"
            prompt = {"prompt": [1, 2, 3, 4], "max_tokens": 2}
            held = [asyncio.ensure_future(client.post(url, json=prompt))]
            await asyncio.wait_for(entered.wait(), 10)  # its batch waits at the gate
            held.append(asyncio.ensure_future(client.post(url, json=prompt)))  # its 4 rows fill the queue
            deadline = asyncio.get_running_loop().time() + 10
            while batcher.queued_rows < 4:
                assert asyncio.get_running_loop().time() < deadline, "the queue never filled"
                await asyncio.sleep(0.01)
            for stream in (False, True):
                r = await client.post(url, json={"prompt": [5], "max_tokens": 2, "stream": stream})
                doc = await r.json()
                assert r.status == 503 and doc["error"]["type"] == "server_overloaded", (stream, doc)
            gate.set()
            assert [(await h).status for h in held] == [200, 200]
            model.kv = SlotPool(slots=2, waiting=4)
            for stream in (False, True):
                r = await client.post(url, json={"prompt": [1], "n": 7, "max_tokens": 1, "stream": stream})
                doc = await r.json()
                assert r.status == 400 and doc["error"]["param"] == "n", doc
                assert "2 slots and lets 4 sessions wait" in doc["error"]["message"]
            r = await client.post(url, json={"prompt": [[1]] * 6, "max_tokens": 1})
            assert r.status == 200  # 2 in slots, 4 waiting: all get in
        finally:
            await client.close()
            await batcher.close()
        assert sorted(requests.statuses) == [200, 200, 200, 400, 400, 503, 503]

    _run(scenario())


def test_openai_streams_read_to_done_are_counted_as_served() -> None:
    """The ``openai`` package closes the connection once it has read ``[DONE]``: the server's end of the
    stream then fails to write, which must not count a whole stream as a client gone (499)."""
    openai = pytest.importorskip("openai")
    local = _text_gpt()
    requests = _Requests()

    async def scenario() -> None:
        for m in local.all():
            m.batcher.start()
        runner, base = await start_api(local, requests, "127.0.0.1", 0)
        try:
            api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

            def streams() -> list[list[int]]:
                out = []
                for _ in range(6):
                    chunks = api.completions.create(
                        model="gpt", prompt=[5, 9, 3], max_tokens=3, temperature=None, stream=True,
                        stream_options={"include_usage": True},
                    )  # fmt: skip
                    out.append([t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]])
                return out

            got = await asyncio.to_thread(streams)
            assert all(len(g) == 3 for g in got)
            deadline = asyncio.get_running_loop().time() + 10
            while len(requests.statuses) < 6:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            assert requests.statuses == [200] * 6
        finally:
            await runner.cleanup()
            for m in local.all():
                await m.batcher.close()

    _run(scenario())


def test_an_undeployed_deployments_series_do_not_come_back_with_its_last_answers() -> None:
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry)

    def series() -> list[str]:
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if 'deployment="kv"' in line and not line.startswith("#")]

    metrics.observe_request("kv", "/v1/completions", 200)
    metrics.observe_batch("kv", 4, 0.01, 0, 2)
    assert series()
    metrics.forget_deployment("kv")
    assert series() == []
    metrics.observe_request("kv", "/v1/completions", 503)  # a request answered as the deployment went
    metrics.observe_tokens("kv", 3, 2)
    metrics.observe_first_token("kv", 0.1)
    metrics.observe_inter_token("kv", 0.1)
    metrics.observe_batch("kv", 4, 0.01, 0, 2)
    assert series() == []
    metrics.serve_deployment("kv")  # deployed again under the same name
    metrics.observe_request("kv", "/v1/completions", 200)
    assert series()


def test_a_deployment_name_with_a_final_newline_is_refused_before_anything_is_traced() -> None:
    """``re.match`` with ``$`` takes "mlp\\n": the name then passed the CLI's check and failed the
    request model's (pydantic's ``$`` is the text's end) as an internal error, after the model was traced."""
    import argparse

    from fusionnet.cli.cmd_deploy import _name

    assert _name("mlp-1.b") == "mlp-1.b"
    for bad in ("mlp\n", "mlp?", "-mlp", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="letters, digits"):
            _name(bad)


def test_the_kv_slots_gauge_follows_the_sessions_not_the_last_batch() -> None:
    """Set only from each batch's report (while its sessions still held their slots), the gauge stayed
    at its last batch's count after every session ended."""
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry)
    pool = SlotPool(slots=2, waiting=2, on_change=lambda in_use: metrics.observe_kv_slots("kv", in_use))

    def gauge() -> float | None:
        return registry.get_sample_value("fusionnet_serving_kv_cache_slots_in_use", {"deployment": "kv"})

    async def scenario() -> None:
        async with pool.session():
            async with pool.session():
                assert gauge() == 2
            assert gauge() == 1
        assert gauge() == 0

    asyncio.run(scenario())
    metrics.forget_deployment("kv")
    metrics.observe_kv_slots("kv", 1)  # a session of an undeployed deployment ending late
    assert gauge() is None
