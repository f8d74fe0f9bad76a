"""The operator registry: the single interface for adding DAG operators, and the decoder's allowlist.

FusionAI section 3.1 asks for "a unified interface for new DAG operators". Here an operator is a
*name* in the IR (``"F.linear"``, ``"torch.cat"``, ``"operator.add"``, ``"aten.mm.default"``,
``"method:view"``) bound to a callable on the executing compnode. A peer's IR can only name
operators that this registry knows; nothing is looked up by arbitrary import path, so an IR can
never reach ``os.system`` or ``torch.load``.

Families registered by default (all pure tensor math):

- ``torch.<fn>``      the C-implemented tensor functions of ``torch`` (``torch._C._VariableFunctions``)
- ``F.<fn>``          public functions of ``torch.nn.functional``
- ``operator.<fn>``   Python arithmetic, comparison and indexing operators
- ``aten.<op>.<overload>``  ATen operator overloads, as produced by ``torch.export``
- ``method:<name>``   public ``torch.Tensor`` methods
- ``builtins.getattr`` restricted to tensor metadata attributes (``shape``, ``dtype``, ``T``, ...)

Each family has a deny list for the few members that touch files, global state or autograd hooks.
``register_op`` adds anything else (a custom kernel, say) under a new name.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fusionnet.dag import precision
from fusionnet.errors import IRError, TraceError

# Names in the default families that are not tensor math: file access, global RNG/threads state,
# autograd hooks, storage aliasing, device transfers. An IR naming one of them is refused.
_DENIED_TORCH = frozenset(
    {
        "from_file",
        "set_flush_denormal",
        "manual_seed",
        "seed",
        "initial_seed",
        "set_num_threads",
        "set_num_interop_threads",
        "set_default_dtype",
        "set_grad_enabled",
        "use_deterministic_algorithms",
        "set_printoptions",
        "load",
        "save",
    }
)
_DENIED_METHODS = frozenset(
    {
        "backward",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "retain_grad",
        "storage",
        "untyped_storage",
        "share_memory_",
        "numpy",
        "data_ptr",
        "set_",
        "resize_",
        "resize_as_",
        "pin_memory",
        "cuda",
        "record_stream",
        "requires_grad_",
        "apply_",
        "map_",
        "map2_",
        "tolist",
        "is_shared",
        "storage_offset",
        "new_tensor",
        "detach_",
        "to_sparse",
        "xpu",
        "ipu",
        "mtia",
        "hpu",
        "share_memory",
        "dim_order",
        "__reduce_ex__",
        "__setstate__",
    }
)
_DENIED_ATEN = frozenset({"from_file", "_local_scalar_dense", "set_", "resize_", "record_stream", "save"})
_GETATTR_ALLOWED = frozenset({"shape", "dtype", "T", "mT", "H", "mH", "ndim", "device", "is_floating_point"})
_OPERATORS = (
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "neg",
    "pos",
    "abs",
    "invert",
    "and_",
    "or_",
    "xor",
    "lshift",
    "rshift",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "getitem",
    "not_",
    "iadd",
    "isub",
    "imul",
    "itruediv",
)


def _safe_getattr(obj: Any, name: str) -> Any:
    if name not in _GETATTR_ALLOWED:
        raise IRError(
            f"builtins.getattr: attribute {name!r} is not allowed (allowed: {sorted(_GETATTR_ALLOWED)})"
        )
    return getattr(obj, name)


class OpRegistry:
    """Maps IR operator names to callables and back.

    ``resolve(name)`` is what an executing compnode uses (raises ``IRError`` for an unknown name);
    ``name_of(target)`` is what the tracer uses (raises ``TraceError`` for a callable that cannot
    be named, which makes the tracer fall back to ``torch.export``).
    """

    def __init__(self) -> None:
        self._by_name: dict[str, Callable[..., Any]] = {}
        self._by_id: dict[int, str] = {}

    # -- registration -------------------------------------------------------------------------
    def register_op(self, name: str, fn: Callable[..., Any], *, replace: bool = False) -> None:
        """Adds an operator. ``name`` is how IR files refer to it; it must be unique."""
        if not name or not isinstance(name, str):
            raise ValueError("operator name must be a non-empty string")
        if name in self._by_name and not replace:
            raise ValueError(f"operator {name!r} is already registered")
        self._by_name[name] = fn
        self._by_id.setdefault(id(fn), name)

    # -- lookups -----------------------------------------------------------------------------
    def resolve(self, name: str) -> Callable[..., Any]:
        fn = self._by_name.get(name)
        if fn is not None:
            return fn
        if isinstance(name, str):
            if name.startswith("method:"):
                return self._resolve_method(name)
            if name.startswith("aten."):
                return self._resolve_aten(name)
        raise IRError(f"unknown operator {name!r}: not in the operator registry")

    def is_known(self, name: str) -> bool:
        try:
            self.resolve(name)
        except IRError:
            return False
        return True

    def name_of(self, target: Any) -> str:
        """The registry name of an fx ``call_function`` target."""
        if isinstance(target, torch._ops.OpOverload):
            name = f"aten.{target._overloadpacket.__name__}.{target._overloadname}"
            if target.namespace != "aten":
                raise TraceError(f"operator {target} is outside the aten namespace and not registered")
            self._resolve_aten(name)
            return name
        name = self._by_id.get(id(target))
        if name is None:
            label = getattr(target, "__qualname__", None) or repr(target)
            module = getattr(target, "__module__", None) or "?"
            raise TraceError(f"operator {module}.{label} is not in the operator registry")
        return name

    @staticmethod
    def method_name(method: str) -> str:
        if method.startswith("_") or method in _DENIED_METHODS or not hasattr(torch.Tensor, method):
            raise TraceError(f"tensor method {method!r} is not allowed in a DAG")
        return f"method:{method}"

    def _resolve_method(self, name: str) -> Callable[..., Any]:
        method = name[len("method:") :]
        if method.startswith("_") or method in _DENIED_METHODS or not hasattr(torch.Tensor, method):
            raise IRError(f"unknown operator {name!r}: tensor method not allowed")
        return operator.methodcaller  # marker: executors call methods by name, see rebuild.py

    def _resolve_aten(self, name: str) -> Callable[..., Any]:
        parts = name.split(".")
        if len(parts) != 3 or not all(p.isidentifier() for p in parts[1:]):
            raise IRError(f"unknown operator {name!r}: expected aten.<op>.<overload>")
        _, op, overload = parts
        if op in _DENIED_ATEN or overload == "out":
            raise IRError(f"unknown operator {name!r}: denied")
        try:
            packet = getattr(torch.ops.aten, op)
            fn = getattr(packet, overload)
        except (AttributeError, RuntimeError) as e:
            raise IRError(f"unknown operator {name!r}: no such aten overload") from e
        if not isinstance(fn, torch._ops.OpOverload):
            raise IRError(f"unknown operator {name!r}: not an aten overload")
        return fn


def _build_default_registry() -> OpRegistry:
    registry = OpRegistry()
    for name in sorted(dir(torch._C._VariableFunctions)):
        if name.startswith("_") or name in _DENIED_TORCH:
            continue
        fn = getattr(torch, name, None)
        if callable(fn):
            registry.register_op(f"torch.{name}", fn)
    for name in sorted(dir(F)):
        fn = getattr(F, name)
        if name.startswith("_") or not callable(fn) or isinstance(fn, type):
            continue
        if name.startswith(("has_torch_function", "handle_torch_function", "boolean_dispatch")):
            continue
        if getattr(fn, "__module__", "").startswith("typing"):
            continue
        registry.register_op(f"F.{name}", fn, replace=True)
    for name in _OPERATORS:
        registry.register_op(f"operator.{name}", getattr(operator, name))
    registry.register_op("builtins.getattr", _safe_getattr)
    # torch.export's dtype assertions, relaxed for the autocast dtype under mixed precision.
    registry.register_op("aten._assert_tensor_metadata.default", precision.assert_tensor_metadata)
    registry._by_id[id(builtins.getattr)] = "builtins.getattr"
    # torch.Tensor.* functions that fx records as call_function (e.g. torch.Tensor.add).
    return registry


REGISTRY = _build_default_registry()


def register_op(name: str, fn: Callable[..., Any], *, replace: bool = False) -> None:
    """Public entry point for adding an operator to the process-wide registry."""
    REGISTRY.register_op(name, fn, replace=replace)
