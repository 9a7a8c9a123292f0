"""Where jobs and saved voices are kept: SQLite under --data-dir, or PostgreSQL shared by
every replica. The PostgreSQL store (and its driver, asyncpg) is imported only when
``--jobs-db`` names one: the embedded default needs no database driver."""

from service.jobs.store.base import JobStore
from service.jobs.store.sqlite import SqliteJobStore


def make_job_store(settings) -> JobStore:
    """The store ``settings`` ask for, not yet opened."""
    if settings.jobs_db:
        from service.jobs.store.postgres import PostgresJobStore

        return PostgresJobStore(settings.jobs_db, pool_size=settings.jobs_db_pool_size,
                                password=settings.jobs_db_password())
    return SqliteJobStore(settings.data_dir)
