"""Text generation over a deployed causal LM: one session per choice, batched per token.

Each session loops: its tokens so far, right-padded to the deployment's context window, go to the
deployment's batcher as one row with the position of its last token (``pick``), and the row's logits
there come back; the next token is sampled (``sampling``) and appended. Sessions of every request share
the batcher, so at each decode iteration the rows of all live sessions travel together (continuous
batching at iteration level: a new session joins the next batch, a finished one leaves), and several
batches are in the pipeline at once.

Why padding is exact: the model is causal, so the logits at position ``t`` depend on tokens ``0..t``
only; what follows the last real token (padding) changes nothing before it.

What this version does not do: keep KV caches on the compnodes. Every token recomputes the whole
window (prefill cost per token); a session is therefore stateless on the swarm, and a batch that
fails on a lost compnode is simply run again on the replacement with the same output.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from fusionnet.serving.answers import Answer, RowAnswers, Submit
from fusionnet.serving.sampling import SamplingParams, generator_for, next_token


def needs_logits(params: SamplingParams, on_logits: Callable[[torch.Tensor], None] | None) -> bool:
    """Whether a session needs its rows' logits: not when it is greedy with nothing to adjust and no one
    looks at them (logprobs). Then the compnode answers the argmax alone (``keep``): the same token,
    since greedy ``next_token`` is the argmax of those very logits (ties: the lowest id either way)."""
    return on_logits is not None or not params.greedy or params.adjusts


def next_of(
    answer: object,
    need: bool,
    params: SamplingParams,
    generator: torch.Generator,
    tokens: list[int],
    prompt_len: int,
    on_logits: Callable[[torch.Tensor], None] | None,
) -> int:
    """The next token from an answer to rows sent with ``keep`` (the last row's): its argmax id as it
    came, or, when the session ``need``s logits, sampled from them (``on_logits`` sees them first)."""
    if not isinstance(answer, RowAnswers):
        raise TypeError("the batcher answered rows sent with keep without RowAnswers")
    if not need:
        return int(answer.ids[-1])
    logits = answer.outputs[-1]
    if on_logits is not None:
        on_logits(logits)
    return next_token(logits, params, generator, tokens, prompt_len)


@dataclass(frozen=True)
class Window:
    """What a deployed causal LM takes: ``context`` token positions of ``dtype``, ids below ``vocab``."""

    context: int
    vocab: int
    dtype: torch.dtype = torch.long
    pad_id: int = 0


def check_prompt(prompt: list[int], max_tokens: int, window: Window) -> str | None:
    """What is wrong with a prompt for this window (None: nothing)."""
    if not prompt:
        return "prompt must hold at least one token"
    bad = next((t for t in prompt if not 0 <= t < window.vocab), None)
    if bad is not None:
        return f"token id {bad} is outside the vocabulary (0..{window.vocab - 1})"
    if len(prompt) + max_tokens > window.context:
        return (
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the deployment's context "
            f"window of {window.context} tokens"
        )
    return None


def ask_ahead(
    submit: Submit, rows: torch.Tensor, pick: list[int], keep: list[bool]
) -> asyncio.Future[Answer]:
    """``submit(rows, ...)`` started now: the batcher's ``enqueue`` (what ``DynamicBatcher.caller``
    hands out) queues the rows before this returns, any other ``submit`` once the loop turns.

    Why: a session asks for its next token's row before it hands the token on. The stream then writes
    that token's chunk while the batch carrying the row already runs, instead of the batch waiting
    for every stream's chunk first (about 0.4 ms of each decode pass with 16 streams)."""
    try:
        return asyncio.ensure_future(submit(rows, pick, keep))
    except Exception as e:  # refused at once (a full queue, an undeployed model): raised where the
        # answer is awaited, after the token in hand has been handed on, as when the row was asked later
        refused: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        refused.set_exception(e)
        return refused


def withdraw(pending: asyncio.Future[Answer] | None) -> None:
    """A row asked ahead that nobody will read (the choice stopped early): out of the queue if no batch
    took it yet; a batch that did drops its answer."""
    if pending is None:
        return
    if not pending.done():
        pending.cancel()
    pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody reads its outcome


async def generate(
    submit: Submit,
    window: Window,
    prompt: list[int],
    max_tokens: int,
    params: SamplingParams,
    seed: int | None,
    choice: int,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> AsyncIterator[int]:
    """The generated token ids, one at a time (``check_prompt`` must have passed); ``on_logits`` sees
    the logits each one was sampled from, just before it comes. The row of the next token is asked for
    before each token is handed on (``ask_ahead``)."""
    generator = generator_for(seed, choice)
    tokens = list(prompt)
    row = torch.full((1, window.context), window.pad_id, dtype=window.dtype)
    row[0, : len(tokens)] = torch.tensor(tokens, dtype=window.dtype)
    need = needs_logits(params, on_logits)
    pending = ask_ahead(submit, row.clone(), [len(tokens) - 1], [need]) if max_tokens > 0 else None
    try:
        while pending is not None:
            answer = await pending
            token = next_of(answer, need, params, generator, tokens, len(prompt), on_logits)
            row[0, len(tokens)] = token
            tokens.append(token)
            last = len(tokens) - len(prompt) == max_tokens
            pending = None if last else ask_ahead(submit, row.clone(), [len(tokens) - 1], [need])
            yield token
    finally:
        withdraw(pending)
