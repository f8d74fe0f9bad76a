"""What a deployed causal LM generates within: its context window, vocabulary and end-of-text ids, read
from the deployment's traced graph (and, for ``SlotDecoder`` deployments with KV caches, the request's
window). A deployment whose graph does not look like a causal LM is refused here, with what it has."""

from __future__ import annotations

from typing import Any

import torch

from fusionnet.broker.deployment_run import DeploymentRun
from fusionnet.errors import JobError
from fusionnet.serving.generation import Window


def cached_window(run: DeploymentRun, context: int) -> Window:
    """A ``SlotDecoder`` deployment's window: rows (token, position, slot), logits [batch, vocabulary]."""
    if run.row_shape != (3,) or run.row_dtype != torch.long:
        raise JobError(
            f"generate with KV caches: rows must be (token, position, slot), got {list(run.row_shape)}"
        )
    graph = run.job.graph
    meta = graph.node(graph.output.input_names()[0]).meta
    if not (isinstance(meta, dict) and "shape" in meta and len(meta["shape"]) == 2):
        raise JobError("generate with KV caches: the decoder's output must be logits [batch, vocabulary]")
    return Window(context=context, vocab=int(meta["shape"][1]), dtype=torch.long)


def window_of(run: DeploymentRun) -> Window:
    """A causal LM's context window (the traced sequence length) and vocabulary (its logits' last dim)."""
    if len(run.row_shape) != 1 or run.row_dtype not in (torch.long, torch.int32):
        raise JobError(
            f"generate: the model must read token ids [batch, sequence] as integers, its 'inputs' is "
            f"{list(run.row_shape)} {run.row_dtype}"
        )
    graph = run.job.graph
    meta = graph.node(graph.output.input_names()[0]).meta
    if not (isinstance(meta, dict) and "shape" in meta and len(meta["shape"]) == 3):
        raise JobError("generate: the model's first output must be logits [batch, sequence, vocabulary]")
    return Window(context=run.row_shape[0], vocab=int(meta["shape"][2]), dtype=run.row_dtype)


def end_of_text(ids: list[int], tokenizer: Any, window: Window | None) -> tuple[int, ...]:
    """The deployment's end-of-text ids: the model's and its tokenizer's, those inside the vocabulary
    (a toy config may name GPT-2's 50256 for a vocabulary of 1000: it can never come)."""
    found = set(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos >= 0:
        found.add(eos)
    if window is None:
        return ()
    return tuple(sorted(i for i in found if i < window.vocab))
