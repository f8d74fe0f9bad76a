"""The serving layer in one process (no swarm): dynamic batching (max batch, bounded queue, batches in
flight), sampling, the HTTP API's answers and errors over a deployment whose batches run a local model,
greedy generation through padding equal to ``transformers``' ``generate()``, server-sent events, and the
compnode's ``pick`` of each row's last position."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from safetensors.torch import load as load_st
from safetensors.torch import save as save_st

from fusionnet.compnode.serve_steps import kept, picked
from fusionnet.errors import ExecutionError, JobError
from fusionnet.serving.answers import Overloaded, Oversized, RowAnswers, RowsFailed
from fusionnet.serving.batching import BatchStats, DynamicBatcher
from fusionnet.serving.generation import Window, generate
from fusionnet.serving.http import CLIENT_GONE, build_app, start_api
from fusionnet.serving.kv_sessions import SlotPool
from fusionnet.serving.sampling import SamplingParams, generator_for, next_token
from fusionnet.serving.served import ServedModel
from fusionnet.serving.tokenizers import CharTokenizer
from tests.serving_support import answer_rows

pytestmark = pytest.mark.timeout(120)


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def _until(condition: Callable[[], bool], deadline: float = 10.0) -> None:
    """Yields to the event loop until ``condition`` holds, failing after ``deadline`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    while not condition():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.001)


# ---- batching ----------------------------------------------------------------------------------------
def test_batcher_packs_rows_up_to_max_batch_and_answers_each_request_its_rows() -> None:
    seen: list[int] = []

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        seen.append(int(rows.shape[0]))
        await asyncio.sleep(0)
        return rows * 10

    async def main() -> list[torch.Tensor]:
        b = DynamicBatcher(run_batch, max_batch=4, max_wait=0.05, queue_limit=100)
        b.start()
        try:
            return await asyncio.gather(*(b.submit(torch.full((1, 2), float(i))) for i in range(10)))
        finally:
            await b.close()

    outs = _run(main())
    assert [o[0, 0].item() for o in outs] == [10.0 * i for i in range(10)]
    assert max(seen) <= 4 and sum(seen) == 10 and len(seen) < 10  # rows shared batches


def _sessions(
    b: DynamicBatcher, turns: list[int], rounds: list[int], use_caller: bool
) -> list[Awaitable[None]]:
    """Sessions that each submit one row per round; session ``i`` takes ``turns[i]`` event-loop turns
    between an answer and its next row (sampling, writing to its stream)."""

    async def session(i: int) -> None:
        async def rounds_with(submit: Callable[..., Awaitable[torch.Tensor]]) -> None:
            for _ in range(rounds[i]):
                await submit(torch.full((1, 1), float(i)), [0])
                for _ in range(turns[i]):
                    await asyncio.sleep(0)

        if use_caller:
            async with b.caller() as submit:
                await rounds_with(submit)
        else:
            await rounds_with(b.submit)

    return [session(i) for i in range(len(turns))]


@pytest.mark.parametrize("use_caller", [True, False])
def test_an_idle_pipeline_waits_for_the_sessions_coming_back_and_only_for_them(use_caller: bool) -> None:
    """Four sessions in lockstep, one batch in flight: with ``caller()`` every batch carries all four
    rows although they come back several turns apart, and the wait ends when the last one is in, not at
    ``max_wait`` (5 s here; the whole exchange must end within 3 s). A session that leaves ends the wait
    for it at once. Plain ``submit`` gets no wait: the first row back runs alone."""
    seen: list[int] = []

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        seen.append(int(rows.shape[0]))
        await asyncio.sleep(0)
        return rows

    async def main() -> None:
        b = DynamicBatcher(run_batch, max_batch=8, max_wait=5.0, queue_limit=100, in_flight=1)
        b.start()
        try:
            # session 3 leaves after two rounds, while the others are away
            sessions = _sessions(b, turns=[1, 4, 9, 2], rounds=[4, 4, 4, 2], use_caller=use_caller)
            await asyncio.wait_for(asyncio.gather(*sessions), 3.0)
        finally:
            await b.close()

    _run(main())
    assert sum(seen) == 14
    if use_caller:
        assert seen == [4, 4, 3, 3]
    else:
        assert seen[1] == 1 and len(seen) > 4  # the first row back went alone: sessions fell apart


def test_a_session_that_does_not_come_back_in_time_is_waited_for_once() -> None:
    """A stalled stream (a session that sends its next row only once the others are through) makes one
    batch wait for it in vain (the wait is bounded by ``max_wait`` here, batches being instant); then it
    is not waited for again, and the other sessions' batches go without it."""
    seen: list[int] = []

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        seen.append(int(rows.shape[0]))
        await asyncio.sleep(0)
        return rows

    others_done = asyncio.Event()

    async def stalled(b: DynamicBatcher) -> None:
        async with b.caller() as submit:
            await submit(torch.zeros(1, 1), [0])
            await others_done.wait()  # its stream stalls until the other sessions are through
            await submit(torch.zeros(1, 1), [0])

    async def others(b: DynamicBatcher) -> None:
        await asyncio.gather(*_sessions(b, turns=[1, 2, 3], rounds=[6, 6, 6], use_caller=True))
        others_done.set()

    stats: list[BatchStats] = []

    async def main() -> int:
        b = DynamicBatcher(
            run_batch, max_batch=8, max_wait=0.5, queue_limit=100, in_flight=1, on_batch=stats.append
        )
        b.start()
        try:
            await asyncio.wait_for(asyncio.gather(stalled(b), others(b)), 5.0)
        finally:
            await b.close()
        return b.away_timeouts

    assert _run(main()) == 1
    assert seen == [1, 3, 3, 3, 3, 3, 3, 1]  # the stalled one first alone, last alone
    assert sum(st.missed for st in stats) == 1  # what the metric counts


@pytest.mark.parametrize("sessions", [4, 12])
def test_a_second_batch_runs_beside_the_first_only_when_the_sessions_cannot_all_ride_in_it(
    sessions: int,
) -> None:
    """Two batches may be in flight. One session starts alone, the others a turn later, while its batch
    runs: 4 sessions (fewer than ``max_batch`` 8) wait for that batch and go with it from then on, one
    batch at a time; 12 cannot ride in one batch, so two run side by side."""
    seen: list[int] = []
    running = [0, 0]  # now, most at once

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        seen.append(int(rows.shape[0]))
        running[0] += 1
        running[1] = max(running)
        await asyncio.sleep(0.02)  # a batch takes a while: the late sessions arrive meanwhile
        running[0] -= 1
        return rows

    async def main() -> None:
        b = DynamicBatcher(run_batch, max_batch=8, max_wait=0.0, queue_limit=100, in_flight=2)
        b.start()
        try:
            first = asyncio.ensure_future(_sessions(b, [1], [4], use_caller=True)[0])
            await asyncio.sleep(0)
            rest = _sessions(b, [1] * (sessions - 1), [3] * (sessions - 1), use_caller=True)
            await asyncio.wait_for(asyncio.gather(first, *rest), 10.0)
        finally:
            await b.close()

    _run(main())
    assert sum(seen) == 4 + 3 * (sessions - 1)
    if sessions == 4:
        assert seen == [1, 4, 4, 4] and running[1] == 1
    else:
        assert running[1] == 2


def test_batcher_refuses_beyond_its_queue_and_keeps_at_most_in_flight_batches() -> None:
    gate = asyncio.Event()
    running = [0, 0]  # now, most

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        running[0] += 1
        running[1] = max(running[1], running[0])
        await gate.wait()
        running[0] -= 1
        return rows

    async def main() -> None:
        b = DynamicBatcher(run_batch, max_batch=1, max_wait=0.0, queue_limit=4, in_flight=2)
        b.start()
        try:
            tasks = [asyncio.ensure_future(b.submit(torch.zeros(1, 1))) for _ in range(4)]
            for _ in range(50):
                await asyncio.sleep(0.01)
                if running[0] == 2:
                    break
            assert running[0] == 2  # two batches in flight, two requests queued
            with pytest.raises(Overloaded):
                await b.submit(torch.zeros(3, 1))  # 2 queued + 3 > 4
            gate.set()
            await asyncio.gather(*tasks)
        finally:
            await b.close()
        assert running[1] == 2

    _run(main())


def test_the_queue_limit_admits_new_work_and_never_ends_a_session_it_admitted() -> None:
    """A full queue refuses new requests and new sessions (503: retry later), but an admitted session's
    next row still gets in: refusing it would end a generation half-way. A request larger than the
    limit itself could never get in: ``Oversized`` (400), not a busy queue."""

    async def main() -> None:
        b = DynamicBatcher(lambda rows, pick: rows, max_batch=2, max_wait=0.0, queue_limit=4)  # not started
        try:
            async with b.caller() as session, b.caller() as late:
                first = session(torch.zeros(2, 1), None)  # the session's prefill: admitted
                others = b.enqueue(torch.zeros(2, 1))  # a plain request fills the queue
                assert b.queued_rows == 4
                with pytest.raises(Overloaded):
                    b.enqueue(torch.zeros(1, 1))  # new work: refused
                with pytest.raises(Overloaded):
                    late(torch.zeros(1, 1), None)  # a new session's first row too
                second = session(torch.zeros(1, 1), None)  # the admitted session's next row: in
                assert b.queued_rows == 5
                with pytest.raises(Oversized, match="--queue-limit 4"):
                    b.enqueue(torch.zeros(5, 1))
                others.cancel()  # its client went away: its rows no longer count, though still queued
                assert b.queued_rows == 3
                again = b.enqueue(torch.zeros(1, 1))
                for f in (first, second, again):
                    f.cancel()
        finally:
            await b.close()

    _run(main())


def test_batcher_splits_a_request_larger_than_a_batch() -> None:
    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        assert rows.shape[0] <= 3
        return rows + 1

    async def main() -> torch.Tensor:
        b = DynamicBatcher(run_batch, max_batch=3, max_wait=0.0, queue_limit=100)
        b.start()
        try:
            return await b.submit(torch.arange(8.0).view(8, 1))
        finally:
            await b.close()

    assert _run(main()).view(-1).tolist() == [float(i + 1) for i in range(8)]


def test_a_failed_batch_is_reported_as_failed_and_a_served_one_is_not() -> None:
    """The metrics' ``on_batch`` learns which batches failed: their time (a failover's batch waits out a
    re-placement) must not enter the served batches' histograms."""
    stats: list[BatchStats] = []
    failing = {"now": True}

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        if failing["now"]:
            raise ExecutionError("the pipeline broke")
        return rows + 1

    async def main() -> None:
        b = DynamicBatcher(run_batch, max_batch=4, max_wait=0.0, queue_limit=100, on_batch=stats.append)
        b.start()
        try:
            with pytest.raises(ExecutionError, match="the pipeline broke"):
                await b.submit(torch.zeros(2, 1))
            failing["now"] = False
            assert (await b.submit(torch.zeros(3, 1))).view(-1).tolist() == [1.0, 1.0, 1.0]
        finally:
            await b.close()

    _run(main())
    assert [(s.rows, s.failed) for s in stats] == [(2, True), (3, False)]


def test_requests_for_whole_rows_and_for_picked_positions_never_share_a_batch() -> None:
    """A whole-row request (``/v1/infer``, an echoed prompt: every position's output) queued among
    decode rows (one position each) gets its whole output: batches hold one kind, and the other waits
    its turn (before, it got position 0's output, the shape of a picked row)."""
    batches: list[tuple[int, bool]] = []

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        batches.append((int(rows.shape[0]), pick is None))
        await asyncio.sleep(0.01)  # the batch's compute time: the next requests of both kinds queue meanwhile
        out = rows.float()[:, :, None] * torch.ones(1, 1, 2)  # [rows, positions, 2]
        return out if pick is None else out[torch.arange(len(pick)), torch.tensor(pick)]

    async def main() -> None:
        b = DynamicBatcher(run_batch, max_batch=8, max_wait=0.05, queue_limit=100, in_flight=1)
        b.start()
        try:
            row = torch.arange(5).view(1, 5)
            asks = [b.submit(row + i, [i % 5]) if i % 3 else b.submit(row + i) for i in range(9)]
            outs = await asyncio.gather(*asks)
        finally:
            await b.close()
        for i, out in enumerate(outs):
            if i % 3:
                assert out.tolist() == [[float(i + i % 5)] * 2]
            else:
                assert out.shape == (1, 5, 2) and out[0, :, 0].tolist() == [float(i + p) for p in range(5)]
        assert sum(n for n, _ in batches) == 9 and len(batches) >= 2

    _run(main())


def test_a_batch_that_fails_on_its_rows_fails_only_the_request_that_brought_them() -> None:
    """The model raises on a negative row (``RowsFailed``, as a deployment reports an op's error): the
    batch runs again one request at a time, the others get their outputs, the culprit the error."""
    calls: list[int] = []

    async def run_batch(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        calls.append(int(rows.shape[0]))
        if (rows < 0).any():
            raise RowsFailed("index out of range")
        return rows * 2

    async def main() -> list[Any]:
        b = DynamicBatcher(run_batch, max_batch=16, max_wait=0.0, queue_limit=100, in_flight=1)
        gate = asyncio.Event()
        inner = b.run_batch

        async def first_waits(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
            await gate.wait()  # the first batch holds the pipeline: the three requests queue behind it
            b.run_batch = inner
            return await inner(rows, pick)

        b.run_batch = first_waits
        b.start()
        try:
            first = asyncio.ensure_future(b.submit(torch.tensor([[1.0]])))
            await _until(lambda: bool(calls) or b.running > 0)
            rows = [torch.tensor([[2.0], [3.0]]), torch.tensor([[-1.0]]), torch.tensor([[4.0]])]
            queued = [asyncio.ensure_future(b.submit(r)) for r in rows]
            await _until(lambda: b.queued_rows >= 4)
            gate.set()
            return await asyncio.gather(first, *queued, return_exceptions=True)
        finally:
            await b.close()

    first, good, bad, other = _run(main())
    assert first.view(-1).tolist() == [2.0]
    assert good.view(-1).tolist() == [4.0, 6.0] and other.view(-1).tolist() == [8.0]
    assert isinstance(bad, RowsFailed)
    assert calls == [1, 4, 2, 1, 1]  # the lone first, the batch of three requests, then each alone


# ---- sampling ----------------------------------------------------------------------------------------
def test_sampling_greedy_seeded_and_top_p() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert next_token(logits, SamplingParams(temperature=0.0), generator_for(None, 0)) == 1
    params = SamplingParams(temperature=1.5)
    draws = [next_token(logits, params, generator_for(7, 0)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same choice -> same token
    many = {next_token(logits, params, g) for g in [generator_for(None, 0)] for _ in range(200)}
    assert len(many) > 1  # really sampling
    nucleus = SamplingParams(temperature=1.0, top_p=0.3)  # only the most likely token is left
    g = generator_for(1, 0)
    assert {next_token(logits, nucleus, g) for _ in range(50)} == {1}
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    # a temperature so small the logits overflow: its limit (the most likely tokens), not a NaN's error
    tiny = SamplingParams(temperature=1e-40)
    assert {next_token(logits, tiny, g) for _ in range(20)} == {1}
    tied = torch.tensor([0.1, 2.0, 2.0, -1.0])
    assert {next_token(tied, tiny, g) for _ in range(200)} == {1, 2}


def test_pick_keeps_each_rows_position_over_the_micro_batches() -> None:
    outs = {"0/0": torch.arange(2 * 3 * 2).view(2, 3, 2), "1/0": torch.arange(100, 112).view(2, 3, 2)}
    got = picked(outs, [0, 2, 1, 1])
    assert got["0/0"].tolist() == [[0, 1], [10, 11]]
    assert got["1/0"].tolist() == [[102, 103], [108, 109]]


def test_keep_sends_the_kept_rows_and_every_rows_argmax_over_the_micro_batches() -> None:
    outs = {
        "0/0": torch.tensor([[0.0, 3.0, 1.0], [5.0, 1.0, 0.0]]),
        "0/1": torch.tensor([[7.0], [8.0]]),  # another per-row output loses the same rows
        "1/0": torch.tensor([[1.0, 1.0, 2.0], [0.0, 9.0, 9.0]]),  # a tie goes to the lowest id, as argmax
    }
    rows, ids = kept(outs, [False, True, False, False])
    assert ids is not None and [ids[k].tolist() for k in ("0/0", "1/0")] == [[1, 0], [2, 1]]
    assert rows["0/0"].tolist() == [[5.0, 1.0, 0.0]] and rows["0/1"].tolist() == [[8.0]]
    assert rows["1/0"].shape == (0, 3)
    assert kept(outs, None) == (outs, None)
    with pytest.raises(JobError, match="flags"):
        kept(outs, [True, True, True])  # fewer flags than rows
    with pytest.raises(JobError, match="flags"):
        kept(outs, [True] * 5)
    with pytest.raises(JobError, match="one position per row"):
        kept({"0/0": torch.zeros(2, 4, 3)}, [True, True])  # whole sequences: no argmax per row


def test_requests_with_and_without_keep_share_a_batch_and_each_gets_its_own_answer() -> None:
    """A greedy session (ids only), a sampled one (its logits) and a whole-output request ride in one
    batch; a request longer than a batch is cut and its answers joined again."""
    calls: list[list[bool] | None] = []

    async def run_batch(rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None) -> Any:
        calls.append(keep)
        out = rows.float() * torch.tensor([1.0, -1.0, 0.5])  # argmax: column 0 if positive, else 1
        return out if keep is None else answer_rows(out, keep)

    async def scenario() -> None:
        b = DynamicBatcher(run_batch, max_batch=4, max_wait=0.05, queue_limit=100, in_flight=1)
        b.start()
        try:
            ids_only, logits, whole = await asyncio.gather(
                b.submit(torch.tensor([[2], [-3]]), [0, 0], [False, False]),
                b.submit(torch.tensor([[4]]), [0], [True]),
                b.submit(torch.tensor([[1]]), [0]),
            )
            assert calls == [[False, False, True, True]]
            assert isinstance(ids_only, RowAnswers) and ids_only.ids.tolist() == [0, 1]
            assert ids_only.outputs.shape == (0, 3)
            assert isinstance(logits, RowAnswers) and logits.outputs.tolist() == [[4.0, -4.0, 2.0]]
            assert isinstance(whole, torch.Tensor) and whole.tolist() == [[1.0, -1.0, 0.5]]
            long = await b.submit(torch.tensor([[1], [-1], [2], [-2], [3], [-3]]), [0] * 6, [True, False] * 3)
            assert isinstance(long, RowAnswers) and long.ids.tolist() == [0, 1] * 3
            assert long.outputs[:, 0].tolist() == [1.0, 2.0, 3.0]  # the kept rows, in order, across batches
            with pytest.raises(ValueError, match="flags"):
                await b.submit(torch.tensor([[1]]), [0], [True, False])
        finally:
            await b.close()

    asyncio.run(scenario())


# ---- the HTTP API over local models --------------------------------------------------------------------
class _Local:
    """``Deployments`` whose batches run a local model (as the swarm would, rows padded to the window)."""

    def __init__(self) -> None:
        self.served: dict[str, ServedModel] = {}

    def get(self, name: str) -> ServedModel | None:
        return self.served.get(name)

    def all(self) -> list[ServedModel]:
        return list(self.served.values())

    def add(self, name: str, kind: str, forward: Callable[[torch.Tensor], torch.Tensor], row: tuple,
            dtype: Any, window: Window | None = None, queue_limit: int = 64) -> None:  # fmt: skip
        async def run_batch(
            rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None
        ) -> Any:
            with torch.no_grad():
                out = forward(rows)
            out = out if pick is None else out[torch.arange(len(pick)), torch.tensor(pick)]
            return out if keep is None else answer_rows(out, keep)  # as a compnode answers ``keep``

        batcher = DynamicBatcher(run_batch, max_batch=4, max_wait=0.005, queue_limit=queue_limit)
        self.served[name] = ServedModel(name, kind, "job0", row, dtype, batcher, window)


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).eval()


async def _with_app(deployments: _Local, body: Callable[[TestClient], Awaitable[None]]) -> None:
    for m in deployments.all():
        m.batcher.start()
    client = TestClient(TestServer(build_app(deployments)))
    await client.start_server()
    try:
        await body(client)
    finally:
        await client.close()
        for m in deployments.all():
            await m.batcher.close()


JSON = {"Content-Type": "application/json"}
ODD_CHARSET = {"Content-Type": "application/json; charset=no-such-charset"}


def test_infer_models_and_errors_over_http() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 2)

    async def body(client: TestClient) -> None:
        r = await client.get("/v1/models")
        assert [m["id"] for m in (await r.json())["data"]] == ["lin"]
        x = torch.randn(5, 3)
        r = await client.post("/v1/infer", data=save_st({"inputs": x}))
        assert r.status == 200
        with torch.no_grad():
            assert torch.allclose(load_st(await r.read())["outputs"], linear(x))
        bad = [
            (client.post("/v1/infer", data=save_st({"inputs": torch.randn(2, 4)})), 400, "inputs"),
            (client.post("/v1/infer", data=save_st({"x": torch.randn(2, 3)})), 400, "inputs"),
            (client.post("/v1/infer", data=b"junk"), 400, "safetensors"),
            (client.post("/v1/infer?model=zzz", data=save_st({"inputs": x})), 404, "zzz"),
            (client.post("/v1/completions", json={"model": "lin", "prompt": [1]}), 400, "not a text"),
            (client.post("/v1/completions", json={"prompt": [1], "max_tokens": -1}), 400, "max_tokens"),
            (client.post("/v1/completions", data=b"{"), 400, "JSON"),
            (client.post("/v1/completions", data=b"[" * 100_000 + b"]" * 100_000, headers=JSON), 400, "JSON"),
            (client.post("/v1/completions", data=b'{"prompt": [1]}', headers=ODD_CHARSET), 400, "JSON"),
            (
                client.post("/v1/completions", json={"prompt": [1], "logit_bias": {"\u00b2": 1}}),
                400,
                "token ids",
            ),
            (client.get("/v1/infer"), 405, ""),
            (client.get("/nothing"), 404, ""),
        ]
        for request, status, says in bad:
            r = await request
            doc = await r.json()
            assert r.status == status and says in doc["error"]["message"], (status, doc)
            assert set(doc["error"]) >= {"message", "type"}

    local = _Local()
    local.add("lin", "infer", linear, (3,), torch.float32)
    _run(_with_app(local, body))


def test_overload_is_answered_503_never_queued_without_bound() -> None:
    gate = asyncio.Event()

    async def body(client: TestClient) -> None:
        x = save_st({"inputs": torch.zeros(2, 1)})
        first = asyncio.ensure_future(client.post("/v1/infer", data=x))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(client.post("/v1/infer", data=x))
        await asyncio.sleep(0.05)
        r = await client.post("/v1/infer", data=x)  # 2 in flight + 2 queued: full
        assert r.status == 503 and "overloaded" in (await r.json())["error"]["message"]
        gate.set()
        assert (await first).status == 200 and (await second).status == 200

    local = _Local()
    local.add("slow", "infer", lambda r: r, (1,), torch.float32, queue_limit=2)
    model = local.served["slow"]
    original = model.batcher.run_batch

    async def gated(rows: torch.Tensor, pick: list[int] | None) -> torch.Tensor:
        await gate.wait()
        return await original(rows, pick)

    model.batcher.run_batch = gated
    model.batcher._slots = asyncio.Semaphore(1)  # type: ignore[attr-defined]
    _run(_with_app(local, body))


def test_greedy_completion_through_padding_equals_generate_and_streams() -> None:
    lm = _gpt2()
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4], [11, 12, 13, 14, 15, 16, 17, 18]]
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                          do_sample=False, pad_token_id=0)  # fmt: skip
        want.append(out[0, len(p) :].tolist())

    async def body(client: TestClient) -> None:
        r = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 5, "temperature": 0})
        doc = await r.json()
        assert r.status == 200, doc
        assert [c["token_ids"] for c in doc["choices"]] == want
        r = await client.post(
            "/v1/completions", json={"prompt": prompts[1], "max_tokens": 5, "temperature": 0, "stream": True}
        )
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        tokens = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
        assert tokens == want[1]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        r = await client.post("/v1/completions", json={"prompt": [1] * 30, "max_tokens": 5})
        assert r.status == 400 and "context window" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": [99], "max_tokens": 1})
        assert r.status == 400 and "vocabulary" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "text", "max_tokens": 1})
        assert r.status == 400 and "tokenizer" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": [1], "stop": "x"})
        assert r.status == 400 and "stop strings need" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": [1], "stop": ["a", "b", "c", "d", "e"]})
        assert r.status == 400 and "stop" in (await r.json())["error"]["message"]

    local = _Local()
    local.add(
        "gpt", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    _run(_with_app(local, body))


def test_the_next_batch_starts_before_the_streamed_chunks_of_the_tokens_that_asked_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each token's chunk is written after the batch its choice's next row rides in has started: the
    # chunks' writes are off the decode loop's critical path (``stream_choices``).
    events: list[str] = []
    original_write = web.StreamResponse.write

    async def write(self: web.StreamResponse, data: bytes) -> None:
        if b'"token_ids": [' in data and b'"token_ids": []' not in data:
            events.append("chunk")
        await original_write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    local = _Local()
    flat = Window(context=8, vocab=40)
    local.add("gpt", "generate", lambda rows: torch.ones(*rows.shape, 40), (8,), torch.long, flat)
    model = local.served["gpt"]
    original = model.batcher.run_batch

    async def logged(rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None) -> Any:
        events.append(f"batch of {len(rows)}")
        return await (original(rows, pick) if keep is None else original(rows, pick, keep))

    model.batcher.run_batch = logged

    async def body(client: TestClient) -> None:
        body = {"prompt": [[1, 2], [3, 4]], "max_tokens": 3, "temperature": 0, "stream": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status == 200
        await r.text()

    _run(_with_app(local, body))
    # 2 choices in one stream, 3 tokens each: every batch carries both rows, and each token's chunk
    # comes after the next batch has started (the last tokens ask for none)
    batch = "batch of 2"
    assert events == [batch, batch, "chunk", "chunk", batch, "chunk", "chunk", "chunk", "chunk"], events


def test_a_row_asked_ahead_and_refused_fails_the_next_token_not_the_one_in_hand() -> None:
    calls = 0

    def submit(rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # the batcher's ``enqueue`` refuses at once when its queue is full
            raise Overloaded("128 rows already wait")
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(answer_rows(torch.ones(len(rows), 10), keep or [False] * len(rows)))
        return answer

    async def tokens() -> list[int]:
        got: list[int] = []
        with pytest.raises(Overloaded, match="already wait"):
            async for token in generate(
                submit, Window(context=8, vocab=10), [1], 3, SamplingParams(0.0), None, 0
            ):
                got.append(token)
        return got

    assert asyncio.run(tokens()) == [0]  # the first token came; the refusal ended the choice after it


def test_echo_scores_the_prompt_and_puts_it_before_the_answer() -> None:
    """``echo``: the prompt's text before the answer, and with ``logprobs`` each prompt token's logprob
    given the ones before it (None for the first), checked against the model run here; ``max_tokens: 0``
    scores a prompt without generating (how evaluation harnesses ask for log-likelihoods)."""
    lm = _gpt2()
    vocab = [chr(ord("a") + i) for i in range(26)] + [str(d) for d in range(10)] + [" ", ".", ",", "!"]
    tok = CharTokenizer(vocab)
    prompt = "hello there"
    ids = tok.encode(prompt)
    with torch.no_grad():
        logp = torch.log_softmax(lm(torch.tensor([ids])).logits[0], dim=-1)
    want = [None] + [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]

    async def body(client: TestClient) -> None:
        base = {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
        r = await client.post("/v1/completions", json=base | {"max_tokens": 0})
        doc = await r.json()
        assert r.status == 200, doc
        [choice] = doc["choices"]
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (prompt, [], "length")
        lp = choice["logprobs"]
        assert lp["tokens"] == list(prompt) and lp["text_offset"] == list(range(len(prompt)))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(want[1:], abs=1e-5)
        assert doc["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        r = await client.post("/v1/completions", json=base | {"max_tokens": 3})
        [choice] = (await r.json())["choices"]
        answer = choice["token_ids"]
        assert len(answer) == 3 and choice["text"] == prompt + tok.decode(answer)
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 3
        assert choice["logprobs"]["token_logprobs"][1 : len(ids)] == pytest.approx(want[1:], abs=1e-5)
        r = await client.post("/v1/completions", json=base | {"max_tokens": 3, "stream": True})
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert streamed == choice["logprobs"]["token_logprobs"]
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
        assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"

    local = _Local()
    local.add(
        "gpt", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    local.served["gpt"].tokenizer = tok
    _run(_with_app(local, body))


def test_text_prompts_with_the_jobs_character_vocabulary() -> None:
    lm = _gpt2()
    vocab = [chr(ord("a") + i) for i in range(26)] + [str(d) for d in range(10)] + [" ", ".", ",", "!"]
    tok = CharTokenizer(vocab)
    assert tok.decode(tok.encode("hello world")) == "hello world"

    async def body(client: TestClient) -> None:
        r = await client.post(
            "/v1/completions", json={"prompt": ["abc", "hi."], "max_tokens": 4, "temperature": 0}
        )
        doc = await r.json()
        assert r.status == 200, doc
        for choice, text in zip(doc["choices"], ["abc", "hi."]):
            ids = torch.tensor([tok.encode(text)])
            want = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                               do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()  # fmt: skip
            assert choice["token_ids"] == want and choice["text"] == tok.decode(want)
        r = await client.post("/v1/completions", json={"prompt": "ABC", "max_tokens": 1})
        assert r.status == 400 and "outside the vocabulary" in (await r.json())["error"]["message"]

    local = _Local()
    local.add(
        "gpt", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    local.served["gpt"].tokenizer = tok
    _run(_with_app(local, body))


def test_end_of_text_stop_ids_and_stop_strings_end_a_choice_streamed_or_not() -> None:
    """Seeded sampling (the tiny random model repeats one token greedily): every variant draws the same
    tokens as the full run until it stops, so each answer is a prefix of that run."""
    lm = _gpt2()
    vocab = [chr(ord("a") + i) for i in range(26)] + [str(d) for d in range(10)] + [" ", ".", ",", "!"]
    tok = CharTokenizer(vocab)
    local = _Local()
    local.add(
        "gpt", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    model = local.served["gpt"]
    model.tokenizer = tok
    base = {"prompt": "abc", "max_tokens": 12, "temperature": 1.0, "seed": 7}

    async def body(client: TestClient) -> None:
        async def complete(**extra: Any) -> dict[str, Any]:
            r = await client.post("/v1/completions", json=base | extra)
            doc = await r.json()
            assert r.status == 200, doc
            return doc["choices"][0]

        async def stream(**extra: Any) -> tuple[str, list[int], str | None]:
            r = await client.post("/v1/completions", json=base | extra | {"stream": True})
            events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            choices = [json.loads(e)["choices"][0] for e in events[:-1]]
            assert all(c["finish_reason"] is None for c in choices[:-1])
            text = "".join(c["text"] for c in choices)
            return text, [t for c in choices for t in c["token_ids"]], choices[-1]["finish_reason"]

        first = await complete()
        want, full = first["token_ids"], first["text"]
        assert len(want) == 12 and first["finish_reason"] == "length" and full == tok.decode(want)
        k = next(i for i in range(1, 12) if want[i] not in want[:i])  # a token that first comes at k
        model.eos_token_ids = (want[k],)  # the model's end-of-text: the choice ends before it
        got = await complete()
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (want[:k], full[:k], "stop")
        assert await stream() == (full[:k], want[:k], "stop")
        got = await complete(ignore_eos=True)
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (want, full, "length")
        got = await complete(ignore_eos=True, stop_token_ids=[want[k]])
        assert (got["token_ids"], got["finish_reason"]) == (want[:k], "stop")
        stop = full[k : k + 2]
        cut = full.find(stop)
        got = await complete(ignore_eos=True, stop=["never", stop])
        assert (got["text"], got["finish_reason"]) == (full[:cut], "stop")
        assert got["token_ids"] == want[: cut + len(stop)]  # a character per token: ids up to the stop
        assert await stream(ignore_eos=True, stop=stop) == (full[:cut], want[: cut + len(stop)], "stop")

    _run(_with_app(local, body))


def test_a_repeated_serve_step_call_gets_the_first_answer_and_runs_once() -> None:
    """The broker's RPC client repeats a call whose stream closed early: the batch must not run twice
    (it would be refused as out of order, and write KV caches twice)."""
    from types import SimpleNamespace

    from fusionnet.compnode.serve_steps import KEPT_ANSWERS, StepOrder, serve_step
    from fusionnet.errors import JobError
    from fusionnet.messages.serving_rpc import ServeStepRequest

    runs: list[int] = []

    class Executor:
        async def run_step(self, step: int, microbatches: list, sizes: list) -> SimpleNamespace:
            runs.append(step)
            await asyncio.sleep(0.01)
            return SimpleNamespace(outputs=None, fp_seconds=0.5 + step)

    job = SimpleNamespace(
        job_id="j1",
        subdag=SimpleNamespace(placeholders=[]),
        executor=Executor(),
        channel=SimpleNamespace(mailbox=SimpleNamespace(forget_step=lambda step: None)),
    )

    async def scenario() -> None:
        order = StepOrder()
        ask = lambda step: serve_step(job, order, ServeStepRequest(job_id="j1", step=step, sizes=[2]))
        first, again = await asyncio.gather(ask(0), ask(0))  # the repeat comes while the first runs
        assert first == again and first.fp_seconds == 0.5 and runs == [0]
        for step in range(1, KEPT_ANSWERS + 2):
            await ask(step)
        repeated = await ask(KEPT_ANSWERS + 1)
        assert repeated.fp_seconds == KEPT_ANSWERS + 1.5 and len(order.answers) == KEPT_ANSWERS
        assert runs == list(range(KEPT_ANSWERS + 2))
        with pytest.raises(JobError, match="already ran here"):  # forgotten long ago: refused, not rerun
            await ask(0)

    asyncio.run(scenario())


def test_logprobs_are_the_models_own_plain_and_streamed() -> None:
    """``logprobs: k``: each generated token's log-softmax under the logits it came from (checked against
    the model run here) and the k best alternatives, in OpenAI's legacy form, plain and streamed."""
    lm = _gpt2()
    prompt = [5, 9, 3]
    local = _Local()
    local.add(
        "gpt", "generate", lambda rows: lm(rows).logits, (32,), torch.long, Window(context=32, vocab=40)
    )
    base = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 11, "logprobs": 2}

    async def body(client: TestClient) -> None:
        r = await client.post("/v1/completions", json=base)
        doc = await r.json()
        assert r.status == 200, doc
        choice = doc["choices"][0]
        tokens, lp = choice["token_ids"], choice["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in tokens]  # no tokenizer: vLLM's spelling
        seq = list(prompt)
        for i, token in enumerate(tokens):
            with torch.no_grad():
                want = torch.log_softmax(lm(torch.tensor([seq])).logits[0, -1], dim=-1)
            assert abs(lp["token_logprobs"][i] - float(want[token])) <= 1e-5
            best = torch.topk(want, 2)
            assert list(lp["top_logprobs"][i]) == [f"token_id:{int(t)}" for t in best.indices]
            assert list(lp["top_logprobs"][i].values()) == pytest.approx(best.values.tolist(), abs=1e-5)
            seq.append(token)
        r = await client.post("/v1/completions", json=base | {"stream": True})
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        streamed = [c["logprobs"] for c in chunks if c["token_ids"]]
        assert [x for c in streamed for x in c["token_logprobs"]] == lp["token_logprobs"]
        r = await client.post("/v1/completions", json=base | {"logprobs": None})
        assert (await r.json())["choices"][0]["logprobs"] is None
        r = await client.post("/v1/completions", json=base | {"logprobs": 21})
        assert r.status == 400 and "logprobs" in (await r.json())["error"]["message"]

    _run(_with_app(local, body))


def _next_token_decoder(
    vocab: int, batches: list[int], seconds: float, fails: Callable[[torch.Tensor], bool] = lambda rows: False
) -> Callable[..., Awaitable[Any]]:
    """A KV deployment's ``run_batch`` stand-in: each row's next token is its token + 1; every batch's
    row count goes to ``batches``; a batch takes ``seconds``, and fails where ``fails(rows)``."""

    async def run_batch(rows: torch.Tensor, pick: list[int] | None, keep: list[bool] | None = None) -> Any:
        batches.append(len(rows))
        await asyncio.sleep(seconds)
        if fails(rows):
            raise ExecutionError("sub-DAG 1 failed")
        logits = torch.nn.functional.one_hot((rows[:, 0] + 1) % vocab, vocab).float()
        assert keep is not None  # a KV-cached session always sends its flags
        return answer_rows(logits, keep)

    return run_batch


def _kv_deployment(batcher: DynamicBatcher, vocab: int) -> tuple[_Local, ServedModel]:
    """``_Local`` serving one KV-cached generator (2 cache slots) over ``batcher``."""
    model = ServedModel(
        "gpt", "generate", "job0", (3,), torch.long, batcher, Window(context=64, vocab=vocab),
        kv=SlotPool(slots=2, waiting=4),
    )  # fmt: skip
    local = _Local()
    local.served["gpt"] = model
    return local, model


class _Requests:
    """A ``ServingObserver`` that notes each request's status and ignores the rest."""

    def __init__(self) -> None:
        self.statuses: list[int] = []

    def observe_request(self, deployment: str, endpoint: str, status: int) -> None:
        self.statuses.append(status)

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_sessions_cache_slots_and_queued_rows(stream: bool) -> None:
    """A client that leaves mid-generation (a closed stream, or its own timeout on a plain request): its
    sessions end (a stream's at the next chunk the server cannot write, a plain request's handler is
    cancelled), their KV-cache slots are free and none of their rows stays queued, it is counted as
    499, and the next request gets every slot and runs to its end."""
    import aiohttp

    vocab, tokens = 10, 50  # both choices ride in the same batches: a full generation takes 50 of them
    batches: list[int] = []
    # a decode pass takes a while: the client leaves between tokens
    batcher = DynamicBatcher(
        _next_token_decoder(vocab, batches, 0.005), max_batch=4, max_wait=0.005, queue_limit=64
    )
    local, model = _kv_deployment(batcher, vocab)
    requests = _Requests()

    async def leave(http: aiohttp.ClientSession, url: str) -> None:
        request = {"prompt": [[1, 2], [3, 4]], "max_tokens": tokens, "temperature": 0, "stream": stream}
        if not stream:
            with pytest.raises(asyncio.TimeoutError):
                await http.post(url, json=request, timeout=aiohttp.ClientTimeout(total=0.1))
            return
        async with http.post(url, json=request) as r:
            assert r.status == 200
            chunks = 0
            async for line in r.content:
                token = line.startswith(b"data: ") and b'"token_ids": [' in line
                if token and b'"token_ids": []' not in line:
                    chunks += 1
                    if chunks == 4:
                        break
            assert model.kv is not None and model.kv.in_use == 2
            r.close()  # gone mid-stream, 46 tokens short of each choice's end

    async def scenario() -> None:
        batcher.start()
        runner, base = await start_api(local, requests, "127.0.0.1", 0)  # as the broker serves it
        try:
            async with aiohttp.ClientSession() as http:
                url = f"{base}/v1/completions"
                await leave(http, url)
                assert model.kv is not None
                await _until(lambda: model.kv.in_use == 0 and batcher.queued_rows == 0)
                assert len(batches) < tokens - 5, "the sessions went on generating for a client that had left"
                await _until(lambda: requests.statuses == [CLIENT_GONE])
                again = {"prompt": [[5], [6]], "max_tokens": 3, "temperature": 0}
                async with http.post(url, json=again) as r:
                    doc = await r.json()
                    assert r.status == 200, doc
                assert [c["token_ids"] for c in doc["choices"]] == [[6, 7, 8], [7, 8, 9]]
                assert requests.statuses == [CLIENT_GONE, 200]
        finally:
            await runner.cleanup()
            await batcher.close()

    _run(scenario())


def test_a_choice_that_fails_ends_its_siblings_and_a_stream_still_ends_with_done() -> None:
    """One choice of a request fails (its batch, here): the request is answered with the error at once
    and its other choices stop, their cache slots back, instead of generating to ``max_tokens`` for an
    answer already sent. A stream says the error in a chunk and ends with ``[DONE]``; a request that
    can never fit the queue is told so (400, a stream too: nothing was sent before)."""

    vocab, tokens = 10, 50
    batches: list[int] = []

    def fails(rows: torch.Tensor) -> bool:  # slot 1's fourth token: its compnode fails
        return int(rows[0, 2]) == 1 and int(rows[0, 1]) >= 4

    run_batch = _next_token_decoder(vocab, batches, 0.002, fails)
    local, model = _kv_deployment(DynamicBatcher(run_batch, max_batch=1, max_wait=0.0, queue_limit=8), vocab)
    batcher = model.batcher

    async def body(client: TestClient) -> None:
        request = {"prompt": [[1, 2], [3, 4]], "max_tokens": tokens, "temperature": 0}
        r = await client.post("/v1/completions", json=request)
        doc = await r.json()
        assert r.status == 503 and "sub-DAG 1 failed" in doc["error"]["message"], doc
        assert model.kv is not None and model.kv.in_use == 0 and batcher.queued_rows == 0
        assert len(batches) < tokens, "the other choice went on generating for an answered request"
        r = await client.post("/v1/completions", json=request | {"stream": True})
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert "sub-DAG 1 failed" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
        long = {"prompt": list(range(1, 10)), "max_tokens": 1, "stream": True}  # 9 prefill rows, limit 8
        r = await client.post("/v1/completions", json=long)  # refused before its first token: a real 400
        error = (await r.json())["error"]
        assert r.status == 400 and error["type"] == "invalid_request_error", error
        assert "--queue-limit 8" in error["message"]
        r = await client.post("/v1/completions", json=long | {"stream": False})
        assert r.status == 400 and "--queue-limit 8" in (await r.json())["error"]["message"]

    _run(_with_app(local, body))


def test_a_bad_body_is_counted_under_the_deployment_it_names() -> None:
    """A body refused before its deployment is looked up (a field out of range) still counts as that
    deployment's 400: a client that keeps sending bad bodies shows up in its metrics."""
    batcher = DynamicBatcher(_next_token_decoder(10, [], 0.0), max_batch=1, max_wait=0.0, queue_limit=8)
    local, _ = _kv_deployment(batcher, 10)
    requests = _Requests()

    async def scenario() -> None:
        client = TestClient(TestServer(build_app(local, requests)))
        await client.start_server()
        try:
            for body in ({"model": "gpt", "prompt": [1], "max_tokens": -1}, {"prompt": [1], "n": 0}):
                r = await client.post("/v1/completions", json=body)
                assert r.status == 400
            r = await client.post("/v1/chat/completions", json={"model": "gpt", "messages": []})
            assert r.status == 400
            r = await client.post("/v1/completions", json={"model": "nobody", "prompt": [1], "n": 0})
            assert r.status == 400  # names no deployment: counted under none
        finally:
            await client.close()
        assert requests.statuses == [400, 400, 400]

    _run(scenario())


def test_the_client_raises_a_streams_error_with_its_status_and_a_cut_stream_as_one() -> None:
    """``FusionNetClient.stream``: an error chunk raises ``ServingError`` with the status the request would
    have had (400: sending it again fails again), and a stream that ends without ``[DONE]`` raises too."""
    from fusionnet.serving.client import FusionNetClient, ServingError

    batcher = DynamicBatcher(_next_token_decoder(10, [], 0.0), max_batch=4, max_wait=0.0, queue_limit=8)
    local, _ = _kv_deployment(batcher, 10)

    released = asyncio.Event()

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "token_ids": [3], "text": ""}]}\n\n')
        if (await request.json()).get("prompt") == [7]:  # a broker that stops sending mid-stream
            await released.wait()
        return response  # and no [DONE]: the broker went away

    async def silent(request: web.Request) -> web.Response:
        await released.wait()  # a broker that never answers
        return web.json_response({})

    def stream(url: str, prompt: list[int], timeout: float = 120.0) -> list[Any]:
        return list(FusionNetClient(url, timeout).stream(prompt, max_tokens=2, temperature=0))

    async def scenario() -> None:
        batcher.start()
        runner, url = await start_api(local, None, "127.0.0.1", 0)
        cutter = web.Application()
        cutter.router.add_post("/v1/completions", cut)
        cutter.router.add_get("/v1/models", silent)
        cut_runner = web.AppRunner(cutter)
        await cut_runner.setup()
        site = web.TCPSite(cut_runner, "127.0.0.1", 0)
        await site.start()
        cut_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            chunks = await asyncio.to_thread(stream, url, [1, 2])
            assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [3, 4]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            with pytest.raises(ServingError) as refused:
                await asyncio.to_thread(stream, url, list(range(1, 10)))  # 9 prefill rows, limit 8
            assert refused.value.status == 400 and "--queue-limit 8" in refused.value.message
            with pytest.raises(ServingError, match="ended before") as cut_short:
                await asyncio.to_thread(stream, cut_url, [1])
            assert cut_short.value.status == 502
            # no HTTP answer at all: status 0 and what happened, never a bare socket error
            with pytest.raises(ServingError, match=r"no answer within 0\.3 s") as stalled:
                await asyncio.to_thread(stream, cut_url, [7], 0.3)
            with pytest.raises(ServingError, match=r"/v1/models: no answer within 0\.3 s") as unanswered:
                await asyncio.to_thread(FusionNetClient(cut_url, 0.3).models)
            with socket.socket() as closed:  # a port nothing listens on
                closed.bind(("127.0.0.1", 0))
                nobody = f"http://127.0.0.1:{closed.getsockname()[1]}"
            with pytest.raises(ServingError, match=r"/v1/models: .*refused") as refused_conn:
                await asyncio.to_thread(FusionNetClient(nobody, 5).models)
            assert stalled.value.status == unanswered.value.status == refused_conn.value.status == 0
        finally:
            released.set()
            await cut_runner.cleanup()
            await runner.cleanup()
            await batcher.close()

    _run(scenario())
