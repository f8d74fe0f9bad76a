"""The planner's figures agree with each other and with what runs: a device's interleaved chunks share its
GPU, a link given one way prices both, ``auto``'s plan is priced with the schedule it picks, the exact
chain DP counts zero-bubble's micro-batches in flight as the memory model does, and eq. (3)/(4) refuse
times that are not finite. Pure functions of data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fusionnet.errors import PlanError
from fusionnet.job.loader import load_job
from fusionnet.perfmodel.generation_rate import generation_rate
from fusionnet.perfmodel.memory import inflight_microbatches
from fusionnet.perfmodel.timing import latency_eq3, pipelined_eq4
from fusionnet.perfmodel.types import CostGraph, DeviceSpec, Link, OpCost, Swarm, Workload
from fusionnet.planning.planner import plan_interleaved
from fusionnet.planning.scheduler import chain_dp
from fusionnet.runtime.planjob import plan_job
from fusionnet.runtime.prepare import trace_job

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30


def _gpu(name: str, d_gpu: int, flops: float = 1e12, disk: int = 1024 * GiB) -> DeviceSpec:
    return DeviceSpec(
        name=name, kind="gpu", peak_flops=flops, mem_bandwidth=1e11, d_gpu=d_gpu, d_cpu=GiB, d_disk=disk
    )


def test_a_devices_interleaved_chunks_must_fit_its_gpu_together_whatever_its_disk() -> None:
    graph = trace_job(load_job(REPO / "examples" / "figure3" / "job.yaml")).graph
    roomy = plan_interleaved(graph, [_gpu("a", GiB), _gpu("b", GiB)], 2, microbatches=2)
    need = {s.device: s.demand.gpu for s in roomy.plan.stages}
    each = max(need.values())  # every chunk fits alone, no device's two chunks together
    assert all(need[d] + need[d + 2] > each for d in (0, 1))
    with pytest.raises(PlanError, match=r"the 2 chunks of device 0 \(.a.\) together: needs .* of d_gpu"):
        plan_interleaved(graph, [_gpu("a", each), _gpu("b", each)], 2, microbatches=2)
    together = max(need[d] + need[d + 2] for d in (0, 1))
    plan_interleaved(graph, [_gpu("a", together), _gpu("b", together)], 2, microbatches=2)


def _figure3_job(folder: Path, links: str) -> tuple[Path, Path]:
    example = REPO / "examples" / "figure3"
    for name in ("model.py", "data.safetensors"):
        (folder / name).write_bytes((example / name).read_bytes())
    job = (example / "job.yaml").read_text()
    job = job.replace("compnodes: 3", "compnodes: 2")
    if "schedule:" not in job:
        job = job.replace("compnodes: 2", "compnodes: 2\n  schedule: auto")
    (folder / "job.yaml").write_text(job)
    (folder / "nodes.yaml").write_text(
        "nodes:\n"
        "  - {name: a, kind: cpu, peak_flops: 0.001G, mem_bandwidth: 1GB/s, d_cpu: 16GiB}\n"
        "  - {name: b, kind: cpu, peak_flops: 0.001G, mem_bandwidth: 1GB/s, d_cpu: 16GiB}\n"
        "network:\n  latency: 500ms\n  bandwidth: 1Mbps\n  links:\n" + links
    )
    return folder / "job.yaml", folder / "nodes.yaml"


def test_a_link_listed_one_way_prices_both_ways_and_autos_plan_is_the_schedule_that_runs(
    tmp_path: Path,
) -> None:
    fast = "      latency: 1us\n      bandwidth: 10Gbps\n"
    documents = {}
    for case, links in (
        ("ba", "    - between: [b, a]\n" + fast),
        ("ab", "    - between: [a, b]\n" + fast),
        ("both", "    - between: [a, b]\n" + fast + "    - between: [b, a]\n" + fast),
    ):
        (tmp_path / case).mkdir()
        job, nodes = _figure3_job(tmp_path / case, links)
        documents[case] = plan_job(job, nodes_file=nodes).document
    want = documents["both"]
    for case in ("ba", "ab"):
        assert documents[case]["schedule"] == want["schedule"], case
        assert documents[case]["predicted_step_seconds"] == pytest.approx(want["predicted_step_seconds"])
    ran = want["schedule"]["name"]
    plan = want["plan"]
    assert plan["workload"]["schedule"] == ran
    assert plan["predicted_step_seconds"] == pytest.approx(want["predicted_step_seconds"])
    workload = Workload(plan["workload"]["microbatches"], plan["workload"]["task"], ran)
    stages = plan["stages"]
    for i, stage in enumerate(stages):
        assert stage["memory"]["inflight"] == inflight_microbatches(workload, i, len(stages))


def _chain(flops: list[int], acts: list[int]) -> CostGraph:
    ops = [
        OpCost(f"o{i}", "non_parametric", f, 2 * f, a, a, 0, a, None)
        for i, (f, a) in enumerate(zip(flops, acts))
    ]
    edges = tuple((ops[i].name, ops[i + 1].name, ops[i].activation_bytes) for i in range(len(ops) - 1))
    return CostGraph(tuple(ops), edges)


def test_the_exact_chain_dp_counts_zero_bubbles_micro_batches_as_the_memory_model_does() -> None:
    """Charged all m in flight, a fast device with room for p of them was refused: the DP put the whole
    chain on a device ten times slower."""
    graph = _chain([20 * 10**9] * 3, [100 * MiB] * 3)
    fast = _gpu("fast", 700 * MiB, flops=20e12, disk=64 * GiB)
    slow = _gpu("slow", 4 * GiB, flops=2e12, disk=64 * GiB)
    swarm = Swarm((fast, slow), {}, Link(1e-4, 1e-10))
    plan = chain_dp(graph, swarm, Workload(8, "grad", "zero-bubble"))
    assert [plan.assignment[o.name] for o in graph.ops] == [0, 0, 0]


def test_eq3_and_eq4_refuse_times_that_are_not_finite() -> None:
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(PlanError, match="finite and non-negative"):
            pipelined_eq4([bad], [0.0], 3)
        with pytest.raises(PlanError, match="finite and non-negative"):
            latency_eq3([1.0], [bad])
    with pytest.raises(PlanError, match="finite"):
        generation_rate([math.nan, 1.0], [0.0, 0.1], mb_rows=1, sessions=4, max_batch=2, in_flight=2)
    assert pipelined_eq4([1.0, 2.0], [0.5, 0.5], 3) == pytest.approx(4.0 + 2 * 2.0)
