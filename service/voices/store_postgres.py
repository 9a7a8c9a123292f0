"""Saved voices in the shared PostgreSQL (``--jobs-db``; table ``voices``, service/db/schema.py),
so a voice uploaded through one replica clones on every other at once. Raises StoreUnavailable
while the database is down. The owner column holds '' for the unowned namespace (None here)."""

from __future__ import annotations

import json

import asyncpg
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from service.db.postgres import Database
from service.voices.store import (
    SavedVoice,
    VoiceExists,
    VoiceLimitReached,
    VoicePage,
    VoiceStore,
    limit_message,
    voice_meta,
    voice_tensors,
)

VOICES_LOCK = 0x5754_0019  # pg_advisory_xact_lock key: a cap check and its insert are one step


def _column(owner: str | None) -> str:
    return owner or ""


class PostgresVoiceStore(VoiceStore):
    def __init__(self, db: Database):
        self.db = db

    @staticmethod
    def _voice(row: asyncpg.Record) -> SavedVoice:
        arrays = load_tensors(bytes(row["tensors"]))
        meta = {**json.loads(row["meta"]), "owner": row["owner"] or None}  # the column is authoritative
        return SavedVoice(xvector=arrays["xvector"], codes=arrays["codes"], **meta)

    async def get(self, name: str, owner: str | None) -> SavedVoice | None:
        if not self.valid_name(name):
            return None
        async with self.db.connection() as conn:
            row = await conn.fetchrow("SELECT owner, meta, tensors FROM voices WHERE owner = $1 AND name = $2",
                                      _column(owner), name)
        return self._voice(row) if row else None

    async def list(self, owner=None, any_owner=False, limit=100, after=None) -> VoicePage:
        async with self.db.connection() as conn:
            if any_owner:  # (name, owner) order; the cursor is "name/owner" ('/' is never in a name)
                name, slash, tag = (after or "").partition("/")
                rows = await conn.fetch(
                    "SELECT name, owner, meta, tensors FROM voices WHERE $1::text IS NULL OR name > $1 "
                    "OR (name = $1 AND $2::text IS NOT NULL AND owner > $2) ORDER BY name, owner LIMIT $3",
                    name if after else None, tag if slash else None, limit + 1)
            else:
                rows = await conn.fetch(
                    "SELECT name, owner, meta, tensors FROM voices WHERE owner = $1 AND ($2::text IS NULL OR name > $2) "
                    "ORDER BY name LIMIT $3", _column(owner), after, limit + 1)
        page = rows[:limit]
        voices = [self._voice(row) for row in page]
        if len(rows) <= limit:
            return VoicePage(voices, None)
        last = page[-1]
        return VoicePage(voices, f"{last['name']}/{last['owner']}" if any_owner else last["name"])

    async def count(self, owner=None, any_owner=False) -> int:
        async with self.db.connection() as conn:
            if any_owner:
                return await conn.fetchval("SELECT count(*) FROM voices")
            return await conn.fetchval("SELECT count(*) FROM voices WHERE owner = $1", _column(owner))

    async def add(self, voice, max_per_owner=0, max_total=0) -> SavedVoice:
        owner = _column(voice.owner)
        async with self.db.connection() as conn, conn.transaction():
            if max_per_owner or max_total:  # serialises uploads (rare, rate-limited) so no cap is overshot
                await conn.execute("SELECT pg_advisory_xact_lock($1)", VOICES_LOCK)
            if max_per_owner:
                held = await conn.fetchval("SELECT count(*) FROM voices WHERE owner = $1", owner)
                if held >= max_per_owner:
                    raise VoiceLimitReached(limit_message(held, max_per_owner, "this key has"))
            if max_total:
                held = await conn.fetchval("SELECT count(*) FROM voices")
                if held >= max_total:
                    raise VoiceLimitReached(limit_message(held, max_total, "the server holds"))
            added = await conn.fetchval(
                "INSERT INTO voices (owner, name, meta, tensors, created_at) VALUES ($1, $2, $3, $4, $5) "
                "ON CONFLICT (owner, name) DO NOTHING RETURNING true", owner, voice.name,
                json.dumps(voice_meta(voice)), save_tensors(voice_tensors(voice)), voice.created_at)
        if not added:
            raise VoiceExists(voice.name)
        return voice

    async def delete(self, name: str, owner: str | None) -> bool:
        async with self.db.connection() as conn:
            return bool(await conn.fetchval("DELETE FROM voices WHERE owner = $1 AND name = $2 RETURNING true",
                                            _column(owner), name))
