"""The embedded SQLite database's migration: the steps of service/db/schema.py that it lacks,
applied in one transaction when the job store opens, each version recorded in
``streamvox_schema`` as PostgreSQL records it.

A database made before versions existed (no ``streamvox_schema``) has the tables and some of
the columns of the early steps, added one by one by the releases of that time: it runs every
step from the first, and an ``ADD COLUMN`` of a column it has is skipped (SQLite has no
``ADD COLUMN IF NOT EXISTS``).
"""

from __future__ import annotations

import re
import sqlite3

from service.db.schema import log_migration, pending

_ADD_COLUMN = re.compile(r"\s*ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)", re.I)


def statements(script: str) -> list[str]:
    """A script's statements, one each (sqlite3.complete_statement knows comments and quotes)."""
    found, pending_text = [], ""
    for line in script.splitlines(keepends=True):
        pending_text += line
        if sqlite3.complete_statement(pending_text):
            found.append(pending_text.strip())
            pending_text = ""
    if pending_text.strip():
        raise ValueError(f"incomplete SQL statement: {pending_text.strip()[:80]!r}")
    return found


def _has_column(db: sqlite3.Connection, table: str, column: str) -> bool:
    return any(row[1] == column for row in db.execute(f"PRAGMA table_info({table})"))


def migrate(db: sqlite3.Connection) -> int:
    """Bring ``db`` (autocommit mode: ``isolation_level=None``) to the current schema -> the
    version it had before. SchemaTooNew when a newer streamvox migrated it."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("CREATE TABLE IF NOT EXISTS streamvox_schema (version INTEGER NOT NULL)")
        version = db.execute("SELECT max(version) FROM streamvox_schema").fetchone()[0] or 0
        for step in pending(version):
            for statement in statements(step.sqlite):
                added = _ADD_COLUMN.match(statement)
                if version == 0 and added and _has_column(db, *added.groups()):
                    continue  # a database from before versions gained this column already
                db.execute(statement)
            db.execute("INSERT INTO streamvox_schema (version) VALUES (?)", (step.version,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    log_migration("job store", version)
    return version
