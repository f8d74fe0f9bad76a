"""Real scale: a Llama-style (or, ``--family gpt2``, GPT-2) model of ~100M parameters on a broker and 3
compnodes beside plain PyTorch.

One run, one swarm of processes on loopback (a broker, 3 working compnodes with one thread each and one
``--backup`` compnode), the job built from a ``transformers`` ``LlamaConfig`` (random init, nothing
downloaded; RMSNorm, rotary embeddings, grouped-query attention, untied embeddings):

- plain PyTorch   ``fusionnet.reference`` on one thread in this process: ms/step and the final weights;
- swarm           the job through ``submit``: ms/step (``metrics.jsonl``; it includes the compute-thread
                  time of the state snapshots replicated between compnodes, given apart per step), the
                  broker's one collection of the final state for the results, submission time (trace,
                  pack, send, until the broker accepted the job), exactness against plain PyTorch;
- memory          peak memory of every daemon against the state it holds (its own ``VmHWM``, or, where
                  higher, the peak PSS of its process tree: a compnode's sandbox fork server and job
                  workers, sampled every 0.25 s): parameters + gradients
                  + optimizer state of its sub-DAG (``plan.json``'s parameters per sub-DAG), with the
                  bound of issue 11 (compnode <= 1.5 GB + 2x its state; broker <= 1 GB);
- recovery        the same job again; once it is past step 1 the compnode of the largest sub-DAG is
                  SIGKILLed (its whole process group, as a machine that dies); the backup takes its
                  sub-DAG from the newest replicated step and the final weights must equal plain
                  PyTorch's.

Exactness: SGD with momentum (default) must be within 1e-5; with ``--optimizer adamw`` Adam turns rounding
noise into lr-sized steps (design.md), so the bound is ``lr``. Prints a table, then one JSON line.

    python benchmarks/scale.py [--quick] [--steps 4] [--optimizer sgd|adamw] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from daemon_memory import TreeMemory, vm_kb  # noqa: E402
from swarm_jobs import WORKDIR_HELP, run_main, work_folder  # noqa: E402

from fusionnet.daemon.observer import SwarmObserver  # noqa: E402
from fusionnet.messages.broker_rpc import BrokerClient  # noqa: E402
from fusionnet.runtime.jobcontrol import job_status  # noqa: E402
from fusionnet.runtime.process_swarm import CompnodeSpec, ProcessSwarm, broker_args  # noqa: E402
from fusionnet.runtime.submit import submit_and_wait  # noqa: E402
from fusionnet.runtime.submitter import Signer, load_or_create_key  # noqa: E402

GB = 1e9
# (vocab, hidden, layers, heads, kv heads, intermediate): the full model has ~125M parameters.
FULL = (32000, 768, 12, 12, 4, 2048)
QUICK = (4000, 384, 4, 6, 2, 1024)  # ~8M parameters
# --billion: TinyLlama-1.1B's shape (22 layers of width 2048, 4 KV heads): for a GPU swarm (issue 11)
BILLION = (32000, 2048, 22, 32, 4, 5632)
# --family gpt2: issue 11's GPT-2 job, 12 layers of width 768 with tied embeddings: 97M parameters
GPT2_FULL = (16000, 768, 12, 12, 12, 3072)
GPT2_QUICK = (4000, 384, 4, 6, 6, 1536)
SEQ = 32
# Generous: on a loaded 2-core machine a daemon moving 100s of MB can miss pings for seconds; a
# SIGKILL is still seen at once (its streams break). Detection speed is benchmarks/recovery.py's.
HEARTBEAT_TIMEOUT = 30.0
SLOTS = {"sgd": 1, "adamw": 2}  # optimizer state tensors per parameter
OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.01, "kwargs": {"momentum": 0.9}},
    "adamw": {"name": "adamw", "lr": 1e-4, "kwargs": {"weight_decay": 0.01}},
}
MODEL_PY = '''"""A causal LM from a transformers config (random init, nothing downloaded): Llama (RMSNorm,
rotary, grouped-query attention, untied embeddings) or GPT-2 (LayerNorm, learnt positions, tied
embeddings)."""
import torch
import transformers


class LM(torch.nn.Module):
    def __init__(self, family, vocab, hidden, layers, heads, kv_heads, intermediate, seq):
        super().__init__()
        if family == "gpt2":
            cfg = transformers.GPT2Config(
                vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate,
                n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
            )
        else:
            cfg = transformers.LlamaConfig(
                vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=seq,
                bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
            )
        self.lm = transformers.AutoModelForCausalLM.from_config(cfg)

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels).loss


def build(**kwargs):
    return LM(**kwargs)
'''


@dataclass
class SwarmRun:
    """One job on the swarm."""

    steps: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows
    submit_s: float = float("nan")
    upload_s: float = float("nan")  # of which the state's upload (``submit`` prints it)
    download_s: float = float("nan")  # the results' download after the job (``submit`` prints it)
    max_diff: float = float("nan")
    placement: list[dict[str, Any]] = field(default_factory=list)  # plan.json's sub-DAGs
    compnodes: dict[str, str] = field(default_factory=dict)  # sub-DAG -> peer id
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    killed: str | None = None  # the daemon SIGKILLed mid-job
    wall_s: float = 0.0


def write_job(
    folder: Path, family: str, dims: tuple[int, ...], steps: int, optimizer: str, batch: int
) -> Path:
    import torch
    import yaml
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = dims[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch * steps, SEQ), generator=g)
    save_file({"inputs": ids, "labels": ids.clone()}, str(folder / "data.safetensors"))
    (folder / "model.py").write_text(MODEL_PY)
    keys = ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate")
    doc = {
        "name": f"{family}-scale",
        "task": "train",
        "model": {
            "entrypoint": "model.py:build",
            "kwargs": {"family": family, **dict(zip(keys, dims)), "seq": SEQ},
        },
        "data": {"path": "data.safetensors", "batch_size": batch, "microbatches": 2},
        "optimizer": OPTIMIZERS[optimizer],
        "steps": steps,
        "seed": 0,
        "placement": {"compnodes": 3},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class TimedStream(io.StringIO):
    """Records when ``submit`` printed that the broker accepted the job, and the seconds it printed for
    the state's upload and the results' download."""

    def __init__(self) -> None:
        super().__init__()
        self.accepted_at: float | None = None
        self.seconds: dict[str, float] = {}

    def write(self, s: str) -> int:
        if self.accepted_at is None and " submitted to broker " in s:
            self.accepted_at = time.monotonic()
        for what in ("state uploaded", "results downloaded"):
            found = re.search(rf"{what}: \d+ MB in ([0-9.]+) s", s)
            if found:
                self.seconds[what] = float(found.group(1))
        return super().write(s)


async def kill_when_running(swarm: ProcessSwarm, observer: SwarmObserver, step: int) -> str:
    """SIGKILLs the process group of the compnode with the largest sub-DAG once the job passed ``step``."""
    brokers = BrokerClient(observer.call)
    broker = await observer.find_broker()
    signer = Signer(load_or_create_key(None), broker, observer.peer_id)  # submit's own key: its job
    while True:
        with contextlib.suppress(Exception):  # the broker may be busy: ask again
            jobs = [j for j in (await observer.broker_status())["jobs"] if j["state"] == "RUNNING"]
            if jobs and jobs[0]["step"] >= step:
                status = await job_status(brokers, broker, jobs[0]["job_id"], signer)
                victim = max(status.placement, key=lambda p: (p["params"], -p["subdag"]))
                daemon = next(d for d in swarm.compnodes if d.peer_id == victim["peer_id"])
                os.killpg(daemon.pid, signal.SIGKILL)
                return daemon.name
        await asyncio.sleep(0.2)


async def submit_job(
    swarm: ProcessSwarm, job_path: Path, out: Path, kill_at: int | None, timeout: float
) -> SwarmRun:
    run = SwarmRun()
    stream = TimedStream()
    async with SwarmObserver(swarm.initial_peers) as observer:
        await swarm.wait_members(observer)
        started = time.monotonic()
        killer = (
            asyncio.create_task(kill_when_running(swarm, observer, kill_at)) if kill_at is not None else None
        )
        try:
            await submit_and_wait(job_path, swarm.initial_peers, out, stream=stream, timeout=timeout)
        finally:
            if killer is not None and not killer.done():
                killer.cancel()
                await asyncio.gather(killer, return_exceptions=True)
        if killer is not None and (killer.cancelled() or killer.exception() is not None):
            raise RuntimeError(f"the job ended before its compnode could be SIGKILLed past step {kill_at}")
        run.killed = killer.result() if killer is not None else None
    run.wall_s = time.monotonic() - started
    run.submit_s = (stream.accepted_at or float("nan")) - started
    run.upload_s = stream.seconds.get("state uploaded", float("nan"))
    run.download_s = stream.seconds.get("results downloaded", float("nan"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run.steps = rows
    plan = json.loads((out / "plan.json").read_text())
    run.placement = plan["subdags"]
    run.compnodes = {str(k): v for k, v in plan["compnodes"].items()}
    run.recoveries = plan.get("recoveries", [])
    return run


def max_diff(out: Path, ref: dict[str, Any]) -> float:
    from safetensors.torch import load_file

    got = load_file(str(out / "weights.safetensors"))
    if sorted(got) != sorted(ref):
        raise RuntimeError(f"weights keys differ: {sorted(set(got) ^ set(ref))[:5]}")
    return max((got[k].double() - ref[k].double()).abs().max().item() for k in ref)


def held_bytes(run: SwarmRun, sizes: dict[str, int], slots: int) -> dict[str, int]:
    """peer id -> bytes of parameters + gradients + optimizer state of the sub-DAGs it ran."""
    held: dict[str, int] = {}
    for s in run.placement:
        peer = run.compnodes[str(s["subdag"])]
        held[peer] = held.get(peer, 0) + sum(sizes.get(k, 0) for k in s["params"]) * (2 + slots)
    return held


def memory_rows(
    swarm: ProcessSwarm,
    held: dict[str, int],
    baseline: dict[str, int],
    trees: dict[str, int],
    gpu: dict[str, int],
) -> list[dict[str, Any]]:
    rows = []
    for d in swarm.daemons:
        # The daemon's own peak, or its process tree's (sandbox workers) where that is higher.
        peak = max(vm_kb(d.pid, "VmHWM") * 1024, trees.get(d.name, 0))
        state = 0 if d.kind == "broker" else held.get(d.peer_id, 0)
        bound = 1 * GB if d.kind == "broker" else 1.5 * GB + 2 * state
        rows.append(
            {
                "daemon": d.name
                + (
                    " (backup)"
                    if d in swarm.compnodes and swarm.specs[swarm.compnodes.index(d)].backup
                    else ""
                ),
                "pid": d.pid,
                "idle_rss": baseline.get(d.name, 0),
                "peak_rss": peak,
                "peak_gpu": gpu.get(d.name, 0),  # device memory of its process tree (--device cuda)
                "state": state,
                "bound": bound,
                "within": peak == 0 or peak <= bound,  # 0: SIGKILLed, nothing to read
            }
        )
    return rows


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_ms(run: SwarmRun) -> tuple[float, float, float]:
    """(median step ms, mean snapshot ms per step, ms of the broker's collections), the first step
    (warm-up) left out of the first two when possible."""
    rows = run.steps[1:] if len(run.steps) > 2 else run.steps
    ckpt = [r.get("checkpoint_seconds", 0.0) for r in rows]
    mean = sum(ckpt) / len(ckpt) * 1e3 if ckpt else float("nan")
    return (
        median([r["seconds"] for r in rows]) * 1e3,
        mean,
        sum(r.get("sync_seconds", 0.0) for r in run.steps) * 1e3,
    )


def print_table(rows: list[tuple[str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a ~8M-parameter model {QUICK} instead of {FULL}")
    p.add_argument("--steps", type=int, default=4, help="training steps per job (default 4, >= 3)")
    p.add_argument("--batch", type=int, default=4, help=f"samples of {SEQ} tokens per step (default 4)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument(
        "--family",
        choices=("llama", "gpt2"),
        default="llama",
        help=f"llama (default; {FULL}) or gpt2 (issue 11's 97M GPT-2, tied embeddings; {GPT2_FULL})",
    )
    p.add_argument(
        "--billion", action="store_true", help=f"a 1.1B-parameter Llama {BILLION} (meant for --device cuda)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the compnodes compute (their --device) and plain PyTorch runs: cpu (default) or cuda",
    )
    p.add_argument(
        "--placement",
        choices=("model", "balanced"),
        default="model",
        help="the broker's --placement: the performance model's plan (default) or FLOP-balanced pieces on "
        "all 3 compnodes (on one GPU shared by the 3, the model rightly keeps the whole job on one of them)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one job may take")
    p.add_argument("--no-kill", action="store_true", help="skip the SIGKILL run")
    p.add_argument("--workdir", type=Path, help=WORKDIR_HELP)
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be >= 3 (the SIGKILL lands after step 1)")
    workdir = work_folder(args.workdir, "fusionnet-scale-")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.monotonic()

    import torch

    from fusionnet.job.loader import load_job
    from fusionnet.reference import run_reference

    if args.device == "cpu":
        torch.set_num_threads(1)  # plain PyTorch on one thread, like each compnode
    if args.billion and (args.quick or args.family != "llama"):
        p.error("--billion is a Llama shape: leave out --quick and --family gpt2")
    if args.family == "gpt2":
        dims = GPT2_QUICK if args.quick else GPT2_FULL
    else:
        dims = BILLION if args.billion else QUICK if args.quick else FULL
    job_path = write_job(workdir / "job", args.family, dims, args.steps, args.optimizer, args.batch)
    job = load_job(job_path)
    sizes = {k: v.numel() * v.element_size() for k, v in job.model.named_parameters()}
    n_params = sum(v.numel() for v in job.model.parameters())
    print(f"{args.family} {dims}: {n_params / 1e6:.1f}M parameters, {args.steps} steps, {args.optimizer}, "
          f"on {args.device}; logs in {workdir}", flush=True)  # fmt: skip
    reference = run_reference(job, args.device)
    ref = reference.weights
    # The median step after the first (warm-up), as the swarm's figure is taken.
    torch_ms = median(reference.step_seconds[1:]) * 1e3
    del job
    print(f"  plain PyTorch: {torch_ms:.0f} ms/step", flush=True)

    device = ("--device", args.device)
    specs = [CompnodeSpec(refresh_period=2.0, extra=device) for _ in range(3)] + [
        CompnodeSpec(refresh_period=2.0, backup=True, extra=device)
    ]
    state_mb = sum(sizes.values()) / 2**20
    extra = ["--placement", args.placement, "--max-submission-mb", str(max(1024, round(1.5 * state_mb)))]
    # stage_part_mb: the daemon's default part size
    argv = broker_args(1.0, 1.0, HEARTBEAT_TIMEOUT, extra=extra, stage_part_mb=32.0)
    swarm = ProcessSwarm(workdir / "swarm", specs, argv)
    tol = 1e-5 if args.optimizer == "sgd" else OPTIMIZERS["adamw"]["lr"]
    try:
        swarm.start()
        with TreeMemory({d.name: d.pid for d in swarm.daemons}, gpu=args.device != "cpu") as trees:
            baseline = trees.sample()
            run = asyncio.run(submit_job(swarm, job_path, workdir / "out", None, args.timeout))
        run.max_diff = max_diff(workdir / "out", ref)
        held = held_bytes(run, sizes, SLOTS[args.optimizer])
        memory = memory_rows(swarm, held, baseline, trees.peak, trees.gpu_peak)
        print(f"  swarm: {step_ms(run)[0]:.0f} ms/step, max diff {run.max_diff:.1e}", flush=True)
        for m in memory:  # now, so that a failure of the SIGKILL run below still leaves them
            gpu = f", device {m['peak_gpu'] / GB:.2f} GB" if m["peak_gpu"] else ""
            held_gb = m["state"] / GB
            print(f"  {m['daemon']}: peak RSS {m['peak_rss'] / GB:.2f} GB{gpu}, holds {held_gb:.2f} GB")
        kill = None
        if not args.no_kill:
            kill = asyncio.run(submit_job(swarm, job_path, workdir / "out-kill", 1, args.timeout))
            kill.max_diff = max_diff(workdir / "out-kill", ref)
            print(f"  SIGKILL of {kill.killed}: max diff {kill.max_diff:.1e}", flush=True)
    finally:
        swarm.stop()
    return report(args, dims, n_params, torch_ms, run, kill, memory, tol, time.monotonic() - t0)


def report(
    args: argparse.Namespace,
    dims: tuple[int, ...],
    n_params: int,
    torch_ms: float,
    run: SwarmRun,
    kill: SwarmRun | None,
    memory: list[dict[str, Any]],
    tol: float,
    wall: float,
) -> int:
    swarm_ms, ckpt_ms, sync_ms = step_ms(run)
    where = "1 thread" if args.device == "cpu" else args.device
    rows = [
        ("what", f"plain PyTorch ({where})", f"FusionNet: broker + 3 compnodes ({where} each)"),
        ("model", f"{args.family} {n_params / 1e6:.1f}M params", f"{len(run.placement)} sub-DAGs"),
        ("ms/step", f"{torch_ms:.0f}", f"{swarm_ms:.0f} (of which state snapshots {ckpt_ms:.0f})"),
        ("results collection", "-", f"{sync_ms:.0f} ms once (final state to the broker)"),
        ("exact", "-", f"max diff {run.max_diff:.1e} (bound {tol:g})"),
        ("submission", "-", f"{run.submit_s:.1f} s (trace, pack, send, accepted)"),
        ("of which the state's upload", "-", f"{run.upload_s:.1f} s"),
        ("results download (broker to submitter)", "-", f"{run.download_s:.1f} s"),
    ]
    for m in memory:
        rows.append(
            (
                f"peak RSS {m['daemon']}",
                "-",
                f"{m['peak_rss'] / GB:.2f} GB (idle {m['idle_rss'] / GB:.2f}; "
                + (f"device {m['peak_gpu'] / GB:.2f} GB; " if m["peak_gpu"] else "")
                + f"holds {m['state'] / GB:.2f} GB; "
                f"bound {m['bound'] / GB:.2f}){'' if m['within'] else ' OVER'}",
            )
        )
    if kill is not None:
        rec = next((r for r in kill.recoveries if "detection" in r), {})
        took = sum(rec.get(k, 0.0) for k in ("detection", "redistribution", "replay"))
        rows.append(
            (
                "SIGKILL mid-job",
                "-",
                f"{kill.killed} killed; recovered in {took:.1f} s; max diff {kill.max_diff:.1e}",
            )
        )
    print_table(rows)
    exact = run.max_diff <= tol and (kill is None or kill.max_diff <= tol)
    summary = {
        "benchmark": "scale",
        "model": {
            "family": args.family,
            **dict(zip(("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate"), dims)),
        },
        "params": n_params,
        "device": args.device,
        "placement": args.placement,
        "optimizer": args.optimizer,
        "steps": args.steps,
        "torch_ms_per_step": round(torch_ms, 1),
        "swarm_ms_per_step": round(swarm_ms, 1),
        "checkpoint_ms_per_step": round(ckpt_ms, 1),
        "results_collection_ms": round(sync_ms, 1),
        "submission_s": round(run.submit_s, 2),
        "upload_s": run.upload_s,
        "download_s": run.download_s,
        "max_diff": run.max_diff,
        "memory": memory,
        "memory_within_bounds": all(m["within"] for m in memory),
        "sigkill": None
        if kill is None
        else {"killed": kill.killed, "max_diff": kill.max_diff, "recoveries": kill.recoveries},
        "exact": exact,
        "wall_s": round(wall, 1),
    }
    print(json.dumps(summary))
    return 0 if exact else 1


if __name__ == "__main__":
    run_main(main)
