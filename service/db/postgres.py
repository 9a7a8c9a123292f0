"""One pooled connection to the shared PostgreSQL, its schema migrated when it opens.

    db = Database(url, pool_size=8, password=None)
    await db.open()                       # StoreUnavailable while unreachable
    async with db.connection() as conn:   # StoreUnavailable while unreachable
        ...

The jobs store and the saved-voice store share one :class:`Database` (one pool per replica).
The password comes from the URL, ``PGPASSWORD`` / ``PGPASSFILE`` (libpq's variables, which
asyncpg reads) or ``--jobs-db-password-file``; log lines show the URL redacted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

import asyncpg

from service.db.schema import SCHEMA_VERSION, log_migration, pending
from service.db.urls import redact_url
from service.errors import StoreUnavailable

log = logging.getLogger("streamvox.db")

MIGRATION_LOCK = 0x5754_0017  # pg_advisory_xact_lock key while the schema is migrated
CONNECT_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 30.0
REOPEN_AFTER_S = 1.0  # after a failed open, callers fail at once for this long

# What a lost or refused connection raises; anything else is a bug and propagates.
# A refused login (wrong or rotated password, unknown database) is the same to a client: the
# store cannot be used now (503 + Retry-After), and the log line says why.
UNREACHABLE = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
               asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.InsufficientResourcesError,
               asyncpg.exceptions.InvalidAuthorizationSpecificationError, asyncpg.exceptions.InvalidCatalogNameError)


class Database:
    def __init__(self, url: str, pool_size: int = 8, password: str | None = None):
        self.url = url
        self.pool_size = pool_size
        self.password = password  # None: from the URL or libpq's environment variables
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._open_failure: tuple[float, str] | None = None  # (monotonic time, message) of the last failed open

    def __repr__(self) -> str:
        return f"Database({redact_url(self.url)})"

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    async def open(self) -> None:
        async with self._opening:
            if self._pool is not None:
                return
            # Callers queued on the lock behind a failed try fail at once rather than each
            # waiting out its own connect timeout (a blackholed database: 5 s per caller).
            if self._open_failure is not None and time.monotonic() - self._open_failure[0] < REOPEN_AFTER_S:
                raise StoreUnavailable(self._open_failure[1])
            # min_size 0: no floor that asyncpg restores (with a traceback per try) while the database is down
            pool = asyncpg.create_pool(self.url, password=self.password, min_size=0, max_size=self.pool_size,
                                       timeout=CONNECT_TIMEOUT_S, command_timeout=COMMAND_TIMEOUT_S)
            try:
                await pool
                async with pool.acquire(timeout=CONNECT_TIMEOUT_S) as conn:
                    await self._migrate(conn)
            except BaseException as exc:
                await pool.close()
                if isinstance(exc, UNREACHABLE):
                    message = f"job database {redact_url(self.url)} unreachable: {type(exc).__name__}: {exc}"
                    self._open_failure = (time.monotonic(), message)
                    raise StoreUnavailable(message) from None
                raise
            self._pool, self._open_failure = pool, None
            log.info("database: %s (schema v%d, pool %d)", redact_url(self.url), SCHEMA_VERSION, self.pool_size)

    @staticmethod
    async def _migrate(conn: asyncpg.Connection) -> None:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            await conn.execute("CREATE TABLE IF NOT EXISTS streamvox_schema (version integer NOT NULL)")
            version = await conn.fetchval("SELECT max(version) FROM streamvox_schema") or 0
            for step in pending(version):
                if step.postgresql:
                    await conn.execute(step.postgresql)
                await conn.execute("INSERT INTO streamvox_schema (version) VALUES ($1)", step.version)
        log_migration("database", version)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    @asynccontextmanager
    async def connection(self):
        """A pooled connection (opening the database if needed); StoreUnavailable while unreachable."""
        if self._pool is None:
            await self.open()
        try:
            async with self._pool.acquire(timeout=CONNECT_TIMEOUT_S) as conn:
                yield conn
        except UNREACHABLE as exc:
            raise StoreUnavailable(f"job database unreachable: {exc.__class__.__name__}: {exc}") from None

    async def connect(self) -> asyncpg.Connection:
        """A connection of its own, outside the pool (a LISTEN connection); StoreUnavailable while unreachable."""
        try:
            return await asyncpg.connect(self.url, password=self.password, timeout=CONNECT_TIMEOUT_S)
        except UNREACHABLE as exc:
            raise StoreUnavailable(f"job database unreachable: {exc}") from None

    async def expire_connections(self) -> None:
        """Drop the pool's connections (they died with the server); new ones are made on the next acquire."""
        if self._pool is not None:
            await self._pool.expire_connections()
