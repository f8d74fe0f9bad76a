"""Pipeline schedules as data (issue 13): which action each stage runs next, in what order.

Pure Python (no torch, no IR), at the bottom of the layers so that the executor (``fusionnet.dag``),
the performance model's simulator (``fusionnet.perfmodel.simulator``) and the planner all use the
same objects: plan.json predicts the order that runs.

Map of the package:

- ``actions.py``     ``Action`` (F, B, I, W, U of a micro-batch) and ``Schedule`` (per-stage programs)
                     with their text form and parser.
- ``check.py``       ``check``: well-formed programs, deadlock-freedom on the cut's real edge set (skip
                     edges included), peak in-flight micro-batches per stage; ``ScheduleError``.
- ``generators.py``  ``gpipe``, ``one_f_one_b``, ``zero_bubble_h1``, ``interleaved_1f1b`` (several
                     sub-DAGs per device) and ``make_schedule(name, stages, m, task, chunks)``.
"""

from fusionnet.schedules.actions import Action, Schedule
from fusionnet.schedules.check import CheckResult, Edge, ScheduleError, chain_edges, check
from fusionnet.schedules.generators import (
    INTERLEAVED,
    NAMES,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zero_bubble_h1,
)

__all__ = [
    "INTERLEAVED",
    "NAMES",
    "Action",
    "CheckResult",
    "Edge",
    "Schedule",
    "ScheduleError",
    "chain_edges",
    "check",
    "gpipe",
    "interleaved_1f1b",
    "make_schedule",
    "one_f_one_b",
    "zero_bubble_h1",
]
