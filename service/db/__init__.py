"""The stores' databases: one versioned schema for both (schema.py), applied to the embedded
SQLite when the job store opens (sqlite.py) and to the shared PostgreSQL (``--jobs-db``) by its
connection pool (postgres.py), which the jobs store (service/jobs/store/postgres.py) and the
saved voices (service/voices/store_postgres.py) share."""
