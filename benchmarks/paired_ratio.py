"""How sure a step-time ratio is: FusionNet's pipeline against torch's, measured in alternating rounds.

A benchmark run gives each contender a few rounds (``--repeat``), run in turn, so the two sides of one
round ran under the same load on a shared machine. Two figures come of them, and both are printed:

- ``round_ratios``: each round's median over the other side's median in the same round (paired in time),
  and ``median_of_rounds``, their median: the run's ratio. When the machine's speed moves between rounds
  (on a shared host it does, by 10-20 %), each round's ratio still compares steps taken under one load,
  and the median keeps one odd round from moving the figure.
- The ratio of the pooled medians (every round's steps in one list per side). Under such a move the pooled
  steps fall in two clusters and each side's median lands between them, wherever the count of steps puts
  it: a run whose every round read 0.97-0.99 has pooled 1.03. Kept for comparison with older runs.
- ``ratio_interval``: a bootstrap interval of the pooled ratio that keeps the rounds: each draw resamples
  every round's steps (with replacement, both sides, each round as many steps as it had), pools them and
  takes the ratio of the medians. Seeded, so a run's printed interval can be reproduced from its steps.

Steps of one round are not independent (the load that slowed one slowed its neighbours), so the interval
is narrower than the truth when rounds disagree; the per-round ratios show that, and both are printed.
Pure: lists of seconds in, numbers out.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

Rounds = Sequence[Sequence[float]]  # per round, the timed steps' seconds


def round_ratios(ours: Rounds, theirs: Rounds) -> list[float]:
    """Per round that both sides timed: our median step over theirs."""
    return [
        statistics.median(a) / statistics.median(b)
        for a, b in zip(ours, theirs)
        if a and b and statistics.median(b) > 0
    ]


def median_of_rounds(ratios: Sequence[float]) -> float | None:
    """The median of the rounds' ratios (``round_ratios``); None when no round was timed by both sides."""
    return statistics.median(ratios) if ratios else None


def ratio_interval(
    ours: Rounds, theirs: Rounds, *, level: float = 0.95, draws: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """The central ``level`` bootstrap interval of median(ours) / median(theirs) over the pooled steps,
    each round resampled on its own (module docstring); None when either side timed no step."""
    if not 0 < level < 1 or draws < 1:
        raise ValueError(f"level must be in (0, 1) and draws positive, got {level!r}, {draws!r}")
    a_rounds, b_rounds = [list(r) for r in ours if r], [list(r) for r in theirs if r]
    if not a_rounds or not b_rounds:
        return None
    rng = random.Random(seed)

    def pooled_median(rounds: list[list[float]]) -> float:
        return statistics.median([x for r in rounds for x in rng.choices(r, k=len(r))])

    ratios = sorted(pooled_median(a_rounds) / pooled_median(b_rounds) for _ in range(draws))
    tail = (1 - level) / 2
    low = ratios[min(draws - 1, int(tail * draws))]
    high = ratios[max(0, min(draws - 1, int((1 - tail) * draws) - 1))]
    return low, high


def fmt_rounds(ratios: Sequence[float]) -> str:
    return "/".join(f"{r:.2f}" for r in ratios)


def fmt_interval(interval: tuple[float, float] | None) -> str:
    return "" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}"
