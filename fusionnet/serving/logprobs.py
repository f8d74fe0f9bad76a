"""Log probabilities of the generated tokens, as OpenAI's two APIs write them.

``/v1/completions`` takes ``logprobs: k`` (0..20) and answers, per choice, ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``; ``/v1/chat/completions`` takes ``logprobs: true`` and
``top_logprobs: k`` and answers ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.

A logprob is the model's own: ``log_softmax`` of the logits the token was sampled from, before
temperature and top-p (vLLM's default too), so it says how likely the model found the token whatever the
sampling did with it. A token's text is the tokenizer's decoding of that one id (``token_id:N`` without a
tokenizer, as vLLM writes it); a stop id, which is not part of the answer, has no entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MAX_TOP = 20


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: an echoed prompt's first token (nothing before it to predict it)
    top: tuple[tuple[int, float], ...] | None  # the ``k`` most likely ids and their logprobs, best first


def logprob_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s logprob under ``logits`` (one row) and the ``top`` best alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, int(logp.shape[0])))
        best = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), best)


def token_text(tokenizer: Any, token: int) -> str:
    if tokenizer is None:
        return f"token_id:{token}"
    return str(tokenizer.decode([token]))


def completion_logprobs(
    entries: list[TokenLogprob], tokenizer: Any, top: int, offset: int = 0
) -> dict[str, Any]:
    """The legacy completions form; ``offset`` is where these tokens' text starts in the choice's text
    (a streamed chunk's tokens follow those sent before)."""
    tokens = [token_text(tokenizer, e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.top is None else {token_text(tokenizer, i): lp for i, lp in e.top} for e in entries
        ]
        if top
        else None,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            item(e.token, e.logprob) | {"top_logprobs": [item(i, lp) for i, lp in e.top or ()]}
            for e in entries
        ]
    }
