"""fusionnet.dag.costs against independent references: an analytic count from a tiny GPT's architecture,
FlopCounterMode on the whole model (forward and backward), its torch.export spelling, and hand counts.
"""

from __future__ import annotations

import math
import operator
import time
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from fusionnet.dag import flop_rules as R
from fusionnet.dag.costs import FlopBreakdown, NodeCost, flop_breakdown, op_cost, op_name
from fusionnet.errors import IRError, TraceError

aten = torch.ops.aten
B, T, D, H, V, LAYERS = 2, 64, 128, 4, 256, 2


# --- the tiny GPT ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.register_buffer("mask", torch.tril(torch.ones(T, T, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, H, c // H).transpose(1, 2)
        k = k.view(b, t, H, c // H).transpose(1, 2)
        v = v.view(b, t, H, c // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // H))
        att = att.masked_fill(~self.mask, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings

    def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class _NoLeaf(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False


class CostInterpreter(fx.Interpreter):
    """Runs a graph on real tensors and costs every call_function / call_method node."""

    def __init__(self, gm: nn.Module, grad_of: Any = None) -> None:
        super().__init__(gm)
        self.grad_of = grad_of
        self.costs: list[tuple[fx.Node, NodeCost, Any]] = []
        self.seconds: list[float] = []

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op in ("call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            target = n.target if n.op == "call_function" else f"method:{n.target}"
            owned = sum(a.numel() * 4 for a in tree_leaves((args, kwargs)) if isinstance(a, nn.Parameter))
            start = time.perf_counter()
            cost = op_cost(target, args, kwargs, result, param_bytes=owned, requires_grad=self.grad_of)
            split = flop_breakdown(target, args, kwargs, result, requires_grad=self.grad_of)
            self.seconds.append(time.perf_counter() - start)
            self.costs.append((n, cost, split))
        return result

    def total(self) -> NodeCost:
        return sum((c for _, c, _ in self.costs), NodeCost(0, 0, 0, 0, 0, 0))

    def counted(self) -> tuple[int, int]:
        return sum(s.counted_fwd for _, _, s in self.costs), sum(s.counted_bwd for _, _, s in self.costs)


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return TinyGPT(), torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


def _interpret(gm: nn.Module, args: tuple[torch.Tensor, ...], grad_of: Any = None) -> CostInterpreter:
    (interp := CostInterpreter(gm, grad_of)).run(*args)
    return interp


def _fx_interpret(gpt: Any, grad_of: Any = None) -> CostInterpreter:
    model, idx, labels = gpt
    gm = fx.GraphModule(model, _NoLeaf().trace(model))
    return _interpret(gm, (idx, labels), grad_of)


def analytic_gpt() -> tuple[int, int, int, int]:
    """(matmul fwd, matmul bwd, total fwd, total bwd) of TinyGPT written from its architecture."""
    n, s = B * T, B * H * T * T  # tokens, attention scores
    ln_fwd = (R.NORM_FWD + 2 * R.NORM_AFFINE) * n * D
    ln_bwd = (R.NORM_BWD + R.NORM_WEIGHT_BWD + R.NORM_BIAS_BWD) * n * D

    def linear(k: int, m: int, bias: bool = True) -> tuple[int, int, int, int]:
        mm = 2 * n * k * m  # every linear input needs a gradient, so backward = grad input + grad weight
        return mm, 2 * mm, n * m * bias, n * m * bias

    mm_f = mm_b = other_f = other_b = 0
    layer = [linear(D, 3 * D), linear(D, D), linear(D, 4 * D), linear(4 * D, D)]
    attn_mm = 2 * 2 * s * (D // H)  # q @ k^T and att @ v
    for _ in range(LAYERS):
        for mf, mb, of, ob in layer:
            mm_f, mm_b, other_f, other_b = mm_f + mf, mm_b + mb, other_f + of, other_b + ob
        mm_f, mm_b = mm_f + attn_mm, mm_b + 2 * attn_mm
        other_f += 2 * ln_fwd + s * (1 + 1 + R.SOFTMAX_FWD) + T * T  # scale, masked_fill, softmax, ~mask
        # (fx evaluates ~mask on the concrete buffer at trace time; torch.export keeps it as an op)
        other_b += 2 * ln_bwd + s * (1 + 1 + R.SOFTMAX_BWD)
        other_f += 2 * n * D + R.GELU_FWD * n * 4 * D  # two residual adds, GELU
        other_b += 2 * 2 * n * D + R.GELU_BWD * n * 4 * D  # residual add: both operands need grad
    head = linear(D, V, bias=False)
    mm_f, mm_b = mm_f + head[0], mm_b + head[1]
    other_f += n * D + ln_fwd + R.LOG_SOFTMAX_FWD * n * V + R.NLL * n  # wte + wpe, ln_f, cross entropy
    other_b += 2 * n * D + R.EMBEDDING_BWD * (n + T) * D + ln_bwd + R.LOG_SOFTMAX_BWD * n * V + R.NLL * n
    return mm_f, mm_b, mm_f + other_f, mm_b + other_b


def _whole_model_flop_counter(gpt: Any) -> tuple[int, int]:
    model, idx, labels = gpt
    with FlopCounterMode(display=False) as fwd:
        loss = model(idx, labels)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return fwd.get_total_flops(), bwd.get_total_flops()


def _close(a: int, b: int, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


# --- acceptance: tiny GPT -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_gpt_fx_matches_analytic_and_flop_counter(gpt: Any) -> None:
    interp = _fx_interpret(gpt, grad_of=lambda t: t.requires_grad)
    total = interp.total()
    mm_f, mm_b, fwd, bwd = analytic_gpt()
    # The brief asks for 5%; the rules reproduce the architecture count to within the ~mask that fx
    # folds into a constant (2 * T * T FLOPs), so hold it to 0.1% to catch a rule that drifts.
    assert _close(total.flops_fwd, fwd, 0.001), (total.flops_fwd, fwd)
    assert total.flops_bwd == bwd
    fc_fwd, fc_bwd = _whole_model_flop_counter(gpt)
    # The matmul part is exactly what FlopCounterMode sees, forward and backward.
    assert interp.counted() == (mm_f, mm_b) == (fc_fwd, fc_bwd)
    assert _close(total.flops_bwd, fc_bwd, 0.05), (total.flops_bwd, fc_bwd)
    # Parameters: every trainable tensor owned by some op; the tied weight is read by two ops.
    model = gpt[0]
    assert total.param_bytes == 4 * (sum(p.numel() for p in model.parameters()) + model.wte.weight.numel())


@pytest.mark.timeout(120)
def test_gpt_default_grad_rule_is_close_and_fast(gpt: Any) -> None:
    """The tracer's default (every float input needs a gradient) stays within 5% on this model."""
    interp, (_, _, fwd, bwd) = _fx_interpret(gpt), analytic_gpt()
    total = interp.total()
    assert _close(total.flops_fwd, fwd, 0.05) and _close(total.flops_bwd, bwd, 0.05)
    assert sum(interp.seconds) < 2.0, sum(interp.seconds)
    assert sorted(interp.seconds)[len(interp.seconds) // 2] < 1e-3  # median node well under 1 ms


@pytest.mark.timeout(180)
def test_gpt_export_agrees_with_fx(gpt: Any) -> None:
    model, idx, labels = gpt
    exported = torch.export.export(model, (idx, labels), strict=False)
    ep = _interpret(exported.module(), (idx, labels))
    assert any(isinstance(n.target, torch._ops.OpOverload) for n, _, _ in ep.costs)
    fx_total, ep_total = _fx_interpret(gpt).total(), ep.total()
    for field in ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written", "activation_bytes"):
        a, b = getattr(fx_total, field), getattr(ep_total, field)
        assert _close(a, b, 0.02), (field, a, b)


# --- matmul family against FlopCounterMode --------------------------------------------------------
def _flop_counter(fn: Any, tensors: list[torch.Tensor], grad: list[bool]) -> tuple[int, int, Any]:
    """FlopCounterMode's forward and backward counts of ``fn`` on clones with the given grad flags."""
    leaves = [t.detach().clone().requires_grad_(g) for t, g in zip(tensors, grad)]
    with FlopCounterMode(display=False) as fwd:
        out = fn(*leaves)
    with FlopCounterMode(display=False) as bwd:
        torch.autograd.grad(out, [t for t in leaves if t.requires_grad], torch.ones_like(out))
    return fwd.get_total_flops(), bwd.get_total_flops(), out.detach()


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


MATMULS = [
    (torch.matmul, [_r(3, 4, 5), _r(5, 6)]),
    (torch.matmul, [_r(2, 3, 4, 5), _r(2, 3, 5, 6)]),
    (torch.matmul, [_r(4, 5), _r(2, 5, 6)]),
    (torch.matmul, [_r(2, 1, 4, 5), _r(3, 5, 6)]),
    (torch.matmul, [_r(5), _r(5, 6)]),
    (operator.matmul, [_r(3, 4, 5), _r(3, 5, 2)]),
    ("method:matmul", [_r(4, 5), _r(5, 3)]),
    (torch.mm, [_r(4, 5), _r(5, 6)]),
    (aten.mm.default, [_r(4, 5), _r(5, 6)]),
    (torch.bmm, [_r(3, 4, 5), _r(3, 5, 6)]),
    (F.linear, [_r(3, 4, 5), _r(6, 5), _r(6)]),
    (aten.linear.default, [_r(7, 5), _r(6, 5)]),
    (F.linear, [_r(5), _r(6, 5)]),
    (torch.addmm, [_r(6), _r(4, 5), _r(5, 6)]),
    (aten.baddbmm.default, [_r(3, 4, 6), _r(3, 4, 5), _r(3, 5, 6)]),
]


def _callable(target: Any) -> Any:
    return (lambda s, *a: getattr(s, target[7:])(*a)) if isinstance(target, str) else target


@pytest.mark.parametrize("target,tensors", MATMULS, ids=lambda v: getattr(v, "__name__", str(v))[:30])
def test_matmul_family_matches_flop_counter(target: Any, tensors: list[torch.Tensor]) -> None:
    fwd, bwd, out = _flop_counter(_callable(target), tensors, [True] * len(tensors))
    split = flop_breakdown(target, tuple(tensors), {}, out)
    assert (split.counted_fwd, split.counted_bwd) == (fwd, bwd)
    has_bias = len(tensors) == 3
    assert split.other_fwd == split.other_bwd == (out.numel() if has_bias else 0)
    # Only one product operand needs a gradient (the other is data): half the product work.
    one = tensors[-1 - has_bias]
    assert (
        flop_breakdown(target, tuple(tensors), {}, out, requires_grad=lambda t: t is one).counted_bwd == fwd
    )
    assert op_cost(target, tuple(tensors), {}, out, needs_grad=False).flops_bwd == 0


def test_vector_products_are_counted_outside_flop_counter() -> None:
    a, b = _r(4, 5), _r(5)  # mv: FlopCounterMode sees no mm, we count it as "other"
    assert flop_breakdown(torch.matmul, (a, b), {}, a @ b) == FlopBreakdown(0, 0, 2 * 4 * 5, 2 * 2 * 4 * 5)


CONVS = [
    (F.conv1d, [_r(2, 4, 11), _r(6, 4, 3), _r(6)], {}),
    (F.conv1d, [_r(4, 11), _r(6, 4, 3)], {}),  # unbatched
    (F.conv2d, [_r(2, 4, 9, 9), _r(6, 2, 3, 3)], {"stride": 2, "padding": 1, "groups": 2}),
    (F.conv3d, [_r(1, 2, 5, 6, 7), _r(3, 2, 2, 3, 2), _r(3)], {"dilation": 1}),
    (F.conv_transpose2d, [_r(2, 4, 5, 5), _r(4, 3, 3, 3)], {"stride": 2, "padding": 1}),
]


@pytest.mark.parametrize("fn,tensors,kw", CONVS)
def test_conv_matches_flop_counter(fn: Any, tensors: list[torch.Tensor], kw: dict[str, Any]) -> None:
    for grad in ([True] * len(tensors), [False, True, True][: len(tensors)]):
        fwd, bwd, out = _flop_counter(lambda *t: fn(*t, **kw), tensors, grad)
        flags = {id(t): g for t, g in zip(tensors, grad)}
        split = flop_breakdown(fn, tuple(tensors), kw, out, requires_grad=lambda t, f=flags: f[id(t)])
        assert (split.counted_fwd, split.counted_bwd) == (fwd, bwd), grad
        bias = out.numel() if len(tensors) == 3 else 0
        assert (split.other_fwd, split.other_bwd) == (bias, bias)


def test_aten_convolution_matches_functional() -> None:
    x, w, b = _r(2, 3, 8, 8), _r(4, 3, 3, 3), _r(4)
    out = F.conv2d(x, w, b, padding=1)
    ref = op_cost(F.conv2d, (x, w, b), {"padding": 1}, out)
    args = (x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert op_cost(aten.convolution.default, args, {}, out) == ref


def test_sdpa_uses_flop_counter_formulas_and_matches_plain_attention() -> None:
    q, k, v = _r(2, 4, 16, 8), _r(2, 4, 12, 8), _r(2, 4, 12, 8)
    out = F.scaled_dot_product_attention(q, k, v)
    split = flop_breakdown(F.scaled_dot_product_attention, (q, k, v), {}, out)
    assert split.counted_fwd == sdpa_flop_count(q.shape, k.shape, v.shape)
    assert split.counted_bwd == sdpa_backward_flop_count(out.shape, q.shape, k.shape, v.shape)
    # The same attention spelt with plain ops costs the same forward.
    scores = q @ k.transpose(-2, -1)
    scaled = scores * 0.125
    probs = F.softmax(scaled, dim=-1)
    plain = [
        op_cost(torch.matmul, (q, k.transpose(-2, -1)), {}, scores),
        op_cost(operator.mul, (scores, 0.125), {}, scaled),
        op_cost(F.softmax, (scaled,), {"dim": -1}, probs),
        op_cost(torch.matmul, (probs, v), {}, probs @ v),
    ]
    assert sum(c.flops_fwd for c in plain) == split.fwd
    causal = flop_breakdown(aten.scaled_dot_product_attention.default, (q, q, q), {"is_causal": True}, q)
    plain_causal = flop_breakdown(F.scaled_dot_product_attention, (q, q, q), {}, q)
    assert causal.other_fwd - plain_causal.other_fwd == 2 * 4 * 16 * 16  # the mask: one op per score
    assert op_cost(F.scaled_dot_product_attention, (q, k, v), {}, out, needs_grad=False).flops_bwd == 0


# --- other rules against hand counts --------------------------------------------------------------
def test_pooling_costs_kernel_area_per_output() -> None:
    x = _r(2, 3, 9, 9)
    out = F.max_pool2d(x, 3, stride=2)
    cost = op_cost(F.max_pool2d, (x, 3), {"stride": 2}, out)
    assert (cost.flops_fwd, cost.flops_bwd) == (9 * out.numel(), out.numel())
    pool = aten.max_pool2d_with_indices.default
    assert op_cost(pool, (x, [3, 3], [2, 2]), {}, pool(x, [3, 3], [2, 2])).flops_fwd == cost.flops_fwd
    avg = F.avg_pool2d(x, (2, 3))
    cost = op_cost(F.avg_pool2d, (x, (2, 3)), {}, avg)
    assert (cost.flops_fwd, cost.flops_bwd) == (6 * avg.numel(), 6 * avg.numel())
    ada = F.adaptive_avg_pool2d(x, 1)
    assert op_cost(F.adaptive_avg_pool2d, (x, 1), {}, ada).flops_fwd == x.numel()
    x1 = _r(2, 3, 8)
    assert op_cost(F.max_pool1d, (x1, 2), {}, F.max_pool1d(x1, 2)).flops_fwd == 2 * 2 * 3 * 4


def test_embedding_gathers_bytes_and_scatters_gradient() -> None:
    w, idx = _r(50, 16), torch.tensor([[1, 2, 2, 7]])
    out = F.embedding(idx, w)
    cost = op_cost(F.embedding, (idx, w), {}, out, param_bytes=w.numel() * 4)
    assert cost == NodeCost(0, out.numel(), idx.numel() * 8 + out.numel() * 4, out.numel() * 4, 50 * 64, 256)
    aten_cost = op_cost(aten.embedding.default, (w, idx), {}, out, param_bytes=w.numel() * 4)
    assert aten_cost == cost  # ATen spells it (weight, indices)
    assert op_cost(F.embedding, (idx, w), {}, out, requires_grad=lambda t: False).flops_bwd == 0


def test_views_cost_nothing_and_copies_cost_bytes() -> None:
    x = _r(4, 6)
    for target, args, out in [
        ("method:transpose", (x, 0, 1), x.transpose(0, 1)),
        ("method:view", (x, 24), x.view(24)),
        ("method:contiguous", (x,), x.contiguous()),
        (operator.getitem, (x, (slice(None), 2)), x[:, 2]),
        ("method:expand", (x[:1], 5, 6), x[:1].expand(5, 6)),
    ]:
        cost = op_cost(target, args, {}, out)
        assert cost == NodeCost(0, 0, 0, 0, 0, out.numel() * 4), target
    xt = x.t()
    copied = op_cost("method:reshape", (xt, 24), {}, xt.reshape(24))
    assert copied == NodeCost(0, 0, 96, 96, 0, 96)
    assert op_cost("method:float", (x,), {}, x.float()) == NodeCost(0, 0, 0, 0, 0, 96)  # a no-op
    assert op_cost("method:double", (x,), {}, x.double()) == NodeCost(0, 0, 96, 192, 0, 192)
    parts = x.split(2)
    assert op_cost("method:split", (x, 2), {}, parts) == NodeCost(0, 0, 0, 0, 0, 96)
    picked = x[torch.tensor([0, 2])]  # advanced indexing gathers rows; the gradient scatters back
    gathered = op_cost(operator.getitem, (x, torch.tensor([0, 2])), {}, picked)
    assert (gathered.flops_fwd, gathered.flops_bwd, gathered.bytes_written) == (0, 12, 48)
    assert op_cost("method:size", (x,), {}, x.size()) == NodeCost(0, 0, 0, 0, 0, 0)
    assert op_cost(operator.floordiv, (128, 4), {}, 32) == NodeCost(0, 0, 0, 0, 0, 0)


def test_elementwise_rules() -> None:
    x, row = _r(8, 16), _r(16)
    y = x + row
    add = op_cost(operator.add, (x, row), {}, y)
    assert add == NodeCost(128, 2 * 128, (128 + 16) * 4, 512, 0, 512)
    assert op_cost(aten.add.Tensor, (x, row), {}, y) == add
    assert op_cost("method:__radd__", (x, row), {}, y) == add
    assert op_cost(operator.iadd, (x.clone(), row), {}, y).flops_fwd == 128
    assert op_cost("method:add_", (x.clone(), row), {}, y).flops_bwd == 256
    assert op_cost(operator.mul, (x, x), {}, x * x).flops_bwd == 2 * 128  # both operands get a gradient
    assert op_cost(operator.mul, (x, 2.0), {}, x * 2).flops_bwd == 128
    assert op_cost(operator.gt, (x, 0), {}, x > 0) == NodeCost(128, 0, 512, 128, 0, 128)
    gelu = op_cost(F.gelu, (x,), {}, F.gelu(x))
    assert (gelu.flops_fwd, gelu.flops_bwd) == (R.GELU_FWD * 128, R.GELU_BWD * 128)
    assert op_cost(torch.pow, (x, 2), {}, x**2).flops_fwd == 128
    assert op_cost(torch.pow, (x, 0.5), {}, x**0.5).flops_fwd == (2 * R.TRANSCENDENTAL + 1) * 128
    assert op_cost(torch.max, (x, x), {}, torch.max(x, x)).flops_fwd == 128
    assert op_cost(torch.max, (x, 1), {}, torch.max(x, 1)).flops_fwd == 128
    assert op_cost(torch.sum, (x,), {}, x.sum()) == NodeCost(128, 128, 512, 4, 0, 4)


def test_softmax_matches_softmax_spelt_with_plain_ops() -> None:
    x = _r(8, 16)
    m = x.amax(-1, keepdim=True)
    e = (x - m).exp()
    s = e.sum(-1, keepdim=True)
    steps = [
        op_cost("method:amax", (x, -1), {"keepdim": True}, m),
        op_cost(operator.sub, (x, m), {}, x - m),
        op_cost("method:exp", (x - m,), {}, e),
        op_cost("method:sum", (e, -1), {"keepdim": True}, s),
        op_cost(operator.truediv, (e, s), {}, e / s),
    ]
    fused = op_cost(F.softmax, (x,), {"dim": -1}, F.softmax(x, -1))
    assert fused.flops_fwd == sum(c.flops_fwd for c in steps) == R.SOFTMAX_FWD * 128
    assert op_cost(aten._softmax.default, (x, -1, False), {}, F.softmax(x, -1)).flops_fwd == fused.flops_fwd


def test_norms_count_affine_terms_in_either_argument_order() -> None:
    x, w, b = _r(4, 6, 5), _r(6), _r(6)
    rm, rv = torch.zeros(6), torch.ones(6)
    out = F.batch_norm(x, rm, rv, w, b, training=True)
    ref = op_cost(F.batch_norm, (x, rm.clone(), rv.clone(), w, b, True), {}, out)
    per = R.NORM_FWD + 2 * R.NORM_AFFINE
    assert ref.flops_fwd == per * x.numel()
    grads = [x, w, b]
    exact = op_cost(
        F.batch_norm, (x, rm, rv, w, b, True), {}, out, requires_grad=lambda t: any(t is g for g in grads)
    )
    assert exact.flops_bwd == (R.NORM_BWD + R.NORM_WEIGHT_BWD + R.NORM_BIAS_BWD) * x.numel()
    aten_args = (x, w, b, rm, rv, True, 0.1, 1e-5, False)
    assert op_cost(aten.batch_norm.default, aten_args, {}, out).flops_fwd == ref.flops_fwd
    ln = op_cost(F.layer_norm, (x, (5,)), {}, F.layer_norm(x, (5,)))
    assert (ln.flops_fwd, ln.flops_bwd) == (R.NORM_FWD * x.numel(), R.NORM_BWD * x.numel())


def test_cross_entropy_spellings_agree() -> None:
    logits, labels = _r(6, 10), torch.tensor([1, 0, 3, 9, 2, 2])
    loss = F.cross_entropy(logits, labels)
    cost = op_cost(F.cross_entropy, (logits, labels), {}, loss)
    assert cost.flops_fwd == R.LOG_SOFTMAX_FWD * 60 + R.NLL * 6
    assert cost.flops_bwd == R.LOG_SOFTMAX_BWD * 60 + R.NLL * 6
    assert op_cost(aten.cross_entropy_loss.default, (logits, labels), {}, loss) == cost
    lsm = F.log_softmax(logits, -1)
    nll = op_cost(F.nll_loss, (lsm, labels), {}, F.nll_loss(lsm, labels))
    split = op_cost(F.log_softmax, (logits, -1), {}, lsm).flops_fwd + nll.flops_fwd
    assert split == cost.flops_fwd


def test_dropout_costs_only_in_training() -> None:
    x = _r(10, 10)
    off = op_cost(F.dropout, (x,), {"p": 0.5, "training": False}, F.dropout(x, 0.5, False))
    assert off == NodeCost(0, 0, 0, 0, 0, 400)
    cost = op_cost(F.dropout, (x,), {"p": 0.5}, F.dropout(x, 0.5))
    assert (cost.flops_fwd, cost.flops_bwd) == (R.DROPOUT_FWD * 100, R.DROPOUT_BWD * 100)


def test_unknown_ops_are_probed_or_defaulted_never_raise() -> None:
    a, b = _r(3, 4, 5), _r(3, 5, 6)
    out = torch.einsum("bij,bjk->bik", a, b)
    fwd, bwd, _ = _flop_counter(lambda x, y: torch.einsum("bij,bjk->bik", x, y), [a, b], [True, True])
    assert op_cost(torch.einsum, ("bij,bjk->bik", a, b), {}, out).flops_fwd == fwd
    assert op_cost(torch.einsum, ("bij,bjk->bik", a, b), {}, out).flops_bwd == bwd
    x = _r(7, 9)
    diff = torch.diff(x)  # no rule and no matmul inside: one FLOP per output element
    assert op_cost(torch.diff, (x,), {}, diff) == NodeCost(diff.numel(), 2 * diff.numel(), 252, 224, 0, 224)
    before = x.clone()
    out = x.clone().exponential_()
    op_cost("method:exponential_", (x,), {}, out)  # probed on meta copies: the real input is untouched
    assert torch.equal(x, before)
    calls = []

    def user_fn(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t * 3

    assert op_cost(user_fn, (x,), {}, x * 3).flops_fwd == x.numel()
    assert calls == []  # user code is never re-run for a probe


def test_rule_table_is_consistent() -> None:
    from fusionnet.dag.op_call import OpCall

    for name, rule in R.RULES.items():
        assert rule.why, name
        assert hasattr(OpCall, f"_flops_{rule.kind}"), (name, rule.kind)
    assert op_name(aten.mm.default) == op_name(aten.mm) == op_name(torch.mm) == "mm"
    assert op_name("method:__rmul__") == op_name(operator.imul) == op_name("method:mul_") == "mul"
    assert op_name(operator.truediv) == "div" and op_name(aten._softmax.default) == "_softmax"


# --- NodeCost record and errors -------------------------------------------------------------------
def test_node_cost_round_trip_and_validation() -> None:
    cost = NodeCost(1, 2, 3, 4, 5, 6)
    assert NodeCost.from_dict(cost.to_dict()) == cost
    assert NodeCost.from_dict({**cost.to_dict(), "future_field": 9}) == cost
    assert cost + cost == NodeCost(2, 4, 6, 8, 10, 12)
    with pytest.raises(IRError, match="flops_bwd"):
        NodeCost.from_dict({k: v for k, v in cost.to_dict().items() if k != "flops_bwd"})
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(IRError, match="bytes_read"):
            NodeCost.from_dict({**cost.to_dict(), "bytes_read": bad})
    with pytest.raises(IRError, match="mapping"):
        NodeCost.from_dict([1, 2])  # type: ignore[arg-type]


def test_op_cost_rejects_bad_calls() -> None:
    x = _r(2, 2)
    with pytest.raises(TraceError, match="param_bytes"):
        op_cost(operator.add, (x, x), {}, x + x, param_bytes=-1)
    with pytest.raises(TraceError, match="method:"):
        op_cost("view", (x, 4), {}, x.view(4))
    with pytest.raises(TraceError, match="target"):
        op_cost(42, (x,), {}, x)
    with pytest.raises(TraceError, match="args"):
        op_cost(operator.neg, x, {}, -x)  # type: ignore[arg-type]


def test_a_tied_weight_across_a_cut_is_timed_once_per_step() -> None:
    from fusionnet.dag.row_lookup import row_lookups
    from fusionnet.job.loader import load_job
    from fusionnet.perfmodel.placement_cost import evaluate_assignment
    from fusionnet.perfmodel.types import Link, Swarm, Workload
    from fusionnet.planning.costgraph import cost_graph, traded_bytes
    from fusionnet.runtime.prepare import trace_job
    from tests.jobfiles import REPO
    from tests.planning_support import device as make_device

    graph = trace_job(load_job(REPO / "examples" / "gpt" / "job.yaml")).graph
    (var,) = [n for n in graph.nodes if n.kind == "variable"]
    cg = cost_graph(graph, "sgd", microbatches=4)
    step_edges = {(a, b): nbytes for a, b, nbytes in cg.step_edges}
    # the lookup's side gets the rows of the step's tokens (``dag.row_lookup``), at most the whole matrix
    rows = traded_bytes(graph, row_lookups(graph)[var.name], 1.0, 4)
    assert step_edges and set(step_edges.values()) == {min(int(var.cost["activation_bytes"]), rows)}
    # cut right after the embedding: the head on the other device reads the tied weight
    names = [op.name for op in cg.ops]
    consumer = next(b for a, b in step_edges)
    cut = names.index(consumer)
    assignment = {name: 0 if i < cut else 1 for i, name in enumerate(names)}
    device = make_device("d", flops=1e10)
    swarm = Swarm((device, device), {}, Link.from_bandwidth(1e-3, 1.25e8))
    cost = evaluate_assignment(cg, swarm, Workload(4, "train", "gpipe"), assignment)
    (transfer,) = cost.transfers
    assert transfer.once_bytes == min(int(var.cost["activation_bytes"]), rows)
    assert transfer.fwd_once == pytest.approx(transfer.once_bytes / 1.25e8)
    # per step the link carries the weight once each way, not once per micro-batch
    m = 4
    assert cost.link_loads[(0, 1)] == pytest.approx(m * transfer.fwd + transfer.fwd_once)


def test_an_infer_placement_holds_a_tied_weight_instead_of_timing_it() -> None:
    """Inference keeps a parameter read across a cut where it went (``SubDagExecutor.resident``): the
    model still counts the copy's bytes, but no time per step and nothing per micro-batch."""
    import dataclasses

    from fusionnet.job.loader import load_job
    from fusionnet.perfmodel.placement_cost import evaluate_assignment
    from fusionnet.perfmodel.types import Link, Swarm, Workload
    from fusionnet.planning.costgraph import cost_graph
    from fusionnet.runtime.prepare import trace_job
    from tests.jobfiles import REPO
    from tests.planning_support import device as make_device

    train = trace_job(load_job(REPO / "examples" / "gpt" / "job.yaml")).graph
    graph = dataclasses.replace(train, task="infer")
    (var,) = [n for n in graph.nodes if n.kind == "variable"]
    cg = cost_graph(graph, None, microbatches=4)
    assert cg.resident_step_edges and not cost_graph(train, "sgd").resident_step_edges
    step_edges = {(a, b): nbytes for a, b, nbytes in cg.step_edges}
    assert set(step_edges.values()) == {int(var.cost["activation_bytes"])}
    edges = {(a, b): nbytes for a, b, nbytes in cg.edges}
    assert all(edges[pair] == 0 for pair in step_edges)
    names = [op.name for op in cg.ops]
    cut = names.index(next(b for a, b in step_edges))
    assignment = {name: 0 if i < cut else 1 for i, name in enumerate(names)}
    device = make_device("d", flops=1e10)
    swarm = Swarm((device, device), {}, Link.from_bandwidth(1e-3, 1.25e8))
    cost = evaluate_assignment(cg, swarm, Workload(4, "infer", "gpipe"), assignment)
    (transfer,) = cost.transfers
    assert transfer.once_bytes == int(var.cost["activation_bytes"]) and transfer.fwd_once == 0.0
