"""The broker's HTTP API (aiohttp): ``GET /v1/models``, ``POST /v1/infer``, ``POST /v1/completions``,
``POST /v1/chat/completions``.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a request that is
wrong (naming the field) or whose own rows made the model raise (``RowsFailed``: the requests batched
with it are served), 404 for an unknown deployment or route, 405 for a wrong method, 413 for a body
over the limit, 503 when the deployment's queue is full (``Overloaded``) or it is going away, 500 for a
failure of ours. Nothing a client sends can make a handler wait without bound: the batcher's queue is
bounded and every batch call to the swarm has a timeout.

A client that goes away before its answer (a closed connection, its own timeout) has its handler
cancelled (``start_api``: aiohttp does not cancel it unless asked to). Its rows leave the batcher's
queue and its sessions give back their KV cache slots at once, instead of generating to ``max_tokens``
for nobody while live clients get 503. It is counted with status 499 (nginx's "client closed
request"). A stream notices it at its next chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

import torch
from aiohttp import web

from fusionnet.errors import FusionNetError
from fusionnet.messages.blobs import pack_tensors, unpack_tensors
from fusionnet.serving.chat import CHAT_CHUNKS, ChatRequest, chat_reply, encode_chat
from fusionnet.serving.completion_request import check_sessions, encode_prompts, parse_body, parse_completion
from fusionnet.serving.completions import (
    TEXT_CHUNKS,
    ChoiceRun,
    choice_doc,
    completion_id,
    stream_choices,
    usage,
)
from fusionnet.serving.kv_sessions import score_cached
from fusionnet.serving.served import ApiError, Deployments, ServedModel, ServingObserver, api_error

log = logging.getLogger("fusionnet.serving")

MAX_BODY = 64 << 20  # bytes of one request body
SAFETENSORS = "application/octet-stream"
DEPLOYMENT = web.RequestKey("deployment", str)  # which deployment a request went to (for the metrics)
CLIENT_GONE = 499  # the status a request is counted with when its client left before the answer
T = TypeVar("T")


def build_app(deployments: Deployments, observer: ServingObserver | None = None) -> web.Application:
    api = _Api(deployments, observer)
    app = web.Application(client_max_size=MAX_BODY, middlewares=[api.errors])
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{name}", api.model)
    app.router.add_post("/v1/infer", api.infer)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    return app


async def start_api(
    deployments: Deployments, observer: ServingObserver | None, host: str, port: int
) -> tuple[web.AppRunner, str]:
    """The API served on ``host:port`` (0: any free port): its runner (``cleanup()`` stops it) and URL."""
    # handler_cancellation: a handler whose client went away is cancelled (aiohttp stopped doing so by
    # default in 3.9); without it a generation nobody reads holds its cache slots to ``max_tokens``
    runner = web.AppRunner(build_app(deployments, observer), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:  # taken, or a host name that does not resolve: the broker's flags, one line
        await runner.cleanup()
        raise ValueError(f"--http-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, f"http://{host if ':' not in host else f'[{host}]'}:{bound}"


class _Api:
    def __init__(self, deployments: Deployments, observer: ServingObserver | None) -> None:
        self.deployments = deployments
        self.observer = observer

    # ---- errors --------------------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response = await handler(request)
        except asyncio.CancelledError:  # the client went away (``start_api``), or the broker stops
            self._count(request, CLIENT_GONE)
            raise
        except ConnectionResetError:  # a stream's client went away and a chunk could not be written
            self._count(request, CLIENT_GONE)
            raise
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            response = web.json_response(ApiError(e.status, e.reason, kind).body(), status=e.status)
        except Exception as e:
            error = api_error(e)
            if error.status == 500:  # a bug of ours
                log.exception("%s %s failed", request.method, request.path)
            elif isinstance(e, FusionNetError):  # the swarm failed the batch (after the failover's retries)
                log.warning("%s %s: %s", request.method, request.path, e)
            response = web.json_response(error.body(), status=error.status)
        self._count(request, response.status)
        return response

    def _count(self, request: web.Request, status: int) -> None:
        if self.observer is not None and request.path.startswith("/v1/"):
            name = request.get(DEPLOYMENT)
            if name is not None:
                self.observer.observe_request(name, request.path, status)

    def _lookup(self, request: web.Request, name: str | None) -> ServedModel:
        if name is None:
            served = self.deployments.all()
            if len(served) != 1:
                raise ApiError(400, "say which deployment: 'model' (or ?model=NAME)", param="model")
            model = served[0]
        else:
            found = self.deployments.get(name)
            if found is None:
                raise ApiError(404, f"no deployment named {name!r}", param="model", code="model_not_found")
            model = found
        request[DEPLOYMENT] = model.name
        return model

    # ---- routes --------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [m.describe() for m in self.deployments.all()]})

    async def model(self, request: web.Request) -> web.Response:
        return web.json_response(self._lookup(request, request.match_info["name"]).describe())

    async def infer(self, request: web.Request) -> web.Response:
        """Body: safetensors with ``inputs`` (first dim = sample); reply: safetensors with ``outputs``."""
        model = self._lookup(request, request.query.get("model"))
        body = await request.read()
        try:
            tensors = unpack_tensors(body, "request body")
        except FusionNetError as e:
            raise ApiError(400, f"the body must be safetensors bytes: {e}"[:300]) from None
        inputs = tensors.get("inputs")
        if inputs is None:
            raise ApiError(400, "the body lacks the tensor 'inputs'", param="inputs")
        if inputs.dim() == 0 or tuple(inputs.shape[1:]) != model.row_shape or inputs.shape[0] == 0:
            raise ApiError(
                400,
                f"'inputs' is {list(inputs.shape)}; this deployment takes [N, "
                f"{', '.join(map(str, model.row_shape))}] (N >= 1 samples)",
                param="inputs",
            )
        if inputs.dtype != model.row_dtype:
            raise ApiError(
                400, f"'inputs' is {inputs.dtype}, this deployment takes {model.row_dtype}", param="inputs"
            )
        if model.window is not None:  # token ids: an id outside the vocabulary would fail the whole batch
            bad = inputs[(inputs < 0) | (inputs >= model.window.vocab)]
            if bad.numel():
                why = f"token id {int(bad[0])} is outside the vocabulary (0..{model.window.vocab - 1})"
                raise ApiError(400, why, param="inputs")
        if model.kv is None:
            outputs = await model.batcher.submit(inputs.contiguous())
        else:  # rows of a KV deployment address caches: each sequence is scored as a prefill of its own
            check_sessions(model, len(inputs), "inputs")
            group = object()  # the request's sequences are admitted as one

            async def score(row: torch.Tensor) -> torch.Tensor:
                async with model.batcher.caller(group) as submit:
                    assert model.kv is not None
                    return await score_cached(submit, model.kv, model.epoch, row.tolist())

            outputs = torch.stack(await _all_of(score(r) for r in inputs))
        return web.Response(body=pack_tensors({"outputs": outputs.contiguous()}), content_type=SAFETENSORS)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = self._attributed(request, await _json(request))
        req = parse_completion(body)
        model = self._generator(request, req.model)
        prompts = await asyncio.to_thread(encode_prompts, req, model)  # a long text: not on the loop
        if req.max_tokens or req.logprobs is not None:  # echo alone scores nothing: no session
            check_sessions(model, len(prompts), "n" if req.n > 1 else "prompt")
        params = req.sampling()
        group = object()  # the request's choices are admitted as one
        runs = [ChoiceRun(model, p, req, params, i, self.observer, group) for i, p in enumerate(prompts)]
        if req.stream:
            return await stream_choices(request, model, runs)
        choices = await _all_of(run.run() for run in runs)
        docs = [
            choice_doc(
                i,
                c.tokens,
                runs[i].echoed + c.text,
                c.finish_reason,
                TEXT_CHUNKS.logprobs(runs[i], runs[i].logprobs),
            )
            for i, c in enumerate(choices)
        ]
        return web.json_response(
            {
                "id": completion_id(),
                "object": "text_completion",
                "created": int(time.time()),
                "model": model.name,
                "choices": docs,
                "usage": usage(runs),
            }
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_body(ChatRequest, self._attributed(request, await _json(request)))
        model = self._generator(request, req.model)
        prompt, as_completion = await encode_chat(req, model)
        check_sessions(model, req.n, "n")
        params = req.sampling()
        group, observer = object(), self.observer  # the request's choices are admitted as one
        runs = [ChoiceRun(model, prompt, as_completion, params, i, observer, group) for i in range(req.n)]
        if req.stream:
            return await stream_choices(request, model, runs, CHAT_CHUNKS)
        await _all_of(run.run() for run in runs)
        return web.json_response(chat_reply(completion_id("chatcmpl"), int(time.time()), model, prompt, runs))

    def _attributed(self, request: web.Request, body: Any) -> Any:
        """``body``, its request counted under the deployment it names (or the only one) even when the
        body is refused before the deployment is looked up: a client sending bad bodies shows up in the
        deployment's 400s."""
        name = body.get("model") if isinstance(body, dict) else None
        served = self.deployments.all()
        if isinstance(name, str) and self.deployments.get(name) is not None:
            request[DEPLOYMENT] = name
        elif name is None and len(served) == 1:
            request[DEPLOYMENT] = served[0].name
        return body

    def _generator(self, request: web.Request, name: str | None) -> ServedModel:
        model = self._lookup(request, name)
        if model.kind != "generate" or model.window is None:
            raise ApiError(400, f"deployment {model.name!r} is not a text generation model", param="model")
        return model


async def _all_of(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; at the first failure the others are cancelled before it is raised.
    (``asyncio.gather`` leaves them running: one choice refused would leave its siblings generating to
    ``max_tokens``, holding cache slots, for a request already answered with an error.)"""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()  # nothing for those done
        await asyncio.gather(*tasks, return_exceptions=True)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError, LookupError, RecursionError) as e:
        # not JSON, not in its charset, a charset nobody knows, nested deeper than the parser goes
        raise ApiError(400, f"the body must be a JSON object ({type(e).__name__})") from None
