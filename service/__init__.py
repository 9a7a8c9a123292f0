"""The asyncio service around an engine: one aiohttp app for HTTP and WebSocket.

Modules, one job each:
  settings    flags + STREAMVOX_* environment variables -> frozen Settings
  server      build/start the engine, serve, drain on SIGTERM, exit 1 if the worker dies
  app         routes, probes, /v1/models, /v1/voices, /metrics
  middleware  request ids, JSON errors, access log, auth, CORS
  speech      POST /v1/audio/speech (OpenAI-compatible; file, byte stream or SSE)
  ws          WebSocket /v1/stream (sentences -> utterances, back-pressure, cancel)
  jobs        /v1/jobs routes; job_runner: claims jobs under a lease and runs them
  job_store   the job/voice store interface; job_store_sqlite (embedded, one replica) and
              job_store_pg (PostgreSQL shared by every replica: SKIP LOCKED, leases, NOTIFY)
  voices      saved voices and cloning at the boundary; voice_store: files or the database
  chunks      the worker-thread -> event-loop bridge with pause/resume back-pressure
  params      validation of synthesis parameters; audio: encoders; limits: per-key limits
  state       what one app holds (engine, metrics, keys, drain switch); metrics; auth; errors
"""
