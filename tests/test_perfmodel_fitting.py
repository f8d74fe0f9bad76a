"""Fitting recovers known lambda / alpha / beta from noisy synthetic samples; profiling is cached."""

from __future__ import annotations

import json
import random

import pytest

from fusionnet.perfmodel.fitting import fit_link, fit_speed_factor, refine_speed_factor
from fusionnet.profiling import hardware as profile_mod


def test_speed_factor_recovered_from_noisy_samples_with_outliers():
    rng = random.Random(0)
    peak, lam = 50e12, 0.37
    samples = []
    for _ in range(60):
        flops = rng.uniform(1e9, 1e12)
        samples.append((flops, flops / (peak * lam) * rng.gauss(1.0, 0.03)))
    # a few runs preempted by something else: 3-10x slower
    samples += [(f, t * rng.uniform(3, 10)) for f, t in samples[:5]]
    assert fit_speed_factor(samples, peak) == pytest.approx(lam, rel=0.02)


def test_speed_factor_exact_without_noise_and_errors():
    samples = [(1e9 * k, 1e9 * k / (1e12 * 0.5)) for k in range(1, 5)]
    assert fit_speed_factor(samples, 1e12) == pytest.approx(0.5, rel=1e-9)
    with pytest.raises(ValueError, match="non-empty"):
        fit_speed_factor([], 1e12)
    with pytest.raises(ValueError, match=r"samples\[1\]"):
        fit_speed_factor([(1e9, 1.0), (1e9, -1.0)], 1e12)
    with pytest.raises(ValueError, match="peak_flops"):
        fit_speed_factor(samples, 0)
    with pytest.raises(ValueError, match="0 FLOPs"):
        fit_speed_factor([(0, 1.0)], 1e12)


def test_refine_moves_geometrically_toward_the_observation():
    # predicted 1 s with lambda 0.5 but took 2 s: the observation says lambda 0.25
    assert refine_speed_factor(0.5, measured=2.0, predicted=1.0, weight=1.0) == pytest.approx(0.25)
    assert refine_speed_factor(0.5, measured=2.0, predicted=1.0, weight=0.0) == pytest.approx(0.5)
    half = refine_speed_factor(0.5, measured=2.0, predicted=1.0, weight=0.5)
    assert half == pytest.approx(0.5 * 0.5**0.5)
    # symmetric in ratio: 2x faster moves up by the same factor
    assert refine_speed_factor(0.5, 0.5, 1.0, 0.5) / 0.5 == pytest.approx(0.5 / half)
    # repeated refinement converges to the truth
    lam = 0.9
    for _ in range(60):
        lam = refine_speed_factor(lam, measured=1.0 / (1e12 * 0.3), predicted=1.0 / (1e12 * lam), weight=0.3)
    assert lam == pytest.approx(0.3, rel=1e-4)
    with pytest.raises(ValueError, match="weight"):
        refine_speed_factor(0.5, 1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="measured"):
        refine_speed_factor(0.5, 0.0, 1.0)


def test_link_recovered_from_noisy_samples():
    rng = random.Random(1)
    alpha, beta = 2e-3, 1 / 1.25e8  # 2 ms, 1 Gbps
    samples = []
    for _ in range(80):
        nbytes = rng.choice([1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 5e7])
        samples.append((nbytes, (alpha + beta * nbytes) * rng.gauss(1.0, 0.02)))
    samples += [(1e6, 0.5), (1e2, 0.2)]  # two stalls
    link = fit_link(samples)
    assert link.alpha == pytest.approx(alpha, rel=0.05)
    assert link.beta == pytest.approx(beta, rel=0.05)


def test_link_fit_is_non_negative():
    # decreasing times would give a negative slope: clamp beta to 0, alpha = mean
    link = fit_link([(1e3, 0.02), (1e6, 0.01)])
    assert link.beta == 0.0 and link.alpha > 0
    # a line through the origin would need a negative intercept: clamp alpha
    link = fit_link([(1e6, 0.001), (2e6, 0.003), (3e6, 0.005)])
    assert link.alpha == 0.0 and link.beta > 0
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_link([(1e6, 0.1), (1e6, 0.12)])


@pytest.mark.timeout(120)
def test_profile_local_device_measures_and_caches(tmp_path, monkeypatch):
    first = profile_mod.profile_local_device(0.3, tmp_path)
    assert first.peak_flops > 1e8 and 0 < first.speed_factor <= 1.0 + 1e-9 and first.mem_bandwidth > 1e8
    files = list(tmp_path.glob("profile-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["key"]["torch_threads"] >= 1 and doc["result"]["peak_flops"] == first.peak_flops

    def no_measuring(_budget):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(profile_mod, "_measure", no_measuring)
    assert profile_mod.profile_local_device(0.3, tmp_path) == first
    files[0].write_text("{not json")
    monkeypatch.undo()
    again = profile_mod.profile_local_device(0.2, tmp_path)  # a broken cache is measured again
    assert again.peak_flops > 0
    with pytest.raises(ValueError, match="seconds_budget"):
        profile_mod.profile_local_device(0, tmp_path)
