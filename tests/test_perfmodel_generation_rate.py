"""``perfmodel.generation_rate``: eq. (3)/(4) for live decoding sessions, against hand-worked cases and
against an independent event simulation of batches circulating through a pipeline."""

from __future__ import annotations

import random

import pytest

from fusionnet.errors import PlanError
from fusionnet.perfmodel.generation_rate import asymptote_tokens_per_s, batches_in_flight, generation_rate


def circulate(
    fp: list[float],
    comm: list[float],
    *,
    mb_rows: int,
    sessions: int,
    max_batch: int,
    in_flight: int,
    call: float,
    rounds: int = 200,
) -> float:
    """Tokens/s of a closed pipeline, simulated: k batches (full ones, then the rest) circulate; each
    batch's micro-batches cross link p (R_p) then stage p (C_p), every link and stage a server taking
    one micro-batch at a time in arrival order; a batch comes back (half the call out, half back) once
    its last micro-batch has left the last stage, and its sessions' next rows go in again at once.
    Measured over the second half."""
    k = min(in_flight, -(-sessions // max_batch))
    total = min(sessions, k * max_batch)
    sizes = [max_batch] * (total // max_batch) + ([total % max_batch] if total % max_batch else [])
    free = [0.0] * (2 * len(fp))
    ready = [0.0] * len(sizes)
    done: list[tuple[float, float]] = []
    for _ in range(rounds):
        for b in sorted(range(len(sizes)), key=lambda b: ready[b]):
            t_in, out = ready[b] + call / 2, 0.0
            for _mb in range(-(-sizes[b] // mb_rows)):
                t = t_in
                for p in range(len(fp)):
                    for server, seconds in ((2 * p, comm[p]), (2 * p + 1, fp[p])):
                        t = max(t, free[server]) + seconds
                        free[server] = t
                out = t
            ready[b] = out + call / 2
            done.append((ready[b], float(sizes[b])))
    done.sort()
    half = len(done) // 2
    return sum(n for _, n in done[half + 1 :]) / (done[-1][0] - done[half][0])


def test_one_session_is_a_pass_per_token() -> None:
    rate = generation_rate(
        [0.010, 0.020], [0.0, 0.005], mb_rows=16, sessions=1, max_batch=16, in_flight=2, call_seconds=0.010
    )
    assert rate.batches_in_flight == 1 and rate.rows_per_batch == 1 and rate.microbatches_per_batch == 1
    assert rate.pass_seconds == pytest.approx(0.010 + 0.010 + 0.020 + 0.005)
    assert rate.tokens_per_s == pytest.approx(1 / 0.045)
    assert rate.bound == "pass"


def test_a_short_batch_costs_a_whole_micro_batch() -> None:
    """Rows are padded to the traced micro-batch: 4 sessions take as long per pass as 16 do."""
    kw = {"mb_rows": 16, "max_batch": 16, "in_flight": 1, "call_seconds": 0.0}
    four = generation_rate([0.01, 0.01, 0.01], [0, 0, 0], sessions=4, **kw)
    sixteen = generation_rate([0.01, 0.01, 0.01], [0, 0, 0], sessions=16, **kw)
    assert four.pass_seconds == sixteen.pass_seconds == pytest.approx(0.03)
    assert sixteen.tokens_per_s == pytest.approx(4 * four.tokens_per_s)


def test_micro_batches_of_a_batch_are_pipelined_by_eq_4() -> None:
    rate = generation_rate([0.01, 0.03], [0.0, 0.002], mb_rows=4, sessions=16, max_batch=16, in_flight=1)
    assert rate.microbatches_per_batch == 4
    assert rate.pass_seconds == pytest.approx(0.01 + 0.03 + 0.002 + 3 * 0.03)


def test_prompts_go_first_in_full_rounds() -> None:
    """16 sessions of 8-token prompts and 16 new tokens, batches of 16: the 128 prompt rows take 8
    full rounds, then each of the 15 further tokens one round of 16 rows."""
    kw = {"mb_rows": 16, "sessions": 16, "max_batch": 16, "in_flight": 2, "call_seconds": 0.01}
    one = generation_rate([0.01, 0.02], [0.0, 0.001], **kw)
    both = generation_rate([0.01, 0.02], [0.0, 0.001], **kw, prompt_rows=8, new_tokens=16)
    assert one.round_seconds == both.round_seconds == pytest.approx(0.041)
    assert both.prefill_seconds == pytest.approx(8 * 0.041)
    assert both.seconds == pytest.approx(23 * 0.041)
    assert both.tokens_per_s == pytest.approx(256 / (23 * 0.041))
    # 20 sessions with batches of 8 and two in flight: decode rounds of 16 rows and of 4
    more = generation_rate([0.01], [0.0], mb_rows=8, sessions=20, max_batch=8, in_flight=2, new_tokens=3)
    assert more.batches_in_flight == 2
    full, rest = 2 * 0.01, 0.01  # two full batches (bottleneck-bound), then one of 4 rows (a pass)
    assert more.seconds == pytest.approx(3 * (full + rest))


@pytest.mark.parametrize(
    ("sessions", "max_batch", "in_flight", "k"),
    [(1, 16, 2, 1), (16, 16, 2, 1), (17, 16, 2, 2), (32, 16, 2, 2), (100, 16, 2, 2), (100, 16, 3, 3)],
)
def test_batches_in_flight_follow_the_batcher(sessions: int, max_batch: int, in_flight: int, k: int) -> None:
    """A batch goes beside a running one only when the running ones cannot carry every session."""
    assert batches_in_flight(sessions, max_batch, in_flight) == k


def test_enough_sessions_reach_the_asymptote() -> None:
    """p full batches in flight keep the bottleneck busy: eq. (4)'s limit, and no more."""
    fp, comm = [0.010, 0.012, 0.008], [0.0, 0.001, 0.001]
    rate = generation_rate(fp, comm, mb_rows=16, sessions=48, max_batch=16, in_flight=3)
    assert rate.bound == "bottleneck"
    limit = asymptote_tokens_per_s(fp, comm, max_batch=16, mb_rows=16)
    assert limit == pytest.approx(16 / 0.012)
    assert rate.tokens_per_s == pytest.approx(limit)
    fewer = generation_rate(fp, comm, mb_rows=16, sessions=16, max_batch=16, in_flight=3)
    assert fewer.tokens_per_s < 0.5 * limit  # one batch at a time: bounded by its pass


def test_agrees_with_an_event_simulation() -> None:
    rng = random.Random(7)
    for _ in range(60):
        p = rng.randint(1, 4)
        fp = [rng.uniform(0.001, 0.02) for _ in range(p)]
        comm = [rng.choice([0.0, rng.uniform(0.0, 0.01)]) for _ in range(p)]
        max_batch, in_flight = rng.choice([4, 8, 16]), rng.randint(1, 4)
        kw = {
            "mb_rows": rng.choice([1, 4, 8, 16]),
            "sessions": rng.randint(1, in_flight * max_batch),  # every session in every round
            "max_batch": max_batch,
            "in_flight": in_flight,
        }
        call = rng.uniform(0.0, 0.02)
        model = generation_rate(fp, comm, call_seconds=call, **kw).tokens_per_s
        assert circulate(fp, comm, call=call, **kw) == pytest.approx(model, rel=0.01), (fp, comm, call, kw)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"mb_rows": 0}, "mb_rows"),
        ({"sessions": 0}, "sessions"),
        ({"in_flight": True}, "in_flight"),
        ({"call_seconds": -1.0}, "call_seconds"),
        ({"call_seconds": float("nan")}, "call_seconds"),
        ({"prompt_rows": 0}, "prompt_rows"),
        ({"new_tokens": -1}, "new_tokens"),
    ],
)
def test_bad_figures_are_refused(kwargs: dict[str, object], words: str) -> None:
    args: dict[str, object] = {"mb_rows": 4, "sessions": 4, "max_batch": 4, "in_flight": 1} | kwargs
    with pytest.raises(PlanError, match=words):
        generation_rate([0.01], [0.0], **args)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="C_p per R_p"):
        generation_rate([0.01, 0.02], [0.0], mb_rows=4, sessions=4, max_batch=4, in_flight=1)
    with pytest.raises(PlanError, match="at least one stage"):
        generation_rate([], [], mb_rows=4, sessions=4, max_batch=4, in_flight=1)
