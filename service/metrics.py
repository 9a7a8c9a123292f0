"""Prometheus metrics, on a per-app registry (several apps can live in one process)."""

from __future__ import annotations

import asyncio

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engines.contract import SynthesisEngine, TickReport

# Fine-grained at the low end so "at least 8 rows in one tick" is visible (le=7 vs le=8).
BATCH_ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
LOOP_LAG_PERIOD_S = 0.02

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, engine: SynthesisEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        # The HPA's metric counts the shared job queue too. Jobs wait in the job store,
        # not the engine queue; the leader replica (one per store) adds the store's queued jobs,
        # the others 0, so the average over pods is (engine queues + shared queue) / pods.
        self.job_backlog = 0  # set by the job runner (service/jobs/runner.py)
        self.queue_depth = Gauge("streamvox_queue_depth", "Requests waiting for an engine slot, plus the shared "
                                 "job queue on the leader replica", registry=r)
        self.queue_depth.set_function(lambda: engine.stats().queue_depth + self.job_backlog)
        self.jobs_queued = Gauge("streamvox_jobs_queued", "Jobs waiting in the shared job store (exported by "
                                 "the leader replica; 0 on the others)", registry=r)
        self.jobs_queued.set_function(lambda: self.job_backlog)
        self.jobs_succeeded = Counter("streamvox_jobs_succeeded_total", "Jobs whose audio this replica stored "
                                      "and recorded succeeded", registry=r)
        # Counted when a job's whole audio is in the store, before its completion is recorded: summed over
        # replicas it says how often audio was produced, so a job run to the end twice would show.
        self.job_audio_stored = Counter("streamvox_job_audio_stored_total", "Jobs whose whole audio this replica "
                                        "wrote into the job store", registry=r)
        # Leases: claims by whether the job was new (first) or taken over from a replica
        # that stopped renewing (takeover), attempts this replica gave up (lost: cancelled elsewhere
        # or taken over), and whether the store answered the runner's last call.
        self.job_claims = Counter("streamvox_job_claims_total", "Jobs this replica claimed, by kind", ["kind"],
                                  registry=r)
        self.job_leases_lost = Counter("streamvox_job_leases_lost_total", "Running jobs this replica stopped "
                                       "because their lease was no longer its own", registry=r)
        self.job_store_up = Gauge("streamvox_job_store_up", "1 while the job store answers the job runner",
                                  registry=r)
        self.job_store_up.set(1)
        self.active_slots = Gauge("streamvox_active_slots", "Engine slots in use", registry=r)
        self.active_slots.set_function(lambda: engine.stats().active_slots)
        self.active_requests = Gauge("streamvox_active_requests", "Requests admitted and not finished", registry=r)
        self.active_requests.set_function(lambda: engine.stats().active_requests)
        self.ready = Gauge("streamvox_ready", "1 while the server accepts work", registry=r)
        self.paused_streams = Gauge("streamvox_paused_streams", "Streams paused by back-pressure", registry=r)
        self.tick_batch_rows = Histogram("streamvox_tick_batch_rows", "Rows in one tick's model forward",
                                         buckets=BATCH_ROW_BUCKETS, registry=r)
        self.tick_batch_rows_max = Gauge("streamvox_tick_batch_rows_max", "Most rows in one tick's model forward "
                                         "since start", registry=r)
        self._most_rows = 0
        # How late the event loop wakes from a short sleep: a stall holds every request (/healthz too)
        self.loop_lag = Histogram("streamvox_event_loop_lag_seconds", "How late the event loop ran a "
                                  f"{LOOP_LAG_PERIOD_S * 1000:.0f} ms timer", buckets=LOOP_LAG_BUCKETS, registry=r)
        self.loop_lag_max = Gauge("streamvox_event_loop_lag_max_seconds", "The event loop's longest lag since "
                                  "start", registry=r)
        self._longest_lag = 0.0
        self.tick_seconds = Histogram("streamvox_tick_seconds", "Wall time of one worker tick",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("streamvox_time_to_first_audio_seconds", "Submit to first audio chunk",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.audio_seconds = Counter("streamvox_audio_seconds_total", "Seconds of audio produced", registry=r)
        # Streams that fell behind real time (service/synthesis/chunks.py PlaybackClock): the only notice a
        # raw audio stream gets, which cannot carry an event (SSE and WebSocket clients are told)
        self.behind = Counter("streamvox_stream_behind_total", "Chunks of realtime streams that became available "
                              "after their listener had played everything before them", registry=r)
        self.behind_seconds = Counter("streamvox_stream_behind_seconds_total", "Silence listeners of realtime "
                                      "streams heard because the audio came later than real time", registry=r)
        self.requests = Counter("streamvox_requests_total", "Requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        # The talker's runaway guard and frame budget (engines/pipelines/talker/guard.py, budget.py)
        self.truncated = Counter("streamvox_utterances_truncated_total", "Talker utterances ended before EOS, by "
                                 "what ended them: budget (their text's frame budget), max_new_tokens, max_seq_len, "
                                 "loop (their code 0 repeated one pattern)", ["reason"], registry=r)
        r.register(_StageCollector(engine))
        r.register(_KVCacheCollector(engine))  # no samples where the pipeline has no KV pool (the DiT)
        r.register(_GraphCaptureCollector(engine))

    def observe_loop_lag(self, lag_s: float) -> None:
        self.loop_lag.observe(lag_s)
        if lag_s > self._longest_lag:
            self._longest_lag = lag_s
            self.loop_lag_max.set(lag_s)

    async def watch_event_loop(self) -> None:
        """Until cancelled: sleep LOOP_LAG_PERIOD_S on the running loop and record how late it woke."""
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            self.observe_loop_lag(max(0.0, loop.time() - start - LOOP_LAG_PERIOD_S))

    def on_tick(self, report: TickReport) -> None:
        """Tick listener; runs on the worker thread (prometheus-client is thread-safe)."""
        self.tick_batch_rows.observe(report.batch_rows)
        if report.batch_rows > self._most_rows:  # only the worker thread writes it
            self._most_rows = report.batch_rows
            self.tick_batch_rows_max.set(report.batch_rows)
        self.tick_seconds.observe(report.seconds)

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StageCollector:
    """``streamvox_worker_stage_seconds_total{stage}``: where the device thread's time goes
    (deliver, plan, admit, tick, vocalize, align), and the codec decoder's own time (decode: on a
    CPU it runs on a thread of its own, and vocalize is the worker's wait for it), read from the
    engine at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily("streamvox_worker_stage_seconds",
                                     "Worker thread wall seconds per loop stage; decode: the codec decoder's",
                                     labels=["stage"])
        for stage, seconds in self.engine.stage_seconds().items():
            family.add_metric([stage], seconds)
        yield family


class _GraphCaptureCollector:
    """``streamvox_graph_captures_after_start_total``: CUDA graphs captured after /readyz, on
    first use; each stalled every stream while it ran (without graphs: the ones a GPU would
    have captured), so a served run should keep it at 0."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily("streamvox_graph_captures_after_start",
                                     "CUDA graphs captured after start, on first use (each stalls every stream)")
        family.add_metric([], self.engine.graph_captures_after_start())
        yield family


class _KVCacheCollector:
    """The talker's paged KV pool: ``streamvox_kv_cache_blocks{state=used|total}``,
    ``streamvox_kv_cache_admission_waits_total`` (steps in which a free row waited for blocks) and
    the prompt-prefix cache's ``streamvox_prefix_cache_*`` (lookups by outcome, evictions, reused positions)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.kv_cache_stats()
        if not stats:
            return
        blocks = GaugeMetricFamily("streamvox_kv_cache_blocks", "Talker KV cache pool blocks", labels=["state"])
        blocks.add_metric(["used"], stats["blocks_used"])
        blocks.add_metric(["total"], stats["blocks_total"])
        yield blocks
        waits = CounterMetricFamily("streamvox_kv_cache_admission_waits",
                                    "Steps in which a free talker row waited for KV cache blocks")
        waits.add_metric([], stats["admission_waits"])
        yield waits
        if "prefix_hits" not in stats:  # the prompt-prefix cache is off
            return
        lookups = CounterMetricFamily("streamvox_prefix_cache_lookups",
                                      "Talker prompt-prefix cache lookups by outcome", labels=["outcome"])
        lookups.add_metric(["hit"], stats["prefix_hits"])
        lookups.add_metric(["miss"], stats["prefix_misses"])
        yield lookups
        evictions = CounterMetricFamily("streamvox_prefix_cache_evictions",
                                        "Prompt-prefix KV blocks evicted to make room (LRU)")
        evictions.add_metric([], stats["prefix_evictions"])
        yield evictions
        reused = CounterMetricFamily("streamvox_prefix_cache_reused_positions",
                                     "Prompt positions served from the prefix cache instead of prefilled")
        reused.add_metric([], stats["prefix_hit_positions"])
        yield reused
