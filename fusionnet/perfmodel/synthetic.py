"""Seeded random instances for the scheduler's tests and quality benchmark.

Small graphs (chains and branched DAGs with skip edges, data placeholders, parameter-free ops) and
heterogeneous swarms (speeds, memories, CPU and GPU devices) whose sizes make memory constraints
bind now and then. Everything comes from a ``random.Random`` the caller seeds.
"""

from __future__ import annotations

import random

from fusionnet.perfmodel.types import CostGraph, DeviceSpec, Link, OpCost, Swarm, Workload

MiB = 1 << 20
GiB = 1 << 30


def _op(rng: random.Random, name: str, kind: str, optimizer: str) -> OpCost:
    if kind == "placeholder":
        return OpCost(name, kind, 0, 0, 0, rng.randint(1, 8) * MiB, 0, rng.randint(1, 8) * MiB)
    params = rng.randint(1, 64) * MiB if kind == "parametric" else 0
    fwd = rng.randint(1, 200) * 10**9
    act = rng.randint(1, 64) * MiB
    return OpCost(
        name,
        kind,
        fwd,
        fwd * rng.choice([1, 2, 2, 3]),
        act + params,
        act,
        params,
        act,
        optimizer if params else None,
    )


def random_chain(rng: random.Random, n: int, optimizer: str = "adam") -> CostGraph:
    """A path of ``n`` ops: a placeholder, then parametric and parameter-free ops."""
    ops = [_op(rng, "x", "placeholder", optimizer)]
    for i in range(1, n):
        kind = "loss" if i == n - 1 else rng.choice(["parametric", "parametric", "non_parametric"])
        ops.append(_op(rng, f"op{i}", kind, optimizer))
    edges = tuple((ops[i].name, ops[i + 1].name, ops[i].activation_bytes) for i in range(n - 1))
    return CostGraph(tuple(ops), edges)


def random_dag(rng: random.Random, n: int, optimizer: str = "adam") -> CostGraph:
    """A connected DAG of ``n`` >= 4 ops: every op reads a recent op, some also an older one (skip
    edges, branches); a label placeholder feeds the final loss."""
    if n < 4:
        raise ValueError(f"a random DAG needs at least 4 ops, got {n}")
    ops = [_op(rng, "x", "placeholder", optimizer)]
    edges: list[tuple[str, str, int]] = []
    for i in range(1, n - 2):
        kind = rng.choice(["parametric", "parametric", "non_parametric"])
        ops.append(_op(rng, f"op{i}", kind, optimizer))
        preds = {rng.randint(max(0, i - 2), i - 1)}
        if i >= 2 and rng.random() < 0.5:
            preds.add(rng.randint(0, i - 1))
        edges.extend((ops[p].name, ops[i].name, ops[p].activation_bytes) for p in sorted(preds))
    # the label placeholder goes right before the loss
    ops.append(_op(rng, "labels", "placeholder", optimizer))
    ops.append(_op(rng, "loss", "loss", optimizer))
    last = len(ops) - 1
    sinks = [i for i in range(1, last - 1) if not any(e[0] == ops[i].name for e in edges)]
    for p in sorted(set(sinks) | {last - 2}):
        edges.append((ops[p].name, "loss", ops[p].activation_bytes))
    edges.append(("labels", "loss", ops[last - 1].activation_bytes))
    return CostGraph(tuple(ops), tuple(edges))


def random_swarm(rng: random.Random, k: int, *, with_cpu: bool = True, per_pair_links: bool = False) -> Swarm:
    """``k`` devices with varied speeds and memories; one alpha-beta link for all pairs unless
    ``per_pair_links``."""
    devices = []
    for i in range(k):
        if with_cpu and rng.random() < 0.2:
            devices.append(
                DeviceSpec(
                    name=f"cpu{i}",
                    kind="cpu",
                    peak_flops=rng.choice([0.5e12, 1e12, 2e12]),
                    speed_factor=rng.choice([0.5, 0.8]),
                    mem_bandwidth=rng.choice([50e9, 100e9]),
                    d_gpu=0,
                    d_cpu=rng.choice([1, 2, 4]) * GiB,
                    d_disk=64 * GiB,
                )
            )
        else:
            devices.append(
                DeviceSpec(
                    name=f"gpu{i}",
                    kind="gpu",
                    peak_flops=rng.choice([10e12, 20e12, 30e12, 60e12]),
                    speed_factor=rng.choice([0.6, 0.8, 1.0]),
                    mem_bandwidth=rng.choice([400e9, 800e9]),
                    d_gpu=rng.choice([256 * MiB, 512 * MiB, 1 * GiB, 2 * GiB]),
                    d_cpu=4 * GiB,
                    d_disk=64 * GiB,
                )
            )
    default = Link.from_bandwidth(rng.choice([1e-4, 1e-3, 1e-2]), rng.choice([1e8, 1e9, 1e10]))
    links = {}
    if per_pair_links:
        for i in range(k):
            for j in range(i + 1, k):
                if rng.random() < 0.5:
                    links[(i, j)] = Link.from_bandwidth(
                        rng.choice([1e-4, 1e-3]), rng.choice([1e8, 1e9, 1e10])
                    )
    return Swarm(tuple(devices), links, default)


def random_workload(rng: random.Random) -> Workload:
    return Workload(
        rng.randint(1, 6), rng.choice(["train", "train", "grad", "infer"]), rng.choice(["gpipe", "1f1b"])
    )
