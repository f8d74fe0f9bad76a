"""Optional wire compression (``placement.wire_compression``) on a real swarm: what each codec saves in
bytes and step time, and what it costs in exactness and loss.

The job is the bundled GPT example made larger (``--d-model``, ``--layers``; SGD with momentum, so that
plain PyTorch is a tight reference; ``--steps`` steps, 4 micro-batches), placed on a real local swarm of
processes on loopback: ``fusionnet broker --placement balanced`` (the same FLOP-balanced cut for every
codec: the performance model would learn the compnodes' speeds from one job and cut the next elsewhere,
and another cut sends other tensors) and 2 ``fusionnet compnode`` daemons (one thread each), one swarm for
every codec in turn (``none`` first, the exact baseline), the job handed over as ``fusionnet submit``
does. Per codec:

- ``MB/step``      activation and gradient bytes the sub-DAGs sent each other per step, as on the wire
                   (metrics.jsonl's ``sent_bytes``, summed; link probes and state transfers are not in
                   it), and its ratio to ``none``'s;
- ``ms/step``      median ``seconds`` of ``metrics.jsonl`` after the first step, and its ratio to ``none``'s;
- ``max |dloss|``  the largest difference between the job's loss and plain PyTorch's at any step
                   (``fusionnet.reference``: the same job in one process), and the last step's losses;
- ``max |dw|``     the largest difference of the final weights from plain PyTorch's.

``none`` must be exact (max |dw| <= 1e-5); the others are inexact by design. On loopback bytes are
cheap and the casts cost CPU, so the step time says little about a slow link, where a quarter of the
bytes is a quarter of the transfer time (``benchmarks/links.py`` measures links). Prints a table, then
one JSON line.

    python benchmarks/wire_compression.py [--steps 20] [--codecs none bf16 fp16 int8-ef] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swarm_jobs import WORKDIR_HELP, run_main, work_folder, write_gpt_job

from fusionnet.daemon.observer import SwarmObserver
from fusionnet.runtime.process_swarm import CompnodeSpec, ProcessSwarm, broker_args
from fusionnet.runtime.submit import submit_and_wait

CODECS = ("none", "bf16", "fp16", "int8-ef")
EXACT = 1e-5


SGD = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}


def write_job(folder: Path, args: argparse.Namespace, codec: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_gpt_job(
        folder / f"gpt-{codec}.yaml",
        model={"d_model": args.d_model, "n_layer": args.layers, "n_head": 4, "block_size": args.block},
        data={"block_size": args.block, "batch_size": args.batch, "microbatches": 4},
        steps=args.steps,
        optimizer=SGD,
        placement={"compnodes": 2, "wire_compression": codec},
    )


def max_weight_diff(out: Path, ref: dict[str, Any]) -> float:
    from safetensors.torch import load_file

    got = load_file(str(out / "weights.safetensors"))
    return max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)


async def run_codec(swarm: ProcessSwarm, job: Path, out: Path, timeout: float) -> dict[str, Any]:
    async with SwarmObserver(swarm.initial_peers) as observer:
        await swarm.wait_members(observer)
    started = time.monotonic()
    await submit_and_wait(job, swarm.initial_peers, out, timeout=timeout)
    wall = time.monotonic() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    plan = json.loads((out / "plan.json").read_text())
    return {
        "sub_dags": len(plan["subdags"]),
        "cut": [sorted(s["nodes"]) for s in plan["subdags"]],
        "mb_per_step": statistics.mean(sum(r["sent_bytes"]) for r in rows) / 1e6,
        "ms_per_step": statistics.median(float(r["seconds"]) for r in rows[1:] or rows) * 1e3,
        "losses": [float(r["loss"]) for r in rows],
        "wall_s": wall,
    }


def report(results: dict[str, dict[str, Any]], ref_losses: list[float], plain_ms: float) -> dict[str, Any]:
    base = results.get("none")
    header = ("codec", "sub-DAGs", "MB/step", "x none", "ms/step", "x none", "max |dloss|", "last loss",
              "max |dw|", "exact")  # fmt: skip
    table = [header]
    summary: dict[str, Any] = {"benchmark": "wire_compression", "plain_ms_per_step": round(plain_ms, 2)}
    for codec, r in results.items():
        if "error" in r:
            table.append((codec, "FAILED", "", "", "", "", "", "", "", r["error"][:60]))
            summary[codec] = {"error": r["error"]}
            continue
        dloss = max(abs(a - b) for a, b in zip(r["losses"], ref_losses))
        bytes_ratio = r["mb_per_step"] / base["mb_per_step"] if base and "error" not in base else None
        time_ratio = r["ms_per_step"] / base["ms_per_step"] if base and "error" not in base else None
        exact = r["max_dw"] <= EXACT
        table.append((
            codec, str(r["sub_dags"]), f"{r['mb_per_step']:.2f}",
            "-" if bytes_ratio is None else f"{bytes_ratio:.2f}", f"{r['ms_per_step']:.1f}",
            "-" if time_ratio is None else f"{time_ratio:.2f}", f"{dloss:.2e}",
            f"{r['losses'][-1]:.5f} ({ref_losses[-1]:.5f})", f"{r['max_dw']:.2e}", "yes" if exact else "no",
        ))  # fmt: skip
        summary[codec] = {
            "mb_per_step": round(r["mb_per_step"], 4),
            "bytes_vs_none": None if bytes_ratio is None else round(bytes_ratio, 4),
            "ms_per_step": round(r["ms_per_step"], 2),
            "time_vs_none": None if time_ratio is None else round(time_ratio, 4),
            "max_loss_diff": dloss,
            "last_loss": r["losses"][-1],
            "max_weight_diff": r["max_dw"],
            "exact": exact,
        }
    summary["reference_last_loss"] = ref_losses[-1]
    cuts = [r["cut"] for r in results.values() if "cut" in r]
    summary["same_cut"] = all(c == cuts[0] for c in cuts)
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    print()
    for row in table:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    print(f"(last loss: the swarm's, plain PyTorch's in brackets; plain PyTorch {plain_ms:.1f} ms/step; "
          f"the same cut for every codec: {'yes' if summary['same_cut'] else 'NO'})")  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per codec (default 20)")
    p.add_argument("--codecs", nargs="+", choices=CODECS, default=list(CODECS), help="codecs, none first")
    p.add_argument("--d-model", type=int, default=256, help="GPT width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="GPT layers (default 4)")
    p.add_argument("--block", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--batch", type=int, default=32, help="samples per batch, in 4 micro-batches (default 32)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    p.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    p.add_argument("--quick", action="store_true", help="6 steps of a d 64, 2-layer GPT")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.d_model, args.layers, args.block, args.batch = 6, 64, 2, 32, 8
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is left out of the step time)")
    codecs = sorted(set(args.codecs), key=CODECS.index)  # none first: the baseline of the ratios
    workdir = work_folder(args.workdir, "fusionnet-wire-compression-")

    import torch

    from fusionnet.job.loader import load_job
    from fusionnet.reference import run_reference

    torch.set_num_threads(1)  # plain PyTorch on one thread, like each compnode
    job = load_job(write_job(workdir / "reference", args, "none"))
    started = time.perf_counter()
    ref = run_reference(job)
    plain_ms = (time.perf_counter() - started) / args.steps * 1e3
    n_params = sum(v.numel() for v in job.model.parameters())
    print(f"GPT d {args.d_model}, {args.layers} layers, {n_params / 1e6:.2f}M parameters, {args.steps} "
          f"steps; plain PyTorch {plain_ms:.1f} ms/step; logs in {workdir}", flush=True)  # fmt: skip

    specs = [CompnodeSpec(), CompnodeSpec()]  # one thread each
    swarm = ProcessSwarm(workdir / "swarm", specs, broker_args(1.0, 1.0, 5.0, ["--placement", "balanced"]))
    results: dict[str, dict[str, Any]] = {}
    try:
        swarm.start()
        for codec in codecs:
            path = write_job(workdir / codec, args, codec)
            try:
                r = asyncio.run(run_codec(swarm, path, workdir / codec / "out", args.timeout))
                r["max_dw"] = max_weight_diff(workdir / codec / "out", ref.weights)
            except Exception as e:  # one codec's failure is reported; the others still run
                r = {"error": f"{type(e).__name__}: {e}"}
            results[codec] = r
            line = r.get("error") or f"{r['mb_per_step']:.2f} MB/step, {r['ms_per_step']:.1f} ms/step"
            print(f"  {codec}: {line}", flush=True)
    finally:
        swarm.stop()
    summary = report(results, ref.losses, plain_ms)
    print(json.dumps(summary))
    exact_none = summary.get("none", {}).get("exact", True)
    ok = exact_none and summary["same_cut"] and not any("error" in r for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
