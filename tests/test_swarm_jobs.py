"""Jobs on a real swarm: a broker and compnodes as separate processes over hivemind, jobs submitted with
``fusionnet submit``; results must equal ``run --local`` and plain PyTorch.

One swarm (broker + 3 compnodes) serves the whole module; tests that change membership start their own.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.local import run_local
from fusionnet.runtime.process_swarm import BlockingObserver, ProcessSwarm, running_swarm
from fusionnet.runtime.processes import wait_until
from fusionnet.wire.datapath import DataPathClient
from fusionnet.wire.frames import TensorFrame
from tests.jobfiles import REPO, example_job

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
TOL = 1e-5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(((a[k].double() - b[k].double()).abs().max().item() for k in a), default=0.0)


def _submit_cmd(job: Path, swarm: ProcessSwarm, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "fusionnet.cli.main", "submit", str(job),
        "--initial-peers", *swarm.initial_peers, "--output", str(out), "--timeout", "240",
    ]  # fmt: skip


def _submit(job: Path, swarm: ProcessSwarm, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*_submit_cmd(job, swarm, out), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=_env(),
    )
    assert done.returncode == 0, f"submit failed:\n{done.stdout}\n{done.stderr}\n{swarm.dump_logs()[-6000:]}"
    return done


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProcessSwarm, BlockingObserver]]:
    with running_swarm(tmp_path_factory.mktemp("swarm"), [{}, {}, {}]) as swarm:
        observer = BlockingObserver(swarm.initial_peers)
        try:
            observer.wait_online(3, 60)
            yield swarm, observer
        finally:
            observer.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "example,overrides",
    [
        ("mlp", {"steps": 4, "placement": {"compnodes": 3}}),
        ("figure3", {"steps": 3}),
        ("gpt", {"steps": 3, "optimizer": {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}}),
        ("figure3", {"task": "grad", "steps": 2}),
        ("mlp", {"task": "infer", "placement": {"compnodes": 3}}),
        ("gpt", {"steps": 3, "microbatches": "auto", "schedule": "auto"}),
        (
            "gpt",
            {
                "steps": 2,
                "schedule": "1f1b",
                "cuts": ["blocks.1", "ln_f"],
                "optimizer": {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}},
            },
        ),
    ],
)
def test_submitted_job_equals_local_run_and_plain_pytorch(
    swarm: tuple[ProcessSwarm, BlockingObserver], example: str, overrides: dict, tmp_path: Path
) -> None:
    sw, _ = swarm
    job_path = example_job(example, tmp_path, **overrides)
    try:
        out = tmp_path / "out"
        done = _submit(job_path, sw, out)
        assert "SUCCEEDED" in done.stdout
        job = load_job(job_path)
        local = run_local(load_job(job_path), job.spec.placement.compnodes)
        ref = run_reference(job)
    finally:
        job_path.unlink()
    task = job.spec.task
    if task == "infer":
        got = load_file(out / "outputs.safetensors")["outputs"]
        assert (got - ref.outputs).abs().max().item() <= TOL
        assert (got - local.outputs).abs().max().item() <= TOL
        return
    weights = load_file(out / "weights.safetensors")
    assert sorted(weights) == sorted(job.model.state_dict())  # safetensors files keep keys sorted
    assert _max_diff(weights, ref.weights) <= TOL
    assert _max_diff(weights, local.weights) <= TOL  # compnodes run 1 thread: reductions may differ
    if task == "grad":
        grads = load_file(out / "grads.safetensors")
        assert _max_diff(grads, ref.grads) <= TOL
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(job.spec.steps))
    assert all(abs(r["loss"] - want) <= 1e-5 for r, want in zip(rows, ref.losses))
    plan = json.loads((out / "plan.json").read_text())
    assert len({s["compnode"] for s in plan["subdags"]}) == len(plan["subdags"])
    if overrides.get("microbatches") == "auto":  # the broker chose the count on its placement
        chosen = plan["schedule"]["microbatches"]
        assert str(chosen) in plan["schedule"]["predicted_step_seconds_by_microbatches"]
        assert [r["microbatches"] for r in rows] == [chosen] * job.spec.steps
    assert all(s["measured_seconds"] > 0 for s in plan["subdags"])
    # the sub-DAGs report the activations they held between their micro-batches' F and B (a sub-DAG that
    # only hands on parameters, such as a tied embedding, holds none: parameters are not counted)
    assert all(len(r["activation_peak_bytes"]) == len(plan["subdags"]) for r in rows)
    assert all(min(r["activation_peak_bytes"]) >= 0 and max(r["activation_peak_bytes"]) > 0 for r in rows)
    # Values cross the network exactly when the job is cut: the performance model may keep a small job on
    # fewer compnodes than asked when it predicts that a cut costs more than it saves (a loaded machine
    # measures its links slow), and then no sub-DAG sends anything.
    stages = len(plan["subdags"])
    assert all(len(r["sent_bytes"]) == stages and (sum(r["sent_bytes"]) > 0) == (stages > 1) for r in rows)
    computed = [r["compute_seconds"] for r in rows]  # per sub-DAG: FP + BP + Update of the step
    assert all(len(c) == len(plan["subdags"]) and min(c) >= 0 and sum(c) > 0 for c in computed)
    # the schedule run on that compute with free messages: at least any sub-DAG's own compute, at most
    # the step (which adds the network, the runtime and the broker's call)
    for r, c in zip(rows, computed):
        assert max(c) * 0.999 <= r["compute_path_seconds"] <= r["seconds"]
    # Placed by the performance model on the compnodes' announced hardware: predicted beside measured.
    assert plan["policy"] == ("job's cuts" if "cuts" in overrides else "performance model")
    assert plan["predicted_step_seconds"] > 0
    if "cuts" in overrides:  # sub-DAG 1 begins at block 1, sub-DAG 2 at the final norm
        params = [sd["params"] for sd in sorted(plan["subdags"], key=lambda sd: sd["subdag"])]
        assert {p.split(".")[1] for p in params[1]} == {"1"} and min(params[2]).startswith(("ln_f.", "wte."))
    assert all(s["predicted_seconds"] is not None and s["predicted_seconds"] >= 0 for s in plan["subdags"])
    assert set(plan["slowness"]) == {s["compnode"] for s in plan["subdags"]}
    # Every link that carries activations was probed over the data path after the assignment.
    peer_of = {s["subdag"]: s["compnode"] for s in plan["subdags"]}
    measured = {(link["from"], link["to"]) for link in plan["links"]}
    wanted = {(peer_of[s["subdag"]], peer_of[u]) for s in plan["subdags"] for u in s["compnode_users"]}
    assert wanted <= measured, (wanted, measured)
    for link in plan["links"]:
        assert link["alpha_seconds"] > 0 and link["bandwidth_bytes_per_second"] > 1e7, link


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "example,overrides",
    [
        ("mlp", {"steps": 3, "placement": {"compnodes": 2}, "microbatches": 4}),
        ("gpt", {"steps": 2, "placement": {"compnodes": 3}, "microbatches": 3}),
        ("figure3", {"task": "grad", "steps": 2, "placement": {"compnodes": 2}, "microbatches": 2}),
    ],
)
def test_interleaved_chunks_share_compnodes_and_equal_plain_pytorch(
    swarm: tuple[ProcessSwarm, BlockingObserver], example: str, overrides: dict, tmp_path: Path
) -> None:
    """interleaved-1f1b on the swarm: each compnode holds 2 sub-DAGs (its chunks) in one sandbox worker,
    runs them in its program's order, and passes values between its own chunks without the network;
    the result equals plain PyTorch and the same job's ``run --local``."""
    import json

    sw, _ = swarm
    placement = {**overrides.pop("placement"), "schedule": "interleaved-1f1b", "chunks": 2}
    job_path = example_job(example, tmp_path, **overrides, placement=placement)
    try:
        out = tmp_path / "out"
        done = _submit(job_path, sw, out)
        assert "SUCCEEDED" in done.stdout
        job = load_job(job_path)
        p = job.spec.placement.compnodes
        local = run_local(load_job(job_path), p)
        ref = run_reference(job)
    finally:
        job_path.unlink()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["schedule"]["name"] == "interleaved-1f1b"
    peer_of = {s["subdag"]: s["compnode"] for s in plan["subdags"]}
    assert len(peer_of) == 2 * p and len(set(peer_of.values())) == p
    assert all(peer_of[s] == peer_of[s % p] for s in peer_of)  # compnode d holds d, p + d
    if job.spec.task == "grad":
        grads = load_file(out / "grads.safetensors")
        assert _max_diff(grads, ref.grads) <= TOL
        assert _max_diff(grads, local.grads) <= TOL
    weights = load_file(out / "weights.safetensors")
    assert _max_diff(weights, ref.weights) <= TOL
    assert _max_diff(weights, local.weights) <= TOL
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(r["loss"] - want) <= 1e-5 for r, want in zip(rows, ref.losses, strict=True))
    assert all(len(r["compute_seconds"]) == 2 * p and min(r["compute_seconds"]) > 0 for r in rows)


@pytest.mark.timeout(300)
def test_interleaved_chunks_in_the_daemon_itself_without_sandbox(tmp_path: Path) -> None:
    """``--sandbox off``: the compnode daemon builds and runs both chunks itself; same result."""
    specs = [{"extra": ["--sandbox", "off"]}, {"extra": ["--sandbox", "off"]}]
    with running_swarm(tmp_path / "swarm", specs) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(2, 60)
            placement = {"compnodes": 2, "schedule": "interleaved-1f1b", "chunks": 3}
            job_path = example_job("figure3", tmp_path, steps=2, microbatches=2, placement=placement)
            try:
                out = tmp_path / "out"
                _submit(job_path, sw, out)
                ref = run_reference(load_job(job_path))
            finally:
                job_path.unlink()
            assert _max_diff(load_file(out / "weights.safetensors"), ref.weights) <= TOL
        finally:
            observer.close()


@pytest.mark.timeout(300)
def test_foreign_and_malformed_frames_are_refused_while_the_job_completes(
    swarm: tuple[ProcessSwarm, BlockingObserver], tmp_path: Path
) -> None:
    sw, observer = swarm
    # SGD: AdamW turns rounding-size differences into lr-size ones over 25 steps (see test_exactness).
    sgd = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}
    job_path = example_job("gpt", tmp_path, steps=25, optimizer=sgd)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        _submit_cmd(job_path, sw, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:

        def running_job() -> dict | None:
            jobs = [j for j in observer.broker_status()["jobs"] if j["state"] == "RUNNING"]
            return jobs[0] if jobs else None

        job = wait_until(running_job, 120, "the job RUNNING")
        addresses = [
            c["data_path_address"] for c in observer.broker_status()["compnodes"] if c["data_path_address"]
        ]

        async def attack() -> None:
            rogue = DataPathClient(peer_id="QmRogueRogueRogueRogueRogueRogueRogueRogueRogue1")
            try:
                for address in addresses:
                    frame = TensorFrame(
                        job_id=job["job_id"], sender=rogue.peer_id, kind="act", step=0, microbatch=0,
                        name="x", tensor=torch.ones(4, 4),
                    )  # fmt: skip
                    await rogue.send(address, frame, secrets.token_bytes(32))
            finally:
                await rogue.close()

        refused = 0
        deadline = time.monotonic() + 60
        while refused == 0 and time.monotonic() < deadline:
            asyncio.run(attack())
            for address in addresses:  # garbage straight onto the socket
                host, port = address.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=5) as s:
                    s.sendall(b"GARBAGE" * 100)
            status = observer.as_submitter("job_status", {"job_id": job["job_id"]})
            refused = status["refused_frames"]
            if status["job"]["state"] != "RUNNING":
                break
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{stdout}\n{stderr}"
        assert refused > 0, "no compnode reported the foreign frames as refused"
        logs = sw.dump_logs()
        assert "refused a frame" in logs
        job_spec = load_job(job_path)
        ref = run_reference(job_spec)
        assert _max_diff(load_file(out / "weights.safetensors"), ref.weights) <= TOL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        job_path.unlink()


@pytest.mark.timeout(300)
def test_late_compnode_is_used_by_the_next_job_and_a_leaver_shows_offline(tmp_path: Path) -> None:
    with running_swarm(tmp_path / "swarm", [{}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(1, 60)
            job_path = example_job("mlp", tmp_path, steps=2, placement={"compnodes": 2})
            try:
                # placement.compnodes is 2 and one is online: submit now (not after waiting 60 s for it)
                _submit(job_path, sw, tmp_path / "one", "--wait-compnodes", "0")
                late = sw.add_compnode("late")
                observer.wait_online(2, 60)
                _submit(job_path, sw, tmp_path / "two")
            finally:
                job_path.unlink()
            import json

            first = json.loads((tmp_path / "one" / "plan.json").read_text())
            second = json.loads((tmp_path / "two" / "plan.json").read_text())
            assert len(first["subdags"]) == 1
            assert late.peer_id in {s["compnode"] for s in second["subdags"]}
            late.stop()  # SIGTERM: graceful leave

            def offline() -> bool:
                st = observer.broker_status()
                return any(c["peer_id"] == late.peer_id and c["state"] == "OFFLINE" for c in st["compnodes"])

            wait_until(offline, 5.0, "the leaver OFFLINE at the broker")  # refresh period is 1 s
        finally:
            observer.close()
