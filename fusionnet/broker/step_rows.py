"""The metrics rows of a job's steps that a checkpoint or a replica pointer carries, kept beside it in an
append-only file.

Why: a checkpoint (``ckpt.json``) and a replica pointer (``replicas.json``) carry the rows of the steps
before their step, so that a restarted broker goes on with the job's metrics. Written into each document,
every save encoded every row so far again (1.7 MB at step 6000, on the broker's event loop for the
pointer): a cost that grew with the job. Now each kind of document owns a ``StepRows``: the rows it has
not written yet are appended to its file, and the document names the file and how many of its lines are
its rows.

Between failovers a document's rows only grow. ``sync`` recognises the rows it wrote by identity (the
same row dicts go from the job's progress into its checkpoints and pointers): rows that extend them are
appended, in place. Anything else (rows replaced after a recovery, or the first save of a broker process,
which cannot tell its rows from the file's) goes to a new file, a generation up, and the document that
names it replaces the old one only once it is complete: a crash at any moment leaves a document whose
file holds at least its rows. Older generations are removed after the document is saved (``prune``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


class StepRows:
    def __init__(self, folder: Path, kind: str) -> None:
        self.folder, self.kind = folder, kind
        self._file: Path | None = None  # the generation this process writes (None: none yet)
        self._written: list[Row] = []  # the rows in it, as the objects that were written
        self._lock = threading.Lock()  # checkpoints are saved in a worker thread, pointers on the loop

    def _generation(self, path: Path) -> int:
        return int(path.name[len(self.kind) + 1 :].split(".")[0])

    def _files(self) -> list[Path]:
        return sorted(self.folder.glob(f"{self.kind}.*.jsonl"), key=self._generation)

    def sync(self, rows: Sequence[Row]) -> dict[str, Any]:
        """Puts ``rows`` on disk; returns what the document names: ``{"file": NAME, "count": N}``."""
        with self._lock:
            known = self._written
            common = min(len(rows), len(known))
            extends = self._file is not None and (common == 0 or rows[common - 1] is known[common - 1])
            if not extends or len(rows) < len(known):
                if extends:  # a prefix of what is written: its lines are there already
                    assert self._file is not None
                    return {"file": self._file.name, "count": len(rows)}
                files = self._files()
                top = self._generation(files[-1]) if files else 0
                self._file = self.folder / f"{self.kind}.{top + 1}.jsonl"
                self._written = []
                self._file.write_text("")
            assert self._file is not None
            new = rows[len(self._written) :]
            if new:
                with self._file.open("a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in new))
                self._written.extend(new)
            return {"file": self._file.name, "count": len(rows)}

    def prune(self) -> None:
        """Removes the generations older than the one written now (its document has been saved)."""
        with self._lock:
            for path in self._files():
                if self._file is not None and self._generation(path) < self._generation(self._file):
                    path.unlink(missing_ok=True)

    def load(self, doc: dict[str, Any]) -> list[Row]:
        """The rows a document names (``sync``'s answer); ``ValueError`` when its file lacks them."""
        name, count = doc["file"], int(doc["count"])
        if not (isinstance(name, str) and name.startswith(f"{self.kind}.") and "/" not in name):
            raise ValueError(f"{self.kind} rows: bad file name {name!r}")
        rows: list[Row] = []
        with (self.folder / name).open() as f:
            for line in f:
                if len(rows) == count:
                    break
                rows.append(json.loads(line))
        if len(rows) < count:
            raise ValueError(f"{name} holds {len(rows)} rows, the document names {count}")
        return rows
