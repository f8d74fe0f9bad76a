"""What ``fusionnet plan`` prints and what plan.json says about the schedule that runs.

- ``placement.schedule: auto`` choosing another schedule than the 1F1B the cut was searched with: the
  printed plan is the chosen schedule's (it printed 1F1B's table, micro-batches in flight and step time
  above ``schedule: zero-bubble``, while plan.json was zero-bubble's).
- plan.json's ``schedule.text`` (each compnode's program, README) from ``fusionnet plan --json`` and from
  a swarm run, not only from ``run --local``.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from fusionnet.cli.main import main
from fusionnet.perfmodel.nodes import load_nodes_file
from fusionnet.planning.cut_plan import plan_cuts
from fusionnet.planning.optimizers import job_optimizers
from fusionnet.planning.planner import plan_graph, priced_with
from fusionnet.runtime.prepare import trace_job
from fusionnet.schedules import Schedule, make_schedule
from tests.jobfiles import example_job
from tests.test_jobrun_decisions import FakeCompnodes, make_run, submitted  # noqa: F401 (a fixture)

# Two equal slow CPUs: ``auto`` picks zero-bubble for the bundled GPT at 4 micro-batches (checked below).
NODES = (
    "nodes:\n  - {name: laptop, kind: cpu, peak_flops: 2G, mem_bandwidth: 2GB/s, d_cpu: 8GiB, count: 2}\n"
    "network: {latency: 50us, bandwidth: 10Gbps}\n"
)


@pytest.fixture(scope="module", autouse=True)
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Nothing here profiles this machine (nodes files only); a scratch cache all the same."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], **placement: Any) -> tuple[str, dict[str, Any]]:
    """``fusionnet plan --json`` of the bundled GPT (4 micro-batches) on ``NODES``: the text, plan.json."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(NODES)
    job_path = example_job("gpt", tmp_path, microbatches=4, compnodes=2, **placement)
    out = tmp_path / "plan.json"
    try:
        assert main(["plan", str(job_path), "--nodes", str(nodes), "--json", str(out)]) == 0
    finally:
        job_path.unlink()
    return capsys.readouterr().out, json.loads(out.read_text())


def _table_says(text: str) -> tuple[str, float, list[int]]:
    """The printed plan's schedule, step time and micro-batches in flight per stage."""
    head = re.search(r"^plan: .*, (\S+) schedule, objective", text, re.M)
    step = re.search(r"^predicted step time: (\S+) s$", text, re.M)
    rows = re.findall(r"^ +\d+  \d+:.* (\d+)$", text, re.M)
    assert head is not None and step is not None and rows, text
    return head.group(1), float(step.group(1)), [int(r) for r in rows]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cuts", [None, ["blocks.1"]])
def test_plan_prints_the_plan_of_the_schedule_auto_chose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cuts: list[str] | None
) -> None:
    placement: dict[str, Any] = {"schedule": "auto"} | ({"cuts": cuts} if cuts else {})
    text, doc = _plan(tmp_path, capsys, **placement)
    chosen = doc["schedule"]["name"]
    assert chosen == "zero-bubble"  # else this swarm no longer tests a re-priced plan
    name, step, inflight = _table_says(text)
    assert name == chosen == doc["plan"]["workload"]["schedule"]
    assert step == pytest.approx(doc["predicted_step_seconds"], rel=1e-5)
    assert inflight == [s["memory"]["inflight"] for s in doc["plan"]["stages"]]
    assert f"schedule: {chosen} (auto: " in text
    if cuts:  # why these devices: still said after the plan was priced again
        assert "cut at placement.cuts; devices chosen from" in text


@pytest.mark.timeout(180)
def test_priced_with_writes_the_explanation_of_its_own_pricing(tmp_path: Path) -> None:
    """``planner.priced_with`` directly: its text is the re-priced plan's, the notes of ``plan_cuts`` kept."""
    job_path = example_job("gpt", tmp_path, microbatches=4, compnodes=2)
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(NODES)
    try:
        from fusionnet.job.loader import load_job

        job = load_job(job_path)
    finally:
        job_path.unlink()
    graph = trace_job(job).graph
    swarm = load_nodes_file(nodes)
    devices = list(swarm.devices)
    priced: dict[str, Any] = {
        "microbatches": 4,
        "batch_size": job.spec.data.batch_size,
        "optimizer": job_optimizers(job, graph),
        "default_link": swarm.default_link,
    }
    searched = plan_graph(graph, devices, max_devices=2, pipeline_schedule="1f1b", **priced)
    again = priced_with(graph, searched, devices, "zero-bubble", max_devices=2, **priced)
    assert "1f1b schedule" in searched.explanation and "zero-bubble schedule" in again.explanation
    assert "1f1b schedule" not in again.explanation
    assert f"predicted step time: {again.predicted_step_seconds:.6g} s" in again.explanation
    assert again.predicted_step_seconds != searched.predicted_step_seconds

    cut = {n: int(i >= len(graph.nodes) // 2) for i, n in enumerate(n.name for n in graph.nodes)}
    by_cut = plan_cuts(graph, devices, cut, pipeline_schedule="1f1b", **priced)
    assert by_cut.notes and by_cut.explanation.endswith(by_cut.notes)
    cut_again = priced_with(graph, by_cut, devices, "zero-bubble", max_devices=2, **priced)
    assert "zero-bubble schedule" in cut_again.explanation and cut_again.explanation.endswith(by_cut.notes)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("placement", "header"),
    [
        ({"schedule": "auto"}, "zero-bubble p=2 m=4"),
        ({"schedule": "interleaved-1f1b", "chunks": 2}, "interleaved-1f1b p=2 m=4 v=2"),
    ],
)
def test_plan_json_of_fusionnet_plan_has_the_schedule_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], placement: dict[str, Any], header: str
) -> None:
    _, doc = _plan(tmp_path, capsys, **placement)
    text = doc["schedule"]["text"]
    assert text.splitlines()[0] == header
    program = Schedule.parse(text)  # each compnode's program, one line each
    assert len(program.programs) == 2 and program.name == doc["schedule"]["name"]


@pytest.mark.timeout(120)
def test_plan_json_of_a_swarm_run_has_the_schedule_text(
    tmp_path: Path,
    submitted: Any,  # noqa: F811 (the fixture imported above)
) -> None:
    """The broker's plan.json (a real ``JobRun`` on fake compnodes): the programs its compnodes ran."""
    fake = FakeCompnodes()
    run, context = make_run(tmp_path, submitted, fake)
    asyncio.run(run.run())
    assert context.store.get_job("j1")["state"] == "SUCCEEDED", context.store.get_job("j1")["error"]
    assert run.partition is not None
    doc = json.loads((tmp_path / "jobs" / "j1" / "plan.json").read_text())
    schedule = doc["schedule"]
    m = run.progress.metrics[-1]["microbatches"]
    chunks = schedule.get("chunks", 1)
    want = make_schedule(schedule["name"], len(run.partition.subdags), m, "train", chunks).text()
    assert schedule["text"] == want
