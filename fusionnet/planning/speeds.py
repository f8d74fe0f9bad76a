"""How fast each compnode really runs, refined online from measured sub-task times (FusionAI 3.7).

A compnode announces the profile it took when it started (λp from a short matmul, memory bandwidth,
fixed per-op costs). What it achieves on real sub-DAGs can differ: other programs share the machine,
the profile ran on a cold or boosted CPU, the device throttles. After every step the broker knows, per
sub-DAG, the FP+BP+Update seconds its compnode measured and the seconds the model predicted when the
placement was planned; ``SpeedBook`` turns the ratio into a per-compnode *slowness* (1 = as profiled,
2 = twice as slow), smoothed geometrically (``fusionnet.perfmodel.fitting.refine_speed_factor``: a
ratio, so 2x too slow and 2x too fast move it by the same factor, and one preempted step moves it
little), and every later placement plans with the profile scaled by it (``DeviceSpec.scaled``: speed,
bandwidth and fixed costs together). It is kept per broker, so the next job starts from what the
previous ones learnt.
"""

from __future__ import annotations

import logging

from fusionnet.perfmodel.fitting import refine_speed_factor
from fusionnet.perfmodel.types import DeviceSpec

log = logging.getLogger("fusionnet.planning.speeds")

WEIGHT = 0.2  # how far one step's evidence moves the estimate (geometric)
CLAMP = (0.05, 20.0)  # a slowness beyond this is a broken measurement, not a device
MIN_SECONDS = 5e-4  # shorter sub-tasks are timer and scheduling noise


class SpeedBook:
    def __init__(self, weight: float = WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._slowness: dict[str, float] = {}

    def slowness(self, peer: str) -> float:
        return self._slowness.get(peer, 1.0)

    def device(self, peer: str, announced: DeviceSpec) -> DeviceSpec:
        """The announced profile as this compnode has been measured to run."""
        slowness = self.slowness(peer)
        return announced if slowness == 1.0 else announced.scaled(1.0 / slowness)

    def observe(self, peer: str, planned_slowness: float, predicted: float, measured: float) -> float:
        """One sub-task of ``peer`` took ``measured`` seconds where the model, planning with
        ``planned_slowness``, predicted ``predicted``. Returns the new slowness."""
        if predicted < MIN_SECONDS or measured < MIN_SECONDS:
            return self.slowness(peer)
        current = self.slowness(peer)
        # The slowness that would have predicted this measurement exactly ...
        evidence = planned_slowness * measured / predicted
        # ... blended into the current estimate (refine_speed_factor works on speeds: invert).
        speed = refine_speed_factor(1.0 / current, evidence, current, self.weight)
        new = min(max(1.0 / speed, CLAMP[0]), CLAMP[1])
        if abs(new / current - 1.0) > 0.1:
            log.info("compnode %s runs at %.2fx its announced time (was %.2fx)", peer, new, current)
        self._slowness[peer] = new
        return new

    def forget(self, peer: str) -> None:
        self._slowness.pop(peer, None)
