"""Fault tolerance on a real swarm (FusionAI 3.2/3.5, Confidant's passive and proactive recovery).

Compnodes die for real: ``FUSIONNET_FAULT`` makes a compnode SIGKILL itself in FP, BP, Update or a
parameter sync of its k-th step (seeded random points, 5 per swarm, 20 in the module), SIGTERM makes
one leave gracefully, SIGSTOP cuts one off (its traffic is no longer answered), and the broker is
SIGKILLed and restarted on its state dir. Every job must end with the weights of plain PyTorch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.process_swarm import BlockingObserver, ProcessSwarm, broker_args, running_swarm
from fusionnet.runtime.processes import start_daemon, wait_until
from fusionnet.runtime.submit import submission_payload, submit_and_wait
from tests.jobfiles import example_job

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
TOL = 1e-5
SGD = {"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}}
PHASES = ("fp", "bp", "update", "sync")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _check_weights(job_path: Path, out: Path) -> None:
    ref = run_reference(load_job(job_path))
    assert _max_diff(load_file(out / "weights.safetensors"), ref.weights) <= TOL


def _submit_and_check(job_path: Path, sw: ProcessSwarm, out: Path) -> Path:
    """Submits the job, waits for it and checks its weights against plain PyTorch; the job file goes."""
    try:
        asyncio.run(submit_and_wait(job_path, sw.initial_peers, out, timeout=300))
        _check_weights(job_path, out)
    finally:
        job_path.unlink()
    return out


def _fault_points(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    phases = list(PHASES) + [rng.choice(PHASES) for _ in range(n - len(PHASES))]
    rng.shuffle(phases)
    points = []
    for phase in phases[:n]:
        k = rng.randrange(0, 3)
        mb = f":{rng.randrange(0, 2)}" if phase in ("fp", "bp") else ""
        points.append(f"{phase}:{k}{mb}")
    return points


@pytest.mark.timeout(420)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_kills_in_fp_bp_update_and_sync_lose_nothing(seed: int, tmp_path: Path) -> None:
    """3 working compnodes and 3 backups, 5 of them armed to die at seeded points. The first deaths are
    replaced from the backup pool, the later ones (pool empty) are absorbed by re-planning over the
    survivors. Two seeds: each arms every phase (``_fault_points``), so more seeds bought a minute of
    the suite each and no phase more."""
    points = _fault_points(seed, 5)
    regular = [{"env": {"FUSIONNET_FAULT": p}} for p in points[:3]]
    backups = [{"backup": True, "env": {"FUSIONNET_FAULT": p}} for p in points[3:]] + [{"backup": True}]
    with running_swarm(tmp_path / "swarm", regular + backups) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(6, 90)
            job_path = example_job("mlp", tmp_path, steps=24, optimizer=SGD, placement={"compnodes": 3})
            out = _submit_and_check(job_path, sw, tmp_path / "out")
            plan = json.loads((out / "plan.json").read_text())
            armed = sw.compnodes[:5]
            died = [d for d in armed if d.proc.poll() is not None]
            # Who dies depends on the placements: a re-plan after a failure may leave an armed survivor
            # out (the model preferred the backups, or a compnode it would give no work goes back to the
            # pool: placement.idle_stages), and then its point never comes. One the job kept to the end
            # had to die (points are within a node's first 3 steps, the job runs 24), and so did every
            # armed compnode of the first placement that ran a step.
            final = set(plan["compnodes"].values())
            kept = [d.name for d in armed if d not in died and d.peer_id in final]
            assert not kept, f"armed compnodes in the final placement that never died: {kept}"
            assert died, "no armed compnode died"
            logs = sw.dump_logs()
            assert logs.count("fault injection: SIGKILL") == len(died)
            recoveries = [r for r in plan["recoveries"] if "lost" in r and "detection" in r]
            assert recoveries and all("redistribution" in r for r in recoveries)
            assert all("replay" in r or r.get("superseded") for r in recoveries)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == list(range(24))  # every step exactly once in the results
        finally:
            observer.close()


@pytest.mark.timeout(300)
def test_sigterm_hands_the_sub_dag_over_without_replay(tmp_path: Path) -> None:
    with running_swarm(tmp_path / "swarm", [{}, {}, {"backup": True}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(3, 90)
            job_path = example_job("gpt", tmp_path, steps=30, optimizer=SGD, placement={"compnodes": 2})
            try:
                leaver: list[str] = []

                def sigterm(placement: list[dict]) -> None:
                    daemon = next(d for d in sw.compnodes if d.peer_id == placement[0]["peer_id"])
                    daemon.send(signal.SIGTERM)
                    leaver.append(daemon.peer_id)

                outcome = _run_with(sw, observer, job_path, tmp_path / "out", sigterm)
                outcome["leaver"] = leaver[0]
                _check_weights(job_path, tmp_path / "out")
            finally:
                job_path.unlink()
            kinds = [e["kind"] for e in outcome["events"]]
            assert "handed-over" in kinds and "recovered" not in kinds
            leaver = next(d for d in sw.compnodes if d.peer_id == outcome["leaver"])
            wait_until(lambda: leaver.proc.poll() is not None, 30, "the leaving compnode to exit")
            assert leaver.proc.returncode == 0  # a clean exit right after the hand-over (not its timeout)
        finally:
            observer.close()


@pytest.mark.timeout(300)
def test_a_compnode_cut_off_is_replaced_after_heartbeats_fail(tmp_path: Path) -> None:
    with running_swarm(tmp_path / "swarm", [{}, {}, {"backup": True}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        frozen: list[Any] = []
        try:
            observer.wait_online(3, 90)
            job_path = example_job("gpt", tmp_path, steps=30, optimizer=SGD, placement={"compnodes": 2})

            def freeze(placement: list[dict]) -> None:
                daemon = next(d for d in sw.compnodes if d.peer_id == placement[0]["peer_id"])
                daemon.send(signal.SIGSTOP)  # no packet answered from now on: as if its cable were pulled
                frozen.append(daemon)

            try:
                outcome = _run_with(sw, observer, job_path, tmp_path / "out", freeze)
                _check_weights(job_path, tmp_path / "out")
            finally:
                job_path.unlink()
            assert any(e["kind"] == "recovered" for e in outcome["events"])
        finally:
            for daemon in frozen:
                with contextlib.suppress(ProcessLookupError):
                    daemon.proc.kill()
                    daemon.proc.send_signal(signal.SIGCONT)
            observer.close()


@pytest.mark.timeout(120)
def test_a_broker_whose_known_compnodes_are_gone_starts_anyway(tmp_path: Path) -> None:
    """The compnodes a broker knew from its last run may all be gone by its restart: it tries them,
    then starts a swarm of its own as it would have without them, instead of refusing to start."""
    from fusionnet.dht.identity import load_or_create_identity, peer_id_of

    state = tmp_path / "broker.state"
    state.mkdir(mode=0o700)
    gone = peer_id_of(load_or_create_identity(tmp_path / "gone.key"))
    (state / "known_peers").write_text(f"/ip4/127.0.0.1/tcp/9/p2p/{gone}\n")  # port 9: nobody listens
    broker = start_daemon("broker", tmp_path, "broker", broker_args()).wait_ready()
    try:
        assert "rejoined the swarm through 0 compnode(s) known from the last run" in broker.log_text()
    finally:
        assert broker.stop() == 0


@pytest.mark.timeout(360)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_broker_stopped_and_restarted_resumes_the_job(how: signal.Signals, tmp_path: Path) -> None:
    """A broker SIGKILLed (or stopped gracefully: SIGTERM, a systemd restart) mid-job and started again on
    its state dir, without ``--initial-peers``, finds its compnodes again and finishes the job from its
    checkpoint, equal to plain PyTorch. A graceful stop must not lose more than a crash: its compnodes
    keep the job's snapshots (it used to release them, and the job started over from step 0)."""
    workdir = tmp_path / "swarm"
    with running_swarm(workdir, [{}, {}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(2, 90)
            job_path = example_job("gpt", tmp_path, steps=60, optimizer=SGD, placement={"compnodes": 2})
            payload = submission_payload(load_job(job_path)).model_dump()
            broker_id = sw.broker.peer_id
            job_id = observer.as_submitter("submit_job", payload, timeout=60)["job_id"]
            wait_until(
                lambda: observer.as_submitter("job_status", {"job_id": job_id})["job"]["step"] >= 4,
                120,
                "step 4",
            )
            # Killed before its first checkpoint or replica pointer is on disk, the broker would rightly
            # start the job over: no "resumed". Wait for a restart point (replication rounds are paced).
            job_dir = Path(sw.broker.state_dir) / "jobs" / job_id
            wait_until(
                lambda: (job_dir / "ckpt.json").exists() or (job_dir / "replicas.json").exists(),
                120,
                "a checkpoint or replica pointer on the broker's disk",
            )
            port = sw.broker.maddrs()[0].split("/tcp/")[1].split("/")[0]
            known = (Path(sw.broker.state_dir) / "known_peers").read_text()
            assert all(d.peer_id in known for d in sw.compnodes)  # what the restart rejoins through
            sw.broker.send(how)
            sw.broker.wait_exit(60)
            sw.broker.reap()
            maddr = f"/ip4/127.0.0.1/tcp/{port}"
            sw.broker = start_daemon(
                "broker",
                workdir,
                "broker",
                # no --initial-peers, as a swarm's first broker starts: it rejoins through the compnodes
                # it knew (``known_peers``), which never dial it back on their own
                broker_args(extra=["--host-maddrs", maddr]),
            ).wait_ready()
            assert sw.broker.peer_id == broker_id  # same identity from the state dir

            def finished() -> dict | None:
                try:
                    status = observer.as_submitter("job_status", {"job_id": job_id})
                except Exception:
                    return None
                return status if status["job"]["state"] in ("SUCCEEDED", "FAILED") else None

            status = wait_until(finished, 180, "the resumed job to finish")
            assert status["job"]["state"] == "SUCCEEDED", status["job"]
            files = observer.as_submitter("job_results", {"job_id": job_id}, timeout=60)["files"]
            out = tmp_path / "out"
            out.mkdir()
            for name, blob in files.items():
                (out / name).write_bytes(blob)
            _check_weights(job_path, out)
            resumed = [e for e in status["events"] if e["kind"] == "resumed"]
            assert resumed and resumed[0]["detail"]["step"] > 0, status["events"]
            job_path.unlink()
        finally:
            observer.close()


@pytest.mark.timeout(300)
def test_a_grad_job_whose_compnode_dies_while_its_gradients_are_collected_replays_the_last_step(
    tmp_path: Path,
) -> None:
    """The last batch's gradients live on the compnodes until the broker collects them: a compnode
    killed in that collection (``sync:2``, the 3rd step's) takes its share with it, so the backup runs
    the last step again and the job succeeds with plain PyTorch's gradients (it used to fail)."""
    specs: list[dict[str, Any]] = [{"env": {"FUSIONNET_FAULT": "sync:2"}} for _ in range(2)]
    with running_swarm(tmp_path / "swarm", [*specs, {"backup": True}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(3, 90)
            job_path = example_job("mlp", tmp_path, task="grad", steps=3, placement={"compnodes": 2})
            out = tmp_path / "out"
            try:
                asyncio.run(submit_and_wait(job_path, sw.initial_peers, out, timeout=240))
                ref = run_reference(load_job(job_path))
            finally:
                job_path.unlink()
            assert ref.grads is not None
            assert _max_diff(load_file(out / "grads.safetensors"), ref.grads) <= TOL
            assert sum(d.proc.poll() is not None for d in sw.compnodes[:2]) >= 1
            plan = json.loads((out / "plan.json").read_text())
            assert any("lost" in r and "replay" in r for r in plan["recoveries"]), plan["recoveries"]
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [0, 1, 2]
        finally:
            observer.close()


def _run_with(
    sw: ProcessSwarm,
    observer: BlockingObserver,
    job_path: Path,
    out: Path,
    act: Any,
    wait_compnodes: float = 60.0,
) -> dict[str, Any]:
    """Submits the job (once the broker has its compnodes, up to ``wait_compnodes`` s), waits until it has
    run a few steps, does ``act`` to one of its compnodes, and returns the broker's final job status once
    ``submit`` finished."""

    async def main() -> None:
        await submit_and_wait(
            job_path, sw.initial_peers, out, timeout=240, show_plan=False, wait_compnodes=wait_compnodes
        )

    errors: list[BaseException] = []

    def submit() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    thread = threading.Thread(target=submit)
    thread.start()
    try:

        def running() -> dict | None:
            jobs = [j for j in observer.broker_status()["jobs"] if j["state"] == "RUNNING" and j["step"] >= 3]
            return jobs[0] if jobs else None

        job = wait_until(running, 120, "the job RUNNING past step 3")
        status = observer.as_submitter("job_status", {"job_id": job["job_id"]})
        act(status["placement"])
    finally:
        thread.join(timeout=260)
    assert not errors, errors
    return observer.as_submitter("job_status", {"job_id": job["job_id"]})


@pytest.mark.timeout(300)
def test_a_compnode_joining_mid_job_is_used_after_a_replan(tmp_path: Path) -> None:
    """Elastic join: the job starts on the only compnode; one that joins mid-job is taken in at a step
    boundary because the model predicts a faster step (any gain counts here: --replan-gain 0)."""
    broker_kw = {"extra": ["--replan-gain", "0"]}
    with running_swarm(tmp_path / "swarm", [{}], broker_kw=broker_kw) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(1, 90)
            # A GPT big enough that a step lasts (the late compnode needs seconds to profile and join)
            # and that two compnodes pipeline it clearly faster than one.
            model = {
                "entrypoint": "model.py:build",
                "kwargs": {"vocab_size": 41, "block_size": 32, "n_layer": 4, "d_model": 128, "n_head": 4},
            }
            # (The late compnode was ONLINE at step 47 in a run on an idle 2-core machine.)
            # Plain SGD: with momentum, 300 steps amplify float rounding (any change of summation order,
            # even plain PyTorch's own) far beyond 1e-5; without it they stay at 1e-7.
            job_path = example_job(
                "gpt", tmp_path, steps=200, batch_size=32, microbatches=4, model=model, compnodes=2,
                optimizer={"name": "sgd", "lr": 0.01},
            )  # fmt: skip
            late: list[Any] = []

            def join(_placement: list[dict]) -> None:
                late.append(sw.add_compnode("late"))
                observer.wait_online(2, 90)
                jobs = observer.broker_status()["jobs"]
                late.append(max(j["step"] for j in jobs))  # the step the job was at when it could join

            try:
                # placement.compnodes is 2 and one is online: the job starts now, on it
                outcome = _run_with(sw, observer, job_path, tmp_path / "out", join, wait_compnodes=0)
                _check_weights(job_path, tmp_path / "out")
            finally:
                job_path.unlink()
            assert late[1] < 150, f"the late compnode was ONLINE only at step {late[1]}: make the job longer"
            replans = [e for e in outcome["events"] if e["kind"] == "re-plan"]
            assert replans, [e["kind"] for e in outcome["events"]]
            plan = json.loads((tmp_path / "out" / "plan.json").read_text())
            assert late[0].peer_id in {s["compnode"] for s in plan["subdags"]}
            assert len(plan["subdags"]) == 2
        finally:
            observer.close()


@pytest.mark.timeout(420)
def test_a_compnode_holding_interleaved_chunks_killed_mid_step_loses_nothing(tmp_path: Path) -> None:
    """interleaved-1f1b: each compnode holds 2 sub-DAGs; one is SIGKILLed in a backward of its sixth
    step. Both of its chunks are lost at once; their snapshots are on the other compnode (each chunk's
    ring holder is the next chunk's compnode), so the backup takes them from the replicas, not from the
    broker's checkpoint of the submission, and the job ends with plain PyTorch's weights, every step
    once."""
    regular = [{"env": {"FUSIONNET_FAULT": "bp:5:0"}}, {}]
    with running_swarm(tmp_path / "swarm", [*regular, {"backup": True}]) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(3, 90)
            placement = {"compnodes": 2, "schedule": "interleaved-1f1b", "chunks": 2}
            job_path = example_job(
                "mlp", tmp_path, steps=10, microbatches=4, optimizer=SGD, placement=placement
            )
            out = _submit_and_check(job_path, sw, tmp_path / "out")
            assert sw.compnodes[0].proc.poll() is not None, "the armed compnode did not die"
            plan = json.loads((out / "plan.json").read_text())
            assert sw.compnodes[2].peer_id in set(plan["compnodes"].values())  # the backup took over
            holders = [s["compnode"] for s in plan["subdags"]]
            assert len(holders) == 4 and len(set(holders)) == 2
            recoveries = [r for r in plan["recoveries"] if "lost" in r]
            assert recoveries and all("replay" in r or r.get("superseded") for r in recoveries)
            # The round asked for at step 0 (2 s apart at most: these steps take tens of ms) was on its
            # holder's disk steps before the kill: the replay starts after step 0, from the replicas.
            assert recoveries[0]["checkpoint"] == "replicas" and recoveries[0]["replay_from"] >= 1
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == list(range(10))
        finally:
            observer.close()


@pytest.mark.timeout(420)
def test_interleaving_chosen_by_auto_survives_a_killed_compnode(tmp_path: Path) -> None:
    """``placement.schedule: auto`` with a broker that lets interleaving through (``--interleave-gain
    -1``: whenever an interleaved cut runs and fits, so the choice does not hang on this machine's load,
    nor on the survivor's measured speed after the kill):
    the broker cuts the GPT into 2 x v sub-DAGs, the compnodes get interleaved-1f1b with v chunks in
    their spec, one is SIGKILLed in a backward of its sixth step, the backup takes over after a re-plan
    (which decides the schedule again), and the job ends with plain PyTorch's weights, every step once."""
    regular = [{"env": {"FUSIONNET_FAULT": "bp:5:0"}}, {}]
    broker_kw = {"extra": ["--interleave-gain", "-1"]}
    with running_swarm(tmp_path / "swarm", [*regular, {"backup": True}], broker_kw=broker_kw) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(3, 90)
            model = {
                "entrypoint": "model.py:build",
                "kwargs": {"vocab_size": 41, "block_size": 32, "n_layer": 4, "d_model": 64, "n_head": 4},
            }
            placement = {"compnodes": 2, "schedule": "auto"}
            job_path = example_job(
                "gpt", tmp_path, steps=10, microbatches=4, model=model, optimizer=SGD, placement=placement
            )
            out = _submit_and_check(job_path, sw, tmp_path / "out")
            assert sw.compnodes[0].proc.poll() is not None, "the armed compnode did not die"
            plan = json.loads((out / "plan.json").read_text())
            assert sw.compnodes[2].peer_id in set(plan["compnodes"].values())  # the backup took over
            schedule = plan["schedule"]
            assert schedule["name"] == "interleaved-1f1b", schedule
            assert schedule["why"].startswith("auto: interleaved-1f1b with")
            v = schedule["chunks"]
            holders = [s["compnode"] for s in plan["subdags"]]
            assert len(holders) == 2 * v and len(set(holders)) == 2
            assert all(holders[s] == holders[s % 2] for s in range(2 * v))  # compnode d holds d, 2 + d, ...
            assert [r for r in plan["recoveries"] if "lost" in r]
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == list(range(10))
            assert all(len(r["compute_seconds"]) == 2 * v for r in rows[-3:])  # after the re-plan too
        finally:
            observer.close()
