"""Planning a job with the performance model: IR graph -> cost graph -> scheduler -> sub-DAG assignment.

Pure functions of data except at the edges (``local_device_spec`` profiles this machine, ``plan_job``
loads and traces a job file):

- ``cost_graph`` turns an ``IRGraph`` into the performance model's ``CostGraph``. Only operators
  become ops; data placeholders and variables are folded into their first user, as in Table 3
  (labels are fed where the loss is computed; a variable lives with the op that first reads it), so
  the scheduler cannot separate a placeholder from its user and every plan maps back onto IR nodes.
- ``plan_graph`` runs the scheduler (``fusionnet.broker.scheduler.schedule``) over a list of devices,
  e.g. the ``DeviceSpec``s of the live compnodes (``CompnodeEntry.device_spec()``), and returns the
  IR assignment that ``build_partition`` accepts, which device runs each sub-DAG and the predicted
  seconds.
- ``predict_subdags`` predicts a given partition (``fusionnet run --local``: predicted next to
  measured in plan.json).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fusionnet.broker.scheduler import Plan, plan_for_assignment, schedule
from fusionnet.dag.costs import op_name
from fusionnet.dag.flop_rules import RULES
from fusionnet.dag.ir import IRGraph, IRNode
from fusionnet.dag.partition import Partition, build_partition
from fusionnet.dag.registry import REGISTRY
from fusionnet.errors import FusionNetError, PlanError
from fusionnet.perfmodel.memory import fmt_bytes
from fusionnet.perfmodel.types import CostGraph, DeviceSpec, Link, OpCost, Swarm, Workload

OPS = ("parametric", "non_parametric", "loss")  # IR kinds that become cost-graph ops
# flop_rules kind -> Overheads op class
_RULE_CLASS = {
    **dict.fromkeys(("linear", "matmul", "addmm", "sdpa"), "matmul"),
    "conv": "conv",
    **dict.fromkeys(("elementwise", "pow", "minmax", "dropout", "fill"), "elementwise"),
    **dict.fromkeys(("norm", "softmax", "reduction"), "norm"),
    "pool": "pool",
    **dict.fromkeys(("loss", "cross_entropy"), "loss"),
    "gather": "gather",
    **dict.fromkeys(("copy", "view"), "copy"),  # a "view" rule that wrote bytes had to copy
}
LOOPBACK = Link.from_bandwidth(100e-6, 1e9)  # local compnodes: loopback TCP, design.md's figures
IN_PROCESS = Link(alpha=0.0, beta=0.0)  # run --local: tensors are handed over in memory


@dataclass(frozen=True)
class PlannedJob:
    """The planner's answer for one IR graph."""

    assignment: dict[str, int]  # every IR node -> sub-DAG index 0..k-1 (build_partition's order)
    devices: list[int]  # devices[i]: index into the input device list of sub-DAG i
    predicted_seconds: dict[int, float]  # sub-DAG -> FP + BP + Update seconds per step
    predicted_step_seconds: float  # the schedule simulator's step time (pipelining, transfers)
    explanation: str  # the plan as text: per-stage times, memory, bottleneck
    plan: Plan  # the scheduler's plan (stage i of ``plan.stages`` is sub-DAG i)


def op_class(node: IRNode) -> str:
    """Which ``Overheads`` class (``perfmodel.types.OP_CLASSES``) prices ``node``: by its cost rule's
    kind; an op that neither computes nor writes anything is a view."""
    if not node.cost.get("flops_fwd") and not node.cost.get("bytes_written"):
        return "view"
    try:
        target = node.op if node.op.startswith("method:") else REGISTRY.resolve(node.op)
        rule = RULES.get(op_name(target))
    except FusionNetError:
        rule = None
    return _RULE_CLASS.get(rule.kind, "other") if rule is not None else "other"


def optimizer_profile_name(cls_name: str, kwargs: Mapping[str, Any]) -> str:
    """A torch.optim class and its kwargs -> the performance model's optimizer profile name."""
    name = cls_name.lower()
    if name == "sgd" and float(kwargs.get("momentum", 0) or 0) != 0:
        return "sgd_momentum"
    return name


def _owners(graph: IRGraph) -> dict[str, str]:
    """Placeholder / variable -> the operator it is folded into (its first user that is an op)."""
    ops = [n.name for n in graph.nodes if n.kind in OPS]
    owner: dict[str, str] = {}
    for n in graph.nodes:
        if n.kind in ("placeholder", "variable"):
            users = [u for u in n.users if graph.node(u).kind in OPS]
            owner[n.name] = users[0] if users else ops[0]
    return owner


def cost_graph(
    graph: IRGraph, optimizer: str | Mapping[str, str] | None = None, *, scale: float = 1.0
) -> CostGraph:
    """The IR as the performance model sees it (module docstring). ``optimizer`` is one profile name for
    every parameter or a map from parameter key to name; ``scale`` multiplies per-micro-batch FLOPs and
    bytes (planning for a micro-batch of another size than the traced one)."""
    ops = [n for n in graph.nodes if n.kind in OPS]
    if not ops:
        raise PlanError("the graph has no operators to place")
    owner = _owners(graph)
    folded: dict[str, list[IRNode]] = {}
    for name, op in owner.items():
        folded.setdefault(op, []).append(graph.node(name))

    def per_mb(value: Any) -> int:
        return round(int(value or 0) * scale)

    def opt_of(keys: list[str]) -> str | None:
        if optimizer is None or isinstance(optimizer, str):
            return optimizer
        return next((optimizer[k] for k in keys if k in optimizer), None)

    needs: dict[str, bool] = {}  # a gradient flows into the node's output
    for n in graph.nodes:
        needs[n.name] = n.kind == "variable" or bool(n.param_keys()) or any(needs[s] for s in n.input_names())
    costs = []
    for n in ops:
        extra = folded.get(n.name, [])
        keys = n.param_keys() + [k for v in extra if v.kind == "variable" for k in v.param_keys()]
        param_bytes = int(n.cost.get("param_bytes", 0)) + sum(
            int(v.cost.get("param_bytes", 0)) for v in extra if v.kind == "variable"
        )
        held = sum(int(v.cost.get("activation_bytes", 0)) for v in extra if v.kind == "placeholder")
        costs.append(
            OpCost(
                name=n.name,
                kind=n.kind,
                flops_fwd=per_mb(n.cost.get("flops_fwd")),
                flops_bwd=per_mb(n.cost.get("flops_bwd")),
                bytes_read=per_mb(n.cost.get("bytes_read")),
                bytes_written=per_mb(n.cost.get("bytes_written")),
                param_bytes=param_bytes,
                activation_bytes=per_mb(int(n.cost.get("activation_bytes", 0)) + held),
                optimizer=opt_of(keys) if param_bytes else None,
                op_class=op_class(n),
                param_tensors=len(keys),
                input_grad=any(needs[s] for s in n.input_names() if graph.node(s).kind != "variable"),
            )
        )
    edges: dict[tuple[str, str], int] = {}
    for n in ops:
        for src in n.input_names():
            producer = owner.get(src, src)
            if producer == n.name or graph.node(src).kind == "output":
                continue
            nbytes = int(graph.node(src).cost.get("activation_bytes", 0))
            if graph.node(src).kind != "variable":
                nbytes = per_mb(nbytes)
            edges[(producer, n.name)] = edges.get((producer, n.name), 0) + nbytes
    return CostGraph(tuple(costs), tuple((a, b, nbytes) for (a, b), nbytes in edges.items()))


def _traced_samples(graph: IRGraph) -> int | None:
    for n in graph.nodes:
        if (
            n.kind == "placeholder"
            and n.target == "inputs"
            and isinstance(n.meta, dict)
            and n.meta.get("shape")
        ):
            return int(n.meta["shape"][0])
    return None


def _scale(graph: IRGraph, batch_size: int | None, microbatches: int) -> float:
    """Per-micro-batch costs were traced on one example micro-batch; rescale them to ``batch_size``."""
    traced = _traced_samples(graph)
    if batch_size is None or not traced:
        return 1.0
    return batch_size / microbatches / traced


Links = Mapping[tuple[int, int], Link] | Link | None


def _swarm(devices: Sequence[DeviceSpec], links: Links, default_link: Link | None) -> Swarm:
    if not devices:
        raise PlanError("no devices to plan for: no compnode is online (or none has announced its hardware)")
    if isinstance(links, Link):
        return Swarm(tuple(devices), {}, links)
    return Swarm(tuple(devices), dict(links or {}), default_link or LOOPBACK)


def _ir_assignment(graph: IRGraph, op_label: Mapping[str, int]) -> dict[str, int]:
    """Cost-graph op -> label, extended to every IR node: placeholders and variables go with the op
    they were folded into, the output with the producer of its last input (as build_partition does)."""
    owner = _owners(graph)
    labels: dict[str, int] = {}
    for n in graph.nodes:
        if n.kind in OPS:
            labels[n.name] = op_label[n.name]
        elif n.kind in ("placeholder", "variable"):
            labels[n.name] = op_label[owner[n.name]]
        else:  # output
            inputs = n.input_names()
            labels[n.name] = labels[inputs[-1]] if inputs else 0
    return labels


def _partition(graph: IRGraph, labels: Mapping[str, int]) -> Partition:
    return build_partition(graph, labels)


def plan_graph(
    graph: IRGraph,
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    max_devices: int | None = None,
    links: Links = None,
    default_link: Link | None = None,
    objective: str = "step_time",
    stages: int | None = None,
) -> PlannedJob:
    """Plans ``graph`` onto ``devices`` with the scheduler of problem (2).

    ``microbatches`` and ``batch_size`` are the job's (costs are rescaled when the traced micro-batch
    had another size); ``optimizer`` one profile name (``"adam"``, ``"sgd_momentum"``, ...) or a map
    parameter key -> name; ``max_devices`` caps the sub-DAGs (default: every device may be used);
    ``links`` a map (i, j) of device indices -> ``Link`` (pairs not given use ``default_link``,
    loopback by default) or one ``Link`` for every pair; ``stages`` fixes the number of sub-DAGs (the
    scheduler then picks only the cuts and the devices). Deterministic for equal inputs. Raises
    ``PlanError`` naming the binding constraint (an op or the model too big for the memories, ...)
    when no placement fits.
    """
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
    swarm = _swarm(devices, links, default_link)
    cg = cost_graph(graph, optimizer, scale=_scale(graph, batch_size, microbatches))
    plan = schedule(
        cg,
        swarm,
        Workload(microbatches, graph.task),
        max_devices=max_devices,
        objective=objective,
        stages=stages,
    )
    stage_of = {d: i for i, d in enumerate(plan.devices_used)}
    labels = _ir_assignment(graph, {op: stage_of[d] for op, d in plan.assignment.items()})
    partition = _partition(graph, labels)
    # sub-DAG i of the partition -> the stage (and device) it came from
    stage_for = {s.index: s.compnode for s in partition.subdags}
    if sorted(stage_for.values()) != list(range(len(plan.stages))):
        raise PlanError("internal: the plan's stages do not map one-to-one onto sub-DAGs")
    plan_devices = [plan.stages[stage_for[i]].device for i in range(len(partition.subdags))]
    predicted = {i: plan.stages[stage_for[i]].compute_seconds for i in range(len(partition.subdags))}
    return PlannedJob(
        assignment=dict(partition.assignment),
        devices=plan_devices,
        predicted_seconds=predicted,
        predicted_step_seconds=plan.predicted_step_seconds,
        explanation=_explain(plan, swarm, plan_devices, predicted, max_devices),
        plan=plan,
    )


def _explain(
    plan: Plan, swarm: Swarm, devices: list[int], predicted: Mapping[int, float], max_devices: int | None
) -> str:
    allowed = min(max_devices or len(swarm.devices), len(swarm.devices))
    lines = [plan.describe(), ""]
    for i, d in enumerate(devices):
        dev = swarm.devices[d]
        lines.append(
            f"sub-DAG {i}: device {d} ({dev.name}, {dev.kind}, S(p) {dev.speed / 1e9:.3g} GFLOP/s, "
            f"{fmt_bytes(dev.compute_memory)}): predicted FP+BP+Update {predicted[i]:.6g} s per step"
        )
    if len(devices) < allowed:
        lines.append(
            f"{len(devices)} of {allowed} allowed device(s) used: more sub-DAGs would add transfers and "
            "fixed costs without shortening the predicted step"
        )
    lines.append(f"predicted step time: {plan.predicted_step_seconds:.6g} s")
    return "\n".join(lines)


def predict_subdags(
    graph: IRGraph,
    partition: Partition,
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    optimizer: str | Mapping[str, str] | None = None,
    links: Links = IN_PROCESS,
) -> dict[int, float]:
    """Predicted FP + BP + Update seconds per step of each sub-DAG of ``partition``, sub-DAG ``i`` on
    ``devices[i]`` (one device for all when a single one is given)."""
    k = len(partition.subdags)
    devs = list(devices) * k if len(devices) == 1 else list(devices)
    if len(devs) != k:
        raise PlanError(f"need one device per sub-DAG: {k} sub-DAGs, {len(devices)} devices")
    cg = cost_graph(graph, optimizer)
    plan = plan_for_assignment(
        cg,
        _swarm(devs, links, None),
        Workload(microbatches, graph.task),
        {op.name: partition.assignment[op.name] for op in cg.ops},
        check_memory=False,
    )
    return {s.device: s.compute_seconds for s in plan.stages}


def predict_assignment(
    graph: IRGraph,
    assignment: Mapping[str, int],
    devices: Sequence[DeviceSpec],
    *,
    microbatches: int,
    batch_size: int | None = None,
    optimizer: str | Mapping[str, str] | None = None,
    links: Links = None,
) -> tuple[dict[int, float], float]:
    """(sub-DAG -> predicted FP+BP+Update seconds per step, predicted step seconds) of an IR assignment
    whose sub-DAG ``i`` runs on ``devices[i]``."""
    cg = cost_graph(graph, optimizer, scale=_scale(graph, batch_size, microbatches))
    plan = plan_for_assignment(
        cg,
        _swarm(devices, links, None),
        Workload(microbatches, graph.task),
        {op.name: assignment[op.name] for op in cg.ops},
        check_memory=False,
    )
    return {s.device: s.compute_seconds for s in plan.stages}, plan.predicted_step_seconds


def optimizer_profiles(spec: Any, graph: IRGraph) -> dict[str, str] | None:
    """Parameter key -> optimizer profile name from an ``OptimizerSpec`` (None: no optimizer)."""
    from fusionnet.job.optim import resolve_param_optimizers

    if spec is None or not graph.params:
        return None
    resolved = resolve_param_optimizers(spec, list(graph.params))
    return {k: optimizer_profile_name(r.cls_name, r.kwargs) for k, r in resolved.items()}


def job_optimizers(job: Any, graph: IRGraph) -> dict[str, str] | None:
    """Parameter key -> optimizer profile name from a loaded job's optimizer section (train only)."""
    if job.spec.task != "train":
        return None
    return optimizer_profiles(job.spec.optimizer, graph)


@dataclass
class JobPlan:
    """``plan_job``'s answer: the job partitioned as planned, the plan, its text and its JSON form."""

    prepared: Any  # runtime.prepare.PreparedJob with the planned partition
    planned: PlannedJob
    devices: list[DeviceSpec]  # the swarm planned for
    explanation: str
    document: dict[str, Any]  # plan.json form (runtime.results.plan_document + the plan)


def plan_job(
    job: Any,
    nodes_file: str | Path | None = None,
    *,
    seconds_budget: float = 1.0,
    cache_dir: str | Path | None = None,
) -> JobPlan:
    """``fusionnet plan``: traces ``job`` (a ``LoadedJob`` or a job file path) and plans it for the
    swarm in ``nodes_file`` or, without one, for ``placement.compnodes`` compnodes like this machine
    (profiled once, cached) on loopback links. Nothing runs."""
    from fusionnet.job.loader import LoadedJob, load_job
    from fusionnet.perfmodel.nodes import load_nodes_file
    from fusionnet.runtime.prepare import prepare_job, trace_job
    from fusionnet.runtime.results import plan_document

    if not isinstance(job, LoadedJob):
        job = load_job(job)
    spec = job.spec
    if nodes_file is not None:
        swarm = load_nodes_file(nodes_file)  # before tracing: a bad nodes file fails fast
        devices, links, default, cap = list(swarm.devices), dict(swarm.links), swarm.default_link, None
        where = f"the {len(devices)} device(s) of {nodes_file}"
    else:
        from fusionnet.runtime.calibration import local_device_spec  # measures; imports the executor

        local = local_device_spec(seconds_budget=seconds_budget, cache_dir=cache_dir)
        n = spec.placement.compnodes
        devices = [replace(local, name=f"local #{i}") for i in range(n)]
        links, default, cap = {}, LOOPBACK, n
        where = (
            f"{n} compnode(s) like this machine (placement.compnodes; profiled: peak "
            f"{local.peak_flops / 1e9:.3g} GFLOP/s x lambda {local.speed_factor:.3g}, memory bandwidth "
            f"{local.mem_bandwidth / 1e9:.3g} GB/s), loopback links"
        )
    traced = trace_job(job)
    planned = plan_graph(
        traced.graph,
        devices,
        microbatches=spec.data.microbatches,
        batch_size=spec.data.batch_size,
        optimizer=job_optimizers(job, traced.graph),
        max_devices=cap,
        links=links,
        default_link=default,
    )
    prepared = prepare_job(job, len(planned.devices), traced=traced, assignment=planned.assignment)
    explanation = f"planned for {where}\n\n{planned.explanation}"
    used = [devices[d] for d in planned.devices]
    document = plan_document(
        prepared.partition,
        predicted=planned.predicted_seconds,
        extra={
            "job": spec.name,
            "task": spec.task,
            "frontend": traced.graph.frontend,
            "swarm": where,
            "devices": [
                {"subdag": i, "device": d, "name": dev.name, "kind": dev.kind, "speed_flops": dev.speed}
                for i, (d, dev) in enumerate(zip(planned.devices, used))
            ],
            "predicted_step_seconds": planned.predicted_step_seconds,
            "plan": planned.plan.to_dict(),
        },
    )
    return JobPlan(prepared, planned, devices, explanation, document)
