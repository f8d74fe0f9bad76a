"""``POST /v1/completions``, OpenAI's subset: the request model, prompts to token ids, one ``ChoiceRun`` per
prompt (timed for the metrics), the JSON reply's parts and server-sent events for ``stream``.

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
from typing import Annotated, Any, TypeVar

import torch
from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from fusionnet.errors import ExecutionError
from fusionnet.serving.generation import check_prompt, generate
from fusionnet.serving.kv_sessions import generate_cached, score_cached
from fusionnet.serving.logprobs import MAX_TOP, TokenLogprob, completion_logprobs, logprob_of
from fusionnet.serving.sampling import SamplingParams
from fusionnet.serving.served import ApiError, ServedModel, ServingObserver, api_error
from fusionnet.serving.stopping import Piece, StopRule, StopTracker

log = logging.getLogger("fusionnet.serving")
MAX_PROMPTS = 64
MAX_NEW_TOKENS = 4096
MAX_STOPS = 4  # stop strings per request, as OpenAI allows
MAX_STOP_CHARS = 256
MAX_TOKEN_ID_DIGITS = 12

TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
Request = TypeVar("Request", bound=BaseModel)


MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_NEW_TOKENS)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]  # added to one token's logit, as OpenAI allows


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False  # a last chunk, before [DONE], with no choices and the usage


class GenerationParams(BaseModel):
    """What ``/v1/completions`` and ``/v1/chat/completions`` share: the deployment, sampling, stopping."""

    # Unknown OpenAI fields (user, suffix, best_of, ...) are ignored rather than refused.
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=8)] = 1
    stop: (
        Annotated[StrictStr, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOPS),
        ]
        | None
    ) = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=64)] | None = None
    ignore_eos: StrictBool = False
    # Penalties and biases (``sampling``): OpenAI's, then vLLM's top_k (-1 or 0: off) and
    # repetition_penalty (``transformers``' semantics).
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: Annotated[dict[StrictStr, Bias], Field(max_length=300)] = {}
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, doc: Any) -> Any:
        """OpenAI takes ``null`` for an optional field as "the default" (its ``openai`` client sends
        ``temperature: null`` for ``temperature=None``): such a field is dropped before validation."""
        if not isinstance(doc, dict):
            return doc
        defaulted = {
            name for name, f in cls.model_fields.items() if not f.is_required() and f.default is not None
        }
        return {k: v for k, v in doc.items() if not (v is None and k in defaulted)}

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float]) -> dict[str, float]:
        # JSON keys are strings: "50256"; ASCII digits only ("²" is a digit to ``isdigit``, not to
        # ``int``), and short: Python refuses to convert over 4300 digits, and no vocabulary is that big
        bad = next(
            (k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= MAX_TOKEN_ID_DIGITS)), None
        )
        if bad is not None:
            raise ValueError(f"keys must be token ids, got {bad[:20]!r}")
        return bias

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()},
        )


class CompletionRequest(GenerationParams):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_NEW_TOKENS)] = 16  # 0: only with echo
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP)] | None = None  # top alternatives per token
    echo: StrictBool = False  # the prompt before the answer (and, with logprobs, its tokens' logprobs)


def parse_completion(doc: Any) -> CompletionRequest:
    return parse_body(CompletionRequest, doc)


def parse_body(cls: type[Request], doc: Any) -> Request:
    """A request body as ``cls``, or a 400 that names the first wrong field."""
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())[:1]) or "(body)"
        raise ApiError(400, f"{where}: {err.get('msg', 'invalid')}"[:300], param=where) from None


def encode_prompts(req: CompletionRequest, model: ServedModel) -> list[list[int]]:
    """The prompts as token-id lists (each repeated ``n`` times), every one checked for the window."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        if model.tokenizer is None:
            raise ApiError(
                400, "this deployment has no tokenizer: send the prompt as token ids", param="prompt"
            )
        try:
            ids = [list(model.tokenizer.encode(t)) for t in texts]  # type: ignore[arg-type]
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}"[:300], param="prompt") from None
    elif prompt and isinstance(prompt[0], list):
        ids = [list(p) for p in prompt]  # type: ignore[union-attr]
    else:
        ids = [list(prompt)]  # type: ignore[arg-type]
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens: 0 is for echo: true (scoring a prompt) only", param="max_tokens")
    if not ids or len(ids) * req.n > MAX_PROMPTS:
        raise ApiError(400, f"1..{MAX_PROMPTS} prompts (times n) per request", param="prompt")
    assert model.window is not None
    if req.stop and model.tokenizer is None:
        raise ApiError(400, "this deployment has no tokenizer: stop strings need one", param="stop")
    for i, p in enumerate(ids):
        problem = check_prompt(p, req.max_tokens, model.window)
        if problem is not None:
            raise ApiError(400, f"prompt {i}: {problem}", param="prompt")
    return [p for p in ids for _ in range(req.n)]


def check_sessions(model: ServedModel, sessions: int, param: str) -> None:
    """A 400 for a request of more KV sessions than the deployment could ever admit at once (its slots
    and the sessions it lets wait): a 503 would send the client to retry what can never get in."""
    kv = model.kv
    if kv is not None and sessions > kv.slots + kv.waiting_limit:
        raise ApiError(
            400,
            f"{sessions} sessions in one request (a KV-cache slot each): this deployment holds "
            f"{kv.slots} slots and lets {kv.waiting_limit} sessions wait; send fewer at a time",
            param=param,
        )


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
    ) -> None:
        self.model, self.prompt, self.req, self.params = model, prompt, req, params
        self.index, self.observer = index, observer
        rule = StopRule.of(model.eos_token_ids, req.stop_token_ids, req.stop, req.ignore_eos)
        self.tracker = StopTracker(rule, model.tokenizer)
        self.top = req.logprobs  # None: no logprobs
        self.logprobs: list[TokenLogprob] = []  # one per token of the answer (after the echo's), if asked
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
        async with model.batcher.caller() as submit:
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
                        piece.logprobs = [logprob_of(self._logits, token, self.top)]
                        self.logprobs.extend(piece.logprobs)
                    yield piece
                    if tracker.finish_reason is not None:
                        break
        if tracker.finish_reason is None:
            yield tracker.finish()
        if observer is not None:
            observer.observe_tokens(model.name, len(self.prompt), count)

    async def _echo(self) -> Piece:
        """The prompt as the choice's first piece: its text (decoded by the tokenizer) and, with logprobs,
        each prompt token's logprob given the tokens before it (none for the first), from one prefill."""
        model, prompt = self.model, self.prompt
        self.echoed = "" if model.tokenizer is None else str(model.tokenizer.decode(prompt))
        piece = Piece([], self.echoed, echo=True)
        if self.top is not None:
            logits = await self._prompt_logits()
            piece.logprobs = [TokenLogprob(prompt[0], None, None)] + [
                logprob_of(logits[i - 1], prompt[i], self.top) for i in range(1, len(prompt))
            ]
            self.logprobs.extend(piece.logprobs)
        return piece

    async def _prompt_logits(self) -> torch.Tensor:
        """The logits at every position of the prompt (``[len(prompt), vocab]``)."""
        model, prompt, window = self.model, self.prompt, self.model.window
        assert window is not None
        if model.kv is not None:
            return await score_cached(model.batcher.submit, model.kv, model.epoch, prompt)
        row = torch.full((1, window.context), window.pad_id, dtype=window.dtype)
        row[0, : len(prompt)] = torch.tensor(prompt, dtype=window.dtype)
        return (await model.batcher.submit(row, None))[0, : len(prompt)]

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


def usage(prompts: list[list[int]], choices: list[StopTracker]) -> dict[str, int]:
    p, c = sum(map(len, prompts)), sum(t.generated for t in choices)
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

    def logprobs(self, run: ChoiceRun, entries: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if run.top is None:
            return None
        return completion_logprobs(entries, run.model.tokenizer, run.top, offset)


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
        sent = [0] * len(runs)  # characters of each choice's text sent so far
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
                    logprobs = shape.logprobs(runs[index], item.logprobs, sent[index])
                sent[index] += len(item.text)
                await send(shape.chunk(index, item.tokens, item.text, finish if done else None, logprobs))
            if finish is not None and item.tokens:  # ended by this token (a stop string): say so
                await send(shape.chunk(index, [], "", finish))
        else:
            options = runs[0].req.stream_options if runs else None
            if options is not None and options.include_usage:  # as OpenAI: after every choice's end
                await send(None, usage=usage([r.prompt for r in runs], [r.tracker for r in runs]))
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
