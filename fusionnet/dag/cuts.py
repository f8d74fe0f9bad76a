"""The job's own cuts (``placement.cuts``): where each sub-DAG after the first begins, named by the user.

A cut names an op or a module:

- an op's IR name, as ``plan.json`` lists a sub-DAG's ``nodes`` (``layer_norm_12``, ``addmm_14``);
- a module's path, a ``state_dict`` key prefix such as ``lm.transformer.h.6`` or ``blocks.3``: the sub-DAG
  then begins at the first op, in the graph's topological order, that reads a parameter or buffer of that
  module. That is where ``torch.distributed.pipelining`` cuts at ``SplitPoint.BEGINNING`` of a submodule,
  and where a user who knows the model wants a stage to start.

Sub-DAG i holds the ops from cut i-1 (inclusive) up to cut i; placeholders and variables go with their
first user, as in ``partition.balanced_assignment`` (both are ``partition.contiguous_assignment``). The
pieces are contiguous runs of a topological order, so their sub-DAG graph is acyclic whatever the cuts:
skip edges across them are routed as usual.
Pure functions of the IR; errors name the cut by its index, as the job file's key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fusionnet.dag.ir import IRGraph, IRNode
from fusionnet.dag.partition import contiguous_assignment, op_nodes
from fusionnet.errors import PartitionError

_SHOWN = 6  # module paths listed in an error about a cut that names nothing


def _keys_read(graph: IRGraph, op: IRNode, tied: dict[str, list[str]]) -> list[str]:
    """The ``state_dict`` keys ``op`` reads: its own parameters and buffers, those of the variables it
    reads (a parameter shared by several ops is a variable node), and every key tied to one of them."""
    keys = op.param_keys() + op.buffer_keys()
    for name in op.input_names():
        src = graph.node(name)
        if src.kind == "variable" and src.target is not None:
            keys.append(src.target)
    return keys + [alias for k in keys for alias in tied.get(k, ())]


def _in_module(key: str, module: str) -> bool:
    return key == module or key.startswith(module + ".")


def _module_paths(graph: IRGraph) -> list[str]:
    """Every module path that owns a key (``a.b.weight`` -> ``a``, ``a.b``), in first-seen order."""
    paths: dict[str, None] = {}
    for key in [*graph.params, *graph.buffers, *graph.aliases]:
        parts = key.split(".")
        for i in range(1, len(parts)):
            paths.setdefault(".".join(parts[:i]), None)
    return list(paths)


def cut_positions(graph: IRGraph, cuts: Sequence[str]) -> list[int]:
    """Each cut's position in the graph's op order (the first op of the sub-DAG it begins), strictly
    increasing. ``PartitionError`` naming ``placement.cuts[i]`` when a cut names no op and no module
    with parameters, begins the first sub-DAG, or does not come after the cut before it."""
    ops = op_nodes(graph)
    index = {n.name: i for i, n in enumerate(ops)}
    tied: dict[str, list[str]] = {}
    for alias, owner in graph.aliases.items():
        tied.setdefault(owner, []).append(alias)
    reads: list[list[str]] | None = None  # computed on the first module cut
    positions: list[int] = []
    for i, cut in enumerate(cuts):
        where = f"placement.cuts[{i}] {cut!r}"
        if cut in index:
            pos = index[cut]
        else:
            if reads is None:
                reads = [_keys_read(graph, op, tied) for op in ops]
            pos = next((j for j, keys in enumerate(reads) if any(_in_module(k, cut) for k in keys)), -1)
            if pos < 0:
                paths = _module_paths(graph)
                shown = ", ".join(paths[:_SHOWN]) + (", ..." if len(paths) > _SHOWN else "")
                raise PartitionError(
                    f"{where} names no op of the traced graph and no module with parameters "
                    f"(modules: {shown or 'none'}; ops are listed per sub-DAG in plan.json)"
                )
        if pos == 0:
            raise PartitionError(
                f"{where} begins at the graph's first op ({ops[0].name}): sub-DAG 0 would be empty"
            )
        if positions and pos <= positions[-1]:
            raise PartitionError(
                f"{where} begins at op #{pos} ({ops[pos].name}), not after placement.cuts[{i - 1}] "
                f"{cuts[i - 1]!r} (op #{positions[-1]}, {ops[positions[-1]].name}): list the cuts in the "
                "model's order, one per sub-DAG boundary"
            )
        positions.append(pos)
    return positions


def cut_assignment(graph: IRGraph, cuts: Sequence[str]) -> dict[str, int]:
    """Every IR node -> its sub-DAG (0..len(cuts)) for the job's ``cuts`` (see the module's text)."""
    return contiguous_assignment(graph, cut_positions(graph, cuts))


def piece_work(graph: IRGraph, assignment: Mapping[str, int], pieces: int) -> list[int]:
    """Each piece's FP + BP FLOPs (the traced costs) under ``assignment``."""
    work = [0] * pieces
    for op in op_nodes(graph):
        work[assignment[op.name]] += int(op.cost.get("flops_fwd", 0)) + int(op.cost.get("flops_bwd", 0))
    return work
