"""The asyncio service around an engine: one aiohttp app for HTTP and WebSocket.

At the root: app (routes, probes, /v1/models, /metrics), server (engine start, serve, SIGTERM
drain), settings (every flag and STREAMVOX_* variable), state (what one app holds), errors
(the one error shape, the engine-error map), metrics. In rooms, one job per module:
  access      API keys; per-key rate limit and caps
  http        middleware, body reading, admission (the front of every work-starting call), playground
  synthesis   request schema and params, submit (prepare / open_stream), chunks, encoders, spool, tempo
  rest        POST /v1/audio/speech (OpenAI-compatible; file, byte stream or SSE)
  ws          /v1/stream, vllm-omni's socket, and the voice-agent dialects over one context core
  jobs        /v1/jobs, the runner (leases, quota) and the stores (SQLite, PostgreSQL, migrate-store)
  voices      saved voices (owned by their key), reference decoding in worker processes, URL fetching
  db          the stores' versioned schema (SQLite and PostgreSQL) and the PostgreSQL pool
docs/ARCHITECTURE.md walks a request through them.
"""
