"""``fusionnet plan`` (local profile and ``--nodes``), ``fusionnet section4`` and the predictions that
``fusionnet run --local`` writes into plan.json, through the real console entry point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fusionnet.cli.main import main
from tests.jobfiles import REPO

MLP = REPO / "examples" / "mlp" / "job.yaml"
GPT = REPO / "examples" / "gpt" / "job.yaml"

NODES = """
nodes:
  - device: RTX 3080
    count: 2
  - name: laptop
    kind: cpu
    peak_flops: 200G
    mem_bandwidth: 20GB/s
    d_cpu: 8GiB
network:
  latency: 5ms
  bandwidth: 1Gbps
"""


@pytest.fixture(scope="module", autouse=True)
def profile_cache(tmp_path_factory):
    """This machine is profiled once for the module, into a scratch cache (not the user's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.mark.timeout(180)
def test_plan_prints_table3_and_writes_the_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(MLP), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Sub-DAG" in text and "Outer required" in text  # Table 3
    assert "like this machine" in text and "predicted step time" in text
    doc = json.loads(out.read_text())
    assert doc["job"] == "mlp" and doc["predicted_step_seconds"] > 0
    assert 1 <= len(doc["subdags"]) <= 2  # placement.compnodes caps the sub-DAGs
    assert all(s["predicted_seconds"] > 0 for s in doc["subdags"])
    assert sum(len(s["nodes"]) for s in doc["subdags"]) == 9  # every IR node in exactly one sub-DAG
    assert doc["plan"]["workload"]["microbatches"] == 2


@pytest.mark.timeout(180)
def test_plan_for_a_nodes_file(tmp_path: Path, capsys) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(NODES)
    out = tmp_path / "plan.json"
    assert main(["plan", str(GPT), "--nodes", str(nodes), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"the 3 device(s) of {nodes}" in text
    doc = json.loads(out.read_text())
    names = {d["name"] for d in doc["devices"]}
    assert names <= {"RTX 3080 #0", "RTX 3080 #1", "laptop"} and names
    assert [s["subdag"] for s in doc["subdags"]] == list(range(len(doc["subdags"])))
    assert all(s["predicted_seconds"] > 0 for s in doc["subdags"])


@pytest.mark.timeout(120)
def test_plan_refuses_bad_or_too_small_swarms_in_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - device: RTX 3080\n    colour: red\n")
    assert main(["plan", str(MLP), "--nodes", str(bad)]) == 2  # the nodes file is bad input (exit 2)
    err = capsys.readouterr().err.strip()
    assert "nodes[0]" in err and "colour" in err and len(err.splitlines()) == 1
    small = tmp_path / "small.yaml"
    small.write_text("- {name: tiny, kind: cpu, peak_flops: 1G, mem_bandwidth: 1GB/s, d_cpu: 4KiB}\n")
    assert main(["plan", str(MLP), "--nodes", str(small)]) == 1
    err = capsys.readouterr().err.strip()
    assert "needs" in err and "d_cpu" in err and "tiny" in err


def test_help_texts() -> None:
    for command in ("plan", "section4"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0


@pytest.mark.timeout(120)
def test_section4_writes_the_plot_and_the_rows(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    assert main(["section4", "--output", str(tmp_path), "--n-batches", "8", "--no-simulate"]) == 0
    png = tmp_path / "section4.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = json.loads((tmp_path / "section4.json").read_text())
    assert {r["model"] for r in rows} == {"bert-large", "gpt3-24l-4096"}
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["plot"] == str(png)


@pytest.mark.timeout(180)
def test_run_local_puts_predictions_next_to_measurements(tmp_path: Path, capsys) -> None:
    assert main(["run", str(MLP), "--local", "2", "--output", str(tmp_path)]) == 0
    assert "predicted" in capsys.readouterr().out
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["predicted_for"]["device"] == "local"
    for s in doc["subdags"]:
        assert s["predicted_seconds"] > 0 and s["measured_seconds"] > 0
        assert s["prediction_error"] == pytest.approx(
            (s["predicted_seconds"] - s["measured_seconds"]) / s["measured_seconds"]
        )


@pytest.mark.timeout(180)
def test_plan_of_an_interleaved_job_is_the_brokers_placement(tmp_path: Path, capsys) -> None:
    """``fusionnet plan`` on interleaved-1f1b: the 2 fastest devices of the nodes file (the laptop is
    left out), the model cut evenly into 2 x 2 chunks, sub-DAG s on device s mod 2, and the step the
    broker's placement predicts for those devices (``planning.placement``): plan.json predicts what runs."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(NODES)
    job, doc = _plan_gpt(tmp_path, nodes, compnodes=2, schedule="interleaved-1f1b", chunks=2)
    text = capsys.readouterr().out
    assert "interleaved-1f1b" in text and "2 fastest" in text and "chunk 1 of 2" in text
    assert [d["device"] for d in doc["devices"]] == [0, 1, 0, 1]
    assert {d["name"] for d in doc["devices"]} == {"RTX 3080 #0", "RTX 3080 #1"}
    assert len(doc["subdags"]) == 4 and doc["plan"]["workload"]["schedule"] == "interleaved-1f1b"

    placed = _brokers_placement(job, nodes, schedule="interleaved-1f1b", chunks=2)
    assert placed.peers == ("peer0", "peer1", "peer0", "peer1")
    assert doc["predicted_step_seconds"] == pytest.approx(placed.predicted_step, rel=1e-9)


@pytest.mark.timeout(180)
def test_plan_of_a_job_with_its_own_cuts_is_the_brokers_placement(tmp_path: Path, capsys) -> None:
    """``placement.cuts``: ``fusionnet plan`` prices the job's cut on the fastest devices, sub-DAG i on
    the i-th fastest, and predicts the step the broker's placement predicts for them."""
    from fusionnet.dag.cuts import cut_assignment

    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(NODES)
    job, doc = _plan_gpt(tmp_path, nodes, compnodes=2, schedule="1f1b", cuts=["blocks.1"])
    assert "cut at placement.cuts" in capsys.readouterr().out
    assert {d["name"] for d in doc["devices"]} == {"RTX 3080 #0", "RTX 3080 #1"}
    placed = _brokers_placement(job, nodes, schedule="1f1b", cuts=("blocks.1",))
    want = cut_assignment(placed_graph := _traced(job), ["blocks.1"])
    for sd in doc["subdags"]:
        ops = [
            n for n in sd["nodes"] if placed_graph.node(n).kind not in ("placeholder", "variable", "output")
        ]
        assert {want[n] for n in ops} == {sd["subdag"]}
    assert doc["predicted_step_seconds"] == pytest.approx(placed.predicted_step, rel=1e-9)


@pytest.mark.timeout(120)
def test_plan_of_an_auto_job_that_interleaves_is_the_brokers_placement(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` weighs interleaved-1f1b in ``fusionnet plan`` as the broker does: with a margin that
    lets it through, plan.json names the schedule, its chunks and the cut the broker would place, and
    predicts the broker's step for it."""
    from fusionnet.planning import auto_interleaved

    monkeypatch.setattr(auto_interleaved, "MIN_GAIN", -1.0)  # the broker's --interleave-gain -1
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(
        "nodes:\n  - {name: laptop, kind: cpu, peak_flops: 2G, mem_bandwidth: 2GB/s, d_cpu: 8GiB, count: 2}\n"
        "network: {latency: 50us, bandwidth: 10Gbps}\n"
    )
    job, doc = _plan_gpt(tmp_path, nodes, compnodes=2, schedule="auto")
    assert "(interleaved-1f1b)" in capsys.readouterr().out
    v = doc["schedule"]["chunks"]
    assert doc["schedule"]["name"] == "interleaved-1f1b" and v in (2, 3, 4)
    assert "auto: interleaved-1f1b with" in doc["schedule"]["why"]
    assert len(doc["subdags"]) == 2 * v and [d["device"] for d in doc["devices"]] == [0, 1] * v

    placed = _brokers_placement(job, nodes, schedule="auto", interleave_gain=-1.0)
    assert placed.chunks == v and placed.schedule is not None
    assert doc["predicted_step_seconds"] == pytest.approx(placed.predicted_step, rel=1e-9)


@pytest.mark.timeout(180)
def test_plan_of_an_auto_job_names_the_schedule_the_broker_runs(tmp_path: Path, capsys) -> None:
    """``auto`` where interleaving does not pay: plan.json's ``schedule`` is the one the broker's
    placement chooses on the same devices (it used to say nothing, and price 1f1b's step), and its
    predicted step is that schedule's."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(
        "nodes:\n  - {name: laptop, kind: cpu, peak_flops: 2G, mem_bandwidth: 2GB/s, d_cpu: 8GiB, count: 2}\n"
        "network: {latency: 50us, bandwidth: 10Gbps}\n"
    )
    job, doc = _plan_gpt(tmp_path, nodes, compnodes=2, schedule="auto")
    placed = _brokers_placement(job, nodes, schedule="auto")
    assert placed.schedule is not None and placed.schedule.name != "interleaved-1f1b"
    assert doc["schedule"]["name"] == placed.schedule.name and doc["schedule"]["why"].startswith("auto: ")
    assert set(doc["schedule"]["predicted_step_seconds"]) == {"gpipe", "1f1b", "zero-bubble"}
    assert doc["predicted_step_seconds"] == pytest.approx(placed.predicted_step, rel=1e-9)
    assert f"schedule: {placed.schedule.name} (auto: " in capsys.readouterr().out


def _plan_gpt(tmp_path: Path, nodes: Path, **placement: Any) -> tuple[Any, dict[str, Any]]:
    """``fusionnet plan`` of the bundled GPT (4 micro-batches, ``placement`` keys) for ``nodes``: the job
    as loaded, and plan.json."""
    from fusionnet.job.loader import load_job
    from tests.jobfiles import example_job

    job_path = example_job("gpt", tmp_path, microbatches=4, **placement)
    out = tmp_path / "plan.json"
    try:
        assert main(["plan", str(job_path), "--nodes", str(nodes), "--json", str(out)]) == 0
        job = load_job(job_path)
    finally:
        job_path.unlink()
    return job, json.loads(out.read_text())


def _traced(job: Any) -> Any:
    from fusionnet.runtime.prepare import trace_job

    return trace_job(job).graph


def _brokers_placement(job: Any, nodes: Path, **shape: Any) -> Any:
    """The broker's placement of the (4 micro-batch) ``job`` on the first 2 devices of ``nodes``, their
    link the nodes file's network: what ``fusionnet plan`` must predict."""
    from fusionnet.perfmodel.nodes import load_nodes_file
    from fusionnet.planning.optimizers import job_optimizers
    from fusionnet.planning.placement import Candidate, JobShape, plan_placement
    from fusionnet.runtime.prepare import trace_job

    graph = trace_job(job).graph
    swarm = load_nodes_file(nodes)
    optimizer = job_optimizers(job, graph)
    job_shape = JobShape(graph, 2, 4, job.spec.data.batch_size, optimizer, **shape)
    pool = [Candidate(f"peer{i}", False, d) for i, d in enumerate(swarm.devices[:2])]
    link = swarm.default_link
    return plan_placement(job_shape, pool, links={("peer0", "peer1"): link, ("peer1", "peer0"): link})
