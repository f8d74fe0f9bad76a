"""One ``RunResult`` from what the sub-DAGs report, the same way for ``run --local`` and the broker.

State: the sub-DAGs' tensors are merged under the model's ``state_dict`` keys, in its order. Tied keys
take their owner's value; tensors no sub-DAG holds keep their initial values. Tensors the IR reads that
``state_dict()`` leaves out (non-persistent buffers such as rotary ``inv_freq``, constants that
torch.export lifted) travel with the job but are not results: ``weights.safetensors`` loads into the
model with ``load_state_dict(strict=True)``.

Outputs (infer): each micro-batch's output value (a tensor, or a tuple/list/dict of them) is flattened
to its tensor leaves, keyed ``"mb/leaf"`` (``output_tensors``: what a compnode sends the broker and
what ``run --local`` keeps per step). ``join_outputs`` concatenates every leaf over the micro-batches
of every step, in order: leaf 0 is ``outputs`` (interface.md), further leaves ``outputs.1``, ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fusionnet.dag.ir import IRGraph
from fusionnet.errors import ExecutionError
from fusionnet.results.stream_safetensors import TensorMeta, describe

OUTPUTS = "outputs"


@dataclass
class RunResult:
    weights: Mapping[str, torch.Tensor]  # train/grad: keys exactly as in model.state_dict()
    grads: dict[str, torch.Tensor] | None  # grad: the last batch's gradients, same keys
    outputs: torch.Tensor | None  # infer: the model's output (its first tensor), one row per sample
    metrics: list[dict[str, Any]]
    plan: dict[str, Any]
    # infer, a model returning several tensors: the others, "outputs.1", "outputs.2", ...
    more_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    measured_seconds: dict[int, float] = field(default_factory=dict)  # median step, after the first
    # per sub-DAG, per step: (FP, BP, Update) seconds summed over the step's micro-batches
    phase_seconds: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)
    predicted_seconds: dict[int, float] | None = None

    def __repr__(self) -> str:
        # Short on purpose: at the end of ``asyncio.run`` Python 3.11's ``signal.getsignal`` formats
        # the main task, and with it this result, so a full repr printed every tensor of the model
        # (0.5 s for 4M parameters, and growing with the model) after each ``run --local``.
        tensors = len(self.weights) + len(self.grads or {}) + len(self.output_files())
        return f"RunResult({len(self.metrics)} steps, {tensors} tensors)"

    def output_files(self) -> dict[str, torch.Tensor]:
        """The tensors of ``outputs.safetensors``."""
        if self.outputs is None:
            return {}
        return {OUTPUTS: self.outputs, **self.more_outputs}


def assemble_state(
    state_keys: Iterable[str],
    pieces: Iterable[Mapping[str, torch.Tensor]],
    fallback: Mapping[str, torch.Tensor] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Merges the sub-DAGs' tensors into one ``state_dict`` with the model's key order. Tied keys
    take their owner's value; keys no sub-DAG holds (tensors the graph never reads) keep their
    values from ``fallback``, or are left out when there is none (gradients)."""
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for k, v in piece.items():
            merged.setdefault(k, v)
    aliases = aliases or {}
    out: dict[str, torch.Tensor] = {}
    for k in state_keys:
        owner = aliases.get(k, k)
        if owner in merged:
            out[k] = merged[owner].detach().contiguous()
        elif fallback is not None and k in fallback:
            out[k] = fallback[k].detach().contiguous()
    return out


class StateView(Mapping[str, torch.Tensor]):
    """``assemble_state`` over one mapping that reads lazily (the broker's checkpoint on disk), without
    reading it: each key's tensor is read when asked for (``results.stream_safetensors`` writes them
    one at a time), tied keys read their owner's."""

    def __init__(
        self, state_keys: Iterable[str], source: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
    ) -> None:
        self.source = source
        self.where: dict[str, str] = {}
        for k in state_keys:
            owner = aliases.get(k, k)
            if owner in source:
                self.where[k] = owner
            elif k in source:
                self.where[k] = k

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.source[self.where[key]].detach()

    def meta(self, key: str) -> TensorMeta:
        return describe(self.source, self.where[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def output_tensors(per_microbatch: Sequence[Any]) -> dict[str, torch.Tensor]:
    """One step's outputs (one value per micro-batch, any pytree of tensors) as flat ``"mb/leaf"``
    tensors; leaves that are not tensors (None, Python numbers) are not results and are dropped."""
    flat: dict[str, torch.Tensor] = {}
    for mb, value in enumerate(per_microbatch):
        leaves = [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
        for i, leaf in enumerate(leaves):
            flat[f"{mb}/{i}"] = leaf.detach()
    return flat


def _parse_key(key: str) -> tuple[int, int]:
    mb, sep, leaf = key.partition("/")
    if not sep or not mb.isdigit() or not leaf.isdigit():
        raise ExecutionError(f"outputs: tensor name {key[:40]!r} is not 'microbatch/leaf'")
    return int(mb), int(leaf)


def join_outputs(per_step: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every step's ``"mb/leaf"`` tensors, in step order -> one tensor per leaf, the micro-batches
    concatenated along the sample dimension (0-dim leaves, one per micro-batch, are stacked)."""
    columns: dict[int, list[torch.Tensor]] = {}
    for blob in per_step:
        for key in sorted(blob, key=_parse_key):
            columns.setdefault(_parse_key(key)[1], []).append(blob[key])
    joined: dict[str, torch.Tensor] = {}
    for leaf in sorted(columns):
        parts = columns[leaf]
        name = OUTPUTS if leaf == 0 else f"{OUTPUTS}.{leaf}"
        try:
            joined[name] = torch.cat(parts) if parts[0].dim() else torch.stack(parts)
        except RuntimeError as e:
            raise ExecutionError(f"outputs: the micro-batches' {name!r} tensors do not join: {e}") from e
    return joined


def assemble_result(
    graph: IRGraph,
    task: str,
    *,
    states: Sequence[Mapping[str, torch.Tensor]],
    initial: Mapping[str, torch.Tensor],
    grads: Sequence[Mapping[str, torch.Tensor]] | None,
    outputs: Sequence[Mapping[str, torch.Tensor]],
    metrics: list[dict[str, Any]],
    plan: dict[str, Any],
) -> RunResult:
    """The run's results: the final state (``states``: the sub-DAGs' tensors, or one checkpoint) over
    the ``initial`` state, the gradients (grad), each step's ``"mb/leaf"`` outputs (infer)."""
    weights = assemble_state(graph.state_keys, states, initial, graph.aliases)
    merged_grads = None
    if task == "grad" and grads is not None:
        merged_grads = assemble_state(graph.state_keys, grads, None, graph.aliases)
    joined = join_outputs(outputs) if task == "infer" else {}
    first = joined.pop(OUTPUTS, None)
    return RunResult(
        weights=weights,
        grads=merged_grads,
        outputs=first,
        metrics=metrics,
        plan=plan,
        more_outputs=joined,
    )
