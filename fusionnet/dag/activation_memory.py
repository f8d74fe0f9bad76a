"""The bytes of activations a sub-DAG holds between a micro-batch's FP and its BP, measured as it runs:
what tells the schedules apart (issue 13: GPipe holds every micro-batch's, 1F1B at most p - s of them).

A micro-batch's activations are the tensors autograd saves for its backward (``saved_tensors_hooks``
sees each one as it is saved) and the outputs kept for the gradients that come back, each storage
counted once, parameters left out (a stage holds those whatever the schedule). They are held from the
micro-batch's F until its B, or, for a split backward, until its W (the weight half still reads the
saved inputs). ``ActivationLedger`` keeps the count per micro-batch and the step's peak of their sum,
and what a micro-batch of a given shape saves: the hooks run once per shape, not on every FP.

The pack hook hands autograd ``t.detach()``: the same storage (nothing is copied, the numbers are the
same), without the reference cycle a saved output's own ``grad_fn`` would otherwise close.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

MAX_KEYS = 1024


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of ``t``'s storage; None for a tensor without one of its own (sparse, meta)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ptr = storage.data_ptr()
    return (ptr, storage.nbytes()) if ptr else None


class SavedBytes:
    """The bytes of distinct storages seen, those of ``excluded`` tensors (the parameters) left out."""

    def __init__(self, excluded: Iterable[Any]) -> None:
        self._seen = {s[0] for t in excluded if isinstance(t, torch.Tensor) and (s := _storage(t))}
        self.nbytes = 0

    def add(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            return
        found = _storage(value)
        if found is not None and found[0] not in self._seen:
            self._seen.add(found[0])
            self.nbytes += found[1]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t.detach()


class ActivationLedger:
    """Bytes held per micro-batch of the current step and the step's peak of their sum."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self.peak = 0
        self._bytes_of: dict[Hashable, int] = {}  # an FP's key (its inputs' shapes) -> bytes it saves

    def start_step(self) -> None:
        self._held.clear()
        self.peak = 0

    @contextmanager
    def saving(self, parameters: Iterable[Any]) -> Iterator[SavedBytes]:
        """Counts what autograd saves inside the block (on the thread that computes: hooks are per
        thread), ``parameters`` left out; the caller adds the outputs it keeps, then ``hold``s it."""
        counter = SavedBytes(parameters)
        with torch.autograd.graph.saved_tensors_hooks(counter._pack, _unpack):
            yield counter

    def knows(self, key: Hashable) -> bool:
        return key in self._bytes_of

    def learn(self, key: Hashable, nbytes: int | None) -> int:
        """The bytes an FP of ``key`` saves: ``nbytes`` when it was just counted, else what was."""
        if nbytes is not None:
            if len(self._bytes_of) >= MAX_KEYS:  # shapes that keep changing: forget the oldest
                self._bytes_of.pop(next(iter(self._bytes_of)))
            self._bytes_of[key] = nbytes
        return self._bytes_of.get(key, 0)

    def hold(self, mb: int, nbytes: int) -> None:
        self._held[mb] = nbytes
        self.peak = max(self.peak, sum(self._held.values()))

    def release(self, mb: int) -> None:
        self._held.pop(mb, None)

    @property
    def held(self) -> int:
        return sum(self._held.values())


def activation_key(mb: int, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What an FP's saved bytes depend on: the micro-batch's place in the step and its inputs' shapes.
    The same key saves the same bytes, so it is counted once (the hooks cost a few percent of a small
    model's step)."""
    if all(isinstance(v, torch.Tensor) for v in inputs):  # most FPs: no tree to flatten
        return (mb, *(tuple(v.shape) for v in inputs))
    leaves, _ = tree_flatten(list(inputs))
    return (mb, *(tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in leaves))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
