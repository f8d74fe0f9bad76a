"""The operator registry: the single interface for adding DAG operators, and the decoder's allowlist.

FusionAI section 3.1 asks for "a unified interface for new DAG operators". Here an operator is a
*name* in the IR (``"F.linear"``, ``"torch.cat"``, ``"operator.add"``, ``"aten.mm.default"``,
``"method:view"``) bound to a callable on the executing compnode. A peer's IR can only name
operators that this registry knows; nothing is looked up by arbitrary import path, so an IR can
never reach ``os.system`` or ``torch.load``.

The default registry is a curated allowlist (``allowlist.py``), not whole namespaces:

- ``torch.<fn>``      reviewed dense tensor functions (``TORCH_FUNCS``)
- ``F.<fn>``          reviewed ``torch.nn.functional`` functions (``F_FUNCS``)
- ``operator.<fn>``   Python arithmetic, comparison and indexing operators
- ``aten.<op>.<overload>``  reviewed ATen packets (``ATEN_OPS``), any overload but ``out=`` ones
- ``method:<name>``   reviewed ``torch.Tensor`` methods (real methods, never getset attributes)
- ``builtins.getattr`` restricted to tensor metadata attributes (``shape``, ``dtype``, ``T``, ...)

Ops whose output size comes from their arguments run behind a size check (``guards.py``):
``executable(name)`` gives the guarded callable, ``resolve(name)`` the plain one (for costing).
Sparse tensor invariant checks are switched on process-wide when this module is imported.
``register_op`` adds anything else (a custom kernel, say) under a new name.
"""

from __future__ import annotations

import builtins
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fusionnet.dag import precision
from fusionnet.dag.allowlist import (
    ATEN_OPS,
    F_FUNCS,
    FORBIDDEN_SUBSTRINGS,
    GETATTR_ALLOWED,
    OPERATORS,
    SIZE_GUARDED,
    TENSOR_METHODS,
    TORCH_FUNCS,
)
from fusionnet.dag.guards import guarded, method_caller
from fusionnet.errors import IRError, TraceError

# Defence in depth: no allowed op builds a sparse tensor, but if one ever did, torch checks its
# indices against its size instead of trusting them (the unchecked path segfaulted a compnode).
torch.sparse.check_sparse_tensor_invariants.enable()

# Ops whose first positional argument is the tensor they size from (methods always are).
_TAKES_SELF = frozenset(
    {"new_zeros", "new_ones", "new_full", "expand", "broadcast_to", "repeat", "tile"}
    | {"repeat_interleave", "pad", "constant_pad_nd", "one_hot"}
)
# torch.export's private assertion ops: checks, not computation.
_PRIVATE_ALLOWED = frozenset({"_assert_tensor_metadata", "_assert_scalar"})


def _safe_getattr(obj: Any, name: str) -> Any:
    if name not in GETATTR_ALLOWED:
        raise IRError(
            f"builtins.getattr: attribute {name!r} is not allowed (allowed: {sorted(GETATTR_ALLOWED)})"
        )
    return getattr(obj, name)


def _forbidden(name: str) -> bool:
    """A name no allowlist entry may have (private, sparse, unsafe, pointer...)."""
    dunder = name.startswith("__") and name.endswith("__")  # aten.__and__ is operator &, not private
    if name.startswith("_") and not dunder and name not in _PRIVATE_ALLOWED:
        return True
    return any(bad in name for bad in FORBIDDEN_SUBSTRINGS)


def _is_real_method(name: str) -> bool:
    """True for a callable ``torch.Tensor`` method; False for getset attributes such as ``grad_fn``."""
    attr = inspect.getattr_static(torch.Tensor, name, None)
    if attr is None or inspect.isdatadescriptor(attr) or isinstance(attr, property):
        return False
    return callable(getattr(torch.Tensor, name, None))


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
        """The plain callable of ``name`` (what costing looks at); ``IRError`` for an unknown name.

        For ``method:`` names this is ``operator.methodcaller`` as a marker: methods are called by
        name (see ``executable``)."""
        fn = self._by_name.get(name)
        if fn is not None:
            return fn
        if isinstance(name, str):
            if name.startswith("method:"):
                self._check_method(name[len("method:") :], IRError)
                return operator.methodcaller
            if name.startswith("aten."):
                return self._resolve_aten(name)
        raise IRError(f"unknown operator {name!r}: not in the operator registry")

    def executable(self, name: str) -> Callable[..., Any] | None:
        """What an executor calls for ``name``: the callable behind its argument checks, if it has
        any. ``None`` for an unchecked ``method:`` (call it by name on its first argument)."""
        fn = self.resolve(name)
        family, _, rest = name.partition(".") if not name.startswith("method:") else name.partition(":")
        base = rest.split(".")[0]
        if base not in SIZE_GUARDED:
            return None if family == "method" else fn
        if family == "method":
            return guarded(name, base, method_caller(base), takes_self=True)
        return guarded(name, base, fn, takes_self=base in _TAKES_SELF)

    def is_known(self, name: str) -> bool:
        try:
            self.resolve(name)
        except IRError:
            return False
        return True

    def name_of(self, target: Any) -> str:
        """The registry name of an fx ``call_function`` target (``TraceError`` if not allowed)."""
        if isinstance(target, torch._ops.OpOverload):
            name = f"aten.{target._overloadpacket.__name__}.{target._overloadname}"
            if target.namespace != "aten":
                raise TraceError(f"operator {target} is outside the aten namespace and not allowed")
            try:
                self._resolve_aten(name)
            except IRError as e:
                raise TraceError(str(e)) from None
            return name
        name = self._by_id.get(id(target))
        if name is None:
            label = getattr(target, "__name__", None) or repr(target)
            module = getattr(target, "__module__", None) or "?"
            raise TraceError(f"operator {module}.{label} is not on the operator allowlist")
        return name

    def node_op_name(self, node: Any) -> str:
        """The IR op name of an fx ``call_function``/``call_method`` node; the ``TraceError`` names
        the node and its op, so a user learns which line of their model is not allowed."""
        try:
            if node.op == "call_method":
                return self.method_name(node.target)
            return self.name_of(node.target)
        except TraceError as e:
            raise TraceError(f"node {node.name!r}: {e}") from None

    @staticmethod
    def method_name(method: str) -> str:
        OpRegistry._check_method(method, TraceError)
        return f"method:{method}"

    @staticmethod
    def _check_method(method: str, error: type[Exception]) -> None:
        if method not in _METHODS:
            raise error(f"tensor method {method!r} is not on the operator allowlist")

    def _resolve_aten(self, name: str) -> Callable[..., Any]:
        parts = name.split(".")
        if len(parts) != 3 or not all(p.isidentifier() for p in parts[1:]):
            raise IRError(f"unknown operator {name!r}: expected aten.<op>.<overload>")
        _, op, overload = parts
        if op not in ATEN_OPS or _forbidden(op):
            raise IRError(f"unknown operator {name!r}: aten.{op} is not on the operator allowlist")
        if _forbidden(overload):
            raise IRError(f"unknown operator {name!r}: overload {overload!r} is not allowed")
        try:
            packet = getattr(torch.ops.aten, op)
            fn = getattr(packet, overload)
        except (AttributeError, RuntimeError) as e:
            raise IRError(f"unknown operator {name!r}: no such aten overload") from e
        if not isinstance(fn, torch._ops.OpOverload):
            raise IRError(f"unknown operator {name!r}: not an aten overload")
        if any(arg.is_out for arg in fn._schema.arguments):
            # out= overloads write into a tensor the caller hands in: not something an IR may do
            raise IRError(f"unknown operator {name!r}: out= overloads are not allowed")
        return fn


def _build_default_registry() -> OpRegistry:
    registry = OpRegistry()
    for family, names in (("torch", TORCH_FUNCS), ("F", F_FUNCS), ("method", TENSOR_METHODS)):
        bad = sorted(n for n in names if _forbidden(n))
        assert not bad, f"allowlist {family} holds forbidden names {bad}"
    for name in sorted(TORCH_FUNCS):
        fn = getattr(torch, name, None)
        if callable(fn):
            registry.register_op(f"torch.{name}", fn)
    for name in sorted(F_FUNCS):
        fn = getattr(F, name, None)
        if callable(fn):
            registry.register_op(f"F.{name}", fn)
    for name in OPERATORS:
        registry.register_op(f"operator.{name}", getattr(operator, name))
    registry.register_op("builtins.getattr", _safe_getattr)
    # torch.export's dtype assertions, relaxed for the autocast dtype under mixed precision.
    registry.register_op("aten._assert_tensor_metadata.default", precision.assert_tensor_metadata)
    registry._by_id[id(builtins.getattr)] = "builtins.getattr"
    return registry


# The allowed methods that really are methods on this torch (getset attributes filtered out).
_METHODS = frozenset(m for m in TENSOR_METHODS if _is_real_method(m))
REGISTRY = _build_default_registry()


def register_op(name: str, fn: Callable[..., Any], *, replace: bool = False) -> None:
    """Public entry point for adding an operator to the process-wide registry."""
    REGISTRY.register_op(name, fn, replace=replace)
