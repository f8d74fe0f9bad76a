"""A small synchronous client of a broker's HTTP API (standard library only, no extra package).

    client = FusionNetClient("http://127.0.0.1:8000")
    client.models()                                   # the deployments
    client.infer(torch.randn(4, 16), model="mlp")     # outputs, one row per input row
    client.complete([[1, 2, 3]], model="gpt", max_tokens=8, temperature=0)   # OpenAI's reply, token_ids too
    for chunk in client.stream([1, 2, 3], model="gpt", max_tokens=8): ...   # server-sent events

Errors come back as ``ServingError`` with the HTTP status and OpenAI's error ``type``; status 0 when no
HTTP answer came (the broker unreachable, or silent for ``timeout`` seconds on a read). The ``openai``
package works against the same endpoint (``base_url=f"{url}/v1"``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors


class ServingError(Exception):
    def __init__(self, status: int, message: str, kind: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.kind = status, message, kind


NO_ANSWER = 0  # ``ServingError.status`` when no HTTP answer came


class FusionNetClient:
    def __init__(self, base_url: str, timeout: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    @contextlib.contextmanager
    def _answered(self, path: str) -> Iterator[None]:
        """Turns a request that got no HTTP answer (refused, timed out, cut) into ``ServingError``."""
        try:
            yield
        except (TimeoutError, urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
            if isinstance(e, urllib.error.HTTPError):
                raise
            why = f"no answer within {self.timeout:g} s" if isinstance(e, TimeoutError) else str(e)
            raise ServingError(NO_ANSWER, f"{self.base_url}{path}: {why}") from e

    def _open(self, path: str, body: bytes | None = None, content_type: str = "application/json") -> Any:
        request = urllib.request.Request(self.base_url + path, data=body, method="POST" if body else "GET")
        if body is not None:
            request.add_header("Content-Type", content_type)
        try:
            with self._answered(path):
                return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                error = json.loads(raw)["error"]
                raise ServingError(e.code, str(error.get("message")), str(error.get("type"))) from None
            except (ValueError, KeyError, TypeError):
                raise ServingError(e.code, raw[:300].decode(errors="replace")) from None

    def models(self) -> list[dict[str, Any]]:
        with self._open("/v1/models") as response, self._answered("/v1/models"):
            return list(json.loads(response.read())["data"])

    def infer(self, inputs: torch.Tensor, model: str | None = None) -> torch.Tensor:
        path = "/v1/infer" + (f"?model={model}" if model else "")
        body = save_safetensors({"inputs": inputs.contiguous()})
        with self._open(path, body, "application/octet-stream") as response, self._answered(path):
            return load_safetensors(response.read())["outputs"]

    def complete(self, prompt: Any, model: str | None = None, **params: Any) -> dict[str, Any]:
        """``params``: max_tokens, temperature, top_p, seed, n."""
        doc = {"prompt": prompt, **({"model": model} if model else {}), **params, "stream": False}
        with self._open("/v1/completions", json.dumps(doc).encode()) as response:
            with self._answered("/v1/completions"):
                raw = response.read()
            return dict(json.loads(raw))

    def stream(self, prompt: Any, model: str | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        """The completion's chunks as they come (one per token and choice, then one per finish)."""
        doc = {"prompt": prompt, **({"model": model} if model else {}), **params, "stream": True}
        with self._open("/v1/completions", json.dumps(doc).encode()) as response:
            yield from self._chunks(response)

    def _chunks(self, response: Any) -> Iterator[dict[str, Any]]:
        with self._answered("/v1/completions"):  # a read that times out, or a connection cut
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:  # its ``code``: the status the request would have had
                    error = chunk["error"]
                    code = error.get("code")
                    status = code if isinstance(code, int) and 400 <= code < 600 else 503
                    raise ServingError(status, str(error.get("message")), str(error.get("type")))
                yield chunk
        # a stream that ends without [DONE] was cut (the broker went away): not a whole answer
        raise ServingError(502, "the stream ended before its end ([DONE])")
