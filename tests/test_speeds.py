"""Online refinement of compnode speeds from measured sub-task times (pure)."""

from __future__ import annotations

import pytest

from fusionnet.planning.speeds import CLAMP, SpeedBook
from tests.planning_support import OVERHEADS, device


def test_converges_to_the_measured_slowness_and_scales_the_profile() -> None:
    book = SpeedBook()
    assert book.slowness("p") == 1.0
    for _ in range(60):  # always planned with the current estimate, measured 3x slower than announced
        planned = book.slowness("p")
        book.observe("p", planned, predicted=0.01 * planned, measured=0.03)
    assert book.slowness("p") == pytest.approx(3.0, rel=1e-3)
    announced = device("p", flops=1e11, overheads=OVERHEADS)
    slow, s = book.device("p", announced), book.slowness("p")
    assert slow.speed == pytest.approx(announced.speed / s)
    assert slow.mem_bandwidth == pytest.approx(announced.mem_bandwidth / s)
    assert slow.overheads.matmul.fp == pytest.approx(announced.overheads.matmul.fp * s)
    assert book.device("q", announced) is announced  # nothing learnt: the announced profile


def test_one_outlier_moves_it_little_and_noise_is_ignored() -> None:
    book = SpeedBook()
    book.observe("p", 1.0, predicted=0.01, measured=0.1)  # one preempted step, 10x
    assert 1.0 < book.slowness("p") < 10**0.2 + 1e-9
    before = book.slowness("p")
    book.observe("p", before, predicted=1e-5, measured=1.0)  # too short to mean anything
    assert book.slowness("p") == before
    for _ in range(500):
        book.observe("x", book.slowness("x"), predicted=1.0, measured=1e6)
    assert book.slowness("x") == CLAMP[1]
    book.forget("x")
    assert book.slowness("x") == 1.0
    with pytest.raises(ValueError):
        SpeedBook(weight=0)
