"""The layer order of design.md, as the import contract in pyproject.toml states it.

``lint-imports`` checks the contracts (layers top to bottom, a pure planner and performance model, no
import circles); a broken one fails here with import-linter's own report, which names the importing
module and line. The planner is also imported in a fresh interpreter, to show what it drags in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    """This checkout first on the path, so the code checked is the code under test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.timeout(300)
def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.fail(f"import-linter is not installed next to {sys.executable} (pip install -e '.[dev]')")
    proc = subprocess.run(
        [str(lint), str(REPO / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"an import runs against the layer contract:\n{report}"
    assert " 0 broken." in report, report


# What the planner must never bring along: the daemons, the commands, the network stack.
NOT_IN_PLANNER = ("fusionnet.broker", "fusionnet.compnode", "fusionnet.cli", "fusionnet.runtime", "hivemind")

_PROBE = """
import importlib, pkgutil, sys
import fusionnet.planning as planning
for info in pkgutil.iter_modules(planning.__path__):
    importlib.import_module("fusionnet.planning." + info.name)
bad = sorted(m for m in sys.modules if m.split(".")[0] == "hivemind" or m.startswith(PREFIXES))
print("\\n".join(bad))
"""


@pytest.mark.timeout(120)
def test_planning_imports_no_daemon_command_or_hivemind() -> None:
    """Every module of ``fusionnet.planning`` imported in a fresh interpreter: none of the forbidden
    packages ends up in ``sys.modules`` (also indirectly, e.g. through a package ``__init__``)."""
    prefixes = tuple(p for p in NOT_IN_PLANNER if p.startswith("fusionnet."))
    code = f"PREFIXES = {prefixes!r}\n" + _PROBE
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.split()
    assert not loaded, f"importing fusionnet.planning loaded {loaded}"
