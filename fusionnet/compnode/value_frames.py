"""What a value frame carries, apart from moving it (``netchannel``): the route in a frame's name when
compnodes hold several sub-DAGs each, a value's nested structure (tensors by index, small constants by
value; msgpack, never pickle), and the check of a received value against the IR's description of its
node (dtype, rank, every dimension except those that scale with the micro-batch). Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fusionnet.dag.ir import dtype_name
from fusionnet.errors import WireError

# A job whose compnodes hold several sub-DAGs each (interleaved-1f1b) names both ends of every frame:
# "3>4:a+b" goes from sub-DAG 3 to sub-DAG 4 (the sender's peer alone no longer says which one sent it,
# nor which of ours it is for). The name is inside the frame's authenticated header.
ROUTE_SEP, ROUTE_END = ">", ":"
ROUTE_MAX = 16  # characters a route prefix may take


def is_number(text: str) -> bool:
    """ASCII digits only: ``"²".isdigit()`` holds, and ``int("²")`` raises."""
    return text.isascii() and text.isdigit()


def route_prefix(src: int, dst: int) -> str:
    return f"{src}{ROUTE_SEP}{dst}{ROUTE_END}"


def split_route(name: str) -> tuple[int, int, str]:
    """``(src, dst, rest)`` of a routed frame name; ``WireError`` when it names no route."""
    head, sep, rest = name.partition(ROUTE_END)
    src, arrow, dst = head.partition(ROUTE_SEP)
    if not sep or not arrow or not is_number(src) or not is_number(dst) or len(head) >= ROUTE_MAX:
        raise WireError(
            f"frame {name[:80]!r} names no route 'SRC>DST:' (its job holds several sub-DAGs per compnode)"
        )
    return int(src), int(dst), rest


def encode_structure(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return {"$t": len(tensors) - 1}
    if isinstance(value, tuple | list | torch.Size):
        return {"$seq": [encode_structure(v, tensors) for v in value], "tuple": not isinstance(value, list)}
    if value is None or isinstance(value, bool | int | float):
        return value
    raise WireError(f"cannot send a value of type {type(value).__name__}")


def decode_structure(doc: Any, tensors: Mapping[int, torch.Tensor], depth: int = 0) -> Any:
    if depth > 32:
        raise WireError("value structure nested too deeply")
    if isinstance(doc, dict):
        if set(doc) == {"$t"} and isinstance(doc["$t"], int):
            if doc["$t"] not in tensors:
                raise WireError(f"value structure names tensor {doc['$t']} which was not sent")
            return tensors[doc["$t"]]
        if set(doc) == {"$seq", "tuple"} and isinstance(doc["$seq"], list):
            items = [decode_structure(v, tensors, depth + 1) for v in doc["$seq"]]
            return tuple(items) if doc["tuple"] else items
        raise WireError("malformed value structure")
    if doc is None or isinstance(doc, bool | int | float):
        return doc
    raise WireError(f"unsupported value of type {type(doc).__name__} in value structure")


def check_against_meta(
    value: Any,
    meta: Any,
    batch: int | None,
    where: str,
    compute: torch.dtype = torch.float32,
    rows: int | None = None,
) -> None:
    """Refuses a received value whose tensors disagree with the IR's shapes/dtypes for that node
    (``compute``: the job's autocast dtype, which a float32 value of the IR may arrive in).

    ``batch`` is the micro-batch size the IR was traced on. A dimension may differ from the IR's only
    where it scales with the micro-batch: the IR's size is a multiple of ``batch`` (the batch itself, or
    batch x positions after a flatten), and every such dimension of the value implies the same
    micro-batch size, ``rows`` where the receiver knows it."""
    if meta is None:
        return
    if isinstance(meta, dict) and "shape" in meta:
        if not isinstance(value, torch.Tensor):
            raise WireError(f"{where}: expected a tensor, got {type(value).__name__}")
        autocast = meta["dtype"] == "float32" and value.dtype == compute
        if dtype_name(value.dtype) != meta["dtype"] and not autocast:
            raise WireError(f"{where}: dtype {dtype_name(value.dtype)}, expected {meta['dtype']}")
        want = meta["shape"]
        if value.dim() != len(want) or not _scales_with_batch(list(value.shape), want, batch, rows):
            size = "any micro-batch size" if rows is None else f"micro-batches of {rows}"
            raise WireError(f"{where}: shape {list(value.shape)}, expected {want} traced on {batch} ({size})")
        return
    if isinstance(meta, dict) and "$seq" in meta:
        if not isinstance(value, tuple | list) or len(value) != len(meta["$seq"]):
            raise WireError(f"{where}: expected a sequence of {len(meta['$seq'])} values")
        for i, (v, m) in enumerate(zip(value, meta["$seq"])):
            check_against_meta(v, m, batch, f"{where}[{i}]", compute, rows)


def _scales_with_batch(got: list[int], want: list[int], batch: int | None, rows: int | None) -> bool:
    """Whether ``got`` is ``want`` (traced on ``batch`` samples) at one micro-batch size."""
    implied = {rows} if rows is not None else set()
    for g, w in zip(got, want):
        if g == w:
            continue
        if not batch or w <= 0 or w % batch or g <= 0 or g % (w // batch):
            return False
        implied.add(g // (w // batch))
    return len(implied) <= 1
