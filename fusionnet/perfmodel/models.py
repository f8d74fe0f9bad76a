"""Analytic cost graphs of transformer encoders/decoders (Bert-Large, a GPT-3-style model).

``transformer_blocks``: FusionAI Figure 4's split, one op per sub-DAG: the embedding, then each layer
as an attention block and an FFN block, then the head (Bert-Large: 24 x 2 + 2 = 50). FLOPs are
analytic (multiply-add = 2 FLOPs): per layer QKV ``6bsh^2``, scores and context ``4bs^2h``, output
projection ``2bsh^2``, FFN ``4bsh*f``, plus softmax, GELU, residual and LayerNorm element-wise
work; backward is twice the forward. Activations stashed for backward follow the usual per-layer
accounting (inputs, Q/K/V, attention probabilities, FFN hidden).

``transformer_fine``: the same model at operator granularity (~37 ops per layer: linears, views,
matmuls, softmax, dropout, residual adds, LayerNorm split into its steps) with the real skip edges
(residual streams, the attention mask feeding every layer), about 1000 ops for Bert-Large: the
scheduler's planning-time target.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusionnet.perfmodel.types import CostGraph, OpCost


@dataclass(frozen=True)
class TransformerConfig:
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq: int
    vocab: int
    batch: int = 1  # samples per micro-batch
    elem_bytes: int = 4  # fp32
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "ffn", "seq", "vocab", "batch", "elem_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"transformer config {f} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")


BERT_LARGE = TransformerConfig(layers=24, hidden=1024, heads=16, ffn=4096, seq=512, vocab=30522)
GPT3_24L_4096 = TransformerConfig(layers=24, hidden=4096, heads=32, ffn=16384, seq=2048, vocab=50257)


class _Builder:
    def __init__(self, cfg: TransformerConfig) -> None:
        self.cfg = cfg
        self.ops: list[OpCost] = []
        self.edges: list[tuple[str, str, int]] = []
        self.size: dict[str, int] = {}

    def add(
        self,
        name: str,
        kind: str,
        inputs: tuple[str, ...],
        out_elems: int,
        flops: float,
        params: int = 0,
        *,
        stash_elems: int | None = None,
        view: bool = False,
    ) -> str:
        eb = self.cfg.elem_bytes
        out_bytes = out_elems * eb
        read = sum(self.size[i] for i in inputs) + params * eb
        act = out_bytes if stash_elems is None else stash_elems * eb
        fwd = int(flops)
        self.ops.append(
            OpCost(
                name=name,
                kind=kind,
                flops_fwd=fwd,
                flops_bwd=0 if kind == "placeholder" else 2 * fwd,
                bytes_read=read,
                bytes_written=0 if view else out_bytes,
                param_bytes=params * eb,
                activation_bytes=act if kind != "placeholder" else out_bytes,
                optimizer=self.cfg.optimizer if params else None,
            )
        )
        self.size[name] = out_bytes
        for i in inputs:
            self.edges.append((i, name, self.size[i]))
        return name

    def graph(self) -> CostGraph:
        return CostGraph(tuple(self.ops), tuple(self.edges))


def transformer_blocks(cfg: TransformerConfig, *, causal_lm_head: bool = False) -> CostGraph:
    """Embedding, (attention, FFN) x layers, head: one op each, a chain (FusionAI Figure 4)."""
    b, s, h, f, a, v = cfg.batch, cfg.seq, cfg.hidden, cfg.ffn, cfg.heads, cfg.vocab
    bsh = b * s * h
    g = _Builder(cfg)
    g.size["tokens"] = b * s * 8
    g.ops.append(OpCost("tokens", "placeholder", 0, 0, 0, b * s * 8, 0, b * s * 8))
    x = g.add("embedding", "parametric", ("tokens",), bsh, 11 * bsh, (v + s + 2) * h + 2 * h)
    for i in range(cfg.layers):
        attn_flops = 8 * bsh * h + 4 * b * s * s * h + 5 * b * a * s * s + 9 * bsh
        attn_stash = 7 * bsh + 3 * b * a * s * s
        x = g.add(
            f"layer{i}.attention",
            "parametric",
            (x,),
            bsh,
            attn_flops,
            4 * h * h + 6 * h,
            stash_elems=attn_stash,
        )
        ffn_flops = 4 * bsh * f + 8 * b * s * f + 9 * bsh
        ffn_stash = 3 * bsh + 2 * b * s * f
        x = g.add(
            f"layer{i}.ffn", "parametric", (x,), bsh, ffn_flops, 2 * h * f + f + 3 * h, stash_elems=ffn_stash
        )
    head_flops = 2 * bsh * v + 5 * b * s * v + (0 if causal_lm_head else 2 * bsh * h + 17 * bsh)
    head_params = h * v + v + (0 if causal_lm_head else h * h + 3 * h)
    g.add("head", "loss", (x,), b * s * v, head_flops, head_params, stash_elems=2 * b * s * v)
    return g.graph()


def transformer_fine(cfg: TransformerConfig) -> CostGraph:
    """The same model at operator granularity (module docstring); a DAG with skip edges."""
    b, s, h, f, a, v = cfg.batch, cfg.seq, cfg.hidden, cfg.ffn, cfg.heads, cfg.vocab
    bsh, bss = b * s * h, b * a * s * s
    g = _Builder(cfg)
    for name, elems in (
        ("input_ids", b * s * 2),
        ("token_type_ids", b * s * 2),
        ("attention_mask", b * s * 2),
    ):
        g.size[name] = elems * cfg.elem_bytes
        g.ops.append(OpCost(name, "placeholder", 0, 0, 0, elems * cfg.elem_bytes, 0, elems * cfg.elem_bytes))
    m = g.add("mask.unsqueeze", "non_parametric", ("attention_mask",), b * s, 0, view=True)
    m = g.add("mask.invert", "non_parametric", (m,), b * s, b * s)
    mask = g.add("mask.scale", "non_parametric", (m,), b * s, b * s)
    we = g.add("emb.word", "parametric", ("input_ids",), bsh, bsh, v * h)
    pe = g.add("emb.position", "parametric", (), bsh, bsh, s * h)
    te = g.add("emb.token_type", "parametric", ("token_type_ids",), bsh, bsh, 2 * h)
    x = g.add("emb.add1", "non_parametric", (we, pe), bsh, bsh)
    x = g.add("emb.add2", "non_parametric", (x, te), bsh, bsh)
    x = _layer_norm(g, "emb.ln", x, bsh, h)
    x = g.add("emb.dropout", "non_parametric", (x,), bsh, bsh)
    for i in range(cfg.layers):
        p = f"layer{i}"
        heads = []
        for t in ("q", "k", "v"):
            y = g.add(f"{p}.{t}_proj", "parametric", (x,), bsh, 2 * bsh * h, h * h + h)
            y = g.add(f"{p}.{t}_view", "non_parametric", (y,), bsh, 0, view=True)
            y = g.add(f"{p}.{t}_permute", "non_parametric", (y,), bsh, 0, view=True)
            heads.append(y)
        kt = g.add(f"{p}.k_transpose", "non_parametric", (heads[1],), bsh, 0, view=True)
        sc = g.add(f"{p}.scores", "non_parametric", (heads[0], kt), bss, 2 * b * s * s * h)
        sc = g.add(f"{p}.scale", "non_parametric", (sc,), bss, bss)
        sc = g.add(f"{p}.add_mask", "non_parametric", (sc, mask), bss, bss)
        pr = g.add(f"{p}.softmax", "non_parametric", (sc,), bss, 5 * bss)
        pr = g.add(f"{p}.attn_dropout", "non_parametric", (pr,), bss, bss)
        c = g.add(f"{p}.context", "non_parametric", (pr, heads[2]), bsh, 2 * b * s * s * h)
        c = g.add(f"{p}.ctx_permute", "non_parametric", (c,), bsh, 0, view=True)
        c = g.add(f"{p}.ctx_contiguous", "non_parametric", (c,), bsh, 0)
        c = g.add(f"{p}.ctx_view", "non_parametric", (c,), bsh, 0, view=True)
        o = g.add(f"{p}.out_proj", "parametric", (c,), bsh, 2 * bsh * h, h * h + h)
        o = g.add(f"{p}.out_dropout", "non_parametric", (o,), bsh, bsh)
        o = g.add(f"{p}.attn_residual", "non_parametric", (o, x), bsh, bsh)
        x = _layer_norm(g, f"{p}.attn_ln", o, bsh, h)
        y = g.add(f"{p}.ffn_in", "parametric", (x,), b * s * f, 2 * bsh * f, h * f + f)
        y = g.add(f"{p}.gelu", "non_parametric", (y,), b * s * f, 8 * b * s * f)
        y = g.add(f"{p}.ffn_out", "parametric", (y,), bsh, 2 * bsh * f, h * f + h)
        y = g.add(f"{p}.ffn_dropout", "non_parametric", (y,), bsh, bsh)
        y = g.add(f"{p}.ffn_residual", "non_parametric", (y, x), bsh, bsh)
        x = _layer_norm(g, f"{p}.ffn_ln", y, bsh, h)
    y = g.add("head.dense", "parametric", (x,), bsh, 2 * bsh * h, h * h + h)
    y = g.add("head.gelu", "non_parametric", (y,), bsh, 8 * bsh)
    y = _layer_norm(g, "head.ln", y, bsh, h)
    logits = g.add("head.decoder", "parametric", (y,), b * s * v, 2 * bsh * v, h * v + v)
    g.size["labels"] = b * s * 2 * cfg.elem_bytes
    g.ops.append(OpCost("labels", "placeholder", 0, 0, 0, g.size["labels"], 0, g.size["labels"]))
    g.add("loss", "loss", (logits, "labels"), 1, 5 * b * s * v, stash_elems=b * s * v)
    return g.graph()


def _layer_norm(g: _Builder, p: str, x: str, n: int, h: int) -> str:
    rows = n // h
    mean = g.add(f"{p}.mean", "non_parametric", (x,), rows, n)
    cen = g.add(f"{p}.center", "non_parametric", (x, mean), n, n)
    var = g.add(f"{p}.var", "non_parametric", (cen,), rows, 2 * n)
    norm = g.add(f"{p}.normalize", "non_parametric", (cen, var), n, 2 * n)
    return g.add(f"{p}.affine", "parametric", (norm,), n, 2 * n, 2 * h)
