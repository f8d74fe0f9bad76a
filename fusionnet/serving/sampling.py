"""Choosing the next token from a causal LM's logits: greedy, temperature, top-p, seeded.

``temperature == 0`` is greedy (``argmax``; ties go to the lowest id, as ``transformers``' greedy search).
Otherwise the logits are divided by the temperature, the smallest set of most likely tokens whose
probability reaches ``top_p`` is kept (nucleus sampling), and one is drawn with the choice's own
``torch.Generator``: a request with a ``seed`` gets the same tokens every time, whatever else runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def generator_for(seed: int | None, choice: int) -> torch.Generator:
    """Choice ``i`` of a seeded request draws from ``seed + i``; unseeded requests from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed + choice) % (1 << 63))
    return g


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from a 1-D logits row."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep a token while the mass before it is below top_p (the most likely one always stays)
        keep = (cumulative - sorted_probs) < params.top_p
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator).item())
