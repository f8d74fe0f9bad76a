"""Optional, inexact compression of activations and gradients on the wire (job key
``placement.wire_compression``).

Codecs, applied per tensor to floating-point values only (integer and bool tensors always travel
as they are):

- ``none``     (default) the exact bytes: results equal plain PyTorch.
- ``bf16``     float32/float64 sent as bfloat16: half the bytes, ~3 significant digits kept.
- ``fp16``     float32/float64 sent as float16 (clamped to +-65504 first, so a large value arrives as
               the largest finite fp16, not as inf): half the bytes, ~3 digits, a narrow range.
- ``int8-ef``  a quarter of the bytes: each tensor scaled by one per-tensor factor (max |x| / 127)
               and rounded to int8, with error feedback: the sender keeps what rounding lost, per
               edge (receiver, value, tensor, micro-batch index), and adds it to the next tensor sent
               on that edge, so the error does not accumulate over steps.

All of them change the numbers a job computes: a compressed job no longer equals plain PyTorch to
float rounding, and its loss curve differs (``benchmarks/wire_compression.py`` measures by how much).
The receiver restores the original dtype, so the executor and its checks see the value they expect.

A codec is described per tensor by a small map that travels with the value's structure (``info``):
``{"c": "bf16" | "fp16" | "int8", "d": original dtype, "s": scale (int8 only)}``; ``decompress``
checks it field by field before using it (a peer's map is data, never trusted).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from fusionnet.errors import WireError

CODECS = ("none", "bf16", "fp16", "int8-ef")
_FLOATS = {"float32": torch.float32, "float64": torch.float64}
_WIRE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
FP16_MAX = 65504.0
INT8_MAX = 127
# Residuals kept at most (edges x micro-batches of one job); past this the oldest are dropped, which
# only costs the feedback of those edges, never correctness of what is sent.
MAX_RESIDUALS = 1 << 14


def check_codec(name: object) -> str:
    if name not in CODECS:
        raise WireError(f"wire compression must be one of {', '.join(CODECS)}, got {name!r}")
    return name  # type: ignore[return-value]


class Compressor:
    """The sending side of one codec; holds the error-feedback residuals of ``int8-ef``."""

    def __init__(self, codec: str = "none") -> None:
        self.codec = check_codec(codec)
        self._residual: dict[Hashable, torch.Tensor] = {}

    def compress(self, edge: Hashable, t: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any] | None]:
        """The tensor to send for ``t`` and its codec info (``None``: sent as it is)."""
        name = {torch.float32: "float32", torch.float64: "float64"}.get(t.dtype)
        if self.codec == "none" or name is None:
            return t, None
        x = t.detach()
        if self.codec == "bf16":
            return x.to(torch.bfloat16), {"c": "bf16", "d": name}
        if self.codec == "fp16":
            return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16), {"c": "fp16", "d": name}
        return self._int8(edge, x.float(), name)

    def _int8(self, edge: Hashable, x: torch.Tensor, name: str) -> tuple[torch.Tensor, dict[str, Any] | None]:
        residual = self._residual.pop(edge, None)
        if residual is not None and residual.shape == x.shape and residual.device == x.device:
            x = x + residual
        amax = float(x.abs().max()) if x.numel() else 0.0
        if not math.isfinite(amax):  # inf/nan cannot be scaled: send this one exactly, forget the edge
            return x, {"c": "none", "d": name}
        scale = amax / INT8_MAX if amax > 0 else 1.0
        q = torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        if len(self._residual) >= MAX_RESIDUALS:
            self._residual.pop(next(iter(self._residual)))
        self._residual[edge] = x - q.float() * scale
        return q, {"c": "int8", "d": name, "s": scale}

    @property
    def residual_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residual.values())


def decompress(t: torch.Tensor, info: object) -> torch.Tensor:
    """The value a compressed tensor stands for; ``WireError`` for an info map that does not fit it."""
    if info is None:
        return t
    if (
        not isinstance(info, dict)
        or not set(info) <= {"c", "d", "s"}
        or not all(isinstance(info.get(k), str) for k in ("c", "d"))
    ):
        raise WireError("malformed compression info")
    codec, dtype = info.get("c"), _FLOATS.get(info.get("d"))  # type: ignore[arg-type]
    if dtype is None:
        raise WireError(f"compressed tensor claims original dtype {str(info.get('d'))[:32]!r}")
    if codec == "none":  # int8-ef's exact fallback for a tensor holding inf/nan
        if t.dtype != torch.float32:
            raise WireError(f"uncompressed fallback must be float32, got {t.dtype}")
        return t.to(dtype)
    if codec not in _WIRE_DTYPE or t.dtype != _WIRE_DTYPE[codec]:
        raise WireError(f"compression {str(codec)[:16]!r} does not match a {t.dtype} tensor")
    if codec != "int8":
        return t.to(dtype)
    scale = info.get("s")
    if isinstance(scale, bool) or not isinstance(scale, float | int) or not 0 < scale < math.inf:
        raise WireError(f"int8 scale must be a positive finite number, got {str(scale)[:32]}")
    return (t.to(torch.float32) * float(scale)).to(dtype)


__all__ = ["CODECS", "Compressor", "check_codec", "decompress"]
