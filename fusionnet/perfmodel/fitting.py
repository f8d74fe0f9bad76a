"""Fitting the model to measurements: lambda_p from timed ops, alpha-beta from timed transfers.

- ``fit_speed_factor``: the model says ``t = FLOPs / (S* lambda)``; the fit is least squares through
  the origin on relative residuals (timings are noisy in proportion to their size), made robust by
  iteratively reweighting with Huber weights so one preempted run does not drag lambda down.
- ``refine_speed_factor``: online update from one measured sub-task time against the prediction
  made with the previous lambda, smoothed geometrically (a ratio, so 2x too slow and 2x too fast
  move lambda by the same factor).
- ``fit_link``: non-negative least squares for ``t = alpha + beta * bytes`` with the same robust
  reweighting; a negative coefficient is clamped to zero and the other refitted alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fusionnet.perfmodel.types import Link

HUBER_K = 1.345  # classic Huber constant, in robust standard deviations
ROBUST_ROUNDS = 20


def _check_samples(samples: Sequence[tuple[float, float]], what: str) -> list[tuple[float, float]]:
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)) or not samples:
        raise ValueError(f"{what}: need a non-empty list of (size, seconds) samples")
    out = []
    for i, sample in enumerate(samples):
        try:
            x, t = (float(v) for v in sample)
        except (TypeError, ValueError):
            raise ValueError(f"{what}: samples[{i}] must be a pair of numbers, got {sample!r}") from None
        if not (math.isfinite(x) and math.isfinite(t)) or x < 0 or t <= 0:
            raise ValueError(f"{what}: samples[{i}] = {sample!r} needs size >= 0 and seconds > 0")
        out.append((x, t))
    return out


def _huber_weights(residuals: list[float]) -> list[float]:
    """Huber weights from residuals scaled by their median absolute deviation."""
    mad = sorted(abs(r) for r in residuals)[len(residuals) // 2] / 0.6745
    if mad <= 1e-15:
        return [1.0] * len(residuals)
    c = HUBER_K * mad
    return [1.0 if abs(r) <= c else c / abs(r) for r in residuals]


def fit_speed_factor(samples: Sequence[tuple[float, float]], peak_flops: float) -> float:
    """lambda_p such that ``FLOPs / (peak_flops * lambda)`` best predicts the measured seconds."""
    data = _check_samples(samples, "fit_speed_factor")
    if not (isinstance(peak_flops, (int, float)) and math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"fit_speed_factor: peak_flops must be positive, got {peak_flops!r}")
    data = [(f, t) for f, t in data if f > 0]
    if not data:
        raise ValueError("fit_speed_factor: every sample has 0 FLOPs; nothing to fit")
    # t = k * f, relative residual r = (t - k f) / t; minimise sum w r^2 -> k = sum(w f/t) / sum(w f^2/t^2)
    xs = [f / t for f, t in data]  # so that r = 1 - k * x
    k = sorted(1.0 / x for x in xs)[len(xs) // 2]  # start from the median ratio
    for _ in range(ROBUST_ROUNDS):
        w = _huber_weights([1.0 - k * x for x in xs])
        new_k = sum(wi * x for wi, x in zip(w, xs)) / sum(wi * x * x for wi, x in zip(w, xs))
        if abs(new_k - k) <= 1e-12 * k:
            k = new_k
            break
        k = new_k
    return 1.0 / (k * peak_flops)


def refine_speed_factor(prev: float, measured: float, predicted: float, weight: float = 0.2) -> float:
    """New lambda after a sub-task predicted to take ``predicted`` seconds (with ``prev``) took
    ``measured``: ``prev * (predicted / measured) ** weight``."""
    for name, value in (("prev", prev), ("measured", measured), ("predicted", predicted)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"refine_speed_factor: {name} must be a positive number, got {value!r}")
    if not (isinstance(weight, (int, float)) and 0.0 <= weight <= 1.0):
        raise ValueError(f"refine_speed_factor: weight must be in [0, 1], got {weight!r}")
    return prev * (predicted / measured) ** weight


def _weighted_line(data: list[tuple[float, float]], w: list[float]) -> tuple[float, float]:
    """Weighted least squares t = a + b x, clamped to a, b >= 0."""
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, data)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, data)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, data))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, data))
    b = sxt / sxx if sxx > 0 else 0.0
    a = mt - b * mx
    if b < 0:
        return max(mt, 0.0), 0.0
    if a < 0:
        sxx0 = sum(wi * x * x for wi, (x, _) in zip(w, data))
        return 0.0, (sum(wi * x * t for wi, (x, t) in zip(w, data)) / sxx0 if sxx0 > 0 else 0.0)
    return a, b


def fit_link(samples: Sequence[tuple[float, float]]) -> Link:
    """Alpha-beta link from (bytes, seconds) samples; needs at least two distinct sizes."""
    data = _check_samples(samples, "fit_link")
    if len({x for x, _ in data}) < 2:
        raise ValueError("fit_link: need samples at two or more distinct sizes to separate alpha from beta")
    w = [1.0] * len(data)
    a, b = _weighted_line(data, w)
    for _ in range(ROBUST_ROUNDS):
        # relative residuals: small messages are latency-bound and must not be drowned by big ones
        w = _huber_weights([(t - (a + b * x)) / t for x, t in data])
        na, nb = _weighted_line(data, [wi / (t * t) for wi, (_, t) in zip(w, data)])
        if abs(na - a) <= 1e-15 + 1e-12 * abs(a) and abs(nb - b) <= 1e-21 + 1e-12 * abs(b):
            a, b = na, nb
            break
        a, b = na, nb
    return Link(alpha=a, beta=b)
