"""A busy compnode is not a dead one: while its sub-task computes for 10 s and more, it keeps answering
pings within milliseconds (compute runs on its compute thread, not on its event loop), the broker's
heartbeats (3 s timeout here) never give it up, and the job ends exact.

The sub-task is made long with ``--slowdown`` (the throttle hook sleeps on the compute thread, after a
real stretch of torch work each time), so that the test costs a few seconds of CPU, not minutes;
``benchmarks/responsiveness.py`` measures the same with real compute only.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.rpc.protocol import RPCError
from fusionnet.runtime.process_swarm import BlockingObserver, running_swarm
from fusionnet.runtime.processes import wait_until
from tests.jobfiles import REPO, write_job

pytestmark = pytest.mark.swarm

# x 0.5-0.7 s of real compute per compnode in the job's one step: sub-tasks of 19-23 s at 40 and 37-41 s
# at 60 on the 2-core machine; 50 keeps them >= 12 s on one twice as fast
SLOWDOWN = 50.0
MIN_SUBTASK = 10.0
# The functional bound: pings answered well inside the broker's heartbeat timeout (3 s here). The 100 ms
# p99 figure of issue 11 is measured by benchmarks/responsiveness.py, not asserted by a timed test.
MAX_P90 = 1.0
MAX_LOST = 0.02


def _job(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    width = 1024
    path = write_job(
        tmp_path / "job",
        model_class="SkipEverywhere",
        inputs=torch.randn(512, width, generator=g),
        labels=torch.randint(0, 4, (512,), generator=g),
        batch_size=512,
        microbatches=4,
        steps=1,
        compnodes=2,
    )
    doc = yaml.safe_load(path.read_text())
    doc["model"]["kwargs"] = {"width": width, "depth": 12, "classes": 4}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@pytest.mark.timeout(420)
def test_pings_stay_fast_during_a_long_sub_task_and_the_job_is_exact(tmp_path: Path) -> None:
    slow = {"extra": ["--slowdown", str(SLOWDOWN)]}
    with running_swarm(tmp_path / "swarm", [slow, slow]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            peers = [c.peer_id for c in sw.compnodes]
            wait_until(
                lambda: sum(c["state"] == "ONLINE" for c in observer.broker_status()["compnodes"]) == 2,
                90,
                "2 compnodes ONLINE",
            )
            job_path, out = _job(tmp_path), tmp_path / "out"
            cmd = [
                sys.executable, "-m", "fusionnet.cli.main", "submit", str(job_path),
                "--initial-peers", *sw.initial_peers, "--output", str(out), "--timeout", "300",
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
            for peer in peers:  # connection set-up (a DHT lookup and a dial) is not a round trip
                observer.call(peer, "ping", {"nonce": "warm-up"}, timeout=30.0)
            rtts: list[float] = []
            try:
                running = lambda: any(j["state"] == "RUNNING" for j in observer.broker_status()["jobs"])
                wait_until(lambda: running() or proc.poll() is not None, 120, "the job RUNNING")
                while proc.poll() is None:
                    for peer in peers:  # the broker's heartbeat, from another peer
                        started = time.perf_counter()
                        try:
                            observer.call(peer, "ping", {"nonce": "test"}, timeout=5.0)
                            rtts.append(time.perf_counter() - started)
                        except RPCError as e:  # a lost ping counts as an infinitely slow one
                            print(f"ping {peer} failed: {e}")
                            rtts.append(math.inf)
                    time.sleep(0.05)  # the sampling period, not a wait for readiness
                stdout, stderr = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            assert proc.returncode == 0 and "SUCCEEDED" in stdout, (
                f"{stdout}\n{stderr}\n{sw.dump_logs()[-6000:]}"
            )
        finally:
            observer.close()
    plan = json.loads((out / "plan.json").read_text())
    busy = [s["measured_seconds"] for s in plan["subdags"]]
    assert min(busy) >= MIN_SUBTASK, f"sub-tasks of {busy} s: too short to show anything"
    assert plan["recoveries"] == [], "a busy compnode was taken for a dead one"
    p50, p99 = _p(rtts, 0.5), _p(rtts, 0.99)
    print(f"sub-tasks {busy} s; {len(rtts)} pings: p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    assert len(rtts) >= 50
    p90, lost = _p(rtts, 0.9), sum(not math.isfinite(r) for r in rtts) / len(rtts)
    assert p90 < MAX_P90, f"ping p90 {p90 * 1e3:.0f} ms during the sub-task (p50 {p50 * 1e3:.0f} ms)"
    assert lost <= MAX_LOST, f"{lost:.1%} of the pings went unanswered during the sub-task"
    ref = run_reference(load_job(job_path))
    weights = load_file(out / "weights.safetensors")
    assert max((weights[k].double() - ref.weights[k].double()).abs().max().item() for k in weights) <= 1e-5
