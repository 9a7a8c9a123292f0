"""Database URLs as log lines may show them (no driver needed: the SQLite default imports this)."""

from __future__ import annotations

import re


def redact_url(url: str) -> str:
    """A database URL fit for a log line: the password replaced."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
