"""``/v1/chat/completions`` over a local deployment (no swarm): a model folder's tokenizer with its chat
template (saved by ``transformers`` as ``chat_template.jinja``, shipped by ``deploy``, loaded by the
broker), messages rendered by it and generated as ``/v1/completions`` does, plain and streamed, the real
``openai`` client, and the 400s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp.test_utils import TestClient

from fusionnet.errors import JobError
from fusionnet.serving.batching import DynamicBatcher
from fusionnet.serving.generation import Window
from fusionnet.serving.tokenizers import CharTokenizer, load_tokenizer, tokenizer_files
from tests.test_serving import _gpt2, _Local, _run, _with_app

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

WORDS = [
    "hello", "world", "how", "are", "you", "i", "am", "fine", "thanks", "good", "day",
    "system", "user", "assistant", ":", ".",
]  # fmt: skip
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{{ m['role'] }} : {{ m['content'] }} . {% endfor %}{% if add_generation_prompt %}assistant : {% endif %}"
)
MESSAGES = [{"role": "system", "content": "good day"}, {"role": "user", "content": "hello how are you"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A word-level tokenizer written as a model folder's, then shipped and loaded as ``deploy`` does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "<unk>": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("model")
    fast.save_pretrained(str(folder))
    files = tokenizer_files(folder)
    assert files is not None and "chat_template.jinja" in files  # where transformers 5 keeps it
    loaded = load_tokenizer(files, tmp_path_factory.mktemp("deployment"))
    assert loaded.chat_template == TEMPLATE
    with pytest.raises(JobError, match="not one of"):
        load_tokenizer(files | {"tokenizer.py": b"import os"}, tmp_path_factory.mktemp("bad"))
    return loaded


def _deployment(tokenizer: Any) -> tuple[_Local, Any]:
    lm = _gpt2()
    local = _Local()
    local.add(
        "chat", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    local.served["chat"].tokenizer = tokenizer
    return local, lm


def test_chat_renders_the_template_and_generates_as_completions_does(tokenizer: Any) -> None:
    local, lm = _deployment(tokenizer)
    prompt = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = torch.tensor([prompt])
    want = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                       do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip

    async def body(client: TestClient) -> None:
        r = await client.get("/v1/models")
        assert (await r.json())["data"][0]["chat_template"] is True
        chat = {"model": "chat", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        r = await client.post("/v1/chat/completions", json=chat)
        doc = await r.json()
        assert r.status == 200, doc
        assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
        (choice,) = doc["choices"]
        assert choice["token_ids"] == want and choice["finish_reason"] == "length"
        # the answer decoded after the prompt's last tokens: a word-level tokenizer joins words with spaces
        assert choice["message"] == {"role": "assistant", "content": " " + tokenizer.decode(want)}
        assert doc["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 6,
            "total_tokens": len(prompt) + 6,
        }
        # the same ids through /v1/completions give the same tokens
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert (await r.json())["choices"][0]["token_ids"] == want
        # content as text parts; max_completion_tokens; a stop string
        parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "hello how "},
                                                           {"type": "text", "text": "are you"}]}]  # fmt: skip
        r = await client.post("/v1/chat/completions", json=chat | {"messages": parts, "max_tokens": None,
                                                                  "max_completion_tokens": 3})  # fmt: skip
        assert (await r.json())["choices"][0]["token_ids"] == want[:3]
        # without max_tokens the answer may fill the rest of the context window
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0})
        doc = await r.json()
        assert len(doc["choices"][0]["token_ids"]) == 32 - len(prompt)
        # streamed: the role first, then content deltas that add up to the message, then the reason
        r = await client.post("/v1/chat/completions", json=chat | {"stream": True})
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("content", "") for d in deltas) == " " + tokenizer.decode(want)
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    _run(_with_app(local, body))


def test_chat_errors_say_what_is_wrong(tokenizer: Any) -> None:
    local, _ = _deployment(tokenizer)
    local.add("chars", "generate", lambda rows: rows.float(), (32,), torch.long, Window(context=32, vocab=40))
    local.served["chars"].tokenizer = CharTokenizer([chr(97 + i) for i in range(26)])

    async def body(client: TestClient) -> None:
        cases = [
            ({"model": "chat", "messages": []}, "messages"),
            ({"model": "chat", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
            (
                {"model": "chat", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages",
            ),
            (
                {"model": "chat", "messages": [{"role": "tool", "content": "x"}]},
                "refused them: no tools here",
            ),
            ({"model": "chat", "messages": MESSAGES, "max_tokens": 40}, "context window"),
            ({"model": "chars", "messages": MESSAGES}, "no chat template"),
        ]
        for body_doc, says in cases:
            r = await client.post("/v1/chat/completions", json=body_doc)
            doc = await r.json()
            assert r.status == 400 and says in doc["error"]["message"], (body_doc, doc)

    _run(_with_app(local, body))


def test_chat_logprobs_in_the_chat_form(tokenizer: Any) -> None:
    local, _ = _deployment(tokenizer)

    async def body(client: TestClient) -> None:
        chat = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 3}
        r = await client.post("/v1/chat/completions", json=chat)
        doc = await r.json()
        assert r.status == 200, doc
        choice = doc["choices"][0]
        content = choice["logprobs"]["content"]
        # each token as the text it adds to the answer (after the prompt): the words with their spaces
        assert [c["token"] for c in content] == [" " + tokenizer.decode([t]) for t in choice["token_ids"]]
        assert "".join(c["token"] for c in content) == choice["message"]["content"]
        for c in content:  # greedy: each token is its own best alternative
            assert len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"]
            assert c["top_logprobs"][0]["logprob"] == c["logprob"] <= 0.0
            assert c["bytes"] == list(c["token"].encode())
        r = await client.post("/v1/chat/completions", json=chat | {"stream": True})
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        streamed = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
        assert [x for s in streamed if s for x in s["content"]] == content
        r = await client.post("/v1/chat/completions", json=chat | {"logprobs": False})
        assert r.status == 400 and "needs logprobs" in (await r.json())["error"]["message"]

    _run(_with_app(local, body))


def test_the_openai_client_chats_unchanged(tokenizer: Any) -> None:
    openai = pytest.importorskip("openai")
    local, _ = _deployment(tokenizer)

    async def body(client: TestClient) -> None:
        url = str(client.make_url("/v1"))
        api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)

        def chat() -> tuple[Any, list[str]]:
            reply = api.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=4, temperature=0)
            streamed = api.chat.completions.create(
                model="chat", messages=MESSAGES, max_tokens=4, temperature=0, stream=True
            )
            return reply, [c.choices[0].delta.content or "" for c in streamed]

        reply, pieces = await asyncio.to_thread(chat)
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == "".join(pieces) != ""
        assert len(reply.choices[0].model_extra["token_ids"]) == 4

    _run(_with_app(local, body))


def test_a_folder_without_tokenizer_files_has_none(tmp_path: Path) -> None:
    assert tokenizer_files(tmp_path) is None


def test_an_unsaid_max_tokens_is_what_a_big_window_leaves_capped_at_the_request_limit(tokenizer: Any) -> None:
    """Without ``max_tokens`` a chat may use what the window leaves, but never more than a request may
    ask for: a window of 8192 tokens once made that 8000-odd, which the completion request refused (500)."""
    from fusionnet.serving.chat import ChatRequest, encode_chat
    from fusionnet.serving.completion_request import MAX_NEW_TOKENS
    from fusionnet.serving.served import ServedModel

    def model(context: int) -> ServedModel:
        batcher = DynamicBatcher(lambda *a: None, max_batch=1, max_wait=0.0, queue_limit=1)  # type: ignore
        window = Window(context, 40)
        return ServedModel("chat", "generate", "j", (context,), torch.long, batcher, window, tokenizer)

    async def unsaid(context: int) -> int:
        _, request = await encode_chat(ChatRequest(messages=MESSAGES), model(context))
        return request.max_tokens

    assert _run(unsaid(8192)) == MAX_NEW_TOKENS
    ids, _ = _run(encode_chat(ChatRequest(messages=MESSAGES), model(32)))
    assert _run(unsaid(32)) == 32 - len(ids)
