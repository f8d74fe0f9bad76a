"""Small models for DAG tests: skip edges across every cut, tuples crossing cuts, shared parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SkipEverywhere(nn.Module):
    """Every block reads the input and every earlier block's output, so any cut is crossed by skips."""

    def __init__(self, width: int = 12, depth: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.scale = nn.Parameter(torch.ones(width))  # a root-level variable read by the last block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for block in self.blocks:
            outs.append(torch.tanh(block(sum(outs))))
        return self.head(outs[-1] * self.scale + outs[1])


class SplitMerge(nn.Module):
    """A tuple-valued op (``chunk``) whose parts are used far apart, plus a tied weight."""

    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, 2 * width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.inp(x).chunk(2, dim=-1)
        h = F.gelu(self.mid(a))
        h = F.linear(h, self.mid.weight) + b  # mid.weight shared by two ops
        return self.out(F.layer_norm(h, h.shape[-1:]))


class Normalised(nn.Module):
    """BatchNorm between two layers: buffers (running statistics, a batch count) that FP changes."""

    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.mid = nn.Linear(width, width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.inp(x)))
        return self.out(torch.tanh(self.mid(h)))


class TwoHeads(nn.Module):
    """Returns a tuple: class scores and a per-sample embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 6)
        self.cls = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(x))
        return self.cls(h), h


class WithBatchMean(nn.Module):
    """Returns per-sample scores and their mean over the batch (not one row per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.cls(x)
        return y, y.mean()


def make_data(model: str, n: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = 12 if model == "skip" else 8
    classes = 3 if model == "skip" else 4
    return torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g)


class Figure3(nn.Module):
    """FusionAI Figure 3 / Table 2: Conv, Add (skip from Input), Pool, Tensor A, Multiply, Concat, Linear."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.A = nn.Parameter(torch.randn(3, 8, 8) * 0.1)  # Tensor A: a variable outside any module
        self.linear = nn.Linear(3 * 4 * 4 + 3 * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        add = self.conv(x) + x
        pool = F.max_pool2d(add, 2)
        mul = self.A * add
        return self.linear(torch.cat([pool.flatten(1), mul.flatten(1)], 1))


def figure3_data(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


class TokenTagger(nn.Module):
    """Per-token classes: (batch, seq) ids -> (batch, classes, seq) logits, as ``cross_entropy`` takes
    them with (batch, seq) targets (some of them ignore_index)."""

    def __init__(self, vocab: int = 40, width: int = 16, classes: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.emb(ids)))).transpose(1, 2)


class HFCausalLM(nn.Module):
    """A tiny random-init GPT-2 from ``transformers`` (nothing downloaded), input and output embeddings tied;
    forward returns the loss, or the logits when no labels are given (infer)."""

    def __init__(
        self, vocab: int = 40, width: int = 32, layers: int = 2, heads: int = 2, positions: int = 16
    ) -> None:
        super().__init__()
        import transformers

        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            n_positions=positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, labels=labels)
        return out.logits if labels is None else out.loss


class HFMaskedLM(nn.Module):
    """A tiny random-init BERT masked LM (tied decoder/embedding weights); forward returns the loss."""

    def __init__(
        self, vocab: int = 40, width: int = 32, layers: int = 2, heads: int = 2, positions: int = 16
    ) -> None:
        super().__init__()
        import transformers

        cfg = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * width,
            max_position_embeddings=positions,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
        self.lm = transformers.BertForMaskedLM(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, labels=labels)
        return out.logits if labels is None else out.loss


def token_data(
    n: int = 16, seq: int = 8, vocab: int = 40, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq), generator=g)
    return ids, ids.clone()


# Decoder families from ``transformers`` configs, tiny and random-init: what each brings to the IR.
# llama: RMSNorm, rotary embeddings (non-persistent ``inv_freq`` buffer), grouped-query attention;
# mistral: the same with its own attention module; qwen2: q/k/v biases; gemma: tied embeddings and a
# non-persistent ``embed_scale`` buffer; phi3: fused qkv and gate/up projections.
HF_DECODERS = ("llama", "mistral", "qwen2", "gemma", "phi3")


def hf_decoder_config(family: str, vocab: int, width: int, layers: int, heads: int, kv_heads: int) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": 2 * width,
        "max_position_embeddings": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(sliding_window=None, **common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "gemma": lambda: transformers.GemmaConfig(head_dim=width // heads, **common),
        "phi3": lambda: transformers.Phi3Config(**common),
    }
    if family not in configs:
        raise ValueError(f"unknown decoder family {family!r}; known: {sorted(configs)}")
    return configs[family]()


class HFDecoder(nn.Module):
    """A tiny random-init causal LM of one ``transformers`` family (``HF_DECODERS``; nothing downloaded);
    forward returns the loss, or the logits when no labels are given (infer)."""

    def __init__(
        self,
        family: str = "llama",
        vocab: int = 40,
        width: int = 32,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
    ) -> None:
        super().__init__()
        import transformers

        cfg = hf_decoder_config(family, vocab, width, layers, heads, kv_heads)
        self.lm = transformers.AutoModelForCausalLM.from_config(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, labels=labels)
        return out.logits if labels is None else out.loss
