"""`JobStore`: the job history in an embedded SQLite database and output files under the data folder.
WAL mode and one transaction per change: a process killed at any moment (kill -9 included) leaves every
committed job readable. An output is written whole and renamed (`write_atomically`) before the row naming it
commits; opening removes job files no row names, fails the jobs a stopped server left unfinished, and locks
the folder so that two servers never share one history. A row that cannot be read (edited by hand, damaged on
disk) is set aside: logged once, counted (`unreadable`, on `/health`), left as it is and skipped by every read."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from layerstream.atomic_write import PARTIAL_MARK, write_atomically
from layerstream.errors import LayerstreamError
from layerstream.server.jobs.records import JobKind, JobRecord, JobStatus, job_object
from layerstream.server.jobs.settings import HistorySettings

logger = logging.getLogger(__name__)

DATABASE_NAME = "jobs.sqlite3"
OUTPUTS_FOLDER = "outputs"
SERVING_FOLDER = "serving"  # hard links to outputs being downloaded (`serve_output`)
LOCK_NAME = "lock"
SCHEMA_VERSION = 3  # of the table and its records; another is refused (1 and 2: development versions before 0.1)
# what write_output writes (a job's output, or its temporary file): only these may be removed unasked, since
# --data-dir may name a folder whose outputs/ also holds other files (another tool's results)
_JOB_FILE = re.compile(rf"\.?(video|image)_[0-9a-f]+({re.escape(PARTIAL_MARK)}[0-9a-f]+)?\.(mp4|png)")

_SERVED_FILE = re.compile(rf"[0-9a-f]{{32}}-{_JOB_FILE.pattern}")
_ROW = "seq, id, kind, status, record"  # the columns `_read_row` reads

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order: list pages and retention follow it
    id TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    output_bytes INTEGER NOT NULL DEFAULT 0,
    record TEXT NOT NULL  -- the whole JobRecord as JSON
)
"""


class JobStoreError(LayerstreamError, OSError):
    """The data folder cannot hold this server's history (in use by another server, unreadable, too new)."""


class JobStore:
    """Jobs and their outputs, safe to use from the event loop and the worker thread at once."""

    def __init__(self, settings: HistorySettings):
        self.settings = settings
        self.folder = settings.data_dir
        self.outputs = self.folder / OUTPUTS_FOLDER
        self.serving = self.folder / SERVING_FOLDER
        try:
            self.outputs.mkdir(parents=True, exist_ok=True)
            self.serving.mkdir(exist_ok=True)
        except OSError as e:
            raise JobStoreError(f"data_dir = {str(self.folder)!r} cannot be created: {e.strerror or e}") from e
        self._lock_file = _lock_folder(self.folder)
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self.unreadable: dict[int, str] = {}  # rows set aside (their seq -> why), left in the database as they are
        try:
            self._db = sqlite3.connect(self.folder / DATABASE_NAME, check_same_thread=False, timeout=10.0)
            self._open_schema()
        except sqlite3.Error as e:
            self._lock_file.close()
            raise JobStoreError(f"data_dir = {str(self.folder)!r}: the job database cannot be opened: {e}") from e

    def _open_schema(self) -> None:
        # WAL: readers never block the writer, and a killed process leaves every committed transaction readable
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable against a killed process in WAL mode (only a power loss may lose the last commits)
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version} is newer than this layerstream's {SCHEMA_VERSION}")
        if 0 < version < SCHEMA_VERSION:  # 0: a new database
            raise sqlite3.DatabaseError(
                f"schema version {version} is a development version's, before this layerstream's {SCHEMA_VERSION}; "
                "start a new history in another folder"
            )
        with self._db:
            self._db.execute(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        # a table altered by hand: every query would fail on the column it lost; one line says which, at start
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        missing = [name for name in ("seq", "id", "kind", "status", "output_bytes", "record") if name not in columns]
        if missing:
            raise sqlite3.DatabaseError(
                f"its jobs table has no column {missing[0]!r} (altered outside the server); start a new history in"
                " another folder"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()
        self._lock_file.close()  # releases the folder lock

    def recover_(self) -> list[str]:
        """Fail every job a previous server left unfinished and remove the job files no job names; the ids failed."""
        now = int(time.time())
        failed = []
        with self._transaction() as db:
            records = [self._read_row(row) for row in db.execute(f"SELECT {_ROW} FROM jobs").fetchall()]
            for record in records:  # every row read once: the unreadable ones are set aside (and logged) now
                if record is None or record.status.finished:
                    continue
                message = f"the server stopped while the job was {record.status}; it was not finished"
                error = {"code": "server_restarted", "message": message}
                self._write_row(db, record.with_status(JobStatus.FAILED, error=error, completed_at=now))
                failed.append(record.id)
            # a row that is not JSON names no file (json_extract would refuse the whole query)
            query = "SELECT CASE WHEN json_valid(record) THEN json_extract(record, '$.output_name') END FROM jobs"
            named = {row[0] for row in db.execute(query)}
        for path in self.outputs.iterdir():
            if path.name not in named and _JOB_FILE.fullmatch(path.name):
                path.unlink(missing_ok=True)  # written before a kill, never committed (or a temporary file)
        for path in self.serving.iterdir():
            if _SERVED_FILE.fullmatch(path.name):
                path.unlink(missing_ok=True)  # a download the last server was sending when it stopped
        if failed:
            logger.info("job history: %d job(s) left unfinished by the last server marked failed", len(failed))
        return failed

    def insert(self, record: JobRecord) -> None:
        with self._transaction() as db:
            db.execute(
                "INSERT INTO jobs (id, kind, status, output_bytes, record) VALUES (?, ?, ?, ?, ?)",
                (record.id, record.kind, record.status, record.output_bytes, json.dumps(record.to_dict())),
            )

    def update(self, record: JobRecord) -> bool:
        """Store `record` over the job of its id; False if that job was deleted meanwhile."""
        with self._transaction() as db:
            return self._write_row(db, record)

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {_ROW} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return self._read_row(row) if row else None

    def statuses(self) -> list[tuple[str, JobStatus]]:
        with self._lock:
            rows = self._db.execute("SELECT seq, id, status FROM jobs ORDER BY seq").fetchall()
        return [(job_id, JobStatus(status)) for seq, job_id, status in rows if seq not in self.unreadable]

    def page(
        self, kind: JobKind, *, limit: int, after: str | None, order: Literal["asc", "desc"]
    ) -> tuple[list[JobRecord], bool] | None:
        """(up to `limit` jobs of `kind` after `after`; whether more follow), or None if `after` names no job."""
        sign, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        # rows set aside are left out by the query; one found unreadable just now is set aside, and asked again
        query, args = f"SELECT {_ROW} FROM jobs WHERE kind = ? AND seq NOT IN (SELECT value FROM json_each(?))", [kind]
        with self._lock:
            if after is not None:
                row = self._db.execute("SELECT seq FROM jobs WHERE id = ? AND kind = ?", (after, kind)).fetchone()
                if row is None:
                    return None
                query += f" AND seq {sign} ?"
                args.append(row[0])
            while True:
                aside = json.dumps(list(self.unreadable))
                rows = self._db.execute(f"{query} ORDER BY seq {direction} LIMIT ?", (args[0], aside, *args[1:], limit + 1))
                records = [self._read_row(row) for row in rows.fetchall()]
                if None not in records:
                    return records[:limit], len(records) > limit  # type: ignore[return-value]  # none is None

    def delete(self, job_id: str) -> JobRecord | None:
        with self._transaction() as db:
            row = db.execute(f"SELECT {_ROW} FROM jobs WHERE id = ?", (job_id,)).fetchone()
            record = self._read_row(row) if row else None
            if record is None:  # none, or set aside: left as it is
                return None
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        self.remove_output(record.output_name)
        return record

    def output_path(self, record: JobRecord) -> Path | None:
        return self.outputs / record.output_name if record.output_name else None

    def write_output(self, job_id: str, suffix: str, write: Callable[[Path], None]) -> tuple[str, int]:
        """Write a job's output atomically with `write(path)`; (its file name, its size in bytes)."""
        name = f"{job_id}{suffix}"
        with write_atomically(self.outputs / name) as partial:
            write(partial)
        return name, (self.outputs / name).stat().st_size

    def serve_output(self, record: JobRecord) -> Path | None:
        """A hard link to the output for one download, which a DELETE cannot cut; None if the output is gone."""
        path = self.output_path(record)
        if path is None:
            return None
        link = self.serving / f"{uuid.uuid4().hex}-{path.name}"
        try:
            os.link(path, link)
        except FileNotFoundError:
            return None
        except OSError:
            return path if path.exists() else None
        return link

    def release_served(self, served: Path) -> None:
        if served.parent == self.serving:
            served.unlink(missing_ok=True)

    def remove_output(self, name: str | None) -> None:
        if name:
            (self.outputs / name).unlink(missing_ok=True)

    def enforce_retention_(self) -> list[str]:
        """Remove the oldest finished jobs (never the newest) to fit --max-jobs and --max-output-bytes; their ids."""
        max_jobs, max_bytes = self.settings.max_jobs, self.settings.max_output_bytes
        if max_jobs is None and max_bytes is None:
            return []
        finished = (JobStatus.COMPLETED, JobStatus.FAILED)
        with self._transaction() as db:
            rows = db.execute(f"SELECT {_ROW} FROM jobs WHERE status IN (?, ?) ORDER BY seq", finished).fetchall()
            records = [record for record in map(self._read_row, rows) if record is not None]  # others stay
            count, total = len(records), sum(record.output_bytes for record in records)
            removed = []
            for record in records[:-1]:
                if (max_jobs is None or count <= max_jobs) and (max_bytes is None or total <= max_bytes):
                    break
                db.execute("DELETE FROM jobs WHERE id = ?", (record.id,))
                removed.append(record)
                count, total = count - 1, total - record.output_bytes
        for record in removed:
            self.remove_output(record.output_name)
        if removed:
            logger.info("job history: removed %d oldest finished job(s) (retention limits)", len(removed))
        return [record.id for record in removed]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._db:  # commits on success, rolls back on an exception
            yield self._db

    @staticmethod
    def _write_row(db: sqlite3.Connection, record: JobRecord) -> bool:
        cursor = db.execute(
            "UPDATE jobs SET status = ?, output_bytes = ?, record = ? WHERE id = ?",
            (record.status, record.output_bytes, json.dumps(record.to_dict()), record.id),
        )
        return cursor.rowcount == 1

    def _read_row(self, row: tuple[Any, ...]) -> JobRecord | None:
        """The record of a row, or None for one set aside (logged the first time it is met)."""
        seq, job_id, kind, status, text = row
        try:
            record = JobRecord.from_dict(json.loads(text))
            if (record.id, record.kind, str(record.status)) != (job_id, kind, status):
                raise ValueError(f"its columns (id, kind, status) {(job_id, kind, status)} disagree with its record")
            if record.output_name is not None and not (
                _JOB_FILE.fullmatch(record.output_name) and record.output_name.startswith(record.id)
            ):
                raise ValueError(f"output_name {record.output_name!r} is not the name of this job's output file")
            json.dumps(job_object(record, None, None))  # what the API shows of it can be built
        except Exception as e:  # noqa: BLE001 - whatever a damaged row raises, it is set aside, never raised
            if seq not in self.unreadable:
                reason = f"{type(e).__name__}: {e}"[:300]
                logger.warning("job history: row %s (id %r) cannot be read; set aside, left as it is (%s)", seq, job_id, reason)
                self.unreadable[seq] = reason
            return None
        return record


def _lock_folder(folder: Path):
    """An open file locking `folder` until closed; JobStoreError if another server holds it."""
    handle = open(folder / LOCK_NAME, "a+")
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform: one server per folder is then the user's care
        return handle
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        message = f"data_dir = {str(folder)!r} is in use by another running server (pid in its lock file)"
        raise JobStoreError(f"{message}; give each server its own --data-dir") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
