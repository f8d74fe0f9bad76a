"""FusionNet's pipeline against ``torch.distributed.pipelining`` and plain PyTorch, on one machine.

All contenders train the same model (``benchmarks/pipeline_model.py``: identical pre-norm MLP blocks,
cross-entropy on the last block's output), from the same initial weights (built right after
``torch.manual_seed(seed)``), on the same batches (batch s = samples [s*B, (s+1)*B) modulo the dataset),
with the same GPipe schedule (each batch split into M micro-batches: all forwards, all backwards, one SGD
step), and with the same number of torch threads per process (``--threads``, default 1):

- ``plain torch``       one process, the M micro-batches one after the other with gradient accumulation.
                        The reference for the ratios.
- ``torch pipe N``      ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``, gloo on
                        127.0.0.1), one process per stage, the model cut at the same block boundaries as
                        FusionNet's plan for N compnodes.
- ``fusionnet N``       a real FusionNet swarm on loopback: ``fusionnet broker`` and N ``fusionnet
                        compnode`` daemons (one process each, ``--threads``), the job handed over with
                        ``fusionnet submit``; step times are the ``seconds`` of its ``metrics.jsonl``.
- ``fusionnet local N`` ``fusionnet run --local N``: the same planner and executor in one process (N
                        virtual compnodes, in-memory channel). Shows the executor's own overhead.

Step times are medians over the steps after ``--warmup``. Each torch contender times a step from a
barrier before it to a barrier after the optimizer step (so the slowest stage counts); FusionNet times
it in its driver. The split of the torch pipeline is read from FusionNet's ``plan.json`` (per sub-DAG
its nodes, mapped to blocks; a cut inside a block is refused) and printed; without a FusionNet plan the
balanced block split is used and marked as assumed. The first and last losses are printed per contender
as a check that they all train the same thing.

On a 2-core machine, 3 stages (plus the broker and hivemind's p2pd helpers for FusionNet) oversubscribe
the cores; the ratios then measure that too. Prints a table, then one JSON line.

    python benchmarks/pipeline_vs_torch.py [--steps 20] [--microbatches 4] [--stages 2 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE / "pipeline_model.py"
sys.path.insert(0, str(HERE))  # pipeline_model, also in spawned workers (they get sys.path)

FUSIONNET = [sys.executable, "-m", "fusionnet.cli.main"]
KINDS = ("torch pipe", "fusionnet", "fusionnet local")  # table order, after plain torch


@dataclass(frozen=True)
class Config:
    dim: int
    hidden: int
    layers: int
    batch_size: int
    microbatches: int
    steps: int
    warmup: int
    lr: float
    seed: int
    threads: int
    data_path: str

    @property
    def model_kwargs(self) -> dict[str, int]:
        return {"dim": self.dim, "hidden": self.hidden, "layers": self.layers}


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)  # per step, warm-up included
    losses: list[float] = field(default_factory=list)
    error: str | None = None
    note: str = ""

    def median(self, warmup: int) -> float | None:
        timed = self.times[warmup:] or self.times
        return statistics.median(timed) if timed and self.error is None else None

    def minimum(self, warmup: int) -> float | None:
        timed = self.times[warmup:] or self.times
        return min(timed) if timed and self.error is None else None


# ---- data and batches (shared by the torch contenders; FusionNet reads the same file) ------------------
def make_data(cfg: Config, samples: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(cfg.seed + 1)
    inputs = torch.randn(samples, cfg.dim, generator=g)
    labels = torch.randint(0, cfg.dim, (samples,), generator=g)
    save_file({"inputs": inputs, "labels": labels}, cfg.data_path)


def load_batches(cfg: Config) -> list[tuple[Any, Any]]:
    import torch
    from safetensors.torch import load_file

    data = load_file(cfg.data_path)
    n = data["inputs"].shape[0]
    out = []
    for s in range(cfg.steps):
        idx = torch.arange(s * cfg.batch_size, (s + 1) * cfg.batch_size) % n
        out.append((data["inputs"][idx].contiguous(), data["labels"][idx].contiguous()))
    return out


def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)


# ---- (c) plain PyTorch -----------------------------------------------------------------------------
def plain_worker(cfg: Config, queue: Any) -> None:
    try:
        import torch
        import torch.nn.functional as F
        from pipeline_model import build

        _set_threads(cfg.threads)
        batches = load_batches(cfg)
        torch.manual_seed(cfg.seed)
        model = build(**cfg.model_kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        times, losses = [], []
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for xm, ym in zip(x.chunk(cfg.microbatches), y.chunk(cfg.microbatches)):
                loss = F.cross_entropy(model(xm), ym) * (xm.shape[0] / x.shape[0])
                loss.backward()
                total += loss.item()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(total)
        queue.put(("ok", times, losses))
    except BaseException:
        queue.put(("error", traceback.format_exc(), None))


# ---- (b) torch.distributed.pipelining ------------------------------------------------------------------
def pipe_worker(
    rank: int, world: int, port: int, cfg: Config, split: list[tuple[int, int]], queue: Any
) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from pipeline_model import build, stage_module
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        _set_threads(cfg.threads)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        batches = load_batches(cfg)
        torch.manual_seed(cfg.seed)
        model = build(**cfg.model_kwargs)
        sub = stage_module(model, *split[rank])
        stage = PipelineStage(sub, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, cfg.microbatches, loss_fn=F.cross_entropy)  # scale_grads: 1/M
        opt = torch.optim.SGD(sub.parameters(), lr=cfg.lr)
        times, losses = [], []
        for x, y in batches:
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                mb_losses: list[Any] = []
                schedule.step(target=y, losses=mb_losses, return_outputs=False)
                losses.append(float(torch.stack([v.detach() for v in mb_losses]).mean()))
            else:
                schedule.step()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        if rank == world - 1:
            queue.put(("losses", rank, losses))
        if rank == 0:
            queue.put(("times", rank, times))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(targets: list[tuple[Any, tuple]], expect: int, timeout: float) -> list[tuple]:
    """Runs ``targets`` as spawned processes; collects ``expect`` queue messages (or an error)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, queue), daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    messages: list[tuple] = []
    deadline = time.monotonic() + timeout
    try:
        while len(messages) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no result after {timeout:g} s")
            try:
                msg = queue.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("worker processes exited without a result") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"worker failed:\n{msg[-1]}")
            messages.append(msg)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return messages


def run_plain(cfg: Config, timeout: float) -> Result:
    res = Result("plain torch", note="1 process")
    try:
        [(_, times, losses)] = run_processes([(plain_worker, (cfg,))], 1, timeout)
        res.times, res.losses = times, losses
    except Exception as e:
        res.error = str(e)
    return res


def run_torchpipe(cfg: Config, split: list[tuple[int, int]], split_source: str, timeout: float) -> Result:
    world = len(split)
    res = Result(f"torch pipe {world}", note=f"split {format_split(split)} ({split_source})")
    port = free_port()
    try:
        msgs = run_processes([(pipe_worker, (r, world, port, cfg, split)) for r in range(world)], 2, timeout)
        for kind, _, payload in msgs:
            if kind == "times":
                res.times = payload
            else:
                res.losses = payload
    except Exception as e:
        res.error = str(e)
    return res


# ---- splits ---------------------------------------------------------------------------------------------
_NODE = re.compile(r"^(layer_norm|linear|gelu|add)(?:_(\d+))?$")


def _node_block(name: str) -> int | None:
    """The block a traced node belongs to (fx names the k-th call of an op ``op_k``; two linears a block)."""
    m = _NODE.match(name)
    if m is None:
        return None
    k = int(m.group(2) or 0)
    return k // 2 if m.group(1) == "linear" else k


def split_from_plan(plan: dict[str, Any], layers: int) -> list[tuple[int, int]]:
    """Per sub-DAG (in block order) its first and last block, from ``plan.json``'s ``nodes`` (and ``params``
    where present, as a cross-check). Raises when a cut falls inside a block or blocks are not contiguous."""
    owner: dict[int, int] = {}
    for sd in plan["subdags"]:
        index = sd.get("subdag", sd.get("index"))
        blocks = {b for b in map(_node_block, sd["nodes"]) if b is not None}
        blocks |= {int(p.split(".")[1]) for p in sd.get("params", []) if p.startswith("blocks.")}
        for b in blocks:
            if owner.setdefault(b, index) != index:
                raise ValueError(f"block {b} is cut between sub-DAGs {owner[b]} and {index}")
    if sorted(owner) != list(range(layers)):
        raise ValueError(f"plan covers blocks {sorted(owner)}, expected 0..{layers - 1}")
    stages: dict[int, list[int]] = {}
    for b, index in owner.items():
        stages.setdefault(index, []).append(b)
    split = sorted((min(bs), max(bs)) for bs in stages.values())
    for (_, last), (first, _) in itertools.pairwise(split):
        if first != last + 1:
            raise ValueError(f"sub-DAG blocks are not contiguous: {format_split(split)}")
    return split


def balanced_split(layers: int, stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]


def format_split(split: list[tuple[int, int]]) -> str:
    return "|".join(f"{a}-{b}" if a != b else str(a) for a, b in split)


# ---- (a) FusionNet ------------------------------------------------------------------------------------
def write_job(workdir: Path, cfg: Config, compnodes: int) -> Path:
    import shutil

    shutil.copy(MODEL_FILE, workdir / MODEL_FILE.name)
    job = f"""\
name: pipeline-vs-torch-{compnodes}
task: train
model:
  entrypoint: {MODEL_FILE.name}:build
  kwargs: {json.dumps(cfg.model_kwargs)}
loss:
  name: cross_entropy
data:
  path: {Path(cfg.data_path).name}
  batch_size: {cfg.batch_size}
  microbatches: {cfg.microbatches}
optimizer:
  name: sgd
  lr: {cfg.lr}
steps: {cfg.steps}
seed: {cfg.seed}
placement:
  compnodes: {compnodes}
"""
    path = workdir / f"job{compnodes}.yaml"
    path.write_text(job)
    return path


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def read_metrics(path: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    return [float(r["seconds"]) for r in rows], [float(r["loss"]) for r in rows if "loss" in r]


class Daemon:
    """One ``fusionnet broker|compnode`` process in its own session; the address file says it is ready."""

    def __init__(self, kind: str, name: str, workdir: Path, args: list[str], threads: int):
        self.name = name
        self.state_dir = workdir / f"{name}.state"  # kept across swarms: the compnode profile is cached
        self.address_file = workdir / f"{name}.addr"
        self.log_path = workdir / f"{name}.log"
        self.address_file.unlink(missing_ok=True)
        self.terminated = False
        cmd = [*FUSIONNET, kind, "--state-dir", str(self.state_dir), "--address-file", str(self.address_file)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=workdir,
                env=child_env(threads),
                start_new_session=True,
            )

    def wait_ready(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                    f"{tail(self.log_path)}"
                )
            if self.address_file.exists():
                maddrs = [ln.strip() for ln in self.address_file.read_text().splitlines() if ln.strip()]
                if maddrs:
                    return maddrs
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:g} s:\n{tail(self.log_path)}")
            time.sleep(0.1)

    def terminate(self) -> None:
        """SIGTERM, once: a second one would force the exit instead of a graceful leave."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # stragglers of its own session
            os.killpg(self.proc.pid, signal.SIGKILL)


def wait_compnodes_online(maddr: str, count: int, timeout: float) -> str:
    """Asks the broker (``status`` RPC through a ``SwarmObserver``, what ``fusionnet status`` does, without
    paying for a new process per look) until it has ``count`` ONLINE compnodes. Returns '' or a warning;
    submit is tried anyway (the plan's sub-DAG count is checked afterwards)."""
    import asyncio

    async def poll() -> str:
        from fusionnet.daemon.observer import SwarmObserver

        deadline = time.monotonic() + timeout
        last = "no answer"
        async with SwarmObserver([maddr]) as observer:
            while time.monotonic() < deadline:
                try:
                    doc = await observer.broker_status(timeout=10)
                    states = [c.get("state") for c in doc.get("compnodes", [])]
                    if states.count("ONLINE") >= count:
                        return ""
                    last = f"compnodes {states}"
                except Exception as e:
                    last = f"status failed: {e}"
                await asyncio.sleep(0.25)
        return f"the broker did not report {count} ONLINE compnodes within {timeout:g} s ({last})"

    try:
        return asyncio.run(poll())
    except Exception as e:
        return f"could not ask the broker: {e}"


def submit(cfg: Config, compnodes: int, maddr: str, workdir: Path, timeout: float, attempt: int) -> Path:
    """``fusionnet submit``; returns the output folder or raises with the tail of its output."""
    job = write_job(workdir, cfg, compnodes)
    out_dir = workdir / f"fusionnet{compnodes}-{attempt}"
    submit_log = workdir / f"submit{compnodes}-{attempt}.log"
    with open(submit_log, "wb") as log:
        try:
            rc = subprocess.run(
                [*FUSIONNET, "submit", str(job), "--initial-peers", maddr, "--output", str(out_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=workdir,
                env=child_env(cfg.threads),
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"submit did not finish in {timeout:g} s:\n{tail(submit_log)}") from None
    if rc != 0:
        raise RuntimeError(f"submit exited with {rc}:\n{tail(submit_log, 4)}")
    return out_dir


def run_fusionnet_swarms(
    cfg: Config, stages: list[int], workdir: Path, timeout: float, retries: int
) -> list[tuple[Result, dict[str, Any] | None]]:
    """One broker; for each N (ascending) compnodes are added until N run, then the N-compnode job is
    submitted. Every daemon is stopped at the end (compnodes first, all at once, then the broker)."""
    swarm_dir = workdir / "swarm"
    swarm_dir.mkdir(exist_ok=True)
    out: list[tuple[Result, dict[str, Any] | None]] = []
    daemons: list[Daemon] = []
    broker_error = None
    try:
        broker = Daemon(
            "broker", "broker", swarm_dir, ["--refresh-period", "1", "--heartbeat-period", "0.5"], cfg.threads
        )
        daemons.append(broker)
        maddr = broker.wait_ready(90)[0]
    except Exception as e:
        broker_error = f"broker: {e}"
    for n in sorted(stages):
        res = Result(f"fusionnet {n}", note=f"broker + {n} compnode processes, submit")
        plan = None
        try:
            if broker_error:
                raise RuntimeError(broker_error)
            while len(daemons) - 1 < n:
                args = ["--initial-peers", maddr, "--threads", str(cfg.threads), "--refresh-period", "2"]
                daemons.append(
                    Daemon("compnode", f"compnode{len(daemons) - 1}", swarm_dir, args, cfg.threads)
                )
            for d in daemons[1:]:
                d.wait_ready(180)
            warning = wait_compnodes_online(maddr, n, 60)
            if warning:
                print(f"  warning: {warning}", file=sys.stderr)
            for attempt in range(retries + 1):
                try:
                    out_dir = submit(cfg, n, maddr, workdir, timeout, attempt)
                    break
                except (RuntimeError, TimeoutError) as e:
                    first_line = str(e).strip().splitlines()[-1]
                    if attempt == retries or any(d.proc.poll() is not None for d in daemons):
                        raise
                    print(f"  {res.name}: submit failed, retrying: {first_line}", file=sys.stderr)
                    res.note += f"; retried after: {first_line}"
            res.times, res.losses = read_metrics(out_dir / "metrics.jsonl")
            plan = json.loads((out_dir / "plan.json").read_text())
            used = len(plan["subdags"])
            if used != n:
                raise RuntimeError(f"the broker ran the job on {used} sub-DAGs, not {n}")
        except Exception as e:
            res.error = str(e)
            for d in daemons:
                if d.proc.poll() is not None and d.proc.returncode not in (0, None):
                    res.error += f"\n[{d.name} exited with {d.proc.returncode}]\n{tail(d.log_path)}"
        out.append((res, plan))
    for d in daemons[1:]:
        d.terminate()
    for d in daemons[1:]:
        d.stop()
    if daemons:
        daemons[0].stop()
    return out


def run_fusionnet_local(
    cfg: Config, compnodes: int, workdir: Path, timeout: float
) -> tuple[Result, dict[str, Any] | None]:
    res = Result(f"fusionnet local {compnodes}", note=f"`fusionnet run --local {compnodes}`, 1 process")
    job = write_job(workdir, cfg, compnodes)
    out_dir = workdir / f"local{compnodes}"
    try:
        out = subprocess.run(
            [*FUSIONNET, "run", str(job), "--local", str(compnodes), "--output", str(out_dir), "--quiet"],
            capture_output=True,
            text=True,
            cwd=workdir,
            env=child_env(cfg.threads),
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[-2000:]}")
        res.times, res.losses = read_metrics(out_dir / "metrics.jsonl")
        return res, json.loads((out_dir / "plan.json").read_text())
    except Exception as e:
        res.error = str(e)
        return res, None


# ---- report ---------------------------------------------------------------------------------------------
def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 4)


def one_line(error: str) -> str:
    """First and last line of an error (a headline and, for tracebacks and command output, the reason)."""
    lines = [ln.strip() for ln in error.split("\n[")[0].splitlines() if ln.strip()] or ["?"]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def key_of(name: str) -> str:
    return name.replace("plain torch", "plain").replace("torch pipe", "torchpipe").replace(" ", "_")


def report(results: list[Result], cfg: Config, stages: list[int], splits: dict[int, Any]) -> dict[str, Any]:
    order = ["plain torch"] + [f"{kind} {n}" for kind in KINDS for n in stages]
    results = sorted(results, key=lambda r: order.index(r.name) if r.name in order else len(order))
    med = {r.name: r.median(cfg.warmup) for r in results}
    low = {r.name: r.minimum(cfg.warmup) for r in results}
    plain = med.get("plain torch")
    rows = [
        ("contender", "step ms", "min ms", "x plain", "x torch pipe N", "loss first", "loss last", "notes")
    ]
    for r in results:
        n = r.name.rsplit(" ", 1)[-1]
        pipe = med.get(f"torch pipe {n}") if n.isdigit() and r.name.startswith("fusionnet") else None
        rows.append((
            r.name, fmt_ms(med[r.name]), fmt_ms(low[r.name]),
            fmt_ratio(med[r.name], plain), fmt_ratio(med[r.name], pipe) if pipe else "",
            f"{r.losses[0]:.5f}" if r.losses else "-", f"{r.losses[-1]:.5f}" if r.losses else "-",
            "FAILED (see below)" if r.error else r.note,
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    for r in results:
        if r.error:
            print(f"\n{r.name} failed: {r.error}")

    summary: dict[str, Any] = {"benchmark": "pipeline_vs_torch"}
    for r in results:
        summary[f"{key_of(r.name)}_ms"] = None if med[r.name] is None else round(med[r.name] * 1e3, 3)
    for r in results:
        summary[f"{key_of(r.name)}_min_ms"] = None if low[r.name] is None else round(low[r.name] * 1e3, 3)
    for n in stages:
        pipe = med.get(f"torch pipe {n}")
        summary[f"torchpipe_{n}_over_plain"] = ratio(pipe, plain)
        for prefix in ("fusionnet", "fusionnet local"):
            v = med.get(f"{prefix} {n}")
            k = key_of(f"{prefix} {n}")
            summary[f"{k}_over_plain"] = ratio(v, plain)
            summary[f"{k}_over_torchpipe_{n}"] = ratio(v, pipe)
            summary[f"{k}_over_torchpipe_{n}_min"] = ratio(
                low.get(f"{prefix} {n}"), low.get(f"torch pipe {n}")
            )
    summary["splits"] = {str(n): format_split(s) for n, (s, _) in splits.items()}
    summary["split_sources"] = {str(n): src for n, (_, src) in splits.items()}
    cfg_d = asdict(cfg)
    cfg_d.pop("data_path")
    summary["config"] = cfg_d
    summary["cpus"] = os.cpu_count()
    reference = next((r.losses for r in results if r.name == "plain torch" and r.losses), None)
    summary["max_loss_diff_vs_plain"] = {
        key_of(r.name): max(abs(a - b) for a, b in zip(r.losses, reference))
        for r in results
        if reference and r.losses and r.name != "plain torch"
    }
    summary["errors"] = {key_of(r.name): one_line(r.error) for r in results if r.error}
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per contender (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (default 5)")
    ap.add_argument("--microbatches", type=int, default=4, help="GPipe micro-batches per batch (default 4)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6, help="blocks (default 6: splits evenly in 2 and 3)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="pipeline widths (default 2 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process, all contenders")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 steps, 2 of them warm-up")
    ap.add_argument("--no-swarm", action="store_true", help="skip the FusionNet swarm runs (a)")
    ap.add_argument("--no-local", action="store_true", help="skip `fusionnet run --local`")
    ap.add_argument("--timeout", type=float, default=240, help="limit per contender, seconds")
    ap.add_argument(
        "--submit-retries", type=int, default=1, help="resubmit a failed FusionNet job this often (default 1)"
    )
    ap.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep it (logs, results)")
    args = ap.parse_args(argv)
    args.stages = sorted(set(args.stages))
    if args.stages[0] < 2:
        ap.error("--stages: each must be >= 2")
    if args.quick:
        args.steps, args.warmup = 8, 2
    if args.batch_size % args.microbatches:
        ap.error("--batch-size must be a multiple of --microbatches")
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # spawned workers inherit it
        os.environ[var] = str(args.threads)
    loadavg = os.getloadavg()[0]
    t_start = time.monotonic()

    with contextlib.ExitStack() as stack:
        if args.keep:
            workdir = args.keep.resolve()
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipeline_vs_torch-")))
        cfg = Config(
            dim=args.dim, hidden=args.hidden, layers=args.layers, batch_size=args.batch_size,
            microbatches=args.microbatches, steps=args.steps, warmup=args.warmup, lr=args.lr,
            seed=args.seed, threads=args.threads, data_path=str(workdir / "data.safetensors"),
        )  # fmt: skip
        make_data(cfg, samples=4 * cfg.batch_size)
        print(
            f"model: {cfg.layers} blocks, dim {cfg.dim}, hidden {cfg.hidden}; batch {cfg.batch_size} in "
            f"{cfg.microbatches} micro-batches; {cfg.steps} steps ({cfg.warmup} warm-up); "
            f"{cfg.threads} thread(s)/process; {os.cpu_count()} CPUs; load {loadavg:.2f}; workdir {workdir}",
            flush=True,
        )
        results: list[Result] = []

        def record(res: Result) -> Result:
            status = "failed" if res.error else f"{fmt_ms(res.median(cfg.warmup))} ms/step"
            print(f"  [{time.monotonic() - t_start:5.0f} s] {res.name}: {status}", flush=True)
            results.append(res)
            return res

        record(run_plain(cfg, args.timeout))
        plans: dict[int, list[tuple[str, dict[str, Any] | None]]] = {n: [] for n in args.stages}
        if not args.no_local:
            for n in args.stages:
                res, plan = run_fusionnet_local(cfg, n, workdir, args.timeout)
                record(res)
                plans[n].append(("plan of fusionnet local", plan))
        if not args.no_swarm:
            swarms = run_fusionnet_swarms(cfg, args.stages, workdir, args.timeout, args.submit_retries)
            for res, plan in swarms:
                record(res)
                plans[int(res.name.rsplit(" ", 1)[1])].insert(0, ("plan of fusionnet swarm", plan))
        splits: dict[int, tuple[list[tuple[int, int]], str]] = {}
        for n in args.stages:
            split, source = balanced_split(cfg.layers, n), "balanced, assumed"
            for what, plan in plans[n]:
                if plan is not None:
                    try:
                        split, source = split_from_plan(plan, cfg.layers), what
                    except (ValueError, KeyError) as e:
                        print(f"  warning: {what}: cannot mirror it: {e}", file=sys.stderr)
                        continue
                    break
            splits[n] = (split, source)
            record(run_torchpipe(cfg, split, source, args.timeout))

    summary = report(results, cfg, args.stages, splits)
    summary["loadavg_before"] = round(loadavg, 2)
    summary["loadavg_after"] = round(os.getloadavg()[0], 2)
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(summary))
    return 0 if not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
