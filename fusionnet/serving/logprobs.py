"""Log probabilities of the generated tokens, as OpenAI's two APIs write them.

``/v1/completions`` takes ``logprobs: k`` (0..20) and answers, per choice, ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``; ``/v1/chat/completions`` takes ``logprobs: true`` and
``top_logprobs: k`` and answers ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.

A logprob is the model's own: ``log_softmax`` of the logits the token was sampled from, before
temperature and top-p (vLLM's default too), so it says how likely the model found the token whatever the
sampling did with it. A token's text is what it adds to the choice's text: decoded after the tokens
before it (its last ``CONTEXT``), never alone, since one token decoded alone may differ from its part of
the whole (a SentencePiece tokenizer, the Llama family's, drops a word's leading space); an
alternative's is what it would have added there. So the tokens joined give the text, and
``text_offset`` points at each. ``token_id:N`` without a tokenizer, as vLLM writes it. A stop id,
which is not part of the answer, has no entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

MAX_TOP = 20
CONTEXT = 5  # tokens before a token that its text is decoded after (as vLLM's detokenizer)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: an echoed prompt's first token (nothing before it to predict it)
    top: tuple[tuple[int, float], ...] | None  # the ``k`` most likely ids and their logprobs, best first
    text: str = ""  # what the token adds to its choice's text (``placed``)
    at: int = 0  # where that text begins in the choice's text
    top_texts: tuple[str, ...] = ()  # what each of ``top`` would have added there


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


def text_after(tokenizer: Any, before: list[int], token: int) -> str:
    """The text ``token`` adds when it follows ``before`` (its last ``CONTEXT`` tokens)."""
    if tokenizer is None:
        return token_text(None, token)
    window = before[-CONTEXT:]
    head = str(tokenizer.decode(window)) if window else ""
    whole = str(tokenizer.decode([*window, token]))
    n = 0  # the common start: a byte-level tokenizer may turn a half character into a whole one
    while n < min(len(head), len(whole)) and head[n] == whole[n]:
        n += 1
    return whole[n:]


def placed(entry: TokenLogprob, tokenizer: Any, before: list[int], at: int) -> TokenLogprob:
    """``entry`` with its text (and its alternatives') after the tokens ``before`` it, beginning at
    character ``at`` of its choice's text."""
    texts = tuple(text_after(tokenizer, before, i) for i, _ in entry.top or ())
    return replace(entry, text=text_after(tokenizer, before, entry.token), at=at, top_texts=texts)


def completion_logprobs(entries: list[TokenLogprob], top: int) -> dict[str, Any]:
    """The legacy completions form (``placed`` entries)."""
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.top is None else {t: lp for t, (_, lp) in zip(e.top_texts, e.top, strict=True)}
            for e in entries
        ]
        if top
        else None,
        "text_offset": [e.at for e in entries],
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """The chat form (``placed`` entries)."""

    def item(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode(errors="replace"))}

    return {
        "content": [
            item(e.text, e.logprob)
            | {"top_logprobs": [item(t, lp) for t, (_, lp) in zip(e.top_texts, e.top or (), strict=True)]}
            for e in entries
        ]
    }
