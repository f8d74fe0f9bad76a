"""Sandboxed execution on a real swarm (issue 12): a job whose sub-DAG crashes the interpreter on a
compnode (fault point ``crash``: the job's worker dies of SIGSEGV in its first FP, as an op of the job
would make it) fails with a message that names the crash and the job as its cause. It is not failed
over to the backup, which would crash the same way; the compnode that hosted it stays online, and the
next job, on the same compnodes, ends with PyTorch's weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusionnet.errors import JobError
from fusionnet.job.loader import load_job
from fusionnet.reference import run_reference
from fusionnet.runtime.process_swarm import BlockingObserver, running_swarm
from fusionnet.runtime.submit import submit_and_wait
from tests.jobfiles import example_job

pytestmark = pytest.mark.swarm
TOL = 1e-5


@pytest.mark.timeout(300)
def test_a_crashing_job_fails_alone_and_the_compnode_serves_the_next(tmp_path: Path) -> None:
    nodes = [{"env": {"FUSIONNET_FAULT": "crash:0"}}, {}, {"backup": True}]
    # The mlp takes microseconds a step: whether the performance model splits it (and so uses the armed
    # compnode) turns on calibrations still running; the balanced policy always uses both regulars.
    balanced = {"extra": ["--placement", "balanced"]}
    with running_swarm(tmp_path / "swarm", nodes, broker_kw=balanced) as sw:
        observer = BlockingObserver(sw.initial_peers)
        try:
            observer.wait_online(3, 90)
            two = {"compnodes": 2}
            crashing = example_job("mlp", tmp_path / f"{tmp_path.name}-a", steps=3, placement=two)
            died = r"FAILED: .*sandbox worker died \(it was killed by SIGSEGV"
            try:
                with pytest.raises(JobError, match=died):
                    asyncio.run(submit_and_wait(crashing, sw.initial_peers, tmp_path / "out-a", timeout=120))
            finally:
                crashing.unlink()
            armed, other, backup = sw.compnodes
            assert armed.proc.poll() is None and other.proc.poll() is None  # both daemons live on
            assert "assigned by" not in backup.log_text()  # no failover onto the next victim
            for node in (armed, other):
                assert observer.call(node.peer_id, "info", {})["state"] == "ONLINE"

            job = example_job("mlp", tmp_path / f"{tmp_path.name}-b", steps=3, placement=two)
            out = tmp_path / "out-b"
            try:
                asyncio.run(submit_and_wait(job, sw.initial_peers, out, timeout=120))
                want = run_reference(load_job(job)).weights
            finally:
                job.unlink()
            plan = json.loads((out / "plan.json").read_text())
            assert armed.peer_id in plan["compnodes"].values()  # the crash's host ran the next job
            got = load_file(out / "weights.safetensors")
            diff = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
            assert sorted(got) == sorted(want) and diff <= TOL
            assert torch.isfinite(torch.tensor(diff))
        finally:
            observer.close()
