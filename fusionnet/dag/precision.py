"""Mixed precision (the job key ``precision``), the same for the reference and every executor.

- ``fp32``: nothing changes (no autocast, no loss scaling): bit for bit what it always was.
- ``bf16`` / ``fp16``: the forward pass (model and loss) runs under ``torch.autocast`` with that dtype;
  parameters stay float32 (master weights) and autocast casts them per op, exactly as plain PyTorch
  under the same autocast. Activations and their gradients therefore *are* in the compute dtype wherever
  autocast produced them, and travel between sub-DAGs as such (the wire carries bf16/fp16 frames).
- ``fp16`` adds dynamic loss scaling with ``torch.amp.GradScaler``'s semantics and defaults (scale 2**16,
  x2 after 2000 clean steps, x0.5 and the step skipped when a gradient is inf/nan), built on the same
  two primitives GradScaler uses (``_amp_foreach_non_finite_check_and_unscale_`` and
  ``_amp_update_scale_``), so the scale sequence and the unscaled gradients are the same bits.

One deliberate difference from ``GradScaler``: it decides "found inf" per optimizer, while here the
decision is global (any inf/nan gradient anywhere skips every optimizer of that step). A sub-DAG's
optimizers are not the reference's optimizers (each sub-DAG builds its own over its parameters), so only
a global decision can be made identically on every sub-DAG; executors agree on it by exchanging one flag
per step (``SubDagExecutor``). With one optimizer (no ``per_op``) both rules are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Literal

import torch

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# The message key under which executors share their "found inf" flag (not a valid fx node name, so it
# can never collide with an activation or gradient key).
FOUND_INF_NODE = "#found_inf"
# Checkpoint keys of the loss scaler's state (beside ``opt::...``): every sub-DAG holds the same values.
SCALER_PREFIX = "scaler::"


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    return COMPUTE_DTYPES[precision]


def autocast(precision: str, device_type: str = "cpu") -> contextlib.AbstractContextManager[object]:
    """The context the forward pass (model + loss) runs in. Autocast state is per thread: enter it on
    the thread that computes."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=compute_dtype(precision))


class LossScaler:
    """Dynamic loss scaling with ``torch.amp.GradScaler``'s defaults and arithmetic (see module doc)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = torch.full((), init_scale, dtype=torch.float32)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval

    def loss_seed(self, weight: float) -> float:
        """The seed of the loss's gradient: its share of the batch times the scale (both exact in fp32
        when the share is 1, as the scale is a power of two)."""
        return weight * float(self.scale)

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Divides ``grads`` by the scale in place (GradScaler.unscale_); True when one is inf/nan."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(g)
        # The kernel wants its flag and scale where the gradients are (the executor's device).
        device = next((group[0].device for group in by_dtype.values()), self.scale.device)
        inv_scale = self.scale.double().reciprocal().float().to(device)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv_scale.reshape(1))
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Backs off after an inf/nan step, grows after ``growth_interval`` clean ones (GradScaler.update)."""
        found = torch.full((1,), float(found_inf), dtype=torch.float32)
        scale = self.scale.reshape(1)
        tracker = self.growth_tracker.reshape(1)
        torch._amp_update_scale_(
            scale, tracker, found, self.growth_factor, self.backoff_factor, self.growth_interval
        )

    def state(self) -> dict[str, torch.Tensor]:
        """The scale and growth tracker as checkpoint tensors (``scaler::...``)."""
        return {
            SCALER_PREFIX + "scale": self.scale.clone(),
            SCALER_PREFIX + "growth_tracker": self.growth_tracker.clone(),
        }

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Resumes from ``state()``'s tensors when a checkpoint has them (a replacement compnode)."""
        scale, tracker = tensors.get(SCALER_PREFIX + "scale"), tensors.get(SCALER_PREFIX + "growth_tracker")
        if scale is None or tracker is None:
            return
        if scale.numel() != 1 or tracker.numel() != 1:
            raise ValueError("loss scaler state must be two scalars")
        self.scale.copy_(scale.reshape(()).to(torch.float32))
        self.growth_tracker.copy_(tracker.reshape(()).to(torch.int32))


def assert_tensor_metadata(
    a: torch.Tensor,
    size: Any = None,
    stride: Any = None,
    dtype: torch.dtype | None = None,
    *,
    device: Any = None,
    layout: Any = None,
) -> None:
    """``aten._assert_tensor_metadata`` as ``torch.export`` records it, aware of autocast: the IR is traced
    in float32, so under autocast a recorded float32 is also met by the autocast dtype (the check the
    same model makes in eager mode, where no such assertion exists, passes either way)."""
    kind = a.device.type
    if (
        dtype == torch.float32
        and torch.is_autocast_enabled(kind)
        and a.dtype == torch.get_autocast_dtype(kind)
    ):
        dtype = a.dtype
    torch.ops.aten._assert_tensor_metadata.default(a, size, stride, dtype, device=device, layout=layout)


def make_scaler(precision: str) -> LossScaler | None:
    """A loss scaler for fp16 jobs; bf16 has fp32's exponent range and needs none."""
    return LossScaler() if precision == "fp16" else None
