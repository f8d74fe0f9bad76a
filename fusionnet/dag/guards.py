"""Argument checks for allowed ops that could still be abused: sizes taken from the IR or from data.

A factory op (``zeros``, ``full``, ``arange``...) or a size-changing view (``expand``, ``repeat``,
``pad``, ``one_hot``...) allocates whatever its arguments say; a peer's IR could ask for 2^40
elements and take a compnode's memory down with it. Each such op is wrapped so that the number of
elements it would produce is computed from its arguments *before* it runs and compared with a cap.

The cap is per op, not per job: it stops a single absurd allocation, while the job's memory as a
whole is the sandbox's business. Index ranges are not re-checked here: every op on the allowlist is a
dense CPU kernel that bounds-checks its indices itself (the unchecked ones, sparse and ``*unsafe*``,
are not on the list).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fusionnet.errors import ExecutionError

# 2^31 elements (8 GiB of float32): far above any tensor of the models we run on one compnode, far
# below what a hostile size (1e12, 2^62) would ask for. ``set_element_cap`` changes it per process.
_CAP = [1 << 31]


def set_element_cap(cap: int) -> None:
    """Sets the per-op element cap (a compnode's configuration)."""
    if not isinstance(cap, int) or cap < 1:
        raise ValueError("element cap must be a positive integer")
    _CAP[0] = cap


def element_cap() -> int:
    return _CAP[0]


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ExecutionError(f"{what}: expected one number, got a tensor of shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float | torch.SymInt):
        raise ExecutionError(f"{what}: expected a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ExecutionError(f"{what}: {value} is not a finite size")
    return int(value)


def _sizes(args: Sequence[Any], what: str) -> list[int]:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])`` and ``f(torch.Size([2, 3]))`` all mean shape (2, 3)."""
    if len(args) == 1 and isinstance(args[0], Sequence | torch.Size):
        args = args[0]
    return [_as_int(a, what) for a in args]


def _check(op: str, count: int) -> None:
    if count > _CAP[0]:
        raise ExecutionError(f"{op}: would produce {count} elements, over the per-op cap of {_CAP[0]}")


def _product(op: str, sizes: Sequence[int]) -> int:
    total = 1
    for s in sizes:
        if s < -1:
            raise ExecutionError(f"{op}: negative size {s}")
        total *= max(s, 1)
        _check(op, total)  # early exit keeps the product small
    return total


def _shape_first(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    """zeros/ones/rand/randn(*size), full(size, value)."""
    size = kwargs.get("size")
    if size is None:
        size = args[0] if ".full" in op and args else args  # full(size, value)
    _product(op, _sizes(size if isinstance(size, Sequence | torch.Size) else [size], op))


def _randint(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    size = kwargs.get("size")
    if size is None:
        size = next((a for a in args if isinstance(a, Sequence | torch.Size)), ())
    _product(op, _sizes([size], op))


def _arange(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    nums = [a for a in args if isinstance(a, int | float | torch.Tensor) and not isinstance(a, bool)]
    start, end, step = 0.0, None, 1.0
    if "end" in kwargs:
        start, end = float(kwargs.get("start", nums[0] if nums else 0)), float(kwargs["end"])
    elif len(nums) == 1:
        end = float(nums[0])
    elif len(nums) >= 2:
        start, end = float(nums[0]), float(nums[1])
        step = float(nums[2]) if len(nums) > 2 else float(kwargs.get("step", 1))
    if end is None:
        return  # torch refuses the call itself
    step = float(kwargs.get("step", step))
    if step == 0 or not all(math.isfinite(v) for v in (start, end, step)):
        return  # torch refuses zero and infinite ranges itself
    _check(op, max(0, math.ceil((end - start) / step)))


def _steps(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    steps = kwargs.get("steps", args[2] if len(args) > 2 else None)
    if steps is not None:
        _check(op, _as_int(steps, op))


def _eye(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    n = _as_int(kwargs.get("n", args[0] if args else 1), op)
    m = _as_int(kwargs.get("m", args[1] if len(args) > 1 else n), op)
    _product(op, [n, m])


def _tri_indices(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    _product(
        op,
        [
            2,
            _as_int(args[0] if args else kwargs.get("row", 0), op),
            _as_int(args[1] if len(args) > 1 else kwargs.get("col", 0), op),
        ],
    )


def _size_arg(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    size = kwargs.get("size")
    if size is None:
        rest = [a for a in args if not isinstance(a, torch.Tensor) or a.numel() == 1]
        if op.endswith("new_full") and rest:
            rest = rest[:1]
        size = rest
    return _sizes(size if isinstance(size, Sequence | torch.Size) else [size], op)


def _new_size(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    """``x.new_zeros(size)``: the size after ``self``."""
    _product(op, _size_arg(op, args, kwargs))


def _expanded_size(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    """``x.expand(*sizes)``, ``aten.expand(x, size)``, ``broadcast_to``: a -1 keeps self's size there
    (sizes align from the right); counted as 1 it would let a 2**40-element view past the cap."""
    sizes = _size_arg(op, args, kwargs)
    if isinstance(self, torch.Tensor):
        lead = len(sizes) - self.dim()
        sizes = [self.shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(sizes)]
    _product(op, sizes)


def _repeat(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    """``x.repeat(*reps)`` / ``x.tile(dims)``: numel times the product of the repeats."""
    reps = kwargs.get("repeats", kwargs.get("dims", args))
    count = _product(op, _sizes(reps if isinstance(reps, Sequence | torch.Size) else [reps], op))
    _check(op, count * _numel(self))


def _repeat_interleave(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    reps = kwargs.get("repeats", args[0] if args else None)
    if isinstance(reps, torch.Tensor):
        if reps.is_floating_point() or reps.is_complex():
            return  # torch refuses it
        total = int(reps.sum().item()) if reps.numel() > 1 else _numel(self) * int(reps.item())
    elif reps is None:
        total = int(self.sum().item()) if isinstance(self, torch.Tensor) and self.numel() else 0
    else:
        total = _numel(self) * _as_int(reps, op)
    _check(op, total)


def _pad(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    pad = kwargs.get("pad", args[0] if args else ())
    pads = _sizes([pad], op)
    if not isinstance(self, torch.Tensor) or len(pads) % 2 or len(pads) // 2 > self.dim():
        return  # torch refuses malformed pads itself
    shape = list(self.shape)
    for i in range(len(pads) // 2):
        shape[-1 - i] += pads[2 * i] + pads[2 * i + 1]
    _product(op, shape)


def _one_hot(op: str, args: Sequence[Any], kwargs: dict[str, Any], self: Any) -> None:
    classes = _as_int(kwargs.get("num_classes", args[0] if args else -1), op)
    if classes < 0 and isinstance(self, torch.Tensor) and self.numel():
        classes = int(self.max().item()) + 1  # what one_hot infers: the data decides the width
    _check(op, _numel(self) * max(classes, 1))


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 1


_Check = Callable[[str, Sequence[Any], dict[str, Any], Any], None]
GUARDS: dict[str, _Check] = {
    "zeros": _shape_first,
    "ones": _shape_first,
    "rand": _shape_first,
    "randn": _shape_first,
    "full": _shape_first,
    "randint": _randint,
    "arange": _arange,
    "linspace": _steps,
    "logspace": _steps,
    "eye": _eye,
    "tril_indices": _tri_indices,
    "triu_indices": _tri_indices,
    "new_zeros": _new_size,
    "new_ones": _new_size,
    "new_full": _new_size,
    "expand": _expanded_size,
    "broadcast_to": _expanded_size,
    "repeat": _repeat,
    "tile": _repeat,
    "repeat_interleave": _repeat_interleave,
    "pad": _pad,
    "constant_pad_nd": _pad,
    "one_hot": _one_hot,
}


def guarded(label: str, base: str, fn: Callable[..., Any], *, takes_self: bool) -> Callable[..., Any]:
    """``fn`` with the size check of op ``base`` in front. ``takes_self``: the first positional
    argument is the input tensor (methods, ``aten.expand(x, size)``, ``F.pad(x, pad)``)."""
    check = GUARDS[base]

    def run(*args: Any, **kwargs: Any) -> Any:
        if takes_self and args:
            check(label, args[1:], kwargs, args[0])
        else:
            check(label, args, kwargs, kwargs.get("input"))
        return fn(*args, **kwargs)

    run.__name__ = "guarded_" + "".join(c if c.isalnum() else "_" for c in label)
    run.__qualname__ = run.__name__
    return run


def method_caller(method: str) -> Callable[..., Any]:
    """``x.<method>(*args)`` as a plain function (so that a guard can sit in front of it)."""

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    call.__name__ = "call_" + method
    call.__qualname__ = call.__name__
    return call


__all__ = ["GUARDS", "element_cap", "guarded", "method_caller", "set_element_cap"]
