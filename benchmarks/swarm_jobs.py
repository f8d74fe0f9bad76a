"""What the swarm benchmarks share: the bundled GPT example as a job file that can live anywhere, the
default work folder, and the way a benchmark script exits."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
BULK_BYTES = 8 << 20  # weights, checkpoints, uploads; logs and results are far smaller
WORKDIR_HELP = "logs and results, kept whole (default: a temporary folder, kept without its files over 8 MiB)"


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


def work_folder(given: Path | None, prefix: str) -> Path:
    """``given`` (``--workdir``, kept whole), else a new temporary folder whose logs and results stay after
    the run but whose files over 8 MiB are removed at exit: a 97M-parameter run leaves about 5 GB of
    weights and checkpoints, and a few kept runs once filled a machine's disk."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        return given.resolve()
    workdir = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    atexit.register(prune_bulk, workdir)
    return workdir


def prune_bulk(workdir: Path) -> None:
    """Removes the files over ``BULK_BYTES`` under ``workdir`` and says how much that freed."""
    freed = 0
    for path in workdir.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and (size := path.stat().st_size) > BULK_BYTES:
                path.unlink()
                freed += size
        except OSError:  # a daemon's file that went away meanwhile
            continue
    if freed:
        print(f"removed {freed / 1e9:.2f} GB of weights and checkpoints from {workdir} (logs kept)")


def run_main(main: Callable[[], int]) -> None:
    """Exits with ``main()``'s code; Ctrl-C exits 130 without a traceback (every swarm a benchmark starts
    is stopped on the way out by its own ``finally``)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
