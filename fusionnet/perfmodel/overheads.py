"""Measuring a device's fixed costs (``types.Overheads``) with short torch micro-benchmarks.

Eq. (1) prices FLOPs and bytes; on small ops the time goes elsewhere: Python and dispatcher work per
op, autograd bookkeeping, kernel launches, one module call and one ``autograd.backward`` per sub-DAG
and micro-batch, one ``optimizer.step()`` per step and a few kernels per parameter tensor in it.
This module measures those on the local machine the way the executor runs sub-DAGs:

- per op class (view, matmul, conv, other), a ``torch.fx.GraphModule`` chain of 1 and ``K`` ops on
  a tiny input gives the fixed forward cost per op (slope) and per call (intercept); the same chain's
  ``autograd.backward`` gives the backward ones. A medium-sized input then gives the class's
  efficiency: its roofline time (FLOPs at S(p), bytes at the memory bandwidth, counted by the same
  rules the tracer uses, ``fusionnet.dag.costs``) over the measured time beyond the fixed cost;
- per optimizer (SGD, SGD with momentum, Adam, AdamW), ``step()`` over 1 and ``K`` small tensors
  gives the fixed cost per tensor and per call.

Every figure is the best of a few batches of calls: other processes only ever make a run slower, so
the minimum is what the machine can do, and the number that is stable from run to run. Results are
cached as JSON next to ``profile.py``'s, keyed by the same machine description.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusionnet.perfmodel.profile import _default_cache_dir, machine_key
from fusionnet.perfmodel.timing import bp_bytes, fp_bytes
from fusionnet.perfmodel.types import ClassCost, OpCost, Overheads

CHAIN = 6  # ops in the long chain (the short one has 1)
CACHE_VERSION = 1
TIMED_OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
_EFFICIENCY_RANGE = (0.02, 20.0)


class _Bench:
    """Round-robin timing of many small measurements: every round times a few calls of each, and each
    keeps its best round. A co-tenant that slows the machine for a second then costs every
    measurement one round, instead of ruining the few measurements that happened to run then."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], int]] = {}
        self.best: dict[str, float] = {}

    def add(self, name: str, setup: Callable[[], Any], timed: Callable[[Any], Any], calls: int) -> None:
        self.items[name] = (setup, timed, calls)
        for _ in range(2):  # warm-up: allocations, lazy initialisation (optimizer state), caches
            timed(setup())

    def run(self, seconds: float, min_rounds: int = 4, max_rounds: int = 60) -> dict[str, float]:
        deadline = time.perf_counter() + seconds
        rounds = 0
        while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() < deadline):
            for name, (setup, timed, calls) in self.items.items():
                total = 0.0
                for _ in range(calls):
                    state = setup()
                    t0 = time.perf_counter()
                    timed(state)
                    total += time.perf_counter() - t0
                self.best[name] = min(self.best.get(name, float("inf")), total / calls)
            rounds += 1
        return self.best


def _chain_ops(op_class: str, cols: int) -> list[tuple[Any, tuple[Any, ...], bool]]:
    """The ops a chain cycles through: (target, constant args after the input, has weight+bias)."""
    import torch
    import torch.nn.functional as F

    if op_class == "view":
        return [("method:transpose", (0, 1), False)]
    if op_class == "matmul":
        return [(F.linear, (), True)]
    if op_class == "conv":
        return [(F.conv2d, (1, 1), True)]  # stride 1, padding 1: the shape is kept
    return [
        ("method:mul", (0.5,), False),
        (F.softmax, (-1,), False),
        (torch.relu, (), False),
        (F.layer_norm, ((cols,),), False),
    ]


# op class -> (tiny input shape, medium input shape); weights keep the shape (square / same channels)
_SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "view": ((16, 16), (16, 16)),
    "matmul": ((16, 16), (128, 256)),
    "conv": ((2, 3, 8, 8), (8, 16, 16, 16)),
    "other": ((16, 16), (128, 512)),
}


class _Chain:
    """A GraphModule of ``k`` ops of one class on an input that is a leaf needing a gradient, as the
    activations a sub-DAG receives are in the executor; plus the ops' costs by the tracer's rules."""

    def __init__(self, op_class: str, k: int, shape: tuple[int, ...]) -> None:
        import torch
        import torch.fx as fx
        from torch import nn

        from fusionnet.dag.costs import op_cost

        gen = torch.Generator().manual_seed(k)
        root = nn.Module()
        graph = fx.Graph()
        node = graph.placeholder("x")
        value = torch.randn(shape, generator=gen)
        self.x = value
        self.ops: list[OpCost] = []
        cycle = _chain_ops(op_class, shape[-1])
        for i in range(k):
            target, extra, weighted = cycle[i % len(cycle)]
            params: list[Any] = []
            if weighted:
                channels = shape[1] if op_class == "conv" else shape[-1]
                w_shape = (channels, channels, 3, 3) if op_class == "conv" else (channels, channels)
                for name, t in (
                    (f"w{i}", torch.randn(w_shape, generator=gen) * 0.1),
                    (f"b{i}", torch.zeros(channels)),
                ):
                    root.register_parameter(name, nn.Parameter(t))
                    params.append((name, getattr(root, name)))
            args_nodes = (node, *(graph.get_attr(n) for n, _ in params), *extra)
            args_values = (value, *(p for _, p in params), *extra)
            if isinstance(target, str):
                node = graph.call_method(target.split(":", 1)[1], args_nodes)
                out = getattr(value, target.split(":", 1)[1])(*extra)
            else:
                node = graph.call_function(target, args_nodes)
                with torch.no_grad():
                    out = target(*args_values)
            c = op_cost(
                target, args_values, {}, out, param_bytes=sum(p.numel() * p.element_size() for _, p in params)
            )
            self.ops.append(
                OpCost(
                    f"{op_class}{i}",
                    "parametric" if params else "non_parametric",
                    c.flops_fwd,
                    c.flops_bwd,
                    c.bytes_read,
                    c.bytes_written,
                    c.param_bytes,
                    c.activation_bytes,
                )
            )
            value = out.detach()
        graph.output((node,))
        self.module = fx.GraphModule(root, graph)
        self.seed = torch.ones_like(value)

    def register(self, bench: _Bench, name: str, calls: int) -> None:
        """Adds this chain's forward (``name/fp``) and backward (``name/bp``) to ``bench``."""
        import torch

        x = self.x.clone().requires_grad_(True)

        def forward(_: Any) -> Any:
            with torch.enable_grad():
                return self.module(x)

        def graph() -> Any:
            leaf = self.x.clone().requires_grad_(True)
            with torch.enable_grad():
                return self.module(leaf)[0]

        bench.add(f"{name}/fp", lambda: None, forward, calls)
        bench.add(f"{name}/bp", graph, lambda y: torch.autograd.backward([y], [self.seed]), calls)


def _roofline(ops: list[OpCost], speed: float, bandwidth: float) -> tuple[float, float]:
    """Eq. (1) forward and backward seconds of ``ops`` without any overhead."""
    fp = sum(op.flops_fwd / speed + fp_bytes(op) / bandwidth for op in ops)
    bp = sum(op.flops_bwd / speed + bp_bytes(op) / bandwidth for op in ops)
    return fp, bp


def _register_optimizers(bench: _Bench) -> None:
    import torch

    settings = {
        "sgd": ("SGD", {}),
        "sgd_momentum": ("SGD", {"momentum": 0.9}),
        "adam": ("Adam", {}),
        "adamw": ("AdamW", {}),
    }
    for name in TIMED_OPTIMIZERS:
        cls_name, kwargs = settings[name]
        for n in (1, CHAIN):
            params = [torch.nn.Parameter(torch.zeros(64)) for _ in range(n)]
            grads = [torch.full_like(p, 1e-3) for p in params]
            opt = getattr(torch.optim, cls_name)(params, lr=1e-3, foreach=False, **kwargs)

            def setup(params: list[Any] = params, grads: list[Any] = grads) -> None:
                for p, g in zip(params, grads):
                    p.grad = g

            def step(_: Any, opt: Any = opt, params: list[Any] = params) -> None:
                opt.step()  # as the executor's Update: step, then drop the gradients
                for p in params:
                    p.grad = None

            bench.add(f"{name}/{n}", setup, step, 4)


def measure_overheads(speed: float, mem_bandwidth: float, seconds_budget: float = 2.0) -> Overheads:
    """Times the micro-benchmarks (module docstring); ``speed`` is S(p) and ``mem_bandwidth`` the
    bandwidth that efficiencies are relative to (the device's, from ``profile_local_device``)."""
    from fusionnet.perfmodel.optimizers import optimizer_profile

    if not (speed > 0 and mem_bandwidth > 0):
        raise ValueError("speed and mem_bandwidth must be positive")
    bench = _Bench()
    chains: dict[tuple[str, str], _Chain] = {}
    for op_class, (tiny, medium) in _SHAPES.items():
        sizes = [("k", CHAIN, tiny)]
        if op_class == "view":  # views cost next to nothing: the 1-op chain is the bare call
            sizes.append(("1", 1, tiny))
        if medium != tiny:
            sizes.append(("m", CHAIN, medium))
        for tag, k, shape in sizes:
            chain = chains[(op_class, tag)] = _Chain(op_class, k, shape)
            chain.register(bench, f"{op_class}/{tag}", 2 if tag == "m" else 4)
    _register_optimizers(bench)
    t = bench.run(seconds_budget)

    phases = ("fp", "bp")
    # Per call: the 1-view chain minus one view (a view's own cost from the slope to the 6-view chain).
    view_op = [max(0.0, (t[f"view/k/{ph}"] - t[f"view/1/{ph}"]) / (CHAIN - 1)) for ph in phases]
    call = [max(0.0, t[f"view/1/{ph}"] - view_op[i]) for i, ph in enumerate(phases)]
    classes: dict[str, ClassCost] = {"view": ClassCost(fp=view_op[0], bp=view_op[1])}
    for op_class in _SHAPES:
        if op_class == "view":
            continue
        # t - call = CHAIN * fixed + roofline / efficiency, on the tiny and on the medium input
        spent_k = [t[f"{op_class}/k/{ph}"] - call[i] for i, ph in enumerate(phases)]
        spent_m = [t[f"{op_class}/m/{ph}"] - call[i] for i, ph in enumerate(phases)]
        rk = _roofline(chains[(op_class, "k")].ops, speed, mem_bandwidth)
        rm = _roofline(chains[(op_class, "m")].ops, speed, mem_bandwidth)
        grow = sum(spent_m) - sum(spent_k)
        efficiency = (sum(rm) - sum(rk)) / grow if grow > 0 else _EFFICIENCY_RANGE[1]
        efficiency = min(max(efficiency, _EFFICIENCY_RANGE[0]), _EFFICIENCY_RANGE[1])
        fixed = [max(0.0, (spent_k[i] - rk[i] / efficiency) / CHAIN) for i in range(2)]
        classes[op_class] = ClassCost(fp=fixed[0], bp=fixed[1], efficiency=efficiency)

    per_tensor: dict[str, float] = {}
    step_calls, per_kernel = [], []
    for name in TIMED_OPTIMIZERS:
        one, many = t[f"{name}/1"], t[f"{name}/{CHAIN}"]
        slope = max(0.0, (many - one) / (CHAIN - 1))
        per_tensor[name] = slope
        step_calls.append(max(0.0, one - slope))
        per_kernel.append(slope / optimizer_profile(name).kernels)
    return Overheads(
        **classes,
        stage_fp=call[0],
        stage_bp=call[1],
        stage_update=statistics.median(step_calls),
        update_tensor=tuple(per_tensor.items()),
        update_kernel=statistics.median(per_kernel),
    )


def profile_overheads(
    speed: float,
    mem_bandwidth: float,
    seconds_budget: float = 2.0,
    cache_dir: str | Path | None = None,
    *,
    refresh: bool = False,
) -> Overheads:
    """``measure_overheads``, cached per machine (and per speed / bandwidth they are relative to)."""
    import torch

    key: dict[str, Any] = {
        **machine_key(torch.get_num_threads(), torch.__version__),
        "what": "overheads",
        "overheads_version": CACHE_VERSION,
        "speed": round(float(speed), 3),
        "mem_bandwidth": round(float(mem_bandwidth), 3),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = folder / f"overheads-{digest}.json"
    if not refresh and path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get("key") == key:
                return Overheads.from_dict(doc["result"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable cache: measure again and overwrite it
    result = measure_overheads(speed, mem_bandwidth, seconds_budget)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "result": result.to_dict()}, indent=2))
    tmp.replace(path)
    return result
