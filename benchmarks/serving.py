"""Serving a causal LM from a swarm: a ``transformers`` GPT-2 (random init, nothing downloaded) deployed on a
broker and 3 compnodes (``--compnodes``; one thread each), driven over the HTTP API by 1, 4 and 16
concurrent clients.

Per client count: tokens/s and requests/s, time to first token (TTFT) and inter-token latency (ITL)
percentiles, beside
- plain ``generate()``   the same model and requests in this process, one request at a time (KV cache);
- plain KV decode        the same computation as the deployment (``--kv-slots`` > 0, the default): its
                         ``SlotDecoder`` fed a token at a time, prompt included, one request at a time;
- plain recompute        the same, recomputing the whole window per token (what a deployment without KV
                         caches, ``--kv-slots 0``, computes);
- the model               the performance model's rate for this placement, from the broker's predicted
                         C_p and R_p per micro-batch and its measured call round trip to the pipeline's ends
                         (``perfmodel.generation_rate``): per client count, that many live sessions in the
                         batches the batcher keeps in flight (a session's next row waits for its last one's
                         pass); one full batch at a time (eq. (3)); and eq. (4)'s asymptote, a full batch
                         per stage in flight (``max_batch / max_p max(C_p, R_p)``), which 16 sessions in
                         batches of 16 cannot reach.
Then ``--pairs`` rounds of a plain ``generate()`` pass and a pass with one client per request, in turn
(this machine's speed drifts, so each served figure is held against the plain one just before it).
Then a compnode of the deployment is SIGKILLed while 4 clients stream, after a third of the tokens; the
backup takes its sub-DAG and every request must finish with the tokens of the fault-free run.

Prints a table, then one JSON line.

    python benchmarks/serving.py [--size quick|full|realistic] [--compnodes 3] [--requests 16]
        [--max-tokens 16] [--batch 16] [--microbatches 1] [--kv-slots 16] [--in-flight 1|2]
        [--max-wait-ms MS] [--pairs 3] [--sandbox process|off] [--worker-sends direct|daemon]
        [--worker-receives direct|daemon] [--inline-compute-ms MS]
        [--placement balanced|model] [--serve-path direct|rpc] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from swarm_jobs import WORKDIR_HELP, run_main, work_folder  # noqa: E402

from fusionnet.daemon.flags import DEFAULT_REFRESH_PERIOD  # noqa: E402
from fusionnet.job.kv_decode import SlotDecoder  # noqa: E402
from fusionnet.job.loader import load_job  # noqa: E402
from fusionnet.messages.serving_rpc import ServingSettings  # noqa: E402
from fusionnet.perfmodel.generation_rate import (  # noqa: E402
    GenerationRate,
    asymptote_tokens_per_s,
    generation_rate,
)
from fusionnet.runtime.deploy import deploy  # noqa: E402
from fusionnet.runtime.process_swarm import BlockingObserver, CompnodeSpec, ProcessSwarm  # noqa: E402
from fusionnet.serving.client import FusionNetClient  # noqa: E402

# (vocab, width, layers, heads, window)
FULL = (4000, 256, 6, 4, 64)
QUICK = (1000, 128, 3, 4, 48)
REALISTIC = (32000, 512, 8, 8, 96)  # 41.7M parameters, a tied 65.5 MB embedding
SIZES = {"quick": QUICK, "full": FULL, "realistic": REALISTIC}
PROMPT = 8
CLIENT_COUNTS = [1, 4, 16]
MODEL_PY = """import transformers
from torch import nn


class LM(nn.Module):
    def __init__(self, vocab, width, layers, heads, window):
        super().__init__()
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads,
                                      n_positions=window, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0)
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids).logits


def build(**kw):
    return LM(**kw)
"""


def write_job(folder: Path, shape: tuple[int, ...], batch: int, compnodes: int, microbatches: int) -> Path:
    vocab, width, layers, heads, window = shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_PY)
    save_file({"inputs": torch.randint(1, vocab, (batch, window))}, str(folder / "data.safetensors"))
    kwargs = {"vocab": vocab, "width": width, "layers": layers, "heads": heads, "window": window}
    (folder / "job.yaml").write_text(
        "name: bench-gpt\ntask: generate\n"
        f"model: {{entrypoint: model.py:build, kwargs: {json.dumps(kwargs)}}}\n"
        f"data: {{path: data.safetensors, batch_size: {batch}, microbatches: {microbatches}}}\n"
        f"seed: 0\nplacement: {{compnodes: {compnodes}}}\n"
    )
    return folder / "job.yaml"


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (PROMPT,), generator=g).tolist() for _ in range(n)]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_clients(
    url: str,
    clients: int,
    requests: list[list[int]],
    max_tokens: int,
    on_tokens: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Each client streams its share of ``requests`` one after another; all clients at once.
    ``on_tokens`` sees the count of tokens streamed so far, after each chunk."""
    client = FusionNetClient(url, timeout=600)
    streamed = [0]
    ttft: list[float] = []
    itl: list[float] = []
    tokens: dict[int, list[int]] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        started = last = time.perf_counter()
        got: list[int] = []
        for chunk in client.stream(
            requests[i], model="gpt", max_tokens=max_tokens, temperature=0, ignore_eos=True
        ):
            ids = chunk["choices"][0]["token_ids"]
            if not ids:
                continue
            now = time.perf_counter()
            with lock:
                (itl if got else ttft).append(now - (last if got else started))
                streamed[0] += len(ids)
                count = streamed[0]
            last = now
            got.extend(ids)
            if on_tokens is not None:
                on_tokens(count)
        tokens[i] = got

    def worker(c: int) -> None:
        for i in range(c, len(requests), clients):
            one(i)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    wall = time.perf_counter() - started
    total = sum(map(len, tokens.values()))
    return {
        "clients": clients,
        "requests": len(requests),
        "tokens": total,
        "seconds": wall,
        "tokens_per_s": total / wall,
        "requests_per_s": len(requests) / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p90": pct(ttft, 0.9),
        "itl_p50": pct(itl, 0.5),
        "itl_p90": pct(itl, 0.9),
        "outputs": [tokens[i] for i in range(len(requests))],
    }


def plain_generate(model: Any, max_tokens: int) -> Callable[[list[list[int]]], list[list[int]]]:
    """``transformers``' ``generate()`` of each prompt, one after another (greedy, ``max_tokens`` each)."""

    def generate_all(prompts: list[list[int]]) -> list[list[int]]:
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                gen = model.lm.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    min_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                outs.append(gen[0, len(p) :].tolist())
        return outs

    return generate_all


def paired_rounds(
    job_path: Path, url: str, requests: list[list[int]], max_tokens: int, rounds: int
) -> dict[str, Any]:
    """Plain ``generate()`` one request at a time and the swarm with one client per request, in turn,
    ``rounds`` times: this machine's speed drifts by up to 2x over minutes, so each served figure is
    held against the plain one measured right before it (the swarm is idle meanwhile)."""
    torch.set_num_threads(1)
    generate_all = plain_generate(load_job(job_path, deployment=True).model.eval(), max_tokens)
    generate_all(requests[:1])
    total = len(requests) * max_tokens
    plain, served = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        generate_all(requests)
        plain.append(total / (time.perf_counter() - started))
        served.append(run_clients(url, len(requests), requests, max_tokens)["tokens_per_s"])
    ratios = [s / p for s, p in zip(served, plain)]
    return {
        "plain_tokens_per_s": plain,
        "served_tokens_per_s": served,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
    }


def plain_baselines(
    job_path: Path, requests: list[list[int]], max_tokens: int, window: int
) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = load_job(job_path, deployment=True).model.eval()
    generate_all = plain_generate(model, max_tokens)
    # generate()'s first call pays one-time costs, and this machine's speed drifts: one untimed request,
    # then the faster of two timed passes (the figure the swarm is held against is plain's best)
    generate_all(requests[:1])
    kv = math.inf
    for _ in range(2):
        started = time.perf_counter()
        outs = generate_all(requests)
        kv = min(kv, time.perf_counter() - started)
    started = time.perf_counter()
    recomputed = []
    with torch.no_grad():
        for p in requests:  # what the deployment computes: the whole padded window per token
            row = torch.zeros(1, window, dtype=torch.long)
            row[0, : len(p)] = torch.tensor(p)
            for t in range(max_tokens):
                logits = model(row)[0, len(p) + t - 1]
                row[0, len(p) + t] = int(torch.argmax(logits))
            recomputed.append(row[0, len(p) : len(p) + max_tokens].tolist())
    recompute = time.perf_counter() - started
    started = time.perf_counter()
    decoder = SlotDecoder(model.lm, 1, window).eval()
    decoded = []
    with torch.no_grad():
        for p in requests:  # the deployment's computation with KV caches: a token per forward pass
            tokens = list(p)
            for position in range(len(p) + max_tokens - 1):
                logits = decoder(torch.tensor([[tokens[position], position, 0]]))
                if position == len(tokens) - 1:
                    tokens.append(int(torch.argmax(logits[0])))
            decoded.append(tokens[len(p) :])
    cached = time.perf_counter() - started
    total = len(requests) * max_tokens
    return {
        "generate_tokens_per_s": total / kv,
        "recompute_tokens_per_s": total / recompute,
        "kv_decode_tokens_per_s": total / cached,
        "outputs": outs,
        "recompute_outputs": recomputed,
        "kv_decode_outputs": decoded,
    }


def predictions(status: dict[str, Any], client_counts: list[int], max_tokens: int) -> dict[str, Any]:
    """The performance model's tokens/s for this placement, beside what the batches took (the broker's
    mean wall time per batch and each sub-DAG's mean FP time, and the heartbeat round trips).

    From the broker's per sub-DAG C_p and R_p per micro-batch and its measured call round trip:
    ``eq4_tokens_per_s`` is eq. (4)'s asymptote (full batches, as many in flight as there are stages,
    sessions without end); ``eq3_tokens_per_s`` one full batch at a time (eq. (3) and the call); and per
    client count the rate of that many live sessions with the batches the batcher keeps in flight, their
    prompts' rows first (``perfmodel.generation_rate``: a session's next row waits for its last one's
    pass)."""
    d = status["deployments"][0]
    measured = {
        "batch_seconds_mean": d.get("batch_seconds_mean"),
        "batch_rows_mean": d.get("batch_rows_mean"),
        "stage_fp_seconds_mean": d.get("stage_fp_seconds_mean"),
        "heartbeat_rtt_ms": [c.get("rtt_ms") for c in status["compnodes"]],
    }
    figures = d.get("model")
    if not figures:
        return {"eq3_tokens_per_s": None, "eq4_tokens_per_s": None, "model_tokens_per_s": {}, **measured}
    fp, comm = figures["stage_fp_seconds"], figures["stage_comm_seconds"]
    shape = {"mb_rows": figures["microbatch_rows"], "max_batch": d["max_batch"]}

    def rate(sessions: int, in_flight: int) -> GenerationRate:
        return generation_rate(fp, comm, **shape, sessions=sessions, in_flight=in_flight, prompt_rows=PROMPT,
                               new_tokens=max_tokens, call_seconds=figures["call_seconds"])  # fmt: skip

    return {
        "eq3_tokens_per_s": generation_rate(
            fp, comm, **shape, sessions=d["max_batch"], in_flight=1, call_seconds=figures["call_seconds"]
        ).tokens_per_s,
        "eq4_tokens_per_s": asymptote_tokens_per_s(fp, comm, **shape),
        "model_tokens_per_s": {n: rate(n, d["in_flight"]).to_dict() for n in client_counts},
        "stage_fp_seconds_predicted": fp,
        "stage_comm_seconds_predicted": comm,
        "call_seconds": figures["call_seconds"],
        **measured,
    }


def batch_totals(initial_peers: list[str]) -> tuple[int, float]:
    """The deployment's batches so far and the rows they carried (the broker's status)."""
    observer = BlockingObserver(initial_peers)
    try:
        d = observer.broker_status()["deployments"][0]
    finally:
        observer.close()
    return int(d["batches"]), float(d.get("batch_rows_mean") or 0.0) * int(d["batches"])


def kill_mid_stream(sw: ProcessSwarm, url: str, requests: list[list[int]], max_tokens: int) -> dict[str, Any]:
    observer = BlockingObserver(sw.initial_peers)
    try:
        peers = observer.broker_status()["deployments"][0]["peers"]
    finally:
        observer.close()
    victim = next(c for c in sw.compnodes if c.peer_id in peers)
    # mid-stream by the tokens streamed, not by the clock: a third of them in, whatever the pace
    at = len(requests) * max_tokens // 3
    killed, once = threading.Event(), threading.Lock()

    def kill_at(count: int) -> None:
        with once:  # the clients' threads call this
            if count < at or killed.is_set():
                return
            killed.set()
        victim.send(signal.SIGKILL)

    result = run_clients(url, 4, requests, max_tokens, on_tokens=kill_at)
    assert killed.is_set(), "the streams ended before the SIGKILL"
    observer = BlockingObserver(sw.initial_peers)
    try:
        result["attempt"] = observer.broker_status()["deployments"][0]["attempt"]  # 2: placed again once
    finally:
        observer.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same as --size quick")
    ap.add_argument(
        "--size",
        choices=tuple(SIZES),
        default="realistic",
        help="GPT-2 size (default realistic: 41.7M parameters; full: a small 5.8M one, latency-bound)",
    )
    ap.add_argument("--compnodes", type=int, default=3, help="compnodes the deployment asks for (default 3)")
    ap.add_argument("--requests", type=int, default=16, help="requests per client count (default 16)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="rows per batch (max_batch; default 16)")
    ap.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="micro-batches a batch is cut into (the job's data.microbatches; default 1: on a host whose "
        "cores the stages share, each micro-batch's frames and calls cost more than its overlap gains)",
    )
    ap.add_argument("--kv-slots", type=int, default=16, help="deploy --kv-slots (0: no KV cache; default 16)")
    ap.add_argument(
        "--in-flight", type=int, default=None, help="deploy --in-flight (default: the deploy default)"
    )
    ap.add_argument(
        "--max-wait-ms", type=float, default=None, help="deploy --max-wait-ms (default: the deploy default)"
    )
    ap.add_argument("--sandbox", choices=("process", "off"), default="process", help="compnode --sandbox")
    ap.add_argument(
        "--worker-sends", choices=("direct", "daemon"), default="direct", help="compnode --worker-sends"
    )
    ap.add_argument(
        "--worker-receives", choices=("direct", "daemon"), default="direct", help="compnode --worker-receives"
    )
    ap.add_argument(
        "--inline-compute-ms", type=float, default=None, help="compnode --inline-compute-ms (default: theirs)"
    )
    ap.add_argument(
        "--placement",
        choices=("balanced", "model"),
        default="balanced",
        help="broker --placement (default balanced)",
    )
    ap.add_argument(
        "--serve-path",
        choices=["direct", "rpc"],
        default="direct",
        help="broker --serve-path: batches to the workers over the data path (default) or as RPC calls",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=3,
        help="rounds of plain generate() then all requests' clients at once, in turn (default 3; 0: none)",
    )
    ap.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    args = ap.parse_args()
    shape = QUICK if args.quick else SIZES[args.size]
    work = work_folder(args.workdir, "fusionnet-serving-")
    job = write_job(work / "job", shape, args.batch, args.compnodes, args.microbatches)
    reqs = prompts(args.requests, shape[0])
    plain = plain_baselines(job, reqs, args.max_tokens, shape[4])
    extra = (
        "--sandbox",
        args.sandbox,
        "--worker-sends",
        args.worker_sends,
        "--worker-receives",
        args.worker_receives,
    ) + (() if args.inline_compute_ms is None else ("--inline-compute-ms", str(args.inline_compute_ms)))
    # The daemons' own DHT refresh (and the broker's own heartbeat) periods, as a user runs them: the
    # tests' quick ones cost an idle broker and 3 compnodes 0.08 of a core against 0.02, taken from
    # the stages on 2 cores.
    specs = [CompnodeSpec(refresh_period=DEFAULT_REFRESH_PERIOD, extra=extra) for _ in range(args.compnodes)]
    specs.append(CompnodeSpec(backup=True, refresh_period=DEFAULT_REFRESH_PERIOD, extra=extra))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    # balanced: the model cut in 3 stages whatever the performance model makes of this machine's load
    argv = ["--http-port", "0", "--placement", args.placement, "--serve-path", args.serve_path]
    with ProcessSwarm(work / "swarm", specs, argv) as sw:
        given = {"in_flight": args.in_flight, "max_wait_ms": args.max_wait_ms}
        settings = ServingSettings(
            kv_slots=args.kv_slots, **{k: v for k, v in given.items() if v is not None}
        )
        reply = asyncio.run(deploy(job, sw.initial_peers, name="gpt", settings=settings, wait_compnodes=120))
        assert reply.url is not None
        for clients in CLIENT_COUNTS:
            before = batch_totals(sw.initial_peers)
            rows.append(run_clients(reply.url, clients, reqs, args.max_tokens))
            after = batch_totals(sw.initial_peers)
            batches = after[0] - before[0]
            rows[-1]["batches"] = batches
            rows[-1]["rows_per_batch"] = (after[1] - before[1]) / batches if batches else None
        observer = BlockingObserver(sw.initial_peers)
        try:
            predicted = predictions(observer.broker_status(), CLIENT_COUNTS, args.max_tokens)
        finally:
            observer.close()
        pairs = paired_rounds(job, reply.url, reqs, args.max_tokens, args.pairs) if args.pairs else None
        killed = kill_mid_stream(sw, reply.url, reqs, args.max_tokens)
    # The reference is the same computation in one process (the KV decode a token at a time, or the padded
    # window without KV caches): generate() prefills the prompt in one pass and rounds differently, and a
    # random-init model's logits have near-ties that such rounding flips (in one process too), so its
    # agreement is reported, not required.
    reference = "kv_decode" if args.kv_slots else "recompute"
    want = plain[f"{reference}_outputs"]
    exact = all(r["outputs"] == want for r in rows)
    killed_exact = killed["outputs"] == want
    agree = sum(a == b for a, b in zip(want, plain["outputs"]))
    print(
        f"GPT-2 {shape} on {args.compnodes} compnodes: {args.requests} requests x {args.max_tokens} "
        f"tokens, prompt {PROMPT}, "
        f"max batch {args.batch}"
    )
    print(f"{'clients':>8} {'tok/s':>8} {'req/s':>7} {'TTFT p50':>9} {'p90':>7} {'ITL p50':>8} {'p90':>7} "
          f"{'rows/batch':>10} {'model tok/s':>11} {'/ model':>7}")  # fmt: skip
    for r in [*rows, killed | {"clients": "4+kill"}]:
        fill = "-" if r.get("rows_per_batch") is None else f"{r['rows_per_batch']:.1f}"
        model = predicted["model_tokens_per_s"].get(r["clients"])
        vs = ("-", "-")
        if model is not None:
            vs = (f"{model['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / model['tokens_per_s']:.2f}")
        print(f"{r['clients']!s:>8} {r['tokens_per_s']:8.1f} {r['requests_per_s']:7.2f} {r['ttft_p50']:9.3f} "
              f"{r['ttft_p90']:7.3f} {r['itl_p50']:8.3f} {r['itl_p90']:7.3f} {fill:>10} {vs[0]:>11} "
              f"{vs[1]:>7}")  # fmt: skip
    print(f"plain generate() (KV cache), one request at a time: {plain['generate_tokens_per_s']:.1f} tok/s")
    print(f"plain KV decode, a token per pass (one process): {plain['kv_decode_tokens_per_s']:.1f} tok/s")
    print(f"plain recompute of the window (one process): {plain['recompute_tokens_per_s']:.1f} tok/s")
    if pairs is not None:
        print(
            f"{len(reqs)} clients against plain generate() measured right before, {args.pairs} rounds: "
            + ", ".join(
                f"{s:.1f}/{p:.1f}" for s, p in zip(pairs["served_tokens_per_s"], pairs["plain_tokens_per_s"])
            )
            + f" tok/s, median ratio {pairs['median_ratio']:.2f}"
        )
    if predicted["eq4_tokens_per_s"] is not None:
        pairs_ms = zip(predicted["stage_fp_seconds_predicted"], predicted["stage_comm_seconds_predicted"])
        ms = ", ".join(f"{c * 1e3:.1f}+{r * 1e3:.2f}" for c, r in pairs_ms)
        print(f"performance model: C_p+R_p per micro-batch {ms} ms, call round trip "
              f"{predicted['call_seconds'] * 1e3:.1f} ms; one full batch at a time (eq. (3)) "
              f"{predicted['eq3_tokens_per_s']:.1f} tok/s, eq. (4)'s asymptote (a full batch per stage in "
              f"flight) {predicted['eq4_tokens_per_s']:.1f} tok/s")  # fmt: skip
    stages = ", ".join(f"{s * 1e3:.1f}" for s in predicted["stage_fp_seconds_mean"] or [])
    print(
        f"per batch: {predicted['batch_seconds_mean'] * 1e3:.1f} ms wall at the broker, "
        f"{predicted['batch_rows_mean'] or 0:.1f} rows on average (all client counts); "
        f"FP per sub-DAG {stages} ms"
    )
    print(f"greedy outputs equal the plain {reference}: {exact}; after the SIGKILL: {killed_exact}")
    print(f"(plain generate() agrees with the plain {reference} on {agree} of {len(want)})")
    summary = {
        "benchmark": "serving",
        "model": dict(zip(("vocab", "width", "layers", "heads", "window"), shape)),
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
        "kill": {k: v for k, v in killed.items() if k != "outputs"} | {"exact": killed_exact},
        "plain_generate_tokens_per_s": plain["generate_tokens_per_s"],
        "plain_recompute_tokens_per_s": plain["recompute_tokens_per_s"],
        "plain_kv_decode_tokens_per_s": plain["kv_decode_tokens_per_s"],
        "paired": pairs,
        "kv_slots": args.kv_slots,
        "compnodes": args.compnodes,
        "sandbox": args.sandbox,
        "worker_sends": args.worker_sends,
        "worker_receives": args.worker_receives,
        "inline_compute_ms": args.inline_compute_ms,
        "placement": args.placement,
        "serve_path": args.serve_path,
        "reference": reference,
        **{k: v for k, v in predicted.items()},
        "exact": exact,
        "generate_agrees_with_reference": f"{agree}/{len(want)}",
    }
    print(json.dumps(summary))
    return 0 if exact and killed_exact else 1


if __name__ == "__main__":
    run_main(main)
