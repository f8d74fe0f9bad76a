"""The broker's persistent state: SQLite in its state dir (embedded, nothing to install).

Four tables: ``compnodes`` (every compnode seen, last known state/hardware/heartbeat), ``jobs`` (state,
step, loss, timestamps), ``job_events`` (an append-only log per job) and ``churn`` (one row: the
unplanned compnode losses and compnode-seconds the broker has watched, ``broker.churn``, so a restarted
broker keeps its estimate of how often compnodes fail instead of starting again from the prior). The
schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` upgrades version i to i+1, each in
its own transaction, and a database newer than this code is refused rather than misread.

All calls are synchronous and short (WAL journal, one connection owned by the broker's event loop).

A write the database refuses (a full disk) raises ``StoreError``. A job's fields that could not be
written are kept in memory and read back over the row, and written with the job's next update that
succeeds, so a job still ends FAILED with its reason for the submitter who polls it (a CI machine
whose disk filled once left a job RUNNING until the submitter's timeout).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from fusionnet.errors import JobError, StoreError

log = logging.getLogger(__name__)

MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1
    """
    CREATE TABLE compnodes (
        peer_id TEXT PRIMARY KEY,
        role TEXT NOT NULL,
        backup INTEGER NOT NULL,
        state TEXT NOT NULL,
        reachable INTEGER NOT NULL,
        hardware TEXT,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL,
        last_heartbeat REAL,
        rtt REAL
    );
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        state TEXT NOT NULL,
        step INTEGER NOT NULL DEFAULT 0,
        steps INTEGER,
        loss REAL,
        error TEXT,
        submitter TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE job_events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id TEXT NOT NULL REFERENCES jobs(job_id),
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        detail TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX job_events_by_job ON job_events(job_id, id);
    """,
    # 1 -> 2
    """
    CREATE TABLE churn (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        losses INTEGER NOT NULL CHECK (losses >= 0),
        watched REAL NOT NULL CHECK (watched >= 0),
        updated_at REAL NOT NULL
    );
    """,
    # 1 -> 2: whether a FAILED job's error lies in its input (its job file, model, data: the submitter
    # exits 2) or in the work (the swarm, a peer, the broker: exit 1); NULL for rows from before
    "ALTER TABLE jobs ADD COLUMN error_kind TEXT",
)
SCHEMA_VERSION = len(MIGRATIONS)

# A deployment's row in the jobs table is named "deploy:NAME" (its placement events are a job's).
DEPLOYMENT_ROW = "deploy:"


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PLANNING = "PLANNING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class CompnodeRow:
    peer_id: str
    role: str
    backup: bool
    state: str
    reachable: bool
    hardware: dict[str, Any] | None
    first_seen: float
    last_seen: float
    last_heartbeat: float | None = None
    rtt: float | None = None


class BrokerStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit; explicit transactions
        except sqlite3.Error as e:
            raise ValueError(f"{self.path}: cannot open the broker database ({e})") from e
        self._db.row_factory = sqlite3.Row
        self._unwritten: dict[str, dict[str, Any]] = {}  # job id -> fields the database refused
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            # a damaged page past the header: found now, not by the first query the broker makes
            problem = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if problem != "ok":
                raise sqlite3.DatabaseError("damaged: " + " ".join(str(problem).split())[:200])
        except sqlite3.DatabaseError as e:  # a file that is not a database, or a damaged one
            self._db.close()
            raise ValueError(
                f"{self.path}: not a FusionNet broker database ({e}); move it aside to start afresh"
            ) from None

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise ValueError(
                f"{self.path}: schema version {version} is newer than this FusionNet understands "
                f"({SCHEMA_VERSION}); use a newer FusionNet or another --state-dir"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            # executescript() commits first, so run the statements one by one inside our own transaction.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in MIGRATIONS[target - 1].split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {target}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        self._db.close()

    # ---- compnodes -------------------------------------------------------------------------------
    def upsert_compnodes(self, rows: Iterable[CompnodeRow]) -> None:
        params = [
            (
                r.peer_id, r.role, int(r.backup), r.state, int(r.reachable),
                None if r.hardware is None else json.dumps(r.hardware, sort_keys=True),
                r.first_seen, r.last_seen, r.last_heartbeat, r.rtt,
            )
            for r in rows
        ]  # fmt: skip
        if not params:
            return
        with self._transaction():
            self._db.executemany(
                """INSERT INTO compnodes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT(peer_id) DO UPDATE SET role=excluded.role, backup=excluded.backup,
                   state=excluded.state, reachable=excluded.reachable, hardware=excluded.hardware,
                   last_seen=excluded.last_seen, last_heartbeat=excluded.last_heartbeat, rtt=excluded.rtt""",
                params,
            )

    def list_compnodes(self) -> list[CompnodeRow]:
        rows = self._db.execute("SELECT * FROM compnodes ORDER BY peer_id").fetchall()
        return [
            CompnodeRow(
                **{
                    k: r[k]
                    for k in ("peer_id", "role", "state", "first_seen", "last_seen", "last_heartbeat", "rtt")
                },
                backup=bool(r["backup"]),
                reachable=bool(r["reachable"]),
                hardware=None if r["hardware"] is None else json.loads(r["hardware"]),
            )
            for r in rows
        ]

    # ---- churn -----------------------------------------------------------------------------------
    def save_churn(self, losses: int, watched: float) -> None:
        """The churn history so far (``ChurnBook.history``): it replaces what was there."""
        with self._transaction():
            self._db.execute(
                """INSERT INTO churn VALUES (1, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET
                   losses=excluded.losses, watched=excluded.watched, updated_at=excluded.updated_at""",
                (int(losses), float(watched), time.time()),
            )

    def churn(self) -> tuple[int, float]:
        """``(losses, watched compnode-seconds)`` as last saved; ``(0, 0.0)`` for a new broker, or when
        the row does not hold what ``save_churn`` writes (edited by hand), which is said in the log."""
        row = self._db.execute("SELECT losses, watched FROM churn WHERE id = 1").fetchone()
        if row is None:
            return 0, 0.0
        losses, watched = row
        if (
            not (isinstance(losses, int) and isinstance(watched, float | int))
            or losses < 0
            or not (0 <= watched < float("inf"))
        ):
            log.warning(
                "%s: churn history %r/%r is not a count and seconds; starting from none",
                self.path,
                losses,
                watched,
            )
            return 0, 0.0
        return losses, float(watched)

    # ---- jobs ------------------------------------------------------------------------------------
    def create_job(
        self, job_id: str, name: str, *, steps: int | None = None, submitter: str | None = None
    ) -> dict[str, Any]:
        now = time.time()
        try:
            with self._transaction():
                self._db.execute(
                    "INSERT INTO jobs (job_id, name, state, steps, submitter, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job_id, name, JobState.QUEUED.value, steps, submitter, now, now),
                )
                self._add_event(
                    job_id, "created", {"name": name, "steps": steps, "submitter": submitter}, now
                )
        except sqlite3.IntegrityError as e:
            raise JobError(f"job id {job_id!r} already exists") from e
        return self.get_job(job_id)

    def update_job(
        self,
        job_id: str,
        *,
        state: JobState | str | None = None,
        step: int | None = None,
        loss: float | None = None,
        error: str | None = None,
        error_kind: str | None = None,
    ) -> dict[str, Any]:
        """Updates the given fields; a state change is also logged as a job event."""
        current = self.get_job(job_id)
        if state is not None:
            state = JobState(state)
            if JobState(current["state"]).terminal and state != current["state"]:
                raise JobError(f"job {job_id} is already {current['state']}; cannot move it to {state}")
        now = time.time()
        fields: dict[str, Any] = {"updated_at": now}
        for name, value in (
            ("state", state), ("step", step), ("loss", loss), ("error", error), ("error_kind", error_kind)
        ):  # fmt: skip
            if value is not None:
                fields[name] = value.value if isinstance(value, JobState) else value
        fields = self._unwritten.pop(job_id, {}) | fields  # what an earlier update could not write
        try:
            with self._transaction():
                self._db.execute(
                    f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in fields)} WHERE job_id = ?",
                    (*fields.values(), job_id),
                )
                if state is not None and state != current["state"]:
                    detail = {"from": current["state"], "to": state.value}
                    self._add_event(job_id, "state", detail | ({"error": error} if error else {}), now)
        except StoreError as e:
            self._unwritten[job_id] = fields
            if state is None or not state.terminal:
                raise  # the job cannot go on without its record: its run fails it (below)
            # The job ended: nothing better to do than to say so from memory.
            log.error("job %s: %s kept in memory only (lost if the broker restarts): %s", job_id, state, e)
        return self.get_job(job_id)

    def get_job(self, job_id: str) -> dict[str, Any]:
        row = self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise JobError(f"no job with id {job_id!r}")
        return dict(row) | self._unwritten.get(job_id, {})

    def list_jobs(self, limit: int = 100) -> list[dict[str, Any]]:
        """Most recently updated first."""
        rows = self._db.execute("SELECT * FROM jobs ORDER BY updated_at DESC, job_id LIMIT ?", (limit,))
        return [dict(r) | self._unwritten.get(r["job_id"], {}) for r in rows.fetchall()]

    def count_jobs_by_state(self) -> dict[str, int]:
        """state -> number of jobs in it, over all jobs (``list_jobs`` is capped; this is not)."""
        rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {state: n for state, n in rows}

    def add_job_event(self, job_id: str, kind: str, detail: dict[str, Any] | None = None) -> None:
        self.get_job(job_id)  # refuse events for unknown jobs with a clear message
        with self._transaction():
            self._add_event(job_id, kind, detail or {}, time.time())

    def job_events(self, job_id: str, after_id: int = 0) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, job_id, at, kind, detail FROM job_events WHERE job_id = ? AND id > ? ORDER BY id",
            (job_id, after_id),
        ).fetchall()
        return [dict(r) | {"detail": json.loads(r["detail"])} for r in rows]

    def _add_event(self, job_id: str, kind: str, detail: dict[str, Any], at: float) -> None:
        self._db.execute(
            "INSERT INTO job_events (job_id, at, kind, detail) VALUES (?, ?, ?, ?)",
            (job_id, at, kind, json.dumps(detail, sort_keys=True)),
        )

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db, self.path)


class _Transaction:
    """``with`` block = one IMMEDIATE transaction (the default context manager of sqlite3 does not begin one
    in autocommit mode). A write the database refuses leaves it as ``StoreError`` naming the file."""

    def __init__(self, db: sqlite3.Connection, path: Path):
        self.db, self.path = db, path

    def __enter__(self) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise self._refused(e) from e

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        if exc_type is None:
            try:
                self.db.execute("COMMIT")
                return
            except sqlite3.OperationalError as e:
                exc = e
        if self.db.in_transaction:  # sqlite may have rolled back already (a full disk does)
            with contextlib.suppress(sqlite3.Error):  # the error that got here says more
                self.db.execute("ROLLBACK")
        if isinstance(exc, sqlite3.OperationalError):
            raise self._refused(exc) from exc

    def _refused(self, e: sqlite3.OperationalError) -> StoreError:
        return StoreError(f"{self.path}: the broker database refused a write ({e})")
