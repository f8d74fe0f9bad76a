"""Where a sub-DAG computes: the torch device of a compnode (``--device cpu|cuda|cuda:N|mps``).

The wire and the broker only ever see CPU tensors; the executor keeps its parameters, buffers,
gradients and optimizer state on its device. These helpers are the two crossings:

- ``to_device``: a value that arrived (CPU tensors from a peer, the dataset fields) moved in. To a CUDA
  device through pinned host memory with ``non_blocking``: the copy is queued on the compute stream
  and the host thread goes on queueing kernels.
- ``to_host``: a value to send, copied out. From a CUDA device into pinned buffers with
  ``non_blocking`` plus an event; the send waits for the event on the event loop
  (``host_ready``), so the compute thread never waits for a device-to-host copy. On the CPU both are
  the identity (a detach), so CPU runs are the same bits as before.

``resolve_device`` turns the flag into a ``torch.device`` or a ``ValueError`` naming what is missing;
``is_out_of_memory`` tells a device OOM from other failures (it fails the sub-task, not the daemon).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch.utils._pytree import tree_map

HOST = torch.device("cpu")
CHOICES = "use cpu, cuda, cuda:N or mps"
READY_POLL = 0.0005  # seconds between polls of a device-to-host copy's event


def resolve_device(name: str) -> torch.device:
    """``--device`` as a ``torch.device``, checked against this machine (ValueError if unusable)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"--device {name!r}: not a torch device ({e}); {CHOICES}") from None
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = f"CUDA is not available on this machine (torch {torch.__version__})"
            raise ValueError(f"--device {name}: {why}")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            why = f"this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            raise ValueError(f"--device {name}: {why}")
        return torch.device("cuda", index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {name}: MPS is not available on this machine")
        return device
    raise ValueError(f"--device {name}: unsupported device type {device.type!r}; {CHOICES}")


def device_memory_bytes(device: torch.device) -> int:
    """The accelerator memory a sub-DAG may use there (D_gpu): 0 for the CPU (D_cpu counts instead)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory())
    return 0


def _move_in(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        # Pinned memory makes the host-to-device copy asynchronous (the caching host allocator keeps
        # the pinned block alive until the copy is done).
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor or a pytree of them) on ``device``; the identity on the CPU."""
    if device.type == "cpu":
        return value
    return tree_map(lambda v: _move_in(v, device) if isinstance(v, torch.Tensor) else v, value)


def _copy_out(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t
    if t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to(HOST)


def to_host(value: Any, device: torch.device) -> tuple[Any, Any]:
    """``value`` detached on the CPU, and the CUDA event that marks its copy done (None: done already).
    The copies are queued on the compute stream: the caller must not read them before the event."""
    if device.type == "cpu":
        return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value), None
    host = tree_map(lambda v: _copy_out(v) if isinstance(v, torch.Tensor) else v, value)
    if device.type != "cuda":
        return host, None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return host, event


async def host_ready(event: Any) -> None:
    """Waits on the event loop, without blocking it or the compute thread, for ``to_host``'s copies."""
    if event is None:
        return
    while not event.query():
        await asyncio.sleep(READY_POLL)


def host_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Synchronous CPU copies (state, gradients, optimizer state for a checkpoint or the results): on
    the CPU a clone, so the copy does not change under the next Update."""
    return {k: v.detach().to(HOST, copy=True) for k, v in tensors.items()}


def is_out_of_memory(error: BaseException) -> bool:
    """A device (or host allocator) out-of-memory error, as torch raises it."""
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(error, oom):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def release_cached_memory(device: torch.device) -> None:
    """Gives the allocator's cached blocks back after an OOM, so the next attempt starts clean."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()
