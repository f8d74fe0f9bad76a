"""KV-cached decoding for deployed ``transformers`` causal LMs (issue 14): the model a ``generate``
deployment traces when its model holds one.

``SlotDecoder`` wraps the causal LM so that one forward pass advances every row of a batch by ONE token:
a row is ``(token, position, slot)``. The keys and values of every layer live in buffers of
``[slots, kv heads, window, head dim]``, written at ``(slot, position)`` and read back whole for the
row's slot, with an attention mask that lets position ``p`` see positions ``0..p`` only. Traced with
``torch.export``, the writes are in-place ``index_put_`` on the buffers: the IR keeps them as ops on the
sub-DAG's own state, so each compnode keeps the caches of the layers it holds and nothing but the
hidden states crosses a cut. One slot per session; rows of different sessions at different positions
share a batch (continuous batching). Several rows of one slot in a batch (a prompt: positions 0..n-1)
are a prefill: in each layer every row's key and value are written before any row reads its slot,
and a row sees positions up to its own only.

Why the result equals ``generate()``: attention over positions ``0..p`` of a cache that holds exactly
the keys and values those tokens produced is what the model computes for that prefix; stale values of
a slot's earlier session at positions past ``p`` are masked out (weight exactly zero).

Only models whose attention goes through ``transformers``' cache interface (``cache.update``) and
takes ``position_ids`` and a 4D additive mask are supported: GPT-2, the Llama family and Mistral (its
sliding window goes into the mask) among them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fusionnet.errors import JobError

ROW_FIELDS = 3  # token, position, slot


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """The ``transformers`` causal LM in ``model`` (itself or a submodule), if there is exactly one."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    found = [
        m
        for m in model.modules()
        if isinstance(m, PreTrainedModel) and type(m).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    ]
    return found[0] if len(found) == 1 else None


def cache_geometry(lm: nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a ``transformers`` causal LM's attention."""
    cfg = lm.config  # type: ignore[attr-defined]
    layers = int(cfg.num_hidden_layers)
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return layers, heads, head_dim


def sliding_span(lm: nn.Module, window: int) -> int | None:
    """How many positions back every layer attends (Mistral's ``sliding_window``: position ``p`` sees
    ``p - span + 1 .. p``), or None when every layer sees the whole context window. A model whose layers
    mix the two is refused: one mask serves every layer here."""
    cfg = lm.config  # type: ignore[attr-defined]
    span = getattr(cfg, "sliding_window", None)
    if not isinstance(span, int) or isinstance(span, bool) or span <= 0 or span >= window:
        return None  # no sliding window, or one that covers the whole context window anyway
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds:
        if kinds == {"full_attention"}:
            return None
        if kinds != {"sliding_attention"}:
            raise JobError(
                f"KV cache: the layers mix full attention and a sliding window of {span} positions "
                "(one mask serves every layer here)"
            )
    elif getattr(cfg, "use_sliding_window", True) is False:
        return None
    return span


class _SlotCache:
    """What the model's attention layers call ``update`` on: writes this step's key/value of every row
    at (slot, position) and returns the row's whole cache. Duck-typed ``transformers`` cache."""

    def __init__(self, owner: SlotDecoder, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.owner, self.slots, self.positions = owner, slots, positions

    # transformers' Cache API, the parts attention and masking use (its mask helpers read the flags)
    is_compileable = False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.owner.n_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.owner.n_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.owner.n_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        keys = getattr(self.owner, f"kv_k{layer_idx}")
        values = getattr(self.owner, f"kv_v{layer_idx}")
        index = (self.slots, self.positions)
        # [b, heads, 1, d] -> [b, heads, d] at cache[slot, :, position]; the in-place op's result (the
        # buffer itself) is what is read next, so the read depends on the write in the traced graph.
        keys, values = _put(keys, index, key), _put(values, index, value)
        # index_select copies whole [heads, window, dim] blocks; ``keys[slots]`` (aten.index) goes
        # element by element and took twice as long: the largest cost of a decode step on a CPU
        return keys.index_select(0, self.slots), values.index_select(0, self.slots)


def _put(cache: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    slots, positions = index
    # cache[slots, :, positions] = new[:, :, 0]: index_put_ with a full slice over the heads dimension
    heads = torch.arange(cache.shape[1], device=cache.device)[None, :]
    return cache.index_put_((slots[:, None], heads, positions[:, None]), new[:, :, 0].to(cache.dtype))


class SlotDecoder(nn.Module):
    """``forward(rows [b, 3] int64) -> logits [b, vocab]`` of each row's token, caches updated."""

    def __init__(self, lm: nn.Module, slots: int, window: int) -> None:
        super().__init__()
        if slots < 1 or window < 1:
            raise JobError(f"KV cache: slots ({slots}) and window ({window}) must be >= 1")
        self.lm, self.n_slots, self.window = lm, slots, window
        self.n_layers, heads, head_dim = cache_geometry(lm)
        self.span = sliding_span(lm, window)
        dtype = next(lm.parameters()).dtype
        for i in range(self.n_layers):
            self.register_buffer(f"kv_k{i}", torch.zeros(slots, heads, window, head_dim, dtype=dtype))
            self.register_buffer(f"kv_v{i}", torch.zeros(slots, heads, window, head_dim, dtype=dtype))

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"kv_{kv}{i}") for i in range(self.n_layers) for kv in "kv"]

    def clear_caches(self) -> None:
        for cache in self.caches():
            cache.zero_()

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        tokens, positions, slots = rows[:, 0:1], rows[:, 1:2], rows[:, 2]
        seen = torch.arange(self.window, device=rows.device)[None, :]
        allowed = seen <= positions  # [b, window]
        if self.span is not None:  # transformers' sliding window: key k is seen from p when p - span < k
            allowed = allowed & (seen > positions - self.span)
        dtype = self.kv_k0.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=rows.device)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None, None, :]
        cache = _SlotCache(self, slots, positions[:, 0])
        out = self.lm(input_ids=tokens, position_ids=positions, attention_mask=mask, cache=cache)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[:, -1]


def disagreement(model: nn.Module, decoder: SlotDecoder, sequence: torch.Tensor) -> str | None:
    """Why ``decoder`` is not a stand-in for ``model`` (None: it is): the model's own forward pass on one
    example sequence ``[1, window]`` against the decoder's prefill of it, logits at every position. A
    model that does more than return its LM's logits (a bias, a softmax, another head) must not be
    served through its LM alone."""
    window = int(sequence.shape[1])
    rows = torch.stack(
        [sequence[0].to(torch.long), torch.arange(window), torch.zeros(window, dtype=torch.long)], dim=1
    )
    with torch.no_grad():
        want = model(sequence)
        got = decoder(rows)
        decoder.clear_caches()  # leave them as they were (and nothing else: the LM has buffers too)
    want = getattr(want, "logits", want)
    want = want[0] if isinstance(want, (tuple, list)) else want
    if not isinstance(want, torch.Tensor) or want.shape != (1, *got.shape):
        shape = list(want.shape) if isinstance(want, torch.Tensor) else type(want).__name__
        return f"the model answers {shape}, its causal LM's logits are {[1, *got.shape]}"
    diff = float((want[0].float() - got.float()).abs().max())
    scale = float(want.float().abs().max()) or 1.0
    if diff > 1e-4 * max(1.0, scale):
        return f"the model's outputs differ from its causal LM's logits by up to {diff:.3g}"
    return None


def example_rows(rows: int, vocab_sample: torch.Tensor, slots: int) -> torch.Tensor:
    """A traceable example batch: tokens from the job's example data, position 0, distinct slots."""
    flat = vocab_sample.reshape(-1)
    tokens = flat[torch.arange(rows) % flat.numel()].to(torch.long)
    return torch.stack([tokens, torch.zeros(rows, dtype=torch.long), torch.arange(rows) % slots], dim=1)
