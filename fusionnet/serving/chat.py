"""``POST /v1/chat/completions``, OpenAI's subset: messages rendered to token ids by the deployment's
tokenizer's chat template, then generated exactly as ``/v1/completions`` does (``completions.ChoiceRun``:
the same sampling, stopping, KV sessions and metrics).

The chat template comes with the model folder's tokenizer (``tokenizer_config.json``'s
``chat_template`` or ``chat_template.jinja``) and is rendered by ``transformers`` in its sandboxed Jinja
environment, in a worker thread. A deployment without one answers 400: which roles and markers a model
was tuned on is the model's business, and guessing them gives text that merely looks right. Message
``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts (other part types: 400).
``max_tokens`` (or ``max_completion_tokens``) defaults to what is left of the context window.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from fusionnet.serving.completion_request import (
    MAX_NEW_TOKENS,
    CompletionRequest,
    GenerationParams,
    MaxTokens,
)
from fusionnet.serving.completions import ChoiceRun, TextChunks, usage
from fusionnet.serving.generation import check_prompt
from fusionnet.serving.logprobs import MAX_TOP, TokenLogprob, chat_logprobs
from fusionnet.serving.served import ApiError, ServedModel

MAX_MESSAGES = 256
MAX_MESSAGE_CHARS = 1 << 20


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Annotated[StrictStr, Field(max_length=MAX_MESSAGE_CHARS)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr, Field(max_length=MAX_MESSAGE_CHARS)] | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(GenerationParams):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP)] | None = None


async def encode_chat(req: ChatRequest, model: ServedModel) -> tuple[list[int], CompletionRequest]:
    """The conversation as token ids (the template's generation prompt at the end) and the request as
    ``/v1/completions`` would have it, its ``max_tokens`` checked against the context window."""
    tokenizer, window = model.tokenizer, model.window
    assert window is not None
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "this deployment's tokenizer has no chat template: use /v1/completions with a prompt",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]

    def render() -> list[int]:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]

    try:
        ids = await asyncio.to_thread(render)
    except Exception as e:  # the template's own raise_exception(...), or a message it cannot render
        raise ApiError(
            400, f"messages: the chat template refused them: {e}"[:300], param="messages"
        ) from None
    left = max(1, min(MAX_NEW_TOKENS, window.context - len(ids)))  # unsaid: what the window leaves, capped
    new = req.max_completion_tokens or req.max_tokens or left
    problem = check_prompt(ids, new, window)
    if problem is not None:
        raise ApiError(400, f"messages: {problem}", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    shared = req.model_dump(include=set(GenerationParams.model_fields))
    top = (req.top_logprobs or 0) if req.logprobs else None
    return ids, CompletionRequest(**shared, prompt=ids, max_tokens=new, logprobs=top)


class ChatChunks(TextChunks):
    """How a chat completion streams: a first ``delta`` with the role, then ``content`` deltas."""

    object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def opening(self, index: int) -> dict[str, Any] | None:
        delta = {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "token_ids": [], "logprobs": None, "finish_reason": None}

    def chunk(
        self, index: int, tokens: list[int], text: str, finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        delta = {"content": text} if text or tokens else {}
        return {
            "index": index,
            "delta": delta,
            "token_ids": tokens,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def logprobs(self, run: ChoiceRun, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return None if run.top is None else chat_logprobs(entries)


CHAT_CHUNKS = ChatChunks()


def chat_reply(
    cid: str, created: int, model: ServedModel, prompt: list[int], runs: list[ChoiceRun]
) -> dict[str, Any]:
    choices = [run.tracker for run in runs]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model.name,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "token_ids": c.tokens,
                "logprobs": CHAT_CHUNKS.logprobs(runs[i], runs[i].logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(runs),
    }
