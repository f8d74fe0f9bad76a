"""The ``POST /v1/completions`` request: its pydantic model (OpenAI's fields, vLLM's ``stop_token_ids`` and
``ignore_eos``), the 400 that names a wrong field, and its prompts as token ids checked against the
deployment's window, tokenizer and KV-cache slots. ``completions.py`` runs what this module accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

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

from fusionnet.serving.generation import check_prompt
from fusionnet.serving.logprobs import MAX_TOP
from fusionnet.serving.sampling import SamplingParams
from fusionnet.serving.served import ApiError, ServedModel

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
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")  # type: ignore[union-attr]
            except UnicodeEncodeError as e:  # a lone surrogate (JSON's "\ud800"): no tokenizer takes it
                where = f"prompt {i}" if len(texts) > 1 else "prompt"
                why = f"{where}: not text: {e.reason} at character {e.start}"
                raise ApiError(400, why, param="prompt") from None
        try:
            ids = [list(model.tokenizer.encode(t)) for t in texts]  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
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
