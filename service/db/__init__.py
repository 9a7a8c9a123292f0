"""The shared PostgreSQL database (``--jobs-db``): one connection pool and one versioned schema
for every store that lives there (jobs: service/jobs/store/postgres.py, saved voices:
service/voices/store_postgres.py)."""
