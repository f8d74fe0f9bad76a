"""Stopping jobs and not losing them, on a real swarm (issue 17, items 5 and 6): ``fusionnet cancel``
stops a running job within 5 s and frees its compnodes; ``submit --timeout`` cancels its job; a job
whose submitter was killed runs to its end and ``fusionnet results`` fetches it; a job submitted the
moment the daemons' address files exist waits for its compnodes and succeeds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.process_swarm import BlockingObserver, ProcessSwarm, running_swarm
from fusionnet.runtime.processes import wait_until
from tests.jobfiles import REPO, example_job

pytestmark = [pytest.mark.swarm, pytest.mark.slow]
TOL = 1e-5
LONG = 10_000_000  # steps: a job that would hold the swarm for days


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fusionnet.cli.main", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_cli(*args), capture_output=True, text=True, cwd=REPO, timeout=timeout, env=_env())


def _check_weights(job_path: Path, out: Path) -> None:
    ref = run_reference(load_job(job_path))
    got = load_file(out / "weights.safetensors")
    assert sorted(got) == sorted(ref.weights)
    assert max((got[k].double() - ref.weights[k].double()).abs().max().item() for k in got) <= TOL


class Submitter:
    """``fusionnet submit`` in the background; its job id once it printed it."""

    def __init__(self, job_path: Path, swarm: ProcessSwarm, out: Path, *extra: str) -> None:
        self.log = out.parent / f"{out.name}.submit.log"
        self._file = self.log.open("w")
        args = ["submit", str(job_path), "--initial-peers", *swarm.initial_peers, "--output", str(out)]
        self.proc = subprocess.Popen(
            _cli(*args, *extra), stdout=self._file, stderr=subprocess.STDOUT, cwd=REPO, env=_env()
        )

    def job_id(self, timeout: float = 60) -> str:
        def found() -> str | None:
            m = re.search(r"job ([0-9a-f]+) submitted", self.log.read_text())
            if m is None and self.proc.poll() is not None:
                raise AssertionError(f"submit exited {self.proc.returncode}:\n{self.log.read_text()}")
            return None if m is None else m.group(1)

        return wait_until(found, timeout, "the job id from submit", interval=0.1)

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        code = self.proc.wait(timeout)
        self._file.close()
        return code, self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._file.close()


@pytest.fixture
def submitters() -> Iterator[list[Submitter]]:
    started: list[Submitter] = []
    try:
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProcessSwarm, BlockingObserver]]:
    # over the broker's default quota; balanced: every job on both compnodes, whatever the load (the
    # performance model may keep a small job on one when a loaded machine measured the links slow)
    long_jobs = {"extra": ["--max-steps", str(LONG), "--placement", "balanced"]}
    with running_swarm(tmp_path_factory.mktemp("swarm"), [{}, {}], broker_kw=long_jobs) as swarm:
        observer = BlockingObserver(swarm.initial_peers)
        try:
            observer.wait_online(2, 60)
            yield swarm, observer
        finally:
            observer.close()


def _job(observer: BlockingObserver, swarm: ProcessSwarm, job_id: str) -> dict:
    return observer.as_submitter("job_status", {"job_id": job_id})


def _running(observer: BlockingObserver, swarm: ProcessSwarm, job_id: str, steps: int) -> None:
    def ran() -> bool:
        job = _job(observer, swarm, job_id)["job"]
        assert job["state"] in ("QUEUED", "PLANNING", "RUNNING"), job
        return job["state"] == "RUNNING" and job["step"] >= steps

    wait_until(ran, 60, f"job {job_id} RUNNING past step {steps}", interval=0.2)


@pytest.mark.timeout(300)
def test_cancel_stops_a_running_job_within_5_s_and_frees_its_compnodes(
    swarm: tuple[ProcessSwarm, BlockingObserver], tmp_path: Path, submitters: list[Submitter]
) -> None:
    sw, observer = swarm
    job_path = example_job("mlp", tmp_path, steps=LONG)
    try:
        submitter = Submitter(job_path, sw, tmp_path / "long")
        submitters.append(submitter)
        job_id = submitter.job_id()
        _running(observer, sw, job_id, 2)
        done = _run("cancel", job_id, "--initial-peers", *sw.initial_peers)
    finally:
        job_path.unlink()
    assert done.returncode == 0, done.stderr
    assert f"job {job_id} cancelled" in done.stdout
    status = _job(observer, sw, job_id)
    assert status["job"]["state"] == "CANCELLED"
    events = {e["kind"]: e for e in status["events"]}
    to_cancelled = [e for e in status["events"] if e["kind"] == "state" and e["detail"]["to"] == "CANCELLED"]
    # Stopped within 5 s of the broker getting the request, compnodes released in the same call.
    assert to_cancelled[0]["at"] - events["cancel"]["at"] < 5.0
    steps = status["job"]["step"]
    code, log = submitter.wait()
    assert code == 1 and f"job {job_id} was cancelled" in log, log
    # The compnodes dropped the sub-DAGs: no task left, and the job's step count stays where it was.
    wait_until(
        lambda: all(c["running_tasks"] == 0 for c in observer.broker_status()["compnodes"]),
        30,
        "the compnodes to drop the cancelled job",
        interval=0.2,
    )
    assert _job(observer, sw, job_id)["job"]["step"] == steps
    # Cancelling again says so; an unknown job is named; a cancelled job has no results.
    again = observer.as_submitter("cancel_job", {"job_id": job_id})
    assert again["state"] == "CANCELLED" and not again["cancelled"], again
    with pytest.raises(JobError, match="no job with id 'abc123'"):
        observer.as_submitter("cancel_job", {"job_id": "abc123"})
    with pytest.raises(JobError, match="results exist only for SUCCEEDED jobs"):
        observer.as_submitter("job_results", {"job_id": job_id})


@pytest.mark.timeout(300)
def test_results_of_a_job_whose_submitter_was_killed_are_kept_for_fusionnet_results(
    swarm: tuple[ProcessSwarm, BlockingObserver], tmp_path: Path, submitters: list[Submitter]
) -> None:
    sw, observer = swarm
    # Long enough to be caught running (30 steps once ended between two polls of a loaded CI machine),
    # short enough to run to its end here.
    job_path = example_job("mlp", tmp_path, steps=400)
    try:
        submitter = Submitter(job_path, sw, tmp_path / "gone")
        submitters.append(submitter)
        job_id = submitter.job_id()
        _running(observer, sw, job_id, 1)
        submitter.proc.send_signal(signal.SIGKILL)  # gone without a word: nothing cancels the job
        submitter.wait()

        def ended() -> str | None:
            state = _job(observer, sw, job_id)["job"]["state"]
            return state if state in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        assert wait_until(ended, 180, f"job {job_id} to end", interval=0.3) == "SUCCEEDED"
        out = tmp_path / "fetched"
        done = _run("results", job_id, "--initial-peers", *sw.initial_peers, "--output", str(out))
        assert done.returncode == 0, done.stderr
        # It ran on the compnodes the cancelled job (if any ran before) left: both, exactly.
        plan = json.loads((out / "plan.json").read_text())
        assert len(plan["subdags"]) == 2
        _check_weights(job_path, out)
    finally:
        job_path.unlink()


@pytest.mark.timeout(300)
def test_submit_timeout_cancels_its_job_and_says_so(
    swarm: tuple[ProcessSwarm, BlockingObserver], tmp_path: Path, submitters: list[Submitter]
) -> None:
    sw, observer = swarm
    job_path = example_job("mlp", tmp_path, steps=LONG)
    try:
        submitter = Submitter(job_path, sw, tmp_path / "late", "--timeout", "3")
        submitters.append(submitter)
        job_id = submitter.job_id()
        code, log = submitter.wait()
    finally:
        job_path.unlink()
    assert code == 1, log
    assert f"job {job_id} cancelled on the broker" in log, log
    assert f"job {job_id} did not finish within 3 s; cancelled" in log, log
    assert _job(observer, sw, job_id)["job"]["state"] == "CANCELLED"


@pytest.mark.timeout(300)
def test_ctrl_c_on_submit_cancels_its_job_and_says_so(
    swarm: tuple[ProcessSwarm, BlockingObserver], tmp_path: Path, submitters: list[Submitter]
) -> None:
    sw, observer = swarm
    job_path = example_job("mlp", tmp_path, steps=LONG)
    try:
        submitter = Submitter(job_path, sw, tmp_path / "interrupted")
        submitters.append(submitter)
        job_id = submitter.job_id()
        _running(observer, sw, job_id, 1)
        submitter.proc.send_signal(signal.SIGINT)
        code, log = submitter.wait()
    finally:
        job_path.unlink()
    assert code == 130, log
    assert f"job {job_id} cancelled on the broker (the submitter was interrupted)" in log, log
    assert "fusionnet submit: interrupted" in log, log
    assert _job(observer, sw, job_id)["job"]["state"] == "CANCELLED"


@pytest.mark.timeout(400)
def test_a_job_submitted_the_moment_the_address_files_exist_succeeds(tmp_path: Path) -> None:
    """The start-up race of issue 17: submit waits for the broker to have the job's compnodes."""
    for attempt in range(2):
        workdir = tmp_path / f"swarm{attempt}"
        with running_swarm(workdir, [{}, {}]) as sw:  # returns once every address file exists
            out = tmp_path / f"out{attempt}"
            job_path = example_job("mlp", tmp_path, steps=2)
            try:
                done = _run(
                    "submit", str(job_path), "--initial-peers", *sw.initial_peers, "--output", str(out),
                    "--timeout", "90", timeout=120,
                )  # fmt: skip
                assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
                plan = json.loads((out / "plan.json").read_text())
                assert len(plan["subdags"]) == 2  # placed on both, not on whichever the broker saw first
                _check_weights(job_path, out)
            finally:
                job_path.unlink()
