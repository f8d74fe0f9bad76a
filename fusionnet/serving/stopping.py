"""When a completion ends, and what of it the client sees: end-of-text and stop tokens, stop strings, and
the text streamed so far (``StopTracker``, one per choice).

A choice ends with ``finish_reason`` "stop" when the model emits one of the deployment's end-of-text ids
(unless the request says ``ignore_eos``) or one of the request's ``stop_token_ids``; that token is not
part of the answer, as in OpenAI's API and vLLM. It also ends when its text comes to contain one of the
request's ``stop`` strings: the text is cut before the string, the token ids keep every token generated.
Otherwise it runs for ``max_tokens`` tokens ("length").

Text is decoded from all of a choice's tokens at once, never token by token: a BPE token's leading
space, or a character split over several byte-level tokens, only comes out right in context. The
context includes the prompt's last few tokens (``logprobs.CONTEXT``, as vLLM's detokenizer does): a
SentencePiece tokenizer (the Llama family's) decodes a word at the start of a text without the space
before it, so the answer "▁again" after "Hello world" must read " again", not "again". Streaming
therefore holds back the end of the text that could still change: an incomplete character (the
tokenizer's replacement character U+FFFD at the end) and any tail that could be the start of a stop
string. Nothing sent is ever taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes half a character to


@dataclass(frozen=True)
class StopRule:
    """What ends a choice: ids that end it (not shown) and strings that end its text (cut before)."""

    stop_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        eos_ids: Sequence[int],
        stop_token_ids: Sequence[int] | None,
        strings: str | Sequence[str] | None,
        ignore_eos: bool,
    ) -> StopRule:
        ids = set(stop_token_ids or ()) | (set() if ignore_eos else set(eos_ids))
        if isinstance(strings, str):
            strings = [strings]
        return cls(frozenset(ids), tuple(s for s in strings or () if s))


@dataclass
class Piece:
    """What a new token adds to the client's view: its id (none for a stop id) and the text now safe
    (and, when asked for, its log probability: ``serving.logprobs``)."""

    tokens: list[int]
    text: str
    logprobs: list[Any] = field(default_factory=list)
    echo: bool = False  # the prompt, echoed before the answer (``tokens`` stay the answer's)
    # Set on the piece that ends its choice. A stream writes a piece after its producer has moved on
    # (the tracker may have ended by then), so what a piece says must travel with it.
    finish: str | None = None


@dataclass
class StopTracker:
    rule: StopRule
    tokenizer: Any = None  # decodes the text; without one the text stays "" (token ids only)
    tokens: list[int] = field(default_factory=list)  # the answer's ids
    generated: int = 0  # tokens the model produced (a stop id included): the usage's count
    finish_reason: str | None = None
    context: list[int] = field(default_factory=list)  # the prompt's last tokens (``logprobs.CONTEXT``)
    _text: str = ""  # the answer's text, cut at a stop string once one appeared
    _sent: int = 0  # characters of it handed out
    _head: str | None = None  # the context's own text

    def decode_after_context(self, ids: list[int]) -> tuple[str, int]:
        """The text of ``context + ids`` decoded as a whole and where ``ids``' part of it begins (the
        context's own text's length); where the context's text does not survive whole (half a character
        completed by the answer) the answer's ids alone and 0."""
        if self._head is None:
            self._head = str(self.tokenizer.decode(self.context)) if self.context else ""
        whole = str(self.tokenizer.decode(self.context + ids))
        if whole.startswith(self._head):
            return whole, len(self._head)
        return str(self.tokenizer.decode(ids)), 0

    def push(self, token: int) -> Piece:
        """Takes the model's next token; afterwards ``finish_reason`` says whether the choice ended."""
        assert self.finish_reason is None, "a finished choice takes no more tokens"
        self.generated += 1
        if token in self.rule.stop_ids:
            self.finish_reason = "stop"
            return self._flush([])
        self.tokens.append(token)
        if self.tokenizer is None:
            return Piece([token], "")
        whole, start = self.decode_after_context(self.tokens)
        self._text = whole[start:]
        cut = self._first_stop()
        if cut is not None:
            self._text, self.finish_reason = self._text[:cut], "stop"
            return self._flush([token])
        safe = len(self._text) - self._held_back()
        piece = Piece([token], self._text[self._sent : max(safe, self._sent)])
        self._sent = max(safe, self._sent)
        return piece

    def finish(self) -> Piece:
        """The choice ran out of tokens (``max_tokens``): what was held back, if anything."""
        if self.finish_reason is None:
            self.finish_reason = "length"
        return self._flush([])

    @property
    def text(self) -> str:
        return self._text

    def _flush(self, tokens: list[int]) -> Piece:
        piece = Piece(tokens, self._text[self._sent :], finish=self.finish_reason)
        self._sent = len(self._text)
        return piece

    def _first_stop(self) -> int | None:
        # Only a stop string that ends in the unsent tail can be new; one that began earlier would
        # have been found when its last character came.
        start = max(0, self._sent - max((len(s) for s in self.rule.strings), default=0))
        found = [i for s in self.rule.strings if (i := self._text.find(s, start)) >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Characters at the end that may still change: half a character, or a stop string's start."""
        text = self._text
        longest = len(text) - len(text.rstrip(REPLACEMENT))
        for s in self.rule.strings:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
