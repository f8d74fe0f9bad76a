"""FLOP rules: operator names -> per-element constants, and shape formulas for the matmul family.

Pure functions of names, shapes and numbers; ``costs.py`` looks at real values and applies them.

Convention (``torch.utils.flop_counter``'s): a multiply-add is 2 FLOPs, so a ``(m, k) @ (k, n)``
product costs ``2·m·k·n``. What ``flop_counter`` counts (mm, addmm, bmm, baddbmm, convolution,
attention) is reproduced here with its own formulas, so per-node sums equal its whole-model count.
What it leaves at zero (element-wise math, normalisation, softmax, losses, pooling, reductions) gets
the per-element constants below. Each constant is a count of arithmetic passes, not a hardware
measurement: the performance model turns FLOPs into time with a per-device speed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torch.utils.flop_counter import conv_flop_count

# --- per-element constants (FLOPs per element of the rule's base) --------------------------------
ELEMENTWISE = 1  # one arithmetic instruction per element (add, mul, compare, select)
TRANSCENDENTAL = 4  # exp/log/tanh/erf/sqrt...: vectorised polynomial + range reduction ~ 4 FMA-equivalents
GELU_FWD = 8  # erf (4) + x/sqrt2, 1+, *0.5, *x
GELU_BWD = 16  # cdf (erf 4 + 2) and pdf (exp 4 + 2) re-evaluated, combined with g (4): ~2x forward
# softmax = max, subtract, exp, sum, divide with exp at the transcendental rate, so that F.softmax and
# softmax spelt with plain ops (x - max).exp() / sum cost the same.
SOFTMAX_FWD = ELEMENTWISE * 4 + TRANSCENDENTAL  # 8
SOFTMAX_BWD = 4  # y * (g - sum(g * y)): multiply, row-sum, subtract, multiply
LOG_SOFTMAX_FWD = ELEMENTWISE * 4 + TRANSCENDENTAL  # 8: max, subtract, exp, sum, subtract (log per row)
LOG_SOFTMAX_BWD = TRANSCENDENTAL + 3  # 7: g - exp(y) * sum(g): exp, multiply, row-sum, subtract
NORM_FWD = 5  # mean, subtract, square, variance sum, scale by rstd (rsqrt is per row, negligible)
NORM_AFFINE = 1  # per affine tensor: weight multiply, bias add
NORM_BWD = 2 * NORM_FWD  # grad input needs two row reductions (sum g, sum g*xhat) and the combine
NORM_WEIGHT_BWD = 2  # grad weight = sum(g * xhat): multiply + reduce
NORM_BIAS_BWD = 1  # grad bias = sum(g)
RMS_NORM_FWD = 3  # square, mean, scale (no centring)
NLL = 1  # nll_loss / cross_entropy's pick-and-average: one per target element, forward and backward
EMBEDDING_BWD = 1  # the weight gradient is a scatter-add: one add per output element
REDUCTION = 1  # sum/mean/max...: one op per input element; backward broadcasts (mean: scales) once
DROPOUT_FWD = 2  # draw-and-compare the mask, scale the kept values
DROPOUT_BWD = 1  # the gradient is multiplied by the saved mask
DEFAULT_FWD = 1  # unknown operator: conservatively one FLOP per output element
DEFAULT_BWD = 2  # ... and twice that for its backward when an input needs a gradient


@dataclass(frozen=True)
class Rule:
    """How to cost one family of operators.

    ``kind`` picks the base the constants multiply (see ``costs.py``): ``elementwise`` and ``loss``
    (bwd is per operand that needs a gradient), ``reduction``/``softmax``/``norm`` (per input element),
    ``view``, ``copy``, ``fill``, ``gather``, ``dropout``, ``pool`` and the matmul family (``linear``,
    ``matmul``, ``addmm``, ``conv``, ``sdpa``) that have their own formulas, ``probe`` (run under
    ``FlopCounterMode`` on meta tensors), ``minmax`` and ``pow`` (argument dependent).
    """

    kind: str
    fwd: int = 0
    bwd: int = 0
    why: str = ""


RULES: dict[str, Rule] = {}


def _add(names: str, rule: Rule) -> None:
    for name in names.split():
        assert name not in RULES, f"duplicate flop rule for {name}"
        RULES[name] = rule


# fmt: off
_add("view view_as reshape reshape_as _unsafe_view _reshape_alias transpose t permute getitem flatten "
     "unflatten expand expand_as broadcast_to unsqueeze squeeze contiguous split split_with_sizes "
     "tensor_split chunk unbind narrow select slice as_strided detach alias lift_fresh movedim moveaxis "
     "swapaxes swapdims diagonal unfold real imag view_as_real view_as_complex conj resolve_conj "
     "resolve_neg getattr adjoint",
     Rule("view", why="a new view of the same storage: no arithmetic, no bytes (a copy if it had to copy)"))
_add("cat concatenate stack hstack vstack dstack clone to _to_copy type float double half bfloat16 "
     "int long bool short char byte cpu repeat tile flip fliplr flipud roll rot90 pad constant_pad_nd "
     "reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d "
     "replication_pad3d repeat_interleave copy lift_fresh_copy type_as one_hot",
     Rule("copy", why="data movement only: bytes read and written, no arithmetic, gradient is a slice"))
_add("zeros ones full empty empty_strided arange linspace logspace eye zeros_like ones_like full_like "
     "empty_like rand randn randint rand_like randn_like randint_like new_zeros new_ones new_full new_empty "
     "scalar_tensor tensor as_tensor fill zero tril_indices triu_indices bernoulli normal uniform",
     Rule("fill", why="creates or fills memory from scalars: bytes written only"))
_add("add sub rsub mul multiply div divide true_divide floor_divide remainder fmod neg negative pos "
     "positive abs absolute sign sgn maximum minimum fmax fmin where masked_fill tril triu cumsum "
     "scatter scatter_add scatter_reduce index_add index_copy index_put index_fill masked_scatter "
     "outer ger copysign hypot xlogy",
     Rule("elementwise", ELEMENTWISE, ELEMENTWISE,
          "one arithmetic op per output element; the gradient is one multiply or pass-through per operand"))
_add("eq ne lt le gt ge equal logical_and logical_or logical_not logical_xor bitwise_and bitwise_or "
     "bitwise_xor bitwise_not bitwise_left_shift bitwise_right_shift and or xor invert not lshift rshift "
     "isnan isinf isfinite isclose floor ceil round trunc frac signbit nan_to_num",
     Rule("elementwise", ELEMENTWISE, 0, "one op per element; boolean or piecewise-constant: no gradient"))
_add("relu relu6 hardtanh leaky_relu threshold clamp clip clamp_min clamp_max hardshrink softshrink prelu "
     "rrelu",
     Rule("elementwise", ELEMENTWISE, ELEMENTWISE, "compare and select; backward masks the gradient"))
_add("hardsigmoid", Rule("elementwise", 3, 1, "scale, shift, clamp; backward masks and scales"))
_add("hardswish", Rule("elementwise", 4, 3, "x * hardsigmoid(x); backward is piecewise linear"))
_add("exp expm1", Rule("elementwise", TRANSCENDENTAL, 1, "transcendental; gradient g * y reuses y"))
_add("log", Rule("elementwise", TRANSCENDENTAL, 1, "transcendental; gradient g / x"))
_add("exp2 log2 log10 log1p sqrt", Rule("elementwise", TRANSCENDENTAL, 2,
                                        "transcendental; gradient is g times a scaled reciprocal"))
_add("rsqrt tanh sigmoid tan", Rule("elementwise", TRANSCENDENTAL, 3,
                                    "transcendental; gradient is a 2-op polynomial of the saved output"))
_add("sin cos sinh cosh asin acos atan asinh acosh atanh atan2 arctan2",
     Rule("elementwise", TRANSCENDENTAL, TRANSCENDENTAL + 1, "transcendental; gradient is another one"))
_add("erf erfc erfinv", Rule("elementwise", TRANSCENDENTAL, TRANSCENDENTAL + 2,
                             "transcendental; gradient is a scaled exp(-x^2)"))
_add("reciprocal square", Rule("elementwise", ELEMENTWISE, 2, "one op; gradient 2 ops"))
_add("addcmul lerp", Rule("elementwise", 2, 2, "two ops per element"))
_add("addcdiv", Rule("elementwise", 2, 3, "two ops per element; divisor gradient 3"))
_add("logit", Rule("elementwise", TRANSCENDENTAL + 1, 3, "log(x / (1 - x))"))
_add("silu", Rule("elementwise", TRANSCENDENTAL + 1, 2 * TRANSCENDENTAL,
                  "x * sigmoid(x); gradient re-evaluates sigmoid"))
_add("gelu", Rule("elementwise", GELU_FWD, GELU_BWD, "erf form; see GELU_FWD/GELU_BWD"))
_add("softplus logsigmoid", Rule("elementwise", 2 * TRANSCENDENTAL + 1, TRANSCENDENTAL + 2,
                                 "log(1 + exp(x)); gradient is a sigmoid"))
_add("elu celu selu", Rule("elementwise", TRANSCENDENTAL + 2, 2, "exp on the negative side, scaled"))
_add("mish", Rule("elementwise", 3 * TRANSCENDENTAL + 2, 5 * TRANSCENDENTAL,
                  "x * tanh(softplus(x)); gradient re-evaluates all three"))
_add("pow float_power", Rule("pow", why="integer exponent: repeated multiply; otherwise exp(b * log(a))"))
_add("max min", Rule("minmax", why="two tensors: element-wise maximum; one tensor: a reduction"))
_add("sum mean nansum nanmean amax amin aminmax argmax argmin all any count_nonzero median nanmedian "
     "mode cummax cummin",
     Rule("reduction", REDUCTION, REDUCTION, "one op per input element; backward broadcasts once"))
_add("prod cumprod", Rule("reduction", REDUCTION, 2 * REDUCTION, "products; gradient divides by x"))
_add("norm linalg_vector_norm frobenius_norm", Rule("reduction", 2, 2, "square and sum; gradient g*x/n"))
_add("var std var_mean std_mean", Rule("reduction", 4, 3, "sum, subtract, square, sum"))
_add("logsumexp", Rule("reduction", TRANSCENDENTAL + 3, SOFTMAX_BWD, "max, subtract, exp, sum"))
_add("softmax _softmax softmin special_softmax", Rule("softmax", SOFTMAX_FWD, SOFTMAX_BWD,
                                                      "see SOFTMAX_FWD/SOFTMAX_BWD"))
_add("log_softmax _log_softmax special_log_softmax", Rule("softmax", LOG_SOFTMAX_FWD, LOG_SOFTMAX_BWD,
                                                          "see LOG_SOFTMAX_FWD/LOG_SOFTMAX_BWD"))
_add("layer_norm native_layer_norm group_norm native_group_norm batch_norm native_batch_norm "
     "_native_batch_norm_legit _native_batch_norm_legit_no_training _native_batch_norm_legit_functional "
     "instance_norm",
     Rule("norm", NORM_FWD, NORM_BWD, "centre, scale and optional affine; see NORM_* constants"))
_add("rms_norm _fused_rms_norm", Rule("norm", RMS_NORM_FWD, 2 * RMS_NORM_FWD, "square, mean, scale"))
_add("normalize", Rule("norm", 3, 6, "p-norm (square, sum) then divide"))
_add("cross_entropy cross_entropy_loss", Rule("cross_entropy",
                                              why="log_softmax over the logits + nll pick per target"))
_add("nll_loss nll_loss_nd nll_loss2d nll_loss_forward nll_loss2d_forward",
     Rule("loss", NLL, NLL, "pick one log-probability per target and average; gradient scatters back"))
_add("mse_loss l1_loss", Rule("loss", 3, 2, "subtract, square/abs, sum; gradient 2 ops per element"))
_add("smooth_l1_loss huber_loss", Rule("loss", 4, 3, "subtract, abs, branch, sum"))
_add("binary_cross_entropy", Rule("loss", 2 * TRANSCENDENTAL + 4, 4, "two logs, a blend and a sum"))
_add("binary_cross_entropy_with_logits", Rule("loss", 2 * TRANSCENDENTAL + 6, 6,
                                              "stable log-sigmoid on both sides, blend, sum"))
_add("kl_div poisson_nll_loss", Rule("loss", TRANSCENDENTAL + 2, 3, "a log or exp, a product, a sum"))
_add("soft_margin_loss", Rule("loss", 2 * TRANSCENDENTAL + 2, TRANSCENDENTAL + 2, "softplus of -y*x, mean"))
_add("embedding index_select gather take take_along_dim index masked_select",
     Rule("gather", 0, EMBEDDING_BWD, "a gather moves bytes; its gradient is a scatter-add per element"))
_add("dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout feature_dropout "
     "native_dropout", Rule("dropout", DROPOUT_FWD, DROPOUT_BWD, "mask and scale in training, else a no-op"))
_add("max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices "
     "max_pool3d_with_indices", Rule("pool", 1, 1, "kernel-area compares per output; gradient is routed"))
_add("avg_pool1d avg_pool2d avg_pool3d", Rule("pool", 1, 1, "kernel-area adds per output; gradient spread"))
_add("lp_pool1d lp_pool2d lp_pool3d", Rule("pool", 2, 2, "x^p, kernel-area sum, root"))
_add("adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d _adaptive_avg_pool2d "
     "_adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d",
     Rule("pool", 1, 1, "windows tile the input: one op per input element"))
_add("linear", Rule("linear", why="x @ W.T (+ b): flop_counter's mm formula plus a bias add"))
_add("matmul mm bmm dot vdot mv inner", Rule("matmul", why="flop_counter's mm/bmm formula"))
_add("addmm baddbmm", Rule("addmm", why="flop_counter's mm/bmm formula plus the added input"))
_add("conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d convolution _convolution",
     Rule("conv", why="flop_counter's conv formula (forward and backward) plus a bias add"))
_add("scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu "
     "_scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention "
     "_scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math",
     Rule("sdpa", why="flop_counter's attention formula plus scale, mask and softmax on the scores"))
_add("einsum tensordot bilinear multi_head_attention_forward chain_matmul multi_dot linalg_multi_dot "
     "addbmm addmv addr",
     Rule("probe", why="contractions whose matmuls flop_counter sees once run on meta tensors"))
# fmt: on

# Positions (args index, kwarg name) of the affine weight and bias of each normalisation, for the
# Python (torch.nn.functional) spelling and, where it differs, the ATen one.
AFFINE: dict[str, tuple[tuple[int, str], ...]] = {
    "layer_norm": ((2, "weight"), (3, "bias")),
    "native_layer_norm": ((2, "weight"), (3, "bias")),
    "group_norm": ((2, "weight"), (3, "bias")),
    "native_group_norm": ((1, "weight"), (2, "bias")),
    "batch_norm": ((3, "weight"), (4, "bias")),
    "instance_norm": ((3, "weight"), (4, "bias")),
    "rms_norm": ((2, "weight"),),
    "_fused_rms_norm": ((2, "weight"),),
    "normalize": (),
}
AFFINE_ATEN = {"batch_norm": ((1, "weight"), (2, "bias")), "instance_norm": ((1, "weight"), (2, "bias"))}
# (attn_mask, dropout_p, is_causal) positions of the attention spellings; None = keyword only.
SDPA_ARGS: dict[str, tuple[int | None, int, int]] = {
    "scaled_dot_product_attention": (3, 4, 5),
    "_scaled_dot_product_attention_math": (3, 4, 5),
    "_scaled_dot_product_flash_attention_for_cpu": (None, 3, 4),
    "_scaled_dot_product_flash_attention": (None, 3, 4),
    "_scaled_dot_product_efficient_attention": (3, 5, 6),
    "_scaled_dot_product_cudnn_attention": (3, 5, 6),
}

# Python operator-module names for in-place and reflected forms, mapped to the plain operation.
_OPERATOR_ALIASES = {
    "iadd": "add",
    "isub": "sub",
    "imul": "mul",
    "itruediv": "div",
    "ifloordiv": "floor_divide",
    "imod": "remainder",
    "ipow": "pow",
    "imatmul": "matmul",
    "iand": "and",
    "ior": "or",
    "ixor": "xor",
    "ilshift": "lshift",
    "irshift": "rshift",
    "truediv": "div",
    "floordiv": "floor_divide",
    "mod": "remainder",
    "concat": "cat",
}
_REFLECTED = frozenset(
    {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor"}
)


def normalize_name(name: str) -> str:
    """Maps spellings of one operation to the rule key: ``__radd__``, ``iadd``, ``add_`` -> ``add``."""
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in _REFLECTED:
            name = name[1:]
    name = _OPERATOR_ALIASES.get(name, name)
    if len(name) > 1 and name.endswith("_") and name not in RULES:
        name = name[:-1]  # in-place variant: same arithmetic
    return _OPERATOR_ALIASES.get(name, name)


# --- matmul family: shape formulas ----------------------------------------------------------------
def matmul_flops(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple[int, bool]:
    """FLOPs of ``a @ b`` with torch.matmul's broadcasting, and whether flop_counter counts it.

    flop_counter only knows mm/bmm: products with a 1-D operand on the right (dot, mv) reach other
    kernels that it leaves at zero; we still count them, but report them as not counted.
    """
    if not a_shape or not b_shape:
        raise ValueError(f"matmul of a 0-d tensor: shapes {a_shape} and {b_shape}")
    a = (1, *a_shape) if len(a_shape) == 1 else tuple(a_shape)
    b = (*b_shape, 1) if len(b_shape) == 1 else tuple(b_shape)
    batch = _broadcast(a[:-2], b[:-2])
    m, k, n = a[-2], a[-1], b[-1]
    if b[-2] != k:
        raise ValueError(f"matmul shapes {a_shape} and {b_shape} do not contract")
    return 2 * math.prod(batch) * m * k * n, len(b_shape) >= 2


def _broadcast(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for i in range(1, max(len(x), len(y)) + 1):
        dx = x[-i] if i <= len(x) else 1
        dy = y[-i] if i <= len(y) else 1
        out.append(max(dx, dy) if 1 in (dx, dy) else dx)
    return tuple(reversed(out))


def conv_flops(x: tuple[int, ...], w: tuple[int, ...], out: tuple[int, ...], transposed: bool) -> int:
    """Forward FLOPs of a (batched) convolution: flop_counter's formula."""
    return conv_flop_count(list(x), list(w), list(out), transposed=transposed)


def conv_backward_flops(
    x: tuple[int, ...], w: tuple[int, ...], out: tuple[int, ...], transposed: bool, grad_x: bool, grad_w: bool
) -> int:
    """Backward FLOPs as flop_counter counts ``aten.convolution_backward`` with this output mask."""

    def t(shape: tuple[int, ...]) -> list[int]:
        return [shape[1], shape[0], *shape[2:]]

    flops = 0
    if grad_x:  # grad input is the transposed convolution of grad out with the weight
        flops += conv_flop_count(list(out), list(w), list(x), transposed=not transposed)
    if grad_w:  # grad weight is a convolution of input and grad out with batch and channel swapped
        src, kernel = (out, x) if transposed else (x, out)
        flops += conv_flop_count(t(src), t(kernel), t(w), transposed=False)
    return flops


def sdpa_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...]) -> tuple[int, int, int]:
    """(forward, backward, score elements) of attention on ``(..., L, E)`` tensors.

    Same formulas as flop_counter's ``sdpa_flop_count``/``sdpa_backward_flop_count`` (backward
    recomputes the scores, as fused kernels do), generalised to any number of leading dims;
    grouped-query attention (fewer key heads) costs as if the key heads were broadcast.
    """
    batch = math.prod(_broadcast(tuple(q[:-2]), tuple(k[:-2])))
    length, e, s, ev = q[-2], q[-1], k[-2], v[-1]
    scores = batch * length * s
    fwd = 2 * scores * e + 2 * scores * ev
    bwd = 2 * scores * (3 * e + 2 * ev)
    return fwd, bwd, scores


def pool_area(name: str, kernel: object, out_rank: int) -> int:
    """Elements in one pooling window; ``kernel`` is an int or a sequence as in F.max_pool2d."""
    match = re.search(r"(\d)d", name)
    dims = int(match.group(1)) if match else max(out_rank - 2, 1)
    if isinstance(kernel, int):
        return kernel**dims
    if isinstance(kernel, list | tuple) and all(isinstance(k, int) for k in kernel) and kernel:
        return math.prod(kernel) if len(kernel) > 1 else kernel[0] ** dims
    raise ValueError(f"{name}: kernel_size {kernel!r} is not an int or a sequence of ints")
