"""``POST /v1/completions``, OpenAI's subset, once its request is accepted (``completion_request``): one
``ChoiceRun`` per prompt (timed for the metrics), the JSON reply's parts and server-sent events for
``stream``.

Each ``choices[i]`` carries ``token_ids`` (always: the generated ids) and ``text`` (decoded by the model
folder's tokenizer when the deployment has one, else ""). A choice ends at end-of-text, a stop token or a
stop string (``finish_reason`` "stop", see ``stopping``) or after ``max_tokens`` tokens ("length").
``stop_token_ids`` and ``ignore_eos`` are vLLM's extensions of the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import torch
from aiohttp import web

from fusionnet.errors import ExecutionError
from fusionnet.serving.completion_request import CompletionRequest
from fusionnet.serving.generation import generate
from fusionnet.serving.kv_sessions import generate_cached, score_cached
from fusionnet.serving.logprobs import CONTEXT, TokenLogprob, completion_logprobs, logprob_of, placed
from fusionnet.serving.sampling import SamplingParams
from fusionnet.serving.served import ApiError, ServedModel, ServingObserver, api_error
from fusionnet.serving.stopping import Piece, StopRule, StopTracker

log = logging.getLogger("fusionnet.serving")


class ChoiceRun:
    """One choice's generation, timed: time to first token and between tokens go to the observer."""

    def __init__(
        self,
        model: ServedModel,
        prompt: list[int],
        req: CompletionRequest,
        params: SamplingParams,
        index: int,
        observer: ServingObserver | None,
        group: object | None = None,
    ) -> None:
        self.model, self.prompt, self.req, self.params = model, prompt, req, params
        self.index, self.observer = index, observer
        self.group = group  # the request: its choices are admitted together (``DynamicBatcher.caller``)
        rule = StopRule.of(model.eos_token_ids, req.stop_token_ids, req.stop, req.ignore_eos)
        self.tracker = StopTracker(rule, model.tokenizer, context=prompt[-CONTEXT:])
        self.top = req.logprobs  # None: no logprobs
        self.logprobs: list[TokenLogprob] = []  # one per token of the answer (after the echo's), if asked
        self._at = 0  # where the next logprob entry's text begins in the choice's text
        self.echoed = ""  # the prompt's text, with echo
        self._logits: torch.Tensor | None = None  # what the next token is sampled from

    def _saw(self, logits: torch.Tensor) -> None:
        self._logits = logits

    async def events(self) -> AsyncIterator[Piece]:
        """What each new token adds, until the choice ends (``self.tracker.finish_reason`` set); the
        last piece is what was held back, when the choice ran out of tokens."""
        model, observer = self.model, self.observer
        assert model.window is not None
        req = self.req
        if req.echo:
            yield await self._echo()
        if req.max_tokens == 0:  # a prompt scored (echo): no session, no cache slot
            yield self.tracker.finish()
            return
        started = last = time.monotonic()
        count = 0
        on_logits = self._saw if self.top is not None else None
        # this choice asks again right after each token: the batcher waits for it (``caller``)
        async with model.batcher.caller(self.group) as submit:
            choice = (self.prompt, req.max_tokens, self.params, req.seed, self.index, on_logits)
            tokens = (
                generate(submit, model.window, *choice)
                if model.kv is None
                else generate_cached(submit, model.kv, model.epoch, *choice)
            )
            tracker = self.tracker
            async with aclosing(tokens):  # a choice that stops early gives its cache slot back at once
                async for token in tokens:
                    now = time.monotonic()
                    if observer is not None:
                        if count == 0:
                            observer.observe_first_token(model.name, now - started)
                        else:
                            observer.observe_inter_token(model.name, now - last)
                    last, count = now, count + 1
                    piece = tracker.push(token)
                    if self.top is not None and piece.tokens and self._logits is not None:
                        # the answer's text is decoded after the prompt's last tokens (``StopTracker``)
                        before = tracker.context + tracker.tokens[:-1]
                        entry = placed(
                            logprob_of(self._logits, token, self.top), model.tokenizer, before, self._at
                        )
                        self._at += len(entry.text)
                        piece.logprobs = [entry]
                        self.logprobs.append(entry)
                    yield piece
                    if tracker.finish_reason is not None:
                        break
        if tracker.finish_reason is None:
            yield tracker.finish()
        if observer is not None:  # a prompt is counted once, with its first choice (as ``usage``)
            observer.observe_tokens(model.name, len(self.prompt) if self.first_choice else 0, count)

    async def _echo(self) -> Piece:
        """The prompt as the choice's first piece: its text (decoded by the tokenizer) and, with logprobs,
        each prompt token's logprob given the tokens before it (none for the first), from one prefill."""
        model, prompt = self.model, self.prompt
        self.echoed = "" if model.tokenizer is None else str(model.tokenizer.decode(prompt))
        piece = Piece([], self.echoed, echo=True)
        if self.top is not None:
            logits = await self._prompt_logits()
            entries = [TokenLogprob(prompt[0], None, None)] + [
                logprob_of(logits[i - 1], prompt[i], self.top) for i in range(1, len(prompt))
            ]
            at = 0
            for i, entry in enumerate(entries):
                piece.logprobs.append(placed(entry, model.tokenizer, prompt[:i], at))
                at += len(piece.logprobs[-1].text)
            self.logprobs.extend(piece.logprobs)
        self._at = len(self.echoed)  # the answer's text follows the echo
        return piece

    async def _prompt_logits(self) -> torch.Tensor:
        """The logits at every position of the prompt (``[len(prompt), vocab]``)."""
        model, prompt, window = self.model, self.prompt, self.model.window
        assert window is not None
        async with model.batcher.caller(self.group) as submit:
            if model.kv is not None:
                return await score_cached(submit, model.kv, model.epoch, prompt)
            row = torch.full((1, window.context), window.pad_id, dtype=window.dtype)
            row[0, : len(prompt)] = torch.tensor(prompt, dtype=window.dtype)
            return (await submit(row, None))[0, : len(prompt)]

    @property
    def first_choice(self) -> bool:
        """Whether this is its prompt's first choice (``n`` choices per prompt, in order)."""
        return self.index % self.req.n == 0

    async def run(self) -> StopTracker:
        async for _ in self.events():
            pass
        return self.tracker


def completion_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def choice_doc(
    index: int, tokens: list[int], text: str, finish: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish}


def usage(runs: list[ChoiceRun]) -> dict[str, int]:
    """OpenAI's ``usage``: each prompt's tokens once (not once per choice), every choice's tokens."""
    p = sum(len(r.prompt) for r in runs if r.first_choice)
    c = sum(r.tracker.generated for r in runs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class TextChunks:
    """How ``/v1/completions`` streams a choice: ``text`` and ``token_ids`` per chunk."""

    object = "text_completion"
    id_prefix = "cmpl"

    def opening(self, index: int) -> dict[str, Any] | None:
        return None

    def chunk(
        self, index: int, tokens: list[int], text: str, finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        return choice_doc(index, tokens, text, finish, logprobs)

    def logprobs(self, run: ChoiceRun, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return None if run.top is None else completion_logprobs(entries, run.top)


TEXT_CHUNKS = TextChunks()


def stream_error(e: BaseException) -> ApiError:
    """What a stream says when a choice fails after its 200 went out: the error the same failure gets
    without ``stream``, its status in ``code`` (as vLLM's stream errors do: the status line said 200)."""
    error = api_error(e if isinstance(e, Exception) else ExecutionError(f"generation ended: {e!r}"))
    if error.status == 500:  # a bug of ours: logged as the HTTP layer logs it
        log.error("a streamed completion failed", exc_info=e)
    return ApiError(error.status, error.message, error.kind, param=error.param, code=error.status)


async def stream_choices(
    request: web.Request, model: ServedModel, runs: list[ChoiceRun], shape: TextChunks = TEXT_CHUNKS
) -> web.StreamResponse:
    """Server-sent events: one ``data:`` chunk per token (any choice, as they come; ``text`` is what
    became certain with it), a last chunk per choice with its ``finish_reason`` (and any text held back),
    then ``data: [DONE]``. A failure mid-stream is sent as an ``error`` chunk (the status line has gone
    out already: ``stream_error`` gives it the status the request would have had), then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for piece in run.events():
                await queue.put((run.index, piece))
            await queue.put((run.index, None))
        except Exception as e:
            await queue.put((run.index, e))

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    cid, created = completion_id(shape.id_prefix), int(time.time())

    async def send(choice: dict[str, Any] | None, **extra: Any) -> None:
        chunk = {"id": cid, "object": shape.object, "created": created, "model": model.name}
        chunk |= {"choices": [] if choice is None else [choice]} | extra
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

    async def start() -> None:
        # The status line goes out with the first piece, not before: a request refused at admission
        # (the queue full, no KV slot, the deployment going away) then gets its real status (503, ...),
        # which clients retry on and the metrics count, rather than a 200 carrying an error chunk.
        await response.prepare(request)
        for run in runs:
            opening = shape.opening(run.index)
            if opening is not None:
                await send(opening)

    try:
        live = len(runs)
        while live:
            index, item = await queue.get()
            # One turn of the loop before the chunk is written: with this token its choice also asked
            # for its next row, and the batch those rows complete (a task the batcher's collector
            # creates in this very turn) then starts before the chunks are written, not after. With 16
            # streams, writing their chunks first held every decode batch back by about 0.4 ms (a
            # batch takes about 19 ms at the serving benchmark's small size).
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                if not response.prepared:
                    raise item  # nothing sent yet: the request's own status (``errors``)
                await response.write(f"data: {json.dumps(stream_error(item).body())}\n\n".encode())
                break
            if not response.prepared:
                await start()
            if item is None:
                live -= 1
                continue
            finish = item.finish  # what the piece said when it was made (its choice may be further on)
            done = finish is not None and not item.tokens  # the ending piece: held-back text, the reason
            if item.tokens or item.text or done or item.echo:
                logprobs = None
                if item.tokens or item.echo:
                    logprobs = shape.logprobs(runs[index], item.logprobs)
                await send(shape.chunk(index, item.tokens, item.text, finish if done else None, logprobs))
            if finish is not None and item.tokens:  # ended by this token (a stop string): say so
                await send(shape.chunk(index, [], "", finish))
        else:
            options = runs[0].req.stream_options if runs else None
            if options is not None and options.include_usage:  # as OpenAI: after every choice's end
                await send(None, usage=usage(runs))
        await response.write(b"data: [DONE]\n\n")  # also after an error: the stream ends as streams do
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # A client may close as soon as it has read [DONE] (the ``openai`` package does): the stream was
    # whole, so that is no client gone before its answer.
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response
