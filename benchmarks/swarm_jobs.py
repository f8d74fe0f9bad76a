"""What the swarm benchmarks share: the bundled GPT example as a job file that can live anywhere, and
the way a benchmark script exits."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


def write_gpt_job(path: Path, *, model: dict[str, Any] | None = None, **top: Any) -> Path:
    """``examples/gpt/job.yaml`` with its model file and data copied next to ``path`` (a job's files live
    in its folder), ``model`` merged into the model's kwargs, ``data`` merged into its data section and
    the other keys (steps, optimizer, placement, ...) set."""
    src = REPO / "examples" / "gpt" / "job.yaml"
    doc = yaml.safe_load(src.read_text())
    where, _, _ = doc["model"]["entrypoint"].rpartition(":")
    for rel in (where, doc["data"]["path"]):
        target = path.parent / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.parent / rel, target)
    doc["model"]["kwargs"].update(model or {})
    doc["data"].update(top.pop("data", {}))
    doc.update(top)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_main(main: Callable[[], int]) -> None:
    """Exits with ``main()``'s code; Ctrl-C exits 130 without a traceback (every swarm a benchmark starts
    is stopped on the way out by its own ``finally``)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
