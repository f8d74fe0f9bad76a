"""PALEO-style performance model of FusionAI sections 3.7, 3.8 and 4: pure functions of data.

Map of the package:

- ``graph_types.py`` the graph input: ``OpCost`` and ``CostGraph`` (validated frozen dataclasses).
- ``types.py``       the other inputs: ``DeviceSpec``, ``Link``, ``Swarm``, ``Workload``, a device's fixed
                     costs ``Overheads``; re-exports the graph types, so every input imports from here.
- ``optimizers.py``  per-optimizer state memory, update FLOPs and traffic.
- ``timing.py``      eq. (1) per op (FP, BP, Update), section 3.7's sub-DAG bounds, eq. (3) latency and
                     eq. (4) pipelined time.
- ``memory.py``      a sub-DAG's D_gpu / D_cpu / D_disk demand: params, grads, optimizer state,
                     activations of in-flight micro-batches (GPipe / 1F1B), communication buffers.
- ``simulator.py``   GPipe / 1F1B schedule simulator over stages and links: step time, peak in-flight.
- ``generation_rate.py`` eq. (3)/(4) for a deployment's live decoding sessions: tokens/s per session count.
- ``placement_cost.py`` the cost of one op -> device assignment: stages, transfers, makespan, step time.
- ``fitting.py``     lambda_p and alpha-beta fits from measurements; online lambda refinement.
- ``overhead_fit.py`` the fixed costs refitted to sub-DAG times measured in the executor
                     (``fusionnet.profiling.calibration`` measures them).
- ``catalog.py``     FusionAI Table 1 GPUs and other devices; size / bandwidth / latency parsing.
- ``nodes.py``       ``load_nodes_file`` for ``fusionnet plan --nodes NODES.yaml``.
- ``models.py``      analytic cost graphs of Bert-Large and a GPT-3-style model (blocks or fine ops).
- ``synthetic.py``   seeded random instances for tests and benchmarks.
- ``section4.py``    FusionAI section 4: 50 x RTX 3080 vs 4 x H100 (``main(argv)``).

Nothing here measures anything or imports torch: the measurements that feed the model (hardware
profile, micro-benchmarks, executor calibration) live in ``fusionnet.profiling``, and the planner that
uses it in ``fusionnet.planning``.
"""

from fusionnet.perfmodel.catalog import CATALOG, lookup
from fusionnet.perfmodel.fitting import fit_link, fit_speed_factor, refine_speed_factor
from fusionnet.perfmodel.memory import MemoryBreakdown, MemoryDemand, inflight_microbatches, stage_memory
from fusionnet.perfmodel.nodes import load_nodes_file
from fusionnet.perfmodel.placement_cost import AssignmentCost, evaluate_assignment
from fusionnet.perfmodel.simulator import Hop, SimResult, StageTimes, simulate
from fusionnet.perfmodel.timing import (
    latency_eq3,
    op_bp_seconds,
    op_fp_seconds,
    op_update_seconds,
    pipelined_eq4,
    subdag_time_bounds,
)
from fusionnet.perfmodel.types import (
    ClassCost,
    CostGraph,
    DeviceSpec,
    Link,
    OpCost,
    Overheads,
    Swarm,
    Workload,
)

__all__ = [
    "CATALOG",
    "AssignmentCost",
    "ClassCost",
    "CostGraph",
    "DeviceSpec",
    "Hop",
    "Link",
    "MemoryBreakdown",
    "MemoryDemand",
    "OpCost",
    "Overheads",
    "SimResult",
    "StageTimes",
    "Swarm",
    "Workload",
    "evaluate_assignment",
    "fit_link",
    "fit_speed_factor",
    "inflight_microbatches",
    "latency_eq3",
    "load_nodes_file",
    "lookup",
    "op_bp_seconds",
    "op_fp_seconds",
    "op_update_seconds",
    "pipelined_eq4",
    "refine_speed_factor",
    "simulate",
    "stage_memory",
    "subdag_time_bounds",
]
