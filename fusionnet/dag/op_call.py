"""One operator call on real values and the rules that price it (``costs.op_cost``'s engine).

``OpCall`` holds the call's inputs and outputs, picks the rule of ``flop_rules.py`` for its operator, and
computes its FLOPs (forward, and backward for the inputs that need a gradient) and the bytes it reads
and writes; operators without a rule are run once on meta tensors under ``FlopCounterMode``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from fusionnet.dag import flop_rules as R
from fusionnet.errors import TraceError

log = logging.getLogger("fusionnet.dag.costs")
_warned: set[str] = set()


@dataclass(frozen=True)
class FlopBreakdown:
    """FLOPs split into what ``FlopCounterMode`` counts (matmul-like) and what our rules add."""

    counted_fwd: int = 0
    counted_bwd: int = 0
    other_fwd: int = 0
    other_bwd: int = 0

    @property
    def fwd(self) -> int:
        return self.counted_fwd + self.other_fwd

    @property
    def bwd(self) -> int:
        return self.counted_bwd + self.other_bwd


def op_name(target: Any) -> str:
    """The rule key of an fx target: a callable, an ATen ``OpOverload`` or ``"method:<name>"``."""
    if isinstance(target, str):
        if not target.startswith("method:") or len(target) == len("method:"):
            raise TraceError(f"cost target {target!r} is a string but not 'method:<name>'")
        name = target[len("method:") :]
    elif isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name.split("::")[-1]
    elif callable(target) and isinstance(getattr(target, "__name__", None), str):
        name = target.__name__
    else:
        raise TraceError(f"cost target {target!r} is neither a callable, an ATen op nor 'method:<name>'")
    return R.normalize_name(name)


def logical_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique_bytes(t: torch.Tensor) -> int:
    """Bytes actually read from ``t``: broadcast (stride 0) dimensions are read once."""
    if t.layout != torch.strided:
        return logical_bytes(t)
    size = 1
    for n, s in zip(t.shape, t.stride()):
        if s != 0:
            size *= n
    return size * t.element_size() if t.numel() else 0


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse / exotic layouts have no single storage
        return 0


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class OpCall:
    """One operator call on real values, with the helpers the rules need."""

    def __init__(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        needs_grad: bool,
        requires_grad: Callable[[torch.Tensor], bool] | None,
    ) -> None:
        if not isinstance(args, tuple | list):
            raise TraceError(f"op_cost args must be a tuple, got {type(args).__name__}")
        if not isinstance(kwargs, dict):
            raise TraceError(f"op_cost kwargs must be a dict, got {type(kwargs).__name__}")
        self.target = target
        self.name = op_name(target)
        self.aten = isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket)
        self.rule = R.RULES.get(self.name)
        self.args, self.kwargs, self.output = tuple(args), kwargs, output
        self.inputs = _distinct(t for t in tree_leaves((self.args, kwargs)) if isinstance(t, torch.Tensor))
        self.outs = _distinct(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
        self.needs_grad = needs_grad
        self.requires_grad = requires_grad
        self.out_numel = max((t.numel() for t in self.outs), default=0)

    def arg(self, pos: int | None, kw: str, default: Any = None) -> Any:
        if pos is not None and pos < len(self.args):
            return self.args[pos]
        return self.kwargs.get(kw, default)

    def needs(self, value: Any) -> bool:
        """Whether ``value`` is a tensor whose gradient the backward pass computes."""
        if not (self.needs_grad and isinstance(value, torch.Tensor) and _differentiable(value)):
            return False
        return self.requires_grad is None or bool(self.requires_grad(value))

    def grad_operands(self) -> int:
        """Tensor operands (by position, so ``x * x`` counts twice) that need a gradient."""
        if not any(_differentiable(t) for t in self.outs):
            return 0
        return sum(self.needs(t) for t in tree_leaves((self.args, self.kwargs)))

    def first_tensor(self) -> torch.Tensor:
        return self.inputs[0] if self.inputs else self.outs[0]

    def aliases_input(self) -> bool:
        """The (first) output shares storage with an input: a view, no data moved."""
        ptrs = {_storage(t) for t in self.inputs} - {0}
        return _storage(self.outs[0]) in ptrs

    # -- FLOPs ------------------------------------------------------------------------------------
    def flops(self) -> FlopBreakdown:
        kind = self.rule.kind if self.rule is not None else "unknown"
        try:
            return getattr(self, f"_flops_{kind}")()
        except (ValueError, TypeError, IndexError, AttributeError, RuntimeError) as e:
            if self.name not in _warned:  # a known op with an argument layout the rule did not expect
                _warned.add(self.name)
                log.warning("cost rule %s failed for %s (%s); using the default", kind, self.name, e)
            return self._default()

    def _default(self) -> FlopBreakdown:
        bwd = R.DEFAULT_BWD * self.out_numel if any(self.needs(t) for t in self.inputs) else 0
        return FlopBreakdown(other_fwd=R.DEFAULT_FWD * self.out_numel, other_bwd=bwd)

    def _elementwise(self, fwd: int, bwd: int, base: int) -> FlopBreakdown:
        return FlopBreakdown(other_fwd=fwd * base, other_bwd=bwd * base * self.grad_operands())

    def _per_input(self, fwd: int, bwd: int, x: torch.Tensor) -> FlopBreakdown:
        grad = self.needs(x) and any(_differentiable(t) for t in self.outs)
        return FlopBreakdown(other_fwd=fwd * x.numel(), other_bwd=bwd * x.numel() if grad else 0)

    def _flops_view(self) -> FlopBreakdown:
        if self.aliases_input() or self.name not in ("getitem", "index"):
            return FlopBreakdown()  # a view, or a copy (reshape of a strided tensor): bytes only
        return self._flops_gather()  # advanced indexing gathers; its gradient scatters back

    def _flops_copy(self) -> FlopBreakdown:
        return FlopBreakdown()

    _flops_fill = _flops_copy

    def _flops_elementwise(self) -> FlopBreakdown:
        return self._elementwise(self.rule.fwd, self.rule.bwd, self.out_numel)

    def _flops_pow(self) -> FlopBreakdown:
        exponent = self.arg(1, "exponent")
        integral = isinstance(exponent, int) or (isinstance(exponent, float) and exponent.is_integer())
        if integral:  # x**2, x**3: repeated multiply; gradient n * x**(n-1) * g
            return self._elementwise(R.ELEMENTWISE, 2, self.out_numel)
        return self._elementwise(2 * R.TRANSCENDENTAL + 1, 2 * R.TRANSCENDENTAL + 2, self.out_numel)

    def _flops_minmax(self) -> FlopBreakdown:
        if sum(isinstance(a, torch.Tensor) for a in self.args[:2]) == 2:
            return self._elementwise(R.ELEMENTWISE, R.ELEMENTWISE, self.out_numel)
        return self._per_input(R.REDUCTION, R.REDUCTION, self.first_tensor())

    def _flops_reduction(self) -> FlopBreakdown:
        return self._per_input(self.rule.fwd, self.rule.bwd, self.first_tensor())

    _flops_softmax = _flops_reduction

    def _flops_loss(self) -> FlopBreakdown:
        tensors = [a for a in self.args if isinstance(a, torch.Tensor)] or list(self.inputs)
        base = tensors[1] if self.name.startswith("nll") and len(tensors) > 1 else tensors[0]
        grads = sum(self.needs(t) for t in tensors[:2])
        return FlopBreakdown(
            other_fwd=self.rule.fwd * base.numel(), other_bwd=self.rule.bwd * base.numel() * grads
        )

    def _flops_cross_entropy(self) -> FlopBreakdown:
        logits, target = self.arg(0, "input"), self.arg(1, "target")
        n = logits.numel()
        pick = n * 2 if _differentiable(target) else R.NLL * target.numel()  # soft labels: multiply + sum
        bwd = R.LOG_SOFTMAX_BWD * n + pick if self.needs(logits) else 0
        return FlopBreakdown(other_fwd=R.LOG_SOFTMAX_FWD * n + pick, other_bwd=bwd)

    def _flops_norm(self) -> FlopBreakdown:
        x = self.first_tensor()
        slots = (R.AFFINE_ATEN if self.aten else {}).get(self.name) or R.AFFINE.get(
            self.name, ((1, "weight"), (2, "bias"))
        )
        affine = [self.arg(pos, kw) for pos, kw in slots]
        affine = [t for t in affine if isinstance(t, torch.Tensor)]
        n = x.numel()
        fwd = (self.rule.fwd + R.NORM_AFFINE * len(affine)) * n
        bwd = self.rule.bwd * n if self.needs(x) else 0
        for t, per in zip(affine, (R.NORM_WEIGHT_BWD, R.NORM_BIAS_BWD)):
            bwd += per * n if self.needs(t) else 0
        return FlopBreakdown(other_fwd=fwd, other_bwd=bwd)

    def _flops_gather(self) -> FlopBreakdown:
        source = self._gather_source()
        return FlopBreakdown(other_bwd=R.EMBEDDING_BWD * self.out_numel if self.needs(source) else 0)

    def _gather_source(self) -> torch.Tensor:
        return next((t for t in self.inputs if _differentiable(t)), self.first_tensor())

    def _flops_dropout(self) -> FlopBreakdown:
        if self.aliases_input():  # eval mode or p == 0: the input itself
            return FlopBreakdown()
        return self._per_input(R.DROPOUT_FWD, R.DROPOUT_BWD, self.first_tensor())

    def _flops_pool(self) -> FlopBreakdown:
        x, out = self.first_tensor(), self.outs[0].numel()
        routed = "max" in self.name  # max pooling's gradient goes to one element per window
        if "adaptive" in self.name:  # the windows tile the input
            fwd = self.rule.fwd * x.numel()
            bwd = out if routed else fwd
        else:
            kernel = self.arg(2 if self.name.startswith("lp_") else 1, "kernel_size")
            fwd = self.rule.fwd * R.pool_area(self.name, kernel, self.outs[0].dim()) * out
            bwd = out if routed else fwd
        return FlopBreakdown(other_fwd=fwd, other_bwd=bwd if self.needs(x) else 0)

    def _matmul(self, a: torch.Tensor, b_shape: tuple[int, ...], b: Any) -> FlopBreakdown:
        flops, counted = R.matmul_flops(tuple(a.shape), b_shape)
        bwd = flops * (self.needs(a) + self.needs(b))  # each operand's gradient is one product of equal size
        return (
            FlopBreakdown(counted_fwd=flops, counted_bwd=bwd) if counted else FlopBreakdown(0, 0, flops, bwd)
        )

    def _flops_matmul(self) -> FlopBreakdown:
        a = self.args[0] if self.args else self.kwargs["input"]
        b = self.args[1] if len(self.args) > 1 else next(v for k, v in self.kwargs.items() if k != "input")
        return self._matmul(a, tuple(b.shape), b)

    def _flops_linear(self) -> FlopBreakdown:
        x, w, bias = self.arg(0, "input"), self.arg(1, "weight"), self.arg(2, "bias")
        mm = self._matmul(x, tuple(reversed(w.shape)), w)
        return _plus_bias(mm, bias, self.outs[0].numel(), self.needs(bias))

    def _flops_addmm(self) -> FlopBreakdown:
        inp, a, b = self.arg(0, "input"), self.arg(1, "mat1"), self.arg(2, "mat2")
        if a is None:
            a, b = self.arg(1, "batch1"), self.arg(2, "batch2")
        mm = self._matmul(a, tuple(b.shape), b)
        return _plus_bias(mm, inp, self.outs[0].numel(), self.needs(inp))

    def _flops_conv(self) -> FlopBreakdown:
        x, w, bias = self.arg(0, "input"), self.arg(1, "weight"), self.arg(2, "bias")
        transposed = "transpose" in self.name or bool(self.arg(6, "transposed", False))
        xs, os = tuple(x.shape), tuple(self.outs[0].shape)
        if x.dim() == w.dim() - 1:  # unbatched input: the kernel sees a batch of one
            xs, os = (1, *xs), (1, *os)
        ws = tuple(w.shape)
        fwd = R.conv_flops(xs, ws, os, transposed)
        bwd = R.conv_backward_flops(xs, ws, os, transposed, self.needs(x), self.needs(w))
        return _plus_bias(FlopBreakdown(fwd, bwd), bias, self.outs[0].numel(), self.needs(bias))

    def _flops_sdpa(self) -> FlopBreakdown:
        q, k, v = self.arg(0, "query"), self.arg(1, "key"), self.arg(2, "value")
        mask_pos, drop_pos, causal_pos = R.SDPA_ARGS[self.name]
        masked = isinstance(self.arg(mask_pos, "attn_mask", self.kwargs.get("attn_bias")), torch.Tensor)
        masked = masked or bool(self.arg(causal_pos, "is_causal", False))
        dropout = float(self.arg(drop_pos, "dropout_p", 0.0) or 0.0) > 0
        fwd, bwd, scores = R.sdpa_flops(tuple(q.shape), tuple(k.shape), tuple(v.shape))
        # On the scores: scale, mask, softmax (and dropout), exactly as attention spelt with plain ops.
        extra_fwd = scores * (1 + masked + R.SOFTMAX_FWD + (R.DROPOUT_FWD if dropout else 0))
        extra_bwd = scores * (1 + masked + R.SOFTMAX_BWD + (R.DROPOUT_BWD if dropout else 0))
        if not any(self.needs(t) for t in (q, k, v)):
            bwd = extra_bwd = 0
        return FlopBreakdown(fwd, bwd, extra_fwd, extra_bwd)

    def _flops_unknown(self) -> FlopBreakdown:
        """No rule: a contraction flop_counter can see inside, else the conservative default."""
        # Re-run only torch's own operators that compute from tensors (never torch.load-like sources).
        probed = self._probe() if self.inputs and _torch_owned(self.target) else None
        if probed is not None and probed[0] > 0:
            return FlopBreakdown(*probed)
        return self._default()

    _flops_probe = _flops_unknown

    def _probe(self) -> tuple[int, int] | None:
        """Runs the op on meta copies under FlopCounterMode: (forward, backward) counted FLOPs."""
        memo: dict[int, torch.Tensor] = {}
        leaves: list[torch.Tensor] = []

        def to_meta(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) not in memo:
                meta = value.detach().to("meta")
                if self.needs(value):
                    leaves.append(meta.requires_grad_())
                    meta = meta.clone()  # a non-leaf, so in-place ops are allowed
                memo[id(value)] = meta
            return memo[id(value)]

        args, kwargs = tree_map(to_meta, (self.args, self.kwargs))
        fn = _method(self.target) if isinstance(self.target, str) else self.target
        try:
            with torch.enable_grad(), FlopCounterMode(display=False) as forward:
                out = fn(*args, **kwargs)
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            backward_flops = 0
            if leaves and outs:
                with FlopCounterMode(display=False) as backward:
                    grads = [torch.ones_like(t) for t in outs]
                    torch.autograd.grad(outs, leaves, grads, allow_unused=True)
                backward_flops = backward.get_total_flops()
        except Exception as e:  # data-dependent shapes, no meta kernel, ...: fall back to the default
            log.debug("meta probe of %s failed: %s", self.name, e)
            return None
        return forward.get_total_flops(), backward_flops

    # -- bytes ------------------------------------------------------------------------------------
    def bytes_moved(self) -> tuple[int, int]:
        kind = self.rule.kind if self.rule is not None else "unknown"
        written = sum(logical_bytes(t) for t in self.outs)
        if kind in ("view", "dropout", "copy") and self.name != "copy" and self.aliases_input():
            return 0, 0  # a view, or a conversion that was a no-op (x.float() on a float tensor)
        if kind == "fill":
            return 0, written
        read = sum(_unique_bytes(t) for t in self.inputs)
        if kind == "gather" or (kind == "view" and self.name in ("getitem", "index")):
            source = self._gather_source()  # only the gathered rows of the source are read
            read += min(written, _unique_bytes(source)) - _unique_bytes(source)
        return read, written


def _plus_bias(mm: FlopBreakdown, bias: Any, out_numel: int, bias_grad: bool) -> FlopBreakdown:
    """Adds a broadcast bias (one add per output element; its gradient sums them back)."""
    if not isinstance(bias, torch.Tensor):
        return mm
    return FlopBreakdown(
        mm.counted_fwd,
        mm.counted_bwd,
        mm.other_fwd + out_numel,
        mm.other_bwd + (out_numel if bias_grad else 0),
    )


def _distinct(tensors: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _method(target: str) -> Callable[..., Any]:
    method = target[len("method:") :]
    return lambda self, *a, **k: getattr(self, method)(*a, **k)


def _torch_owned(target: Any) -> bool:
    """Only torch's own operators are re-run for a probe; arbitrary callables may have side effects."""
    if isinstance(target, str | torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return True
    if getattr(target, "__objclass__", None) is torch._C.TensorBase:
        return True
    module = getattr(target, "__module__", None) or ""
    return (
        module == "torch" or module.startswith("torch.") or getattr(operator, target.__name__, None) is target
    )
