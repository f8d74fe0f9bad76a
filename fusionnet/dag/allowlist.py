"""The curated operator allowlist: the data behind ``registry.py`` (issue 12, deliver 1).

Every name here was reviewed. The list started from what the tracer emits for the bundled examples,
the test models, every loss a job file may name and the ``transformers`` families (GPT-2, BERT,
Llama, Mistral, Qwen2, Gemma, Phi-3; both front ends where they apply), plus the common dense tensor
math a model uses. What is deliberately *absent*, and must stay absent:

- sparse and quantized ops (their kernels trust their index/scale arguments: an IR building a sparse
  tensor with an index of 2e9 and calling ``to_dense`` crashed a compnode);
- uninitialised memory (``empty``, ``new_empty``, ``empty_strided``, ``empty_like``,
  ``resize_``...): it returns whatever the allocator held, other jobs' data included;
- anything ``*unsafe*``, any pointer or storage accessor (``data_ptr``, ``storage``...), private ops
  (leading underscore) except the one assertion ``torch.export`` emits;
- file, RNG-state, thread, hook and autograd-graph access (``from_file``, ``manual_seed``,
  ``register_hook``, ``backward``...), and ``out=`` overloads (they write into a caller's tensor);
- getset attributes (``grad_fn``, ``data``, ``grad``...): ``method:`` names only real methods.

Adding an op: put its name in the right set, say why in the commit, and make sure it is dense,
bounds-checked by torch on CPU, and that every size it takes is covered by ``SIZE_GUARDED``.
"""

from __future__ import annotations


def _words(text: str) -> list[str]:
    """The whitespace-separated names of a block (keeps the lists readable in review)."""
    return text.split()


# Elementwise, reduction, linear-algebra, shape and nn ops shared by ``torch.<fn>`` and ``aten.<fn>``.
_MATH = """
abs absolute acos acosh add addcdiv addcmul addmm addmv addbmm baddbmm all allclose amax amin
any argmax argmin argsort asin asinh atan atan2 atanh bitwise_and bitwise_not bitwise_or bitwise_xor
bmm broadcast_tensors broadcast_to cat ceil chunk clamp clamp_max clamp_min clip clone concat
concatenate contiguous cos cosh count_nonzero cummax cummin cumprod cumsum deg2rad detach diag_embed
diagonal diff div divide dot dsplit einsum eq equal erf erfc erfinv exp exp2 expm1 flatten flip
fliplr flipud float_power floor floor_divide fmax fmin fmod frac gather ge greater greater_equal gt
hsplit hstack hypot index_select isclose isfinite isinf isnan isneginf isposinf kron kthvalue lerp
le less less_equal lgamma log log10 log1p log2 logaddexp logaddexp2 logcumsumexp logical_and
logical_not logical_or logical_xor logit logsumexp lt masked_fill masked_select matmul max maximum
mean median min minimum mm moveaxis movedim msort mul multiply mv nan_to_num nanmean nansum narrow
ne neg negative norm not_equal outer permute pow prod rad2deg reciprocal remainder reshape roll
rot90 round rsqrt rsub scatter scatter_add select sgn sigmoid sign signbit sin sinc sinh softmax
log_softmax sort split sqrt square squeeze stack std std_mean sub subtract sum swapaxes swapdims t
take_along_dim tan tanh tensor_split tensordot topk transpose tril triu true_divide trunc unbind
unflatten unsqueeze var var_mean vsplit vstack where xlogy
relu relu_ sigmoid_ tanh_ dropout alpha_dropout feature_dropout layer_norm group_norm batch_norm
instance_norm rms_norm conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
embedding max_pool1d max_pool2d max_pool3d avg_pool1d adaptive_avg_pool1d adaptive_max_pool1d
cosine_similarity pairwise_distance cdist pixel_shuffle pixel_unshuffle channel_shuffle
selu celu rrelu hardshrink prelu threshold native_layer_norm native_batch_norm
binary_cross_entropy_with_logits hinge_embedding_loss kl_div margin_ranking_loss poisson_nll_loss
cosine_embedding_loss triplet_margin_loss
"""

# Factory ops: allowed only with their sizes checked against the element cap (``SIZE_GUARDED``).
_FACTORIES = """
zeros ones full arange linspace logspace eye rand randn randint rand_like randn_like randint_like
zeros_like ones_like full_like scalar_tensor tensor as_tensor tril_indices triu_indices
repeat_interleave tile
"""

TORCH_FUNCS: frozenset[str] = frozenset(_words(_MATH + _FACTORIES))

# ``torch.nn.functional`` names (what symbolic tracing records for nn layers and losses).
F_FUNCS: frozenset[str] = frozenset(
    _words(
        """
linear bilinear relu relu6 leaky_relu elu selu celu gelu silu mish softplus softsign hardtanh
hardswish hardsigmoid sigmoid tanh logsigmoid tanhshrink softshrink hardshrink glu threshold prelu
rrelu softmax log_softmax softmin dropout dropout1d dropout2d dropout3d alpha_dropout
feature_alpha_dropout layer_norm batch_norm group_norm instance_norm rms_norm local_response_norm
normalize embedding one_hot pad conv1d conv2d conv3d conv_transpose1d conv_transpose2d
conv_transpose3d max_pool1d max_pool2d max_pool3d avg_pool1d avg_pool2d avg_pool3d
adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d
lp_pool1d lp_pool2d pixel_shuffle pixel_unshuffle channel_shuffle scaled_dot_product_attention
cosine_similarity pairwise_distance
cross_entropy nll_loss multi_margin_loss multilabel_margin_loss multilabel_soft_margin_loss
binary_cross_entropy binary_cross_entropy_with_logits mse_loss l1_loss smooth_l1_loss huber_loss
soft_margin_loss hinge_embedding_loss kl_div poisson_nll_loss gaussian_nll_loss
cosine_embedding_loss margin_ranking_loss triplet_margin_loss
"""
    )
)

# ``torch.Tensor`` methods (``method:<name>``); real methods only, never getset attributes.
TENSOR_METHODS: frozenset[str] = frozenset(
    _words(
        _MATH
        + """
add_ sub_ mul_ div_ clamp_ masked_fill_ fill_ zero_ copy_ index_add index_copy index_fill
index_put scatter_reduce expand expand_as repeat view view_as reshape_as type_as to float double
half bfloat16 int long bool byte short type size dim numel nelement element_size is_contiguous
is_floating_point is_complex item new_zeros new_ones new_full
masked_scatter float_power_ pow_ exp_ neg_ sqrt_ abs_ unsqueeze_ squeeze_ transpose_ t_ cpu
tile repeat_interleave softmax log_softmax chunk split unflatten flatten narrow
"""
    )
) - frozenset({"concat", "concatenate", "broadcast_tensors"})

# ``aten.<op>`` packets (what ``torch.export`` emits): the shared math plus export's spellings.
ATEN_OPS: frozenset[str] = frozenset(
    _words(
        _MATH
        + _FACTORIES
        + """
linear add_ sub_ mul_ div_ detach_ alias lift_fresh_copy type_as to view expand expand_as repeat
slice new_ones new_zeros new_full cross_entropy_loss nll_loss nll_loss_nd nll_loss2d gelu silu
silu_ gelu_ mish hardtanh hardswish hardsigmoid leaky_relu elu softplus glu log_sigmoid
scaled_dot_product_attention pad constant_pad_nd one_hot avg_pool2d adaptive_avg_pool2d
max_pool2d_with_indices __and__ __or__ __xor__ __invert__ __lshift__ __rshift__ multi_margin_loss
multilabel_margin_loss binary_cross_entropy mse_loss l1_loss smooth_l1_loss huber_loss
soft_margin_loss masked_fill_ fill_ zero_ copy_ index_add index_copy index_fill scatter_reduce
item _assert_tensor_metadata _assert_scalar
index index_put index_put_
"""
    )
)

# Attributes ``builtins.getattr`` may read (tensor metadata only; no ``grad_fn``, ``data``, ``grad``).
GETATTR_ALLOWED: frozenset[str] = frozenset(
    {"shape", "dtype", "T", "mT", "H", "mH", "ndim", "device", "is_floating_point"}
)

# Python operators fx records as ``operator.<name>``.
OPERATORS: tuple[str, ...] = tuple(
    _words(
        """
add sub mul truediv floordiv mod pow matmul neg pos abs invert and_ or_ xor lshift rshift eq ne lt
le gt ge getitem not_ iadd isub imul itruediv
"""
    )
)

# Substrings no allowed name may contain, whatever the lists above say (checked at import).
FORBIDDEN_SUBSTRINGS: tuple[str, ...] = (
    "sparse",
    "quant",
    "unsafe",
    "data_ptr",
    "storage",
    "empty",
    "from_file",
    "resize",
    "set_",
    "hook",
    "backward",
    "pin_memory",
    "share_memory",
    "mkldnn",
    "_local_scalar",
    "to_padded",
    "nested",
)

# Ops whose output size comes from their arguments: each takes a size check before it runs
# (see ``guards.py``). Keyed by the op's base name, shared across ``torch.``, ``F.``, ``aten.``
# and ``method:``.
SIZE_GUARDED: frozenset[str] = frozenset(
    _words(
        """
zeros ones full arange linspace logspace eye rand randn randint tril_indices triu_indices
new_zeros new_ones new_full expand broadcast_to repeat tile repeat_interleave pad constant_pad_nd
one_hot
"""
    )
)
