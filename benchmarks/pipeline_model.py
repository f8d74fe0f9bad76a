"""The model of ``benchmarks/pipeline_vs_torch.py``: a stack of identical pre-norm MLP blocks.

Every block is ``x + fc2(gelu(fc1(layer_norm(x))))`` (a transformer block without attention), so all
blocks cost the same and a balanced pipeline split falls on block boundaries. The output of the last
block is used directly as logits over ``dim`` classes (no head), which keeps the stages uniform.

The job file references ``build`` (``model.entrypoint: pipeline_model.py:build``); the torch contenders
import this module and cut ``model.blocks`` at the same boundaries as FusionNet's plan.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    def __init__(self, dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, hidden) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def build(dim: int = 256, hidden: int = 1024, layers: int = 6) -> BlockStack:
    return BlockStack(dim, hidden, layers)


def stage_module(model: BlockStack, first: int, last: int) -> nn.Sequential:
    """Blocks ``first .. last`` (inclusive) of ``model`` as one module (shares the parameters)."""
    return nn.Sequential(*model.blocks[first : last + 1])


# ---- a transformers GPT-2 (``--model gpt2``) ---------------------------------------------------------------
class GPT2(nn.Module):
    """A ``transformers`` GPT-2 (random init, no dropout, untied embeddings: torch's pipeline cannot share
    one parameter between two stages) whose forward returns its own causal-LM loss, as FusionNet's job
    runs it (no ``loss:`` key)."""

    def __init__(self, vocab: int, dim: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        import transformers

        cfg = transformers.GPT2Config(
            vocab_size=vocab, n_embd=dim, n_inner=hidden, n_layer=layers, n_head=heads, n_positions=seq,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
            bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM",
        )  # fmt: skip
        self.lm = transformers.GPT2LMHeadModel(cfg)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels).loss


def build_gpt2(**kwargs: int) -> GPT2:
    return GPT2(**kwargs)


class GPT2Stage(nn.Module):
    """Blocks ``first .. last`` of a ``GPT2`` (sharing its parameters) as one stage of torch's pipeline: the
    first stage embeds the token ids, the last applies the final norm and the head (logits out); the
    causal mask is made as ``GPT2Model.forward`` makes it."""

    def __init__(self, model: GPT2, first: int, last: int) -> None:
        super().__init__()
        t = model.lm.transformer
        self.config = model.lm.config
        self.blocks = nn.ModuleList(t.h[first : last + 1])
        self.embed = nn.ModuleDict({"wte": t.wte, "wpe": t.wpe}) if first == 0 else None
        self.head = (
            nn.ModuleDict({"ln_f": t.ln_f, "lm_head": model.lm.lm_head}) if last == len(t.h) - 1 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        h = x if self.embed is None else self.embed["wte"](x) + self.embed["wpe"](positions)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        for block in self.blocks:
            h = block(h, None, mask, None, position_ids=positions)
        if self.head is not None:
            h = self.head["lm_head"](self.head["ln_f"](h))
        return h


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: each position predicts the next token, mean over the batch's tokens."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))
