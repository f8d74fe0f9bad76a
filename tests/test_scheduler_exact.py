"""The exact solver against brute force over every assignment, and its limits."""

from __future__ import annotations

import itertools
import random

import pytest

from fusionnet.errors import PartitionError, PlanError
from fusionnet.perfmodel.placement_cost import evaluate_assignment
from fusionnet.perfmodel.synthetic import random_chain, random_dag, random_swarm, random_workload
from fusionnet.planning.scheduler_exact import exact_schedule


def brute_force(graph, swarm, workload, objective, max_devices=None):
    best = float("inf")
    n = len(swarm.devices)
    for assign in itertools.product(range(n), repeat=len(graph.ops)):
        if max_devices is not None and len(set(assign)) > max_devices:
            continue
        try:
            cost = evaluate_assignment(graph, swarm, workload, list(assign))
        except PartitionError:
            continue
        if cost.memory_violation(swarm) is None:
            best = min(best, cost.objective(objective))
    return best


@pytest.mark.timeout(120)
@pytest.mark.parametrize("objective", ["step_time", "makespan"])
def test_branch_and_bound_matches_brute_force(objective):
    rng = random.Random(21)
    checked = 0
    for k in range(10):
        graph = random_chain(rng, rng.randint(3, 5)) if k % 2 else random_dag(rng, rng.randint(4, 5))
        swarm = random_swarm(rng, 3, per_pair_links=k % 3 == 0)
        workload = random_workload(rng)
        truth = brute_force(graph, swarm, workload, objective)
        if truth == float("inf"):
            with pytest.raises(PlanError):
                exact_schedule(graph, swarm, workload, objective=objective)
            continue
        plan = exact_schedule(graph, swarm, workload, objective=objective)
        got = plan.predicted_step_seconds if objective == "step_time" else plan.makespan_seconds
        assert got == pytest.approx(truth, rel=1e-12)
        checked += 1
    assert checked >= 6


def test_max_devices_and_search_limit():
    rng = random.Random(3)
    graph, swarm, workload = random_chain(rng, 5), random_swarm(rng, 3, with_cpu=False), random_workload(rng)
    plan = exact_schedule(graph, swarm, workload, objective="makespan", max_devices=1)
    assert len(plan.devices_used) == 1
    assert plan.makespan_seconds == pytest.approx(
        brute_force(graph, swarm, workload, "makespan", max_devices=1)
    )
    with pytest.raises(PlanError, match="exceeded 5 nodes"):
        exact_schedule(graph, swarm, workload, max_nodes=5)
    with pytest.raises(PlanError, match="objective"):
        exact_schedule(graph, swarm, workload, objective="vibes")
