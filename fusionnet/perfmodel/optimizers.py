"""What an optimizer costs per parameter: state memory, update FLOPs and memory traffic.

Names are torch.optim class names in lower case. ``torch.optim.SGD`` keeps no state without momentum
and one buffer with it; the class name alone cannot say which, so ``sgd`` means no momentum and
``sgd_momentum`` (alias ``sgd+momentum``) means momentum != 0 — the caller that knows the optimizer's
kwargs picks the right one.

Figures are per parameter element, read from torch's single-tensor implementations (each elementwise
op ~1 FLOP; sqrt/div count 1): they feed ``Update`` time and the optimizer-state memory demand. The
kernel count per parameter tensor prices the fixed cost of each launch (``Overheads.update_kernel``)
for optimizers that the local profile did not time one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from fusionnet.errors import PlanError

PARAM_ELEMENT_BYTES = 4  # fp32 training: optimizer FLOPs are per element, costs arrive in bytes


@dataclass(frozen=True)
class OptimizerProfile:
    name: str
    state_factor: int  # optimizer-state bytes per parameter byte
    flops_per_element: int  # update FLOPs per parameter element
    kernels: int = 1  # elementwise kernels torch's single-tensor implementation launches per tensor

    @property
    def traffic_factor(self) -> int:
        """Bytes moved per parameter byte by one update: read param and grad, write param, read and
        write every state buffer."""
        return 3 + 2 * self.state_factor


_PROFILES = {
    p.name: p
    for p in (
        OptimizerProfile("sgd", 0, 2, 1),  # p -= lr * g
        OptimizerProfile("sgd_momentum", 1, 5, 3),  # buf = mu*buf + g; p -= lr*buf (+ weight decay)
        OptimizerProfile("adam", 2, 12, 8),  # m, v; bias corrections; p -= lr * m_hat / (sqrt(v_hat)+eps)
        OptimizerProfile("adamw", 2, 14, 9),  # adam + decoupled weight decay
        OptimizerProfile("adamax", 2, 10, 8),  # m, u = max(beta2*u, |g|)
        OptimizerProfile("nadam", 2, 16, 12),  # adam with Nesterov momentum
        OptimizerProfile("radam", 2, 16, 12),  # rectified adam
        OptimizerProfile("sparseadam", 2, 12, 8),  # adam on the touched rows (dense upper bound)
        OptimizerProfile("adagrad", 1, 6, 5),  # sum of squares
        OptimizerProfile("rmsprop", 1, 7, 5),  # square average (momentum/centered add one buffer each)
        OptimizerProfile("adadelta", 2, 12, 8),  # square average + accumulated delta
        OptimizerProfile("rprop", 2, 8, 8),  # previous gradient + per-element step size
        OptimizerProfile("asgd", 1, 6, 6),  # averaged parameters 'ax'
        # L-BFGS keeps history_size (default 100) pairs of (s, y) vectors over all parameters.
        OptimizerProfile("lbfgs", 200, 800, 400),
    )
}
_ALIASES = {"sgd+momentum": "sgd_momentum", "sgdm": "sgd_momentum"}


@lru_cache(maxsize=256)
def optimizer_profile(name: str | None) -> OptimizerProfile:
    """The profile for a torch.optim class name (lower case); ``None`` (no optimizer given) is plain SGD."""
    if name is None:
        return _PROFILES["sgd"]
    key = _ALIASES.get(name.lower(), name.lower()) if isinstance(name, str) else None
    if key not in _PROFILES:
        raise PlanError(
            f"optimizer {name!r} has no cost profile; "
            f"known: {', '.join(sorted(_PROFILES) + sorted(_ALIASES))}"
        )
    return _PROFILES[key]


def known_optimizers() -> tuple[str, ...]:
    return tuple(sorted(_PROFILES))
