"""Continuous pipelined inference (issue 14, item 2): ``POST /v1/infer`` on a deployed model, against eq. (4).

A stack of pre-norm MLP blocks (``pipeline_model.py``; default dim 1024, hidden 4096, 6 blocks: 50M
parameters) is deployed as ``task: infer`` on a broker and ``--compnodes`` compnodes (one thread each,
cut in balanced stages) plus a backup. 1, 4 and 16 clients each send requests of ``--rows`` rows, one
after another, over the HTTP API; the deployment's batcher packs them into batches of ``--batch`` rows
with ``--in-flight`` batches in the pipeline. Per client count: rows/s and requests/s, latency
percentiles, rows per batch, beside

- plain PyTorch   the same model and requests in this process, one request at a time;
- eq. (4)         the performance model's throughput for this placement: full batches back to back,
                  one leaves the pipeline every ``max_p max(C_p, R_p)`` (``asymptote_tokens_per_s``: rows
                  here), C_p per micro-batch as planned and refined by each compnode's measured FP, R_p
                  from the probed links;
- eq. (3)         one full batch at a time: the broker's call round trip and ``sum_p (C_p + R_p)``.

Every answer must equal the plain model's output for its rows (max abs difference <= 1e-5).
Prints a table, then one JSON line.

    python benchmarks/serving_infer.py [--compnodes 2] [--dim 1024] [--hidden 4096] [--layers 6]
        [--batch 32] [--rows 8] [--requests-per-client 8] [--in-flight 1|2] [--max-wait-ms MS]
        [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from serving import batch_totals, pct  # noqa: E402
from swarm_jobs import WORKDIR_HELP, run_main, work_folder  # noqa: E402

from fusionnet.daemon.flags import DEFAULT_REFRESH_PERIOD  # noqa: E402
from fusionnet.job.loader import load_job  # noqa: E402
from fusionnet.messages.serving_rpc import ServingSettings  # noqa: E402
from fusionnet.perfmodel.generation_rate import asymptote_tokens_per_s  # noqa: E402
from fusionnet.perfmodel.timing import latency_eq3  # noqa: E402
from fusionnet.runtime.deploy import deploy  # noqa: E402
from fusionnet.runtime.process_swarm import BlockingObserver, CompnodeSpec, ProcessSwarm  # noqa: E402
from fusionnet.serving.client import FusionNetClient  # noqa: E402

CLIENT_COUNTS = [1, 4, 16]
NAME = "blocks"
TOL = 1e-5


def write_job(folder: Path, dim: int, hidden: int, layers: int, batch: int, compnodes: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO / "benchmarks" / "pipeline_model.py", folder / "pipeline_model.py")
    save_file({"inputs": torch.zeros(batch, dim)}, str(folder / "data.safetensors"))
    kwargs = {"dim": dim, "hidden": hidden, "layers": layers}
    (folder / "job.yaml").write_text(
        "name: bench-blocks\ntask: infer\n"
        f"model: {{entrypoint: pipeline_model.py:build, kwargs: {json.dumps(kwargs)}}}\n"
        f"data: {{path: data.safetensors, batch_size: {batch}, microbatches: 1}}\n"
        f"seed: 0\nplacement: {{compnodes: {compnodes}}}\n"
    )
    return folder / "job.yaml"


def plain_run(model: torch.nn.Module, requests: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """Each request through the model in this process, one at a time: outputs and rows/s."""
    with torch.no_grad():
        model(requests[0])  # warm-up
        started = time.perf_counter()
        outputs = [model(x) for x in requests]
        wall = time.perf_counter() - started
    return outputs, sum(x.shape[0] for x in requests) / wall


def run_clients(url: str, clients: int, requests: list[torch.Tensor]) -> dict[str, Any]:
    """Client ``c`` sends requests ``c, c + clients, ...`` one after another; all clients at once."""
    client = FusionNetClient(url, timeout=600)
    outputs: dict[int, torch.Tensor] = {}
    latencies: list[float] = []

    def worker(c: int) -> None:
        for i in range(c, len(requests), clients):
            started = time.perf_counter()
            outputs[i] = client.infer(requests[i], model=NAME)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    wall = time.perf_counter() - started
    rows = sum(x.shape[0] for x in requests)
    return {
        "clients": clients,
        "requests": len(requests),
        "rows": rows,
        "seconds": wall,
        "rows_per_s": rows / wall,
        "requests_per_s": len(requests) / wall,
        "latency_p50": pct(latencies, 0.5),
        "latency_p90": pct(latencies, 0.9),
        "outputs": [outputs[i] for i in range(len(requests))],
    }


def model_rates(status: dict[str, Any]) -> dict[str, Any]:
    """Eq. (4)'s and eq. (3)'s rows/s for the deployment's placement (the broker's figures), and what its
    batches took."""
    d = status["deployments"][0]
    out: dict[str, Any] = {
        "batch_seconds_mean": d.get("batch_seconds_mean"),
        "batch_rows_mean": d.get("batch_rows_mean"),
        "stage_fp_seconds_mean": d.get("stage_fp_seconds_mean"),
        "max_batch": d["max_batch"],
    }
    figures = d.get("model")
    if not figures:
        return out | {"eq4_rows_per_s": None, "eq3_rows_per_s": None}
    fp, comm, mb_rows = figures["stage_fp_seconds"], figures["stage_comm_seconds"], figures["microbatch_rows"]
    m = -(-d["max_batch"] // mb_rows)
    one_batch = figures["call_seconds"] + m * latency_eq3(fp, comm)
    return out | {
        "eq4_rows_per_s": asymptote_tokens_per_s(fp, comm, max_batch=d["max_batch"], mb_rows=mb_rows),
        "eq3_rows_per_s": d["max_batch"] / one_batch,
        "stage_fp_seconds_predicted": fp,
        "stage_comm_seconds_predicted": comm,
        "call_seconds": figures["call_seconds"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compnodes", type=int, default=2, help="compnodes the deployment asks for (default 2)")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="rows per batch (the job's data.batch_size)")
    ap.add_argument("--rows", type=int, default=8, help="rows per request (default 8)")
    ap.add_argument("--requests-per-client", type=int, default=8, help="requests each client sends")
    ap.add_argument("--in-flight", type=int, default=2, help="deploy --in-flight (default 2)")
    ap.add_argument("--max-wait-ms", type=float, default=None, help="deploy --max-wait-ms")
    ap.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = work_folder(args.workdir, "fusionnet-serving-infer-")
    job = write_job(work / "job", args.dim, args.hidden, args.layers, args.batch, args.compnodes)
    g = torch.Generator().manual_seed(1)
    count = max(CLIENT_COUNTS) * args.requests_per_client
    requests = [torch.randn(args.rows, args.dim, generator=g) for _ in range(count)]
    model = load_job(job).model.eval()  # the deployed model, built as the job builds it (seed 0)
    want, plain_rows_per_s = plain_run(model, requests)
    del model
    # The daemons' own DHT refresh and heartbeat periods, as a user runs them (``serving.py``: the tests'
    # quick ones take about 0.06 of a core from the stages).
    specs = [CompnodeSpec(refresh_period=DEFAULT_REFRESH_PERIOD) for _ in range(args.compnodes)]
    specs.append(CompnodeSpec(backup=True, refresh_period=DEFAULT_REFRESH_PERIOD))
    argv = ["--http-port", "0", "--placement", "balanced"]
    runs = []
    given = {"in_flight": args.in_flight, "max_wait_ms": args.max_wait_ms}
    settings = ServingSettings(**{k: v for k, v in given.items() if v is not None})
    with ProcessSwarm(work / "swarm", specs, argv) as sw:
        reply = asyncio.run(deploy(job, sw.initial_peers, name=NAME, settings=settings, wait_compnodes=120))
        assert reply.url is not None
        run_clients(reply.url, 4, requests[:16])  # warm-up: the compnodes' speeds refined from real batches
        for clients in CLIENT_COUNTS:
            before = batch_totals(sw.initial_peers)
            run = run_clients(reply.url, clients, requests[: clients * args.requests_per_client])
            after = batch_totals(sw.initial_peers)
            batches = after[0] - before[0]
            run["batches"] = batches
            run["rows_per_batch"] = (after[1] - before[1]) / batches if batches else None
            run["max_diff"] = max((o - w).abs().max().item() for o, w in zip(run["outputs"], want))
            runs.append(run)
        observer = BlockingObserver(sw.initial_peers)
        try:
            rates = model_rates(observer.broker_status())
        finally:
            observer.close()
    exact = all(r["max_diff"] <= TOL for r in runs)
    print(
        f"MLP blocks (dim {args.dim}, hidden {args.hidden}, {args.layers} blocks) deployed on "
        f"{args.compnodes} compnodes, batches of {args.batch} rows, {args.in_flight} in flight; "
        f"requests of {args.rows} rows"
    )
    eq4 = rates["eq4_rows_per_s"]
    print(f"{'clients':>8} {'rows/s':>8} {'req/s':>7} {'lat p50':>8} {'p90':>7} {'rows/batch':>10} "
          f"{'/ eq. (4)':>9} {'/ plain':>8} {'max diff':>9}")  # fmt: skip
    for r in runs:
        fill = "-" if r["rows_per_batch"] is None else f"{r['rows_per_batch']:.1f}"
        vs4 = "-" if not eq4 else f"{r['rows_per_s'] / eq4:.2f}"
        print(f"{r['clients']:>8} {r['rows_per_s']:8.1f} {r['requests_per_s']:7.2f} {r['latency_p50']:8.3f} "
              f"{r['latency_p90']:7.3f} {fill:>10} {vs4:>9} {r['rows_per_s'] / plain_rows_per_s:8.2f} "
              f"{r['max_diff']:9.1e}")  # fmt: skip
    print(f"plain PyTorch, one request at a time in one process: {plain_rows_per_s:.1f} rows/s")
    if eq4:
        ms = ", ".join(
            f"{c * 1e3:.1f}+{k * 1e3:.2f}"
            for c, k in zip(rates["stage_fp_seconds_predicted"], rates["stage_comm_seconds_predicted"])
        )
        print(f"performance model: C_p+R_p per micro-batch {ms} ms, call round trip "
              f"{rates['call_seconds'] * 1e3:.1f} ms; eq. (4) {eq4:.1f} rows/s, eq. (3) (one batch at a "
              f"time) {rates['eq3_rows_per_s']:.1f} rows/s")  # fmt: skip
    stages = ", ".join(f"{s * 1e3:.1f}" for s in rates["stage_fp_seconds_mean"] or [])
    print(f"per batch: {(rates['batch_seconds_mean'] or 0) * 1e3:.1f} ms wall at the broker, "
          f"{rates['batch_rows_mean'] or 0:.1f} rows on average; FP per sub-DAG {stages} ms")  # fmt: skip
    print(f"every answer equal to plain PyTorch's (<= {TOL:g}): {exact}")
    summary = {
        "benchmark": "serving_infer",
        "model": {"dim": args.dim, "hidden": args.hidden, "layers": args.layers},
        "compnodes": args.compnodes,
        "batch": args.batch,
        "rows_per_request": args.rows,
        "in_flight": args.in_flight,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "plain_rows_per_s": plain_rows_per_s,
        **rates,
        "served_over_eq4": {r["clients"]: r["rows_per_s"] / eq4 for r in runs} if eq4 else None,
        "exact": exact,
    }
    print(json.dumps(summary))
    return 0 if exact else 1


if __name__ == "__main__":
    run_main(main)
