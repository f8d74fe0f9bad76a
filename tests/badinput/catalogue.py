"""Every variant of the sweep, in the order it runs."""

from __future__ import annotations

from tests.badinput import code_cases, file_cases, yaml_cases
from tests.badinput.variant import Variant

VARIANTS: list[Variant] = [*yaml_cases.CASES, *code_cases.CASES, *file_cases.CASES]

_names = [v.name for v in VARIANTS]
assert len(set(_names)) == len(_names), sorted({n for n in _names if _names.count(n) > 1})
