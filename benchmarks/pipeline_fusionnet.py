"""The FusionNet contenders of ``pipeline_vs_torch.py``: a real swarm on loopback (a) and
``fusionnet run --local``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline_common import FUSIONNET, MODEL_FILE, Config, Result, block_cuts

# ---- (a) FusionNet ------------------------------------------------------------------------------------
LOSS = "loss:\n  name: cross_entropy\n"  # the MLP blocks' (GPT-2's forward returns its loss itself)


def write_job(workdir: Path, cfg: Config, compnodes: int) -> Path:
    import shutil

    shutil.copy(MODEL_FILE, workdir / MODEL_FILE.name)
    job = f"""\
name: pipeline-vs-torch-{compnodes}
task: train
model:
  entrypoint: {MODEL_FILE.name}:{cfg.builder}
  kwargs: {json.dumps(cfg.model_kwargs)}
{"" if cfg.model == "gpt2" else LOSS}data:
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
  schedule: {cfg.schedule}
"""
    if cfg.per_rank > 1:
        job += f"  chunks: {cfg.per_rank}\n"
    if cfg.placement == "blocks":
        job += f"  cuts: {json.dumps(block_cuts(cfg, compnodes * cfg.per_rank))}\n"
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


def read_metrics(res: Result, path: Path, per_rank: int = 1) -> None:
    """Step times, losses and the stages' peak activation bytes (the last step's) into ``res``; the
    bubble is per compnode (``per_rank`` sub-DAGs each, interleaved: their compute adds up)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    res.times = [float(r["seconds"]) for r in rows]
    res.bubbles = [
        max(0.0, 1.0 - sum(r["compute_seconds"]) / (len(r["compute_seconds"]) / per_rank) / r["seconds"])
        for r in rows
        if r.get("compute_seconds") and r["seconds"] > 0
    ]
    res.beyond_path = [
        max(0.0, 1.0 - r["compute_path_seconds"] / r["seconds"])
        for r in rows
        if "compute_path_seconds" in r and r["seconds"] > 0
    ]
    res.losses = [float(r["loss"]) for r in rows if "loss" in r]
    peaks = [r["activation_peak_bytes"] for r in rows if "activation_peak_bytes" in r]
    res.activation_peak = [int(b) for b in peaks[-1]] if peaks else None


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
            "broker",
            "broker",
            swarm_dir,
            # the daemons' own DHT refresh and heartbeat periods, as a user runs them: the tests' quick
            # ones (refresh 1-2 s, pings every 0.5 s) cost an idle broker and 3 compnodes 0.08 of a core
            # against 0.02, taken from the stages on 2 cores
            ["--placement", "model" if cfg.placement == "blocks" else cfg.placement]
            + ([] if cfg.replica_interval is None else ["--replica-interval", str(cfg.replica_interval)])
            + (["--steps-ahead"] if cfg.steps_ahead else []),
            cfg.threads,
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
                args = ["--initial-peers", maddr, "--threads", str(cfg.threads)]
                args += ["--sandbox", cfg.sandbox, "--worker-sends", cfg.worker_sends]
                args += ["--worker-receives", cfg.worker_receives]
                if cfg.inline_compute_ms is not None:
                    args += ["--inline-compute-ms", str(cfg.inline_compute_ms)]
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
            read_metrics(res, out_dir / "metrics.jsonl", cfg.per_rank)
            plan = json.loads((out_dir / "plan.json").read_text())
            used = len(plan["subdags"])
            if used != n * cfg.per_rank:
                raise RuntimeError(f"the broker ran the job on {used} sub-DAGs, not {n * cfg.per_rank}")
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
        read_metrics(res, out_dir / "metrics.jsonl")
        return res, json.loads((out_dir / "plan.json").read_text())
    except Exception as e:
        res.error = str(e)
        return res, None
