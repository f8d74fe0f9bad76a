"""The project's own exception hierarchy.

Every error that reaches a user or a peer is one of these, carrying a message that says what was
wrong and where (a job-file key, an IR node, a peer id). ``ValueError`` subclasses for user input,
so callers that only know Python conventions still catch them.
"""

from __future__ import annotations


class FusionNetError(Exception):
    """Base class of every error FusionNet raises on purpose."""


class JobError(FusionNetError, ValueError):
    """A job file, its model, its weights or its data are unusable. The message names the key or file."""


class TraceError(FusionNetError, ValueError):
    """A model could not be turned into a DAG (neither symbolic tracing nor torch.export worked)."""


class IRError(FusionNetError, ValueError):
    """IR bytes or an IR graph are malformed: unknown op, bad structure, dangling reference, cycle."""


class PartitionError(FusionNetError, ValueError):
    """An assignment of nodes to compnodes cannot be turned into runnable sub-DAGs."""


class PlanError(FusionNetError, ValueError):
    """The scheduler found no feasible plan; the message names the binding constraint."""


class WireError(FusionNetError, ValueError):
    """A frame or message from a peer is malformed, oversized, unauthenticated or unexpected."""


class StoreError(FusionNetError, RuntimeError):
    """The broker's database refused a write (disk full, read-only file); the message names the file."""


class ExecutionError(FusionNetError, RuntimeError):
    """A sub-task failed while running (wrong tensor shape from a peer, op failure, ...)."""


class ComputeError(ExecutionError):
    """An op of the model raised while computing a sub-task (an index out of range, mismatched
    shapes): the same inputs fail the same way on any compnode. A deployment answers the request that
    brought them with an error instead of failing everyone batched with it."""


class DeviceMemoryError(ExecutionError):
    """A sub-task ran out of its device's memory. The compnode survives; the broker places the job again
    without that compnode (``peer`` names it once the broker's call adds it)."""

    def __init__(self, message: str, *, peer: str = "") -> None:
        super().__init__(message)
        self.peer = peer
