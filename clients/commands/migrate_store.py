"""`streamvox migrate-store`: copy an embedded store (``--data-dir``: saved voices, REST jobs and
their audio) into the shared PostgreSQL (``--jobs-db``), before moving to several replicas."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .errors import fail


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("migrate-store", help="copy --data-dir's voices and jobs into a --jobs-db PostgreSQL")
    p.add_argument("--data-dir", required=True, help="the embedded store's directory (stop its server first)")
    p.add_argument("--jobs-db", default=None,
                   help="postgresql://user@host:port/db (default: STREAMVOX_JOBS_DB; password: PGPASSWORD or "
                        "--jobs-db-password-file, never in this flag)")
    p.add_argument("--jobs-db-password-file", default=None, help="file holding the database password")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from service.db.urls import redact_url
    from service.errors import StoreUnavailable
    from service.jobs.store.copy import copy_embedded_store
    from service.jobs.store.untrusted import UnreadableStore
    from service.settings import from_args

    data_dir = Path(args.data_dir)
    if not (data_dir / "jobs.sqlite3").is_file() and not (data_dir / "voices").is_dir():
        return fail(args.command, f"{data_dir} holds no job store (jobs.sqlite3) and no voices/")
    try:  # the serve flags' rules: a postgresql:// URL, no password on the command line
        settings = from_args(args, os.environ)
    except ValueError as exc:
        return fail(args.command, exc)
    if not settings.jobs_db:
        return fail(args.command, "no database: pass --jobs-db or set STREAMVOX_JOBS_DB")
    try:
        report = asyncio.run(copy_embedded_store(data_dir, settings.jobs_db, settings.jobs_db_password()))
    except UnreadableStore as exc:
        return fail(args.command, exc)
    except StoreUnavailable as exc:
        return fail(args.command, exc, 1)
    except Exception as exc:  # the directory is hostile input: one line, never a traceback
        return fail(args.command, f"{type(exc).__name__}: {str(exc)[:500]}", 1)
    for line in report.skipped_lines():  # what was left behind, and why
        print(line)
    print(f"{data_dir} -> {redact_url(settings.jobs_db)}: {report.summary()}")
    return 0
