"""What a deployment's batcher answers (``batching``): a batch's outputs, or with ``keep`` the argmax of
every row and the outputs of the kept rows only (``RowAnswers``); one request's part of a batch's answer
and the parts of a request cut into several batches joined again; and the reasons a request gets no
answer (``Overloaded``, ``Oversized``, ``Closed``, ``RowsFailed``), which the HTTP layer maps to codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RowAnswers:
    """The answer to rows sent with ``keep``: every row's argmax of its output (``ids``, one per row),
    and the outputs of the kept rows only, in order."""

    ids: torch.Tensor
    outputs: torch.Tensor

    def rows(self, start: int, stop: int, keep: list[bool]) -> RowAnswers:
        """Rows ``start:stop`` of a batch answered with ``keep`` (its flags for the whole batch)."""
        first = sum(keep[:start])
        return RowAnswers(self.ids[start:stop], self.outputs[first : first + sum(keep[start:stop])])


Answer = torch.Tensor | RowAnswers
# rows (n, ...), per row the position of dim 1 to keep (or None) and, only when some request gave
# ``keep``, the rows whose outputs to send -> outputs (one per row), or ``RowAnswers`` with ``keep``
RunBatch = Callable[..., Awaitable[Answer]]


class Submit(Protocol):
    """``DynamicBatcher.submit`` as a caller holds it: a tensor back without ``keep``, else ``RowAnswers``."""

    def __call__(
        self, rows: torch.Tensor, pick: list[int] | None = None, keep: list[bool] | None = None
    ) -> Awaitable[Answer]: ...


class Overloaded(Exception):
    """The deployment's queue is full: try again later (HTTP 503)."""


class Oversized(Exception):
    """A request of more rows than the deployment ever queues at once (HTTP 400: no retry helps)."""


class Closed(Exception):
    """The deployment is going away: no more requests."""


class RowsFailed(Exception):
    """The model raised on a batch's rows (not a lost compnode, not a timeout): running its requests
    apart tells which one brought the rows (HTTP 400)."""


async def joined(futures: list[asyncio.Future[Answer]], kept: bool) -> Answer:
    """The answers of a request cut into several batches, joined in order (``enqueue``)."""
    parts = await asyncio.gather(*futures)
    if not kept:
        return torch.cat(parts)  # type: ignore[arg-type]
    return RowAnswers(
        torch.cat([p.ids for p in parts]),  # type: ignore[union-attr]
        torch.cat([p.outputs for p in parts]),  # type: ignore[union-attr]
    )


def part_of(out: Answer, start: int, stop: int, keep: list[bool] | None, as_answers: bool) -> Answer:
    """One request's rows of a batch's answer: ``RowAnswers`` if it gave ``keep``, else its outputs."""
    if keep is None:
        assert isinstance(out, torch.Tensor)
        return out[start:stop]
    if not isinstance(out, RowAnswers):
        raise TypeError("run_batch answered rows sent with keep without RowAnswers")
    part = out.rows(start, stop, keep)
    return part if as_answers else part.outputs  # a request without keep: all its rows were kept
