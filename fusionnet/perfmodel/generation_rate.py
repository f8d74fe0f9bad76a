"""Eq. (3) and (4) for a deployment that generates text: live sessions, not independent batches.

Eq. (4) prices ``n_b`` independent batches: after the first comes out, one more leaves the pipeline every
``max_p max(C_p, R_p)``. Autoregressive decoding is not that workload. A session's next row exists only
once its last row has come out of the last stage and its token has been sampled, so ``S`` live sessions
fill at most ``k`` batches (full ones of ``max_batch`` rows, then the rest, as the batcher fills them),
and a batch's rows go round again only after the batch's whole pass. One round of the ``k`` batches
takes the longer of

- one batch's pass: the call that brings its rows from the broker and takes the answer back, then eq. (4)
  over its micro-batches (a batch of ``b`` rows is ``ceil(b / mb_rows)`` micro-batches of the traced
  size, the last one padded, so a short batch costs as much as a full micro-batch);
- the bottleneck's busy time: the round's micro-batches, each ``max_p max(C_p, R_p)``;

and carries ``min(S, k * max_batch)`` rows, a token each. With ``S >= p * max_batch`` sessions, ``k = p``
and a pass shorter than the bottleneck's busy time, the rate reaches eq. (4)'s asymptote
``max_batch / (m * max_p max(C_p, R_p))``; with fewer sessions it is bounded by the pass, as eq. (3) is.
The prompts come first: with KV caches each prompt token is a row, in rounds of full batches.

``k`` is what the deployment's batcher runs (``batches_in_flight``): a batch goes beside a running one
only when the live sessions cannot all ride in the running ones (``serving.batching``), up to the
deployment's ``in_flight``. Pure: numbers in, numbers out; the broker supplies the plan's per-stage
figures and the measured call round trip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fusionnet.errors import PlanError
from fusionnet.perfmodel.timing import latency_eq3, pipelined_eq4


@dataclass(frozen=True)
class GenerationRate:
    """The model's figures for ``sessions`` sessions generating at once (seconds, rows, tokens/s)."""

    sessions: int
    batches_in_flight: int  # k
    rows_per_batch: int  # in a decode round
    microbatches_per_batch: int  # in a decode round
    pass_seconds: float  # one decode batch: call round trip + eq. (4) over its micro-batches
    bottleneck_seconds: float  # one micro-batch at the slowest stage or link, max_p max(C_p, R_p)
    round_seconds: float  # a decode round: max(pass, k * micro-batches * bottleneck)
    prefill_seconds: float  # every session's prompt rows, in full rounds
    seconds: float  # prefill + (new_tokens - 1) decode rounds
    tokens_per_s: float  # sessions * new_tokens / seconds
    bound: str  # decode rounds: "pass" (too few sessions to fill the pipeline) or "bottleneck"

    def to_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")
    return value


def batches_in_flight(sessions: int, max_batch: int, in_flight: int) -> int:
    """The batches the batcher keeps in the pipeline for ``sessions`` live sessions: one more only when
    the running ones cannot carry every session, at most ``in_flight``."""
    _positive_int("sessions", sessions)
    _positive_int("max_batch", max_batch)
    _positive_int("in_flight", in_flight)
    return min(in_flight, -(-sessions // max_batch))


def generation_rate(
    fp_seconds: Sequence[float],
    comm_seconds: Sequence[float],
    *,
    mb_rows: int,
    sessions: int,
    max_batch: int,
    in_flight: int,
    call_seconds: float = 0.0,
    prompt_rows: int = 1,
    new_tokens: int = 1,
) -> GenerationRate:
    """Tokens per second of ``sessions`` sessions, each a prompt of ``prompt_rows`` tokens and
    ``new_tokens`` generated ones, decoding together on a pipeline whose stage ``p`` takes
    ``fp_seconds[p]`` (C_p) per micro-batch of ``mb_rows`` rows and receives its inputs in
    ``comm_seconds[p]`` (R_p); ``call_seconds`` is the broker's round trip to the pipeline's ends (the
    batch's rows out to the first stage, the answer back from the last).

    With KV caches a row is one position: the prompts' rows go first (prefill, in rounds of full
    batches; the last prompt row gives the first token), then each further token is one round of a row
    per session."""
    _positive_int("mb_rows", mb_rows)
    _positive_int("prompt_rows", prompt_rows)
    _positive_int("new_tokens", new_tokens)
    if not fp_seconds:
        raise PlanError("a pipeline needs at least one stage")
    if not (math.isfinite(call_seconds) and call_seconds >= 0):
        raise PlanError(f"call_seconds must be a finite non-negative number, got {call_seconds!r}")
    k = batches_in_flight(sessions, max_batch, in_flight)
    latency_eq3(fp_seconds, comm_seconds)  # checks the pairs
    bottleneck = max(max(fp_seconds), max(comm_seconds))

    def round_of(rows: int) -> tuple[float, float, int, int]:
        """(round seconds, pass seconds, rows and micro-batches of its biggest batch) of ``rows`` rows
        (at most ``k * max_batch``) in batches as the batcher fills them: full ones, then the rest."""
        full, rest = divmod(rows, max_batch)
        batches = [max_batch] * full + ([rest] if rest else [])
        micro = [-(-b // mb_rows) for b in batches]
        pass_seconds = call_seconds + pipelined_eq4(fp_seconds, comm_seconds, max(micro))
        return max(pass_seconds, sum(micro) * bottleneck), pass_seconds, batches[0], max(micro)

    def rows_seconds(rows: int) -> float:
        """``rows`` rows in as many rounds of at most ``k * max_batch`` as they need."""
        full, rest = divmod(rows, k * max_batch)
        return full * round_of(k * max_batch)[0] + (round_of(rest)[0] if rest else 0.0)

    decode_rows = min(sessions, k * max_batch)
    round_seconds, pass_seconds, per_batch, m = round_of(decode_rows)
    prefill = rows_seconds(sessions * prompt_rows)
    seconds = prefill + (new_tokens - 1) * rows_seconds(sessions)
    return GenerationRate(
        sessions=sessions,
        batches_in_flight=k,
        rows_per_batch=per_batch,
        microbatches_per_batch=m,
        pass_seconds=pass_seconds,
        bottleneck_seconds=bottleneck,
        round_seconds=round_seconds,
        prefill_seconds=prefill,
        seconds=seconds,
        tokens_per_s=sessions * new_tokens / seconds if seconds > 0 else math.inf,
        bound="pass" if pass_seconds >= round_seconds else "bottleneck",
    )


def asymptote_tokens_per_s(
    fp_seconds: Sequence[float], comm_seconds: Sequence[float], *, max_batch: int, mb_rows: int
) -> float:
    """Eq. (4)'s limit for full batches of ``max_batch`` rows, sessions without end: one batch per
    ``m * max_p max(C_p, R_p)``. What a pipeline reaches only with ``p`` full batches in flight."""
    latency_eq3(fp_seconds, comm_seconds)
    m = -(-_positive_int("max_batch", max_batch) // _positive_int("mb_rows", mb_rows))
    bottleneck = max(max(fp_seconds), max(comm_seconds))
    return max_batch / (m * bottleneck) if bottleneck > 0 else math.inf
