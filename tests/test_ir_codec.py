"""IR round trip and the decoder's refusal of anything malformed (property tests included)."""

from __future__ import annotations

import contextlib
import copy

import msgpack
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusionnet.dag.codec import decode_ir, encode_ir
from fusionnet.dag.trace import trace_model
from fusionnet.errors import IRError
from tests.dag_models import SkipEverywhere, SplitMerge, make_data


def _traced(model_cls, kind: str):
    torch.manual_seed(0)
    x, y = make_data(kind, n=6)
    return trace_model(model_cls(), x, y, F.cross_entropy, "train").graph


GRAPHS = {"skip": _traced(SkipEverywhere, "skip"), "split": _traced(SplitMerge, "split")}
ENCODED = {k: encode_ir(g) for k, g in GRAPHS.items()}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_round_trip_is_identity(name: str) -> None:
    g = GRAPHS[name]
    assert decode_ir(encode_ir(g)) == g
    assert encode_ir(decode_ir(ENCODED[name])) == ENCODED[name]


def _doc(name: str = "skip") -> dict:
    return msgpack.unpackb(ENCODED[name], raw=False)


def _refused(doc: dict, match: str) -> None:
    with pytest.raises(IRError, match=match):
        decode_ir(msgpack.packb(doc, use_bin_type=True))


def test_unknown_operator_is_refused_naming_the_node() -> None:
    doc = _doc()
    node = next(n for n in doc["nodes"] if n["kind"] == "parametric")
    node["op"] = "os.system"
    _refused(doc, f"node '{node['name']}'.*unknown operator 'os.system'")


@pytest.mark.parametrize(
    "op",
    [
        "method:backward",
        "method:_foo",
        "aten.from_file.default",
        "torch.load",
        "aten.mm.out",
        "aten..x",
        "builtins.eval",
    ],
)
def test_dangerous_or_malformed_operator_names_are_refused(op: str) -> None:
    doc = _doc()
    next(n for n in doc["nodes"] if n["kind"] == "non_parametric")["op"] = op
    _refused(doc, "unknown operator")


def test_dangling_reference_is_refused() -> None:
    doc = _doc()
    node = next(n for n in doc["nodes"] if n["kind"] == "parametric")
    node["args"][0] = {"$node": "nowhere"}
    _refused(doc, "unknown node 'nowhere'")


@pytest.mark.parametrize(
    "key",
    [
        "**({} if __import__('os').getpid() else {}), _x",  # torch.fx writes "key = value" into code
        "out=None);import os;(x",
        "$node",  # a kwargs map that reads as a tagged reference
        "$param",
        "class",  # a keyword
        "",
        "a b",
    ],
)
def test_a_keyword_argument_must_be_an_argument_name(key: str) -> None:
    """torch.fx generates Python source with ``key = value`` for every keyword argument and runs it: a
    key is checked as an identifier when the IR is decoded, and again when a sub-DAG is rebuilt."""
    doc = _doc()
    node = next(n for n in doc["nodes"] if n["kind"] == "non_parametric")
    node["kwargs"][key] = 0 if not key.startswith("$") else node["args"][0]
    _refused(doc, f"node '{node['name']}': kwargs key .* is not an argument name")
    from fusionnet.dag.ir import decode_kwargs

    with pytest.raises(IRError, match="is not an argument name"):
        decode_kwargs({key: 0}, lambda tag, name: None)
    assert decode_kwargs({"dim": 1, "keepdim": True}, lambda tag, name: None) == {"dim": 1, "keepdim": True}


def test_cycle_is_refused_naming_its_nodes() -> None:
    doc = _doc()
    ops = [n for n in doc["nodes"] if n["kind"] in ("parametric", "non_parametric")]
    by_name = {n["name"]: n for n in doc["nodes"]}
    first = ops[0]
    later = by_name[by_name[first["users"][0]]["users"][0]]  # depends on first, so reading it closes a loop
    first["args"][0] = {"$node": later["name"]}
    later_users = set(later["users"]) | {first["name"]}
    later["users"] = sorted(later_users)
    for n in doc["nodes"]:  # keep users consistent so that the cycle itself is what gets reported
        n["users"] = sorted(n["users"])
    _refused(doc, "cycle through nodes")


def test_parameter_owned_twice_is_refused() -> None:
    doc = _doc("split")
    owners = [n for n in doc["nodes"] if n["kind"] == "parametric"]
    owners[1]["args"][1] = copy.deepcopy(owners[0]["args"][1])
    _refused(doc, "already owned")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.pop("nodes"), "fields must be"),
        (lambda d: d.update(version=99), "unsupported version"),
        (lambda d: d.update(task="train-hard"), "IR.task"),
        (lambda d: d["nodes"][0].update(kind="magic"), "kind must be one of"),
        (lambda d: d["nodes"][2].update(args="x"), "args must be a list"),
        (lambda d: d["nodes"][2].update(cost={"flops_fwd": "many"}), "cost must map"),
        (lambda d: d["params"].update(x={"shape": [-1], "dtype": "float32"}), "non-negative ints"),
        (lambda d: d["params"].update(x={"shape": [1], "dtype": "object"}), "unsupported dtype"),
        (lambda d: d["nodes"][3]["args"].append({"$eval": "1+1"}), "unknown argument tag"),
        (lambda d: d["nodes"][3]["args"].append({"$node": "a", "$param": "b"}), "exactly one tag"),
        (lambda d: d["nodes"].append(copy.deepcopy(d["nodes"][2])), "duplicate node name"),
    ],
)
def test_malformed_structure_gets_a_clear_error(mutate, match: str) -> None:
    doc = _doc()
    mutate(doc)
    _refused(doc, match)


def test_deeply_nested_arguments_are_refused() -> None:
    doc = _doc()
    tree: object = 1
    for _ in range(200):
        tree = [tree]
    doc["nodes"][3]["args"].append(tree)
    _refused(doc, "nested deeper")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_irerror(data: bytes) -> None:
    with pytest.raises(IRError):
        decode_ir(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_ir_bytes_decode_or_raise_irerror(data: st.DataObject) -> None:
    blob = bytearray(ENCODED[data.draw(st.sampled_from(sorted(ENCODED)))])
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        action = data.draw(st.sampled_from(["flip", "delete", "insert"]))
        if action == "flip":
            blob[pos] ^= data.draw(st.integers(1, 255))
        elif action == "delete":
            del blob[pos]
        else:
            blob.insert(pos, data.draw(st.integers(0, 255)))
    with contextlib.suppress(IRError):
        decode_ir(bytes(blob))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats(allow_nan=False)
        | st.text(max_size=8),
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_random_documents_only_raise_irerror(doc: object) -> None:
    with pytest.raises(IRError):
        decode_ir(msgpack.packb(doc, use_bin_type=True))
