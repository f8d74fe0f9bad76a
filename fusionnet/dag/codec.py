"""IR <-> msgpack bytes, with the validation a compnode applies to IR received from a peer.

``decode_ir`` never trusts its input: structure, types, operator names (against the registry),
references (no dangling node/param/buffer names), parameter ownership and acyclicity are all
checked, and every failure is an ``IRError`` that names the offending node or field. Nothing is
ever unpickled or evaluated.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgpack

from fusionnet.dag.ir import _TAGS, IR_VERSION, NODE_KINDS, IRGraph, IRNode, dtype_from_name, is_argument_name
from fusionnet.dag.registry import REGISTRY
from fusionnet.errors import IRError

MAX_IR_BYTES = 256 * 1024 * 1024
MAX_TREE_DEPTH = 48
_TASKS = ("train", "grad", "infer")
_NODE_FIELDS = {
    "name",
    "kind",
    "op",
    "args",
    "kwargs",
    "target",
    "users",
    "meta",
    "cost",
    "compnode",
    "compnode_users",
}


def _node_to_dict(n: IRNode) -> dict[str, Any]:
    return {f: getattr(n, f) for f in sorted(_NODE_FIELDS)}


def encode_ir(graph: IRGraph) -> bytes:
    doc = {
        "version": graph.version,
        "task": graph.task,
        "frontend": graph.frontend,
        "params": graph.params,
        "buffers": graph.buffers,
        "state_keys": graph.state_keys,
        "aliases": graph.aliases,
        "nodes": [_node_to_dict(n) for n in graph.nodes],
    }
    return msgpack.packb(doc, use_bin_type=True)


def decode_ir(data: bytes) -> IRGraph:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise IRError(f"IR must be bytes, got {type(data).__name__}")
    if len(data) > MAX_IR_BYTES:
        raise IRError(f"IR is {len(data)} bytes, over the {MAX_IR_BYTES} byte limit")
    try:
        doc = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise IRError(f"IR is not valid msgpack: {type(e).__name__}: {e}") from None
    graph = _graph_from_doc(doc)
    validate_ir(graph)
    return graph


# ---- structure ---------------------------------------------------------------------------------


def _expect(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise IRError(f"{where}: {what}")


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _check_tensor_specs(specs: Any, where: str) -> None:
    _expect(isinstance(specs, dict), where, "must be a map")
    for key, spec in specs.items():
        _expect(isinstance(key, str) and key != "", where, "keys must be non-empty strings")
        _expect(
            isinstance(spec, dict) and set(spec) == {"shape", "dtype"},
            f"{where}.{key}",
            "must be {shape, dtype}",
        )
        shape = spec["shape"]
        _expect(
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape),
            f"{where}.{key}.shape",
            "must be a list of non-negative ints",
        )
        try:
            dtype_from_name(spec["dtype"])
        except ValueError as e:
            raise IRError(f"{where}.{key}.dtype: {e}") from None


def _graph_from_doc(doc: Any) -> IRGraph:
    _expect(isinstance(doc, dict), "IR", "top level must be a map")
    expected = {"version", "task", "frontend", "params", "buffers", "state_keys", "aliases", "nodes"}
    _expect(set(doc) == expected, "IR", f"fields must be {sorted(expected)}, got {sorted(map(str, doc))}")
    _expect(doc["version"] == IR_VERSION, "IR.version", f"unsupported version {doc['version']!r}")
    _expect(doc["task"] in _TASKS, "IR.task", f"must be one of {_TASKS}")
    _expect(isinstance(doc["frontend"], str), "IR.frontend", "must be a string")
    _check_tensor_specs(doc["params"], "IR.params")
    _check_tensor_specs(doc["buffers"], "IR.buffers")
    _expect(_is_str_list(doc["state_keys"]), "IR.state_keys", "must be a list of strings")
    aliases = doc["aliases"]
    _expect(
        isinstance(aliases, dict)
        and all(
            isinstance(k, str) and isinstance(v, str) and (v in doc["params"] or v in doc["buffers"])
            for k, v in aliases.items()
        ),
        "IR.aliases",
        "must map state keys to known parameter/buffer keys",
    )
    _expect(isinstance(doc["nodes"], list) and doc["nodes"], "IR.nodes", "must be a non-empty list")
    nodes = []
    for i, raw in enumerate(doc["nodes"]):
        where = f"IR.nodes[{i}]"
        _expect(
            isinstance(raw, dict) and set(raw) == _NODE_FIELDS,
            where,
            f"must be a map with fields {sorted(_NODE_FIELDS)}",
        )
        name = raw["name"]
        _expect(isinstance(name, str) and name != "", where, "name must be a non-empty string")
        where = f"node {name!r}"
        _expect(raw["kind"] in NODE_KINDS, where, f"kind must be one of {NODE_KINDS}, got {raw['kind']!r}")
        _expect(isinstance(raw["op"], str), where, "op must be a string")
        _expect(isinstance(raw["args"], list), where, "args must be a list")
        _expect(isinstance(raw["kwargs"], dict), where, "kwargs must be a map of argument names")
        bad = next((k for k in raw["kwargs"] if not is_argument_name(k)), None)
        _expect(bad is None, where, f"kwargs key {str(bad)[:80]!r} is not an argument name (an identifier)")
        _expect(raw["target"] is None or isinstance(raw["target"], str), where, "target must be a string")
        _expect(_is_str_list(raw["users"]), where, "users must be a list of node names")
        _expect(
            isinstance(raw["cost"], dict)
            and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in raw["cost"].items()
            ),
            where,
            "cost must map strings to ints",
        )
        _expect(
            raw["compnode"] is None or (isinstance(raw["compnode"], int) and raw["compnode"] >= 0),
            where,
            "compnode must be a non-negative int or null",
        )
        _expect(
            isinstance(raw["compnode_users"], list)
            and all(isinstance(c, int) and c >= 0 for c in raw["compnode_users"]),
            where,
            "compnode_users must be a list of non-negative ints",
        )
        _check_depth(raw["meta"], where + " meta", 0)
        nodes.append(IRNode(**raw))
    return IRGraph(
        nodes=nodes,
        task=doc["task"],
        params=doc["params"],
        buffers=doc["buffers"],
        state_keys=doc["state_keys"],
        aliases=aliases,
        frontend=doc["frontend"],
        version=doc["version"],
    )


def _check_depth(tree: Any, where: str, depth: int) -> None:
    if depth > MAX_TREE_DEPTH:
        raise IRError(f"{where}: nested deeper than {MAX_TREE_DEPTH}")
    if isinstance(tree, dict):
        for v in tree.values():
            _check_depth(v, where, depth + 1)
    elif isinstance(tree, list):
        for v in tree:
            _check_depth(v, where, depth + 1)


def _check_tree(tree: Any, where: str, graph: IRGraph, names: set[str], depth: int = 0) -> None:
    """Validates an argument tree: known tags, well-formed bodies, no dangling references."""
    if depth > MAX_TREE_DEPTH:
        raise IRError(f"{where}: arguments nested deeper than {MAX_TREE_DEPTH}")
    if isinstance(tree, list):
        for v in tree:
            _check_tree(v, where, graph, names, depth + 1)
        return
    if not isinstance(tree, dict):
        _expect(
            tree is None or isinstance(tree, bool | int | float | str),
            where,
            f"unsupported argument value of type {type(tree).__name__}",
        )
        return
    _expect(len(tree) == 1, where, f"argument map must have exactly one tag, got {sorted(map(str, tree))}")
    ((tag, body),) = tree.items()
    _expect(tag in _TAGS, where, f"unknown argument tag {tag!r}")
    if tag == "$node":
        _expect(isinstance(body, str) and body in names, where, f"reference to unknown node {body!r}")
    elif tag == "$param":
        _expect(
            isinstance(body, str) and body in graph.params, where, f"reference to unknown parameter {body!r}"
        )
    elif tag == "$buffer":
        _expect(
            isinstance(body, str) and body in graph.buffers, where, f"reference to unknown buffer {body!r}"
        )
    elif tag in ("$tuple",):
        _expect(isinstance(body, list), where, "$tuple body must be a list")
        _check_tree(body, where, graph, names, depth + 1)
    elif tag == "$slice":
        _expect(isinstance(body, list) and len(body) == 3, where, "$slice body must be [start, stop, step]")
        _check_tree(body, where, graph, names, depth + 1)
    elif tag == "$dict":
        _expect(
            isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body),
            where,
            "$dict body must be a list of [key, value] pairs",
        )
        _check_tree(body, where, graph, names, depth + 1)
    elif tag == "$dtype":
        try:
            dtype_from_name(body)
        except ValueError as e:
            raise IRError(f"{where}: {e}") from None
    elif tag == "$memory_format":
        _expect(
            body in ("contiguous_format", "channels_last", "preserve_format"),
            where,
            f"unknown memory format {body!r}",
        )
    elif tag == "$layout":
        _expect(body == "strided", where, f"unknown layout {body!r}")
    elif tag == "$device":
        _expect(isinstance(body, str), where, "$device body must be a string")
    elif tag == "$ellipsis":
        _expect(body == 1, where, "$ellipsis body must be 1")


# ---- semantics ---------------------------------------------------------------------------------


def validate_ir(graph: IRGraph) -> None:
    """Semantic checks shared by the decoder and the tracer's own output."""
    names: set[str] = set()
    for n in graph.nodes:
        _expect(n.name not in names, f"node {n.name!r}", "duplicate node name")
        names.add(n.name)
    owners: dict[str, str] = {}
    for n in graph.nodes:
        where = f"node {n.name!r}"
        if n.kind in ("placeholder", "variable", "output"):
            _expect(n.op == n.kind, where, f"op of a {n.kind} node must be {n.kind!r}")
        elif not REGISTRY.is_known(n.op):
            raise IRError(f"{where}: unknown operator {n.op!r} (not in the operator registry)")
        if n.kind == "placeholder":
            _expect(
                isinstance(n.target, str) and not n.args and not n.kwargs,
                where,
                "a placeholder needs a dataset field as target and no args",
            )
        if n.kind == "variable":
            _expect(
                n.target in graph.params and not n.args and not n.kwargs,
                where,
                "a variable needs a known parameter as target and no args",
            )
        _check_tree(n.args, where, graph, names)
        for value in n.kwargs.values():
            _check_tree(value, where, graph, names)
        for key in n.param_keys():
            _expect(
                key not in owners, where, f"parameter {key!r} is already owned by node {owners.get(key)!r}"
            )
            owners[key] = n.name
    outputs = [n for n in graph.nodes if n.kind == "output"]
    _expect(len(outputs) == 1 and graph.nodes[-1].kind == "output", "IR", "exactly one output node, last")
    losses = [n.name for n in graph.nodes if n.kind == "loss"]
    if graph.task == "infer":
        _expect(not losses, "IR", "an infer graph has no loss node")
    else:
        _expect(len(losses) == 1, "IR", f"a {graph.task} graph has exactly one loss node, found {losses}")
    for key in graph.params:
        _expect(key in owners, f"parameter {key!r}", "is not used by any node")
    _check_acyclic_and_users(graph)


def _check_acyclic_and_users(graph: IRGraph) -> None:
    inputs = {n.name: n.input_names() for n in graph.nodes}
    users: dict[str, list[str]] = {n.name: [] for n in graph.nodes}
    for n in graph.nodes:
        for src in inputs[n.name]:
            users[src].append(n.name)
    indegree = {name: len(srcs) for name, srcs in inputs.items()}
    ready = deque(name for name, d in indegree.items() if d == 0)
    order: list[str] = []
    while ready:
        name = ready.popleft()
        order.append(name)
        for u in users[name]:
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    if len(order) != len(graph.nodes):
        stuck = sorted(name for name, d in indegree.items() if d > 0)
        raise IRError(f"IR graph has a cycle through nodes {stuck}")
    position = {name: i for i, name in enumerate(n.name for n in graph.nodes)}
    for n in graph.nodes:
        for src in inputs[n.name]:
            _expect(
                position[src] < position[n.name],
                f"node {n.name!r}",
                f"reads {src!r} which comes later: nodes must be in topological order",
            )
        _expect(
            sorted(n.users) == sorted(users[n.name]),
            f"node {n.name!r}",
            f"users {n.users} disagree with the graph's edges {users[n.name]}",
        )
