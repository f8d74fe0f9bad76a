"""Measuring a device's fixed costs (``types.Overheads``) with short torch micro-benchmarks.

Eq. (1) prices FLOPs and bytes; on small ops the time goes elsewhere: Python and dispatcher work per
op, autograd bookkeeping, kernel launches, one module call and one ``autograd.backward`` per sub-DAG
and micro-batch, one ``optimizer.step()`` per step and a few kernels per parameter tensor in it.
This module measures those on the local machine the way the executor runs sub-DAGs:

- per op class (``types.OP_CLASSES``), a ``torch.fx.GraphModule`` of ``FAN`` ops of the class on an
  input that is a leaf needing a gradient (as received activations are in the executor): a chain,
  or for ops whose output cannot feed the next (losses, embeddings, cat) one op per input. Its
  forward call and its ``autograd.backward``, minus the bare call (a module of one view, less that
  view), give the class's fixed costs per op. The same
  module on a medium-sized input gives the class's efficiency: its roofline time (FLOPs at S(p),
  bytes at the memory bandwidth, counted by the tracer's own rules, ``fusionnet.dag.costs``) over
  the measured time beyond the fixed costs (a max-pool reaches 1% of it, a matmul most of it);
- matmul and conv also without an input gradient (a first layer's backward skips a kernel);
- per optimizer (SGD, SGD with momentum, Adam, AdamW), ``step()`` over 1 and ``FAN`` small tensors
  gives the fixed cost per tensor and per call.

Every figure is the best of many rounds that time a few calls of every measurement in turn (and
stir the caches between calls, as other sub-DAGs' work does in the executor): other processes only
ever slow a run down, so the best round is what the machine can do, and the figure that is stable
from run to run. Results are cached as JSON next to ``hardware.py``'s, keyed by the same machine
description.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusionnet.dag.costs import op_cost
from fusionnet.perfmodel.optimizers import optimizer_profile
from fusionnet.perfmodel.timing import roofline_seconds
from fusionnet.perfmodel.types import OP_CLASSES, ClassCost, OpCost, Overheads
from fusionnet.profiling.hardware import cached_measurement, machine_key

FAN = 6  # ops per measured module
CACHE_VERSION = 3
TIMED_OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
_EFFICIENCY_RANGE = (0.02, 20.0)
_SCRATCH: list[Any] = []


def _disturb() -> None:
    """What runs between two sub-DAG calls in the executor (other sub-DAGs, the channel, asyncio):
    enough data and code to push the timed call's out of the caches, so calls are not timed hot."""
    import torch

    if not _SCRATCH:
        _SCRATCH.append(torch.zeros(1 << 19))  # 2 MiB: more than a core's L2
        _SCRATCH.append({i: str(i) for i in range(2000)})
    _SCRATCH[0].add_(1.0)
    sum(len(v) for v in _SCRATCH[1].values())


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
                    _disturb()
                    state = setup()
                    t0 = time.perf_counter()
                    timed(state)
                    total += time.perf_counter() - t0
                self.best[name] = min(self.best.get(name, float("inf")), total / calls)
            rounds += 1
        return self.best


# op class -> (tiny input shape, medium input shape or None): the medium one measures efficiency
_SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]] = {
    "view": ((16, 16), None),
    "elementwise": ((16, 16), (128, 512)),
    "norm": ((16, 16), (128, 512)),
    "pool": ((2, 3, 8, 8), (8, 8, 16, 16)),
    "loss": ((16, 8), (256, 256)),
    "gather": ((4, 8), (64, 128)),
    "copy": ((16, 16), (128, 512)),
    "matmul": ((16, 16), (128, 256)),
    "conv": ((2, 3, 8, 8), (8, 16, 16, 16)),
}


def _op(op_class: str, i: int, shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...], list[Any]]:
    """Op ``i`` of a class's module: (target, arguments after the input, parameter shapes)."""
    import torch
    import torch.nn.functional as F

    cols = shape[-1]
    if op_class == "view":
        return "method:transpose", (0, 1), []
    if op_class == "elementwise":
        return [(torch.relu, (), []), ("method:mul", (0.5,), []), (torch.tanh, (), [])][i % 3]
    if op_class == "norm":
        return [(F.layer_norm, ((cols,),), []), (F.softmax, (-1,), [])][i % 2]
    if op_class == "pool":
        return F.max_pool2d, (3, 1, 1), []
    if op_class == "loss":
        return F.cross_entropy, ("labels",), []
    if op_class == "gather":
        return F.embedding, (), [(32, 16)]  # the input holds indices: embedding(input, weight)
    if op_class == "copy":
        return torch.cat, (), []  # cat((x, x)): handled by the builder
    if op_class == "matmul":
        return F.linear, (), [(cols, cols), (cols,)]
    if op_class == "conv":
        return F.conv2d, (1, 1), [(shape[1], shape[1], 3, 3), (shape[1],)]
    raise ValueError(f"no micro-benchmark for op class {op_class!r}")


_FANNED = ("loss", "gather", "copy")  # ops whose output cannot feed the next one of the class


class _Ops:
    """A GraphModule of ``k`` ops of one class, plus the ops' costs by the tracer's rules.

    Shape-keeping classes form a chain (each op reads the previous one's output, as in a real
    sub-DAG; only the first input is a leaf). The others (a loss, an embedding, a cat) fan out: each
    op reads its own input and every result is returned."""

    def __init__(self, op_class: str, k: int, shape: tuple[int, ...], input_grad: bool = True) -> None:
        import torch
        import torch.fx as fx
        from torch import nn

        gen = torch.Generator().manual_seed(k)
        fan = op_class in _FANNED
        root = nn.Module()
        graph = fx.Graph()
        make = (lambda: torch.randint(0, 32, shape, generator=gen)) if op_class == "gather" else None
        self.xs = [make() if make else torch.randn(shape, generator=gen) for _ in range(k if fan else 1)]
        self.input_grad = input_grad and op_class != "gather"
        labels = torch.randint(0, shape[-1], shape[:1], generator=gen)
        root.register_buffer("labels", labels)
        nodes = [graph.placeholder(f"x{i}") for i in range(len(self.xs))]
        outs, self.ops = [], []
        node, value = nodes[0], self.xs[0]
        for i in range(k):
            if fan:
                node, value = nodes[i], self.xs[i]
            target, extra, param_shapes = _op(op_class, i, shape)
            params = []
            for j, ps in enumerate(param_shapes):
                root.register_parameter(f"p{i}_{j}", nn.Parameter(torch.randn(ps, generator=gen) * 0.1))
                params.append(getattr(root, f"p{i}_{j}"))
            consts = tuple(labels if a == "labels" else a for a in extra)
            nodes_extra = tuple(graph.get_attr("labels") if a == "labels" else a for a in extra)
            if target is torch.cat:
                values: tuple[Any, ...] = ((value, value),)
                args: tuple[Any, ...] = ((node, node),)
            else:
                values = (value, *params, *consts)
                args = (node, *(graph.get_attr(f"p{i}_{j}") for j in range(len(params))), *nodes_extra)
            if isinstance(target, str):
                node = graph.call_method(target.split(":", 1)[1], args)
                out = getattr(value, target.split(":", 1)[1])(*consts)
            else:
                node = graph.call_function(target, args)
                with torch.no_grad():
                    out = target(*values)
            outs.append(node)
            param_bytes = sum(p.numel() * p.element_size() for p in params)
            c = op_cost(target, values, {}, out, param_bytes=param_bytes)
            self.ops.append(
                OpCost(
                    f"{op_class}{i}",
                    "parametric" if params else "non_parametric",
                    *(c.flops_fwd, c.flops_bwd, c.bytes_read, c.bytes_written, c.param_bytes, 0),
                )
            )
            value = out.detach()
        graph.output(tuple(outs) if fan else (node,))
        self.module = fx.GraphModule(root, graph)

    def register(self, bench: _Bench, name: str, calls: int) -> None:
        """Adds this module's forward (``name/fp``) and backward (``name/bp``) to ``bench``."""
        import torch

        def leaves() -> list[Any]:
            return [x.clone().requires_grad_(self.input_grad) for x in self.xs]

        def forward(inputs: list[Any]) -> Any:
            with torch.enable_grad():
                return self.module(*inputs)

        def graph() -> tuple[list[Any], list[Any]]:
            outs = list(forward(leaves()))
            return outs, [torch.ones_like(o) for o in outs]

        bench.add(f"{name}/fp", leaves, forward, calls)
        bench.add(f"{name}/bp", graph, lambda og: torch.autograd.backward(og[0], og[1]), calls)


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
        for n in (1, FAN):
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
    if not (speed > 0 and mem_bandwidth > 0):
        raise ValueError("speed and mem_bandwidth must be positive")
    bench = _Bench()
    fans: dict[tuple[str, str], _Ops] = {}
    for op_class, (tiny, medium) in _SHAPES.items():
        sizes: list[tuple[str, int, tuple[int, ...], bool]] = [("k", FAN, tiny, True)]
        if op_class == "view":  # views cost next to nothing: one view is the bare call
            sizes.append(("1", 1, tiny, True))
        if medium is not None:
            sizes.append(("m", FAN, medium, True))
        if op_class in ("matmul", "conv"):  # as a first layer: the data input needs no gradient
            sizes.append(("n", FAN, tiny, False))
        for tag, k, shape, grad in sizes:
            fans[(op_class, tag)] = fan = _Ops(op_class, k, shape, input_grad=grad)
            fan.register(bench, f"{op_class}/{tag}", 2 if tag == "m" else 4)
    _register_optimizers(bench)
    t = bench.run(seconds_budget)
    _SCRATCH.clear()

    phases = ("fp", "bp")
    # The bare call: the 1-view module minus its view (a view's cost from the slope to FAN views).
    view_op = [max(0.0, (t[f"view/k/{ph}"] - t[f"view/1/{ph}"]) / (FAN - 1)) for ph in phases]
    call = [max(0.0, t[f"view/1/{ph}"] - view_op[i]) for i, ph in enumerate(phases)]
    classes: dict[str, ClassCost] = {"view": ClassCost(fp=view_op[0], bp=view_op[1])}
    efficiency: dict[str, float] = {}
    for op_class in (c for c, (_tiny, medium) in _SHAPES.items() if medium is not None):
        # t - call = FAN * fixed + roofline / efficiency, on the tiny and on the medium input
        grow = sum(t[f"{op_class}/m/{ph}"] - t[f"{op_class}/k/{ph}"] for ph in phases)
        rk = roofline_seconds(fans[(op_class, "k")].ops, speed, mem_bandwidth)
        rm = roofline_seconds(fans[(op_class, "m")].ops, speed, mem_bandwidth)
        eff = (sum(rm) - sum(rk)) / grow if grow > 0 else _EFFICIENCY_RANGE[1]
        efficiency[op_class] = min(max(eff, _EFFICIENCY_RANGE[0]), _EFFICIENCY_RANGE[1])
    for op_class in _SHAPES:
        if op_class == "view":
            continue
        eff = efficiency[op_class]
        rk = roofline_seconds(fans[(op_class, "k")].ops, speed, mem_bandwidth)
        fixed = [
            max(0.0, (t[f"{op_class}/k/{ph}"] - call[i] - rk[i] / eff) / FAN) for i, ph in enumerate(phases)
        ]
        bp_input = 0.0
        if (op_class, "n") in fans:  # the module without an input gradient saves FAN of them
            bp_input = min(fixed[1], max(0.0, (t[f"{op_class}/k/bp"] - t[f"{op_class}/n/bp"]) / FAN))
        classes[op_class] = ClassCost(fp=fixed[0], bp=fixed[1], efficiency=eff, bp_input=bp_input)
    classes["other"] = classes["elementwise"]  # ops without a rule: priced like elementwise ones
    assert set(classes) == set(OP_CLASSES)

    per_tensor: dict[str, float] = {}
    step_calls, per_kernel = [], []
    for name in TIMED_OPTIMIZERS:
        one, many = t[f"{name}/1"], t[f"{name}/{FAN}"]
        slope = max(0.0, (many - one) / (FAN - 1))
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
    return cached_measurement(
        cache_dir,
        "overheads",
        key,
        lambda: measure_overheads(speed, mem_bandwidth, seconds_budget),
        Overheads.to_dict,
        Overheads.from_dict,
        refresh=refresh,
    )
