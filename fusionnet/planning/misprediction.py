"""When measured step times contradict the plan's prediction enough to look at the placement again.

A plan is only as good as the figures it was made with: a compnode slower than it announced, a link
slower than the loopback figures a never-probed backup was priced at (issue 16: a failover onto such a
backup ran 4.7x slower than predicted and nothing re-planned). ``PredictionWatch`` compares each step's
measured wall time with the placement's predicted step and says when the two disagree by more than
``tolerance`` (25%) for ``patience`` steps in a row. Hysteresis, so that a noisy machine does not make
the job hop between placements:

- the first ``warmup`` steps after a placement are not judged (allocator warm-up, first connections),
  nor steps shorter than ``min_seconds`` (below);
- after a look (whatever its outcome) the next ``cooldown`` steps are not judged either;
- the caller re-predicts the current placement with what it learnt (measured speeds, probed links) and
  hands that figure back with ``repredicted``: a plan that is slow but correctly priced now is not
  re-planned again and again, and a new placement must beat the re-predicted figure by the broker's
  ``--replan-gain`` to be adopted (``placement.worth_replanning``).

Pure bookkeeping on numbers: tested in-process (``tests/test_misprediction.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOLERANCE = 0.25  # issue 16: |measured - predicted| / measured above this is a contradiction
PATIENCE = 2  # contradicting steps in a row before the placement is looked at again
WARMUP = 1  # steps after a placement that are not judged
COOLDOWN = 3  # steps after a look that are not judged
# Steps shorter than this are not judged: a re-plan costs a state collection and a new assignment (a
# few hundred ms at the least), which such a job cannot win back, and their time is mostly fixed costs
# and scheduling noise, which the model prices coarsely.
MIN_SECONDS = 0.2


@dataclass
class PredictionWatch:
    tolerance: float = TOLERANCE
    patience: int = PATIENCE
    warmup: int = WARMUP
    cooldown: int = COOLDOWN
    min_seconds: float = MIN_SECONDS
    predicted: float | None = None
    _skip: int = field(default=WARMUP, init=False)
    _strikes: int = field(default=0, init=False)
    looks: int = field(default=0, init=False)  # how often the watch asked for a look (for status/tests)

    def __post_init__(self) -> None:
        if self.tolerance <= 0 or self.patience < 1 or self.warmup < 0 or self.cooldown < 0:
            raise ValueError("tolerance > 0, patience >= 1, warmup >= 0 and cooldown >= 0 are required")
        self._skip = self.warmup

    def placed(self, predicted: float | None) -> None:
        """A (new) placement with this predicted step (None: the model could not say; nothing is judged)."""
        self.predicted = predicted
        self._skip = self.warmup
        self._strikes = 0

    def repredicted(self, predicted: float | None) -> None:
        """The current placement priced again with what was learnt since it was planned."""
        if predicted is not None and predicted > 0:
            self.predicted = predicted

    def contradicts(self, predicted: float | None, other: float | None) -> bool:
        """Whether two figures for one step (the plan's and one priced later on probed links, say) differ
        by more than the tolerance."""
        if predicted is None or other is None or predicted <= 0 or other <= 0:
            return False
        return abs(self.error(predicted, other)) > self.tolerance

    @staticmethod
    def error(predicted: float, measured: float) -> float:
        """Relative error of the prediction: (measured - predicted) / measured, as issue 16 counts it."""
        return (measured - predicted) / measured

    def observe(self, measured: float) -> bool:
        """One step took ``measured`` seconds. True when the placement should be looked at now."""
        if self.predicted is None or self.predicted <= 0 or measured < self.min_seconds:
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        if abs(self.error(self.predicted, measured)) <= self.tolerance:
            self._strikes = 0
            return False
        self._strikes += 1
        if self._strikes < self.patience:
            return False
        self._strikes = 0
        self._skip = self.cooldown
        self.looks += 1
        return True
