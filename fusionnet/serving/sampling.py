"""Choosing the next token from a causal LM's logits: penalties and biases, then greedy, temperature,
top-k, top-p, seeded.

Before a token is chosen its row of logits is adjusted, in this order (each step only when asked for):

- ``logit_bias`` (OpenAI): a fixed amount added to the listed token ids;
- ``repetition_penalty`` (``transformers``' and vLLM's): a logit of a token already in the prompt or the
  answer is divided by the penalty when positive, multiplied by it when negative;
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI's): a token already in the answer loses
  ``presence_penalty`` once and ``frequency_penalty`` per time it came.

``temperature == 0`` is then greedy (``argmax``; ties go to the lowest id, as ``transformers``' greedy
search). Otherwise the logits are divided by the temperature, only the ``top_k`` most likely tokens are
kept (``transformers``' order: temperature, top-k, top-p), then the smallest set of most likely tokens
whose probability reaches ``top_p`` (nucleus sampling), and one is drawn with the choice's own
``torch.Generator``: a request with a ``seed`` gets the same tokens every time, whatever else runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: every token), got {self.top_k}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: token {token} -> {bias} (ids >= 0, biases in [-100, 100])")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether logits change before a token is chosen (penalties or biases asked for)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )


def generator_for(seed: int | None, choice: int) -> torch.Generator:
    """Choice ``i`` of a seeded request draws from ``seed + i``; unseeded requests from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed + choice) % (1 << 63))
    return g


def adjusted_logits(
    logits: torch.Tensor, params: SamplingParams, tokens: Sequence[int], prompt_len: int
) -> torch.Tensor:
    """A 1-D logits row after the biases and penalties (a new tensor; ``logits`` is left as it is).
    ``tokens`` are the prompt's followed by the answer's so far, the first ``prompt_len`` the prompt's."""
    out = logits.float().clone()
    vocab = out.shape[0]
    for token, bias in params.logit_bias.items():
        if token < vocab:  # an id the model does not have cannot come anyway
            out[token] += bias
    if params.repetition_penalty != 1.0 and tokens:
        seen = torch.unique(torch.tensor(list(tokens), dtype=torch.long).clamp_(0, vocab - 1))
        score = out[seen]
        penalty = params.repetition_penalty
        out[seen] = torch.where(score < 0, score * penalty, score / penalty)
    answer = tokens[prompt_len:]
    if (params.presence_penalty or params.frequency_penalty) and answer:
        counts = torch.bincount(torch.tensor(list(answer), dtype=torch.long), minlength=vocab)[:vocab]
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return out


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    tokens: Sequence[int] = (),
    prompt_len: int = 0,
) -> int:
    """One token id from a 1-D logits row; ``tokens`` (the prompt's, then the answer's so far, the first
    ``prompt_len`` the prompt's) are what the penalties look at."""
    logits = adjusted_logits(logits, params, tokens, prompt_len) if params.adjusts else logits.float()
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits / params.temperature
    if torch.isposinf(scaled).any():  # a temperature so small the top logits overflow: its limit, the
        # most likely tokens alone (greedy, ties drawn at random), not the NaNs of inf - inf
        scaled = torch.where(logits == logits.max(), 0.0, float("-inf"))
    logits = scaled
    if 0 < params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep a token while the mass before it is below top_p (the most likely one always stays)
        keep = (cumulative - sorted_probs) < params.top_p
        keep[0] = True  # also when top_p is below float32's smallest value (the comparison rounds it to 0)
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())
