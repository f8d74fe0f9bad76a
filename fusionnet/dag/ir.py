"""The IR plane: a model as a DAG of named operators, pure data.

Each node carries the fields of FusionAI Table 2 (op name, users, type, args, kwargs, compnode
location, compnode users) plus output shapes/dtypes and cost metadata. Arguments are a JSON-like
tree in which references are tagged dicts:

- ``{"$node": name}``    the output of another node (an FP edge)
- ``{"$param": key}``    a trainable parameter owned by this node (``state_dict`` key)
- ``{"$buffer": key}``   a non-trainable tensor (buffer or constant), copied to every user
- ``{"$tuple": [...]}``, ``{"$slice": [a, b, c]}``, ``{"$dtype": "float32"}``, ``{"$device": "cpu"}``,
  ``{"$memory_format": "contiguous_format"}``, ``{"$layout": "strided"}``, ``{"$ellipsis": 1}``,
  ``{"$dict": [[k, v], ...]}`` for Python values msgpack cannot express on its own.

Node kinds follow Table 2: ``placeholder`` (data from the job: ``target`` is the dataset field),
``variable`` (a trainable leaf not inside a module, or a parameter shared by several ops, like a
tied embedding: ``target`` is its ``state_dict`` key), ``parametric`` and ``non_parametric`` ops,
``loss``, and the single ``output`` node.
"""

from __future__ import annotations

import keyword
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionnet.errors import IRError

_HOST = torch.device("cpu")  # where a decoded IR device points unless told otherwise

NODE_KINDS = ("placeholder", "variable", "parametric", "non_parametric", "loss", "output")
IR_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    )
}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}
_LAYOUTS = {"strided": torch.strided}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {name!r}") from None


@dataclass
class IRNode:
    """One operator of the DAG (a row of Table 2)."""

    name: str
    kind: str
    op: str  # registry name; "placeholder" / "variable" / "output" for the special kinds
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: str | None = None  # placeholder: dataset field; variable: state_dict key
    users: list[str] = field(default_factory=list)
    meta: Any = None  # output description: {"shape": [...], "dtype": "..."} tree, or {"value": x}
    cost: dict[str, int] = field(default_factory=dict)
    compnode: int | None = None  # Table 2 "Compnode location" (filled by partitioning)
    compnode_users: list[int] = field(default_factory=list)

    def input_names(self) -> list[str]:
        """Names of the nodes whose outputs this node reads (its Table 2 Args), in first-use order."""
        seen: dict[str, None] = {}
        for ref in iter_refs((self.args, self.kwargs), "$node"):
            seen.setdefault(ref, None)
        return list(seen)

    def param_keys(self) -> list[str]:
        keys = list(dict.fromkeys(iter_refs((self.args, self.kwargs), "$param")))
        if self.kind == "variable" and self.target is not None:
            keys.insert(0, self.target)
        return keys

    def buffer_keys(self) -> list[str]:
        return list(dict.fromkeys(iter_refs((self.args, self.kwargs), "$buffer")))


@dataclass
class IRGraph:
    """A whole DAG. ``nodes`` are in a topological order; ``output`` names the output node."""

    nodes: list[IRNode]
    task: str  # train | grad | infer: what the graph computes (train/grad graphs end in a loss)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> {"shape", "dtype"}
    buffers: dict[str, dict[str, Any]] = field(default_factory=dict)
    state_keys: list[str] = field(default_factory=list)  # model.state_dict() key order
    aliases: dict[str, str] = field(default_factory=dict)  # tied state_dict key -> the key that owns it
    frontend: str = "symbolic_trace"  # or "torch.export"
    version: int = IR_VERSION

    def __post_init__(self) -> None:
        self._index: dict[str, IRNode] | None = None

    def node(self, name: str) -> IRNode:
        if self._index is None or len(self._index) != len(self.nodes):
            self._index = {n.name: n for n in self.nodes}
        return self._index[name]

    @property
    def output(self) -> IRNode:
        return self.nodes[-1]

    def traced_samples(self) -> int | None:
        """The samples in the micro-batch the graph was traced on (the ``inputs`` placeholder's first
        dimension): the batch size its recorded shapes hold, whatever micro-batches the job runs."""
        for n in self.nodes:
            meta = n.meta if n.kind == "placeholder" and n.target == "inputs" else None
            if isinstance(meta, dict) and meta.get("shape"):
                return int(meta["shape"][0])
        return None

    def loss_node(self) -> IRNode | None:
        return next((n for n in self.nodes if n.kind == "loss"), None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IRGraph):
            return NotImplemented
        fields = ("nodes", "task", "params", "buffers", "state_keys", "aliases", "frontend", "version")
        return all(getattr(self, f) == getattr(other, f) for f in fields)

    def describe(self) -> str:
        """Table 2 as text."""
        rows = [("OP name", "OP users", "Type", "Args", "Compnode", "Compnode users")]
        for n in self.nodes:
            rows.append(
                (
                    n.name,
                    ", ".join(n.users) or "-",
                    n.kind,
                    ", ".join(n.input_names()) or "-",
                    "-" if n.compnode is None else str(n.compnode),
                    ", ".join(map(str, n.compnode_users)) or "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---- argument trees ----------------------------------------------------------------------------

_TAGS = (
    "$node",
    "$param",
    "$buffer",
    "$tuple",
    "$slice",
    "$dtype",
    "$device",
    "$memory_format",
    "$layout",
    "$ellipsis",
    "$dict",
)


def iter_refs(tree: Any, tag: str) -> Iterator[str]:
    """Yields every reference with the given tag (``$node``, ``$param``, ``$buffer``) in a tree."""
    if isinstance(tree, dict):
        if len(tree) == 1 and tag in tree:
            yield tree[tag]
            return
        for v in tree.values():
            yield from iter_refs(v, tag)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from iter_refs(v, tag)


def encode_value(value: Any) -> Any:
    """Python constant -> IR argument tree (for constants found while tracing)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, slice):
        return {"$slice": [encode_value(value.start), encode_value(value.stop), encode_value(value.step)]}
    if isinstance(value, torch.dtype):
        return {"$dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.memory_format):
        names = {v: k for k, v in _MEMORY_FORMATS.items()}
        return {"$memory_format": names[value]}
    if isinstance(value, torch.layout):
        return {"$layout": "strided"}
    if value is Ellipsis:
        return {"$ellipsis": 1}
    if isinstance(value, dict):
        return {"$dict": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    raise TypeError(f"constant of type {type(value).__name__} cannot be expressed in the IR")


def decode_value(tree: Any, resolve: Any, device: torch.device = _HOST) -> Any:
    """IR argument tree -> Python value. ``resolve(tag, name)`` supplies node/param/buffer values.

    Compnodes run where they run: every device in the IR (the tracer's, ``arange(..., device=cpu)``,
    ``_assert_tensor_metadata(..., device=cpu)`` in export graphs) becomes ``device``, the executor's."""
    if isinstance(tree, list):
        return [decode_value(v, resolve, device) for v in tree]
    if not isinstance(tree, dict):
        return tree
    ((tag, body),) = tree.items()
    if tag in ("$node", "$param", "$buffer"):
        return resolve(tag, body)
    if tag == "$tuple":
        return tuple(decode_value(v, resolve, device) for v in body)
    if tag == "$slice":
        return slice(*(decode_value(v, resolve, device) for v in body))
    if tag == "$dtype":
        return dtype_from_name(body)
    if tag == "$device":
        return device
    if tag == "$memory_format":
        return _MEMORY_FORMATS[body]
    if tag == "$layout":
        return _LAYOUTS[body]
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$dict":
        return {decode_value(k, resolve, device): decode_value(v, resolve, device) for k, v in body}
    raise ValueError(f"unknown tag {tag!r}")


def is_argument_name(key: Any) -> bool:
    """Whether ``key`` can name a keyword argument: torch.fx writes each one as ``key = value`` into the
    Python source of the module it generates and runs, so anything else would be code, not a name."""
    return isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)


def decode_kwargs(kwargs: dict[str, Any], resolve: Any, device: torch.device = _HOST) -> dict[str, Any]:
    """Keyword arguments are a plain map of name -> argument tree (never a tagged value)."""
    bad = next((k for k in kwargs if not is_argument_name(k)), None)
    if bad is not None:  # the decoder refuses these; a graph built some other way must not slip one by
        raise IRError(f"keyword argument {str(bad)[:80]!r} is not an argument name")
    return {k: decode_value(v, resolve, device) for k, v in kwargs.items()}


def tensor_meta(value: Any) -> Any:
    """Describes a (possibly nested) output value: tensors by shape/dtype, small constants by value."""
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": dtype_name(value.dtype)}
    if isinstance(value, tuple | list):
        return {"$seq": [tensor_meta(v) for v in value]}
    if isinstance(value, torch.Size):
        return {"value": list(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return {"value": value}
    if isinstance(value, torch.dtype):
        return {"value": dtype_name(value)}
    return {"value": repr(value)}
