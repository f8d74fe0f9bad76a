"""Checks shared by the job file's two ``kwargs`` mappings (``loss.kwargs``, ``optimizer.kwargs`` and
``per_op.<glob>.kwargs``), whose problems name the one argument at fault.

torch takes a NaN or infinite keyword argument without a word where it only compares it with a bound
(``label_smoothing < 0`` is false for NaN): the job would then train on NaN, or silently on something
else. So every number given there must be finite, before torch sees it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class KwargProblem(ValueError):
    """``key`` of a kwargs mapping is refused because ``text``; the schema names it as ``....kwargs.KEY``."""

    def __init__(self, key: str, text: str) -> None:
        super().__init__(f"{key}: {text}")
        self.key = key
        self.text = text


def check_finite_numbers(kwargs: Mapping[str, Any]) -> None:
    """``KwargProblem`` for the first argument (in key order) that is, or holds, a NaN or infinity:
    a plain number, or one of a list's (``betas: [0.9, .nan]``)."""
    for key in sorted(kwargs, key=str):
        value = kwargs[key]
        for number in value if isinstance(value, list | tuple) else (value,):
            if isinstance(number, float) and not math.isfinite(number):
                raise KwargProblem(str(key), f"must be a finite number (got {number!r})")
