"""Prometheus metrics of one server instance.

Owns a `CollectorRegistry` per app (never prometheus_client's global registry, so several apps,
as in the tests, do not share or collide) and the metric definitions. The worker reports
generations through the `worker.Observer` methods; the app's ASGI middleware reports every HTTP
request (endpoint, status, latency). Does not own how the numbers are served (the app's /metrics
route calls `render`).

Metric names (all prefixed `verispec_`):
  requests_total{endpoint,status}            HTTP requests by route and status code
  request_duration_seconds{endpoint}         arrival to the last byte sent (a stream included)
  time_to_first_token_seconds                arrival to the first text delta (queue wait included)
  prompt_tokens_total{method}                prompt tokens of finished generations
  generated_tokens_total{method}             tokens generated
  drafted_tokens_total{method}               draft tokens proposed for verification
  accepted_tokens_total{method}              draft tokens accepted by the target
  target_forwards_total{method}              target forward passes (prefill included)
  generations_total{method,outcome}          eos | stop | length | timeout | cancelled | error | invalid
  spec_decode_num_drafts_total{method}       drafts: steps that verified at least one draft token
  spec_decode_num_draft_tokens_total{method}     = drafted_tokens_total, under vLLM's name
  spec_decode_num_accepted_tokens_total{method}  = accepted_tokens_total, under vLLM's name
  spec_decode_num_accepted_tokens_per_pos_total{method,position}
                                             drafts whose token at 0-based `position` was accepted
  queue_length                               requests waiting to join the batch
  worker_busy                                1 while at least one request is being generated
  num_requests_running, num_requests_waiting requests in the running batch / waiting (vLLM's names)
  kv_cache_usage_perc                        share of the KV blocks in use, 0..1 (vLLM's name)
  kv_cache_blocks_used, kv_cache_blocks_total  KV blocks of BLOCK positions in use / in the pool
  prefix_cache_queries_total, prefix_cache_hits_total
                                             prompt tokens looked up in the prefix cache / found there
                                             (vLLM's names; hit rate = hits / queries)
  time_per_output_token_seconds              per request: (last text - first text) / (tokens - 1)
  inter_token_latency_seconds                between a request's streamed chunks (speculation commits
                                             several tokens per chunk)
  batch_rows                                 rows of each step's forward (verify rows + prompt chunks)
  batch_sequences                            requests in each step's batch
  step_duration_seconds                      wall time of each step

The spec_decode_* names are vLLM's (`vllm:` replaced by `verispec_`) with vLLM's meaning, so its
dashboards work unchanged apart from the prefix: mean acceptance length =
1 + rate(spec_decode_num_accepted_tokens_total) / rate(spec_decode_num_drafts_total); acceptance
rate at position i = rate(..._per_pos_total{position="i"}) / rate(spec_decode_num_drafts_total).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..core.stats import GenerationStats

# Generation on CPU takes from tens of milliseconds to minutes.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    """The metrics of one app, in a registry of their own."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_length: Callable[[], float], busy: Callable[[], float],
                 running: Callable[[], float] = lambda: 0.0,
                 kv_blocks: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 prefix_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        """The callables read the live state: requests waiting, worker busy, requests running,
        KV blocks (used, total), prefix-cache tokens (queried, hit) so far."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("verispec_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("verispec_request_duration_seconds",
                                 "Request latency: arrival to the last byte of the response.",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("verispec_time_to_first_token_seconds",
                              "Arrival of a generation request to its first text (queue wait included).",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens of generations.", ["method"], registry=r)
        self.generated = Counter("verispec_generated_tokens", "Tokens generated.", ["method"], registry=r)
        self.drafted = Counter("verispec_drafted_tokens", "Draft tokens proposed for verification.",
                               ["method"], registry=r)
        self.accepted = Counter("verispec_accepted_tokens", "Draft tokens accepted by the target.",
                                ["method"], registry=r)
        self.forwards = Counter("verispec_target_forwards", "Target forward passes (prefill included).",
                                ["method"], registry=r)
        self.generations = Counter("verispec_generations", "Generations by how they ended.",
                                   ["method", "outcome"], registry=r)
        self.drafts = Counter("verispec_spec_decode_num_drafts",
                              "Drafts: verification steps that verified at least one draft token.",
                              ["method"], registry=r)
        self.draft_tokens = Counter("verispec_spec_decode_num_draft_tokens",
                                    "Draft tokens verified (vLLM's name for drafted_tokens).", ["method"], registry=r)
        self.accepted_draft_tokens = Counter("verispec_spec_decode_num_accepted_tokens",
                                             "Draft tokens accepted (vLLM's name for accepted_tokens).",
                                             ["method"], registry=r)
        self.accepted_per_position = Counter("verispec_spec_decode_num_accepted_tokens_per_pos",
                                             "Drafts whose token at this 0-based position was accepted.",
                                             ["method", "position"], registry=r)
        self.queue_length = Gauge("verispec_queue_length", "Requests waiting for the worker.", registry=r)
        self.queue_length.set_function(queue_length)
        self.busy = Gauge("verispec_worker_busy", "1 while the worker generates a request.", registry=r)
        self.busy.set_function(busy)
        self.running = Gauge("verispec_num_requests_running", "Requests in the running batch.", registry=r)
        self.running.set_function(running)
        self.waiting = Gauge("verispec_num_requests_waiting", "Requests waiting to join the batch.", registry=r)
        self.waiting.set_function(queue_length)
        self.kv_usage = Gauge("verispec_kv_cache_usage_perc", "Share of the KV blocks in use (0..1).", registry=r)
        self.kv_usage.set_function(lambda: kv_blocks()[0] / max(1, kv_blocks()[1]))
        self.kv_used = Gauge("verispec_kv_cache_blocks_used", "KV blocks in use.", registry=r)
        self.kv_used.set_function(lambda: kv_blocks()[0])
        self.kv_total = Gauge("verispec_kv_cache_blocks_total", "KV blocks in the pool.", registry=r)
        self.kv_total.set_function(lambda: kv_blocks()[1])
        self.prefix_queries = Counter("verispec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter("verispec_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self.tpot = Histogram("verispec_time_per_output_token_seconds",
                              "Per request: (last text - first text) / (generated tokens - 1).",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("verispec_inter_token_latency_seconds", "Time between a request's streamed chunks.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.rows = Histogram("verispec_batch_rows", "Rows of each step's forward.", buckets=_ROW_BUCKETS, registry=r)
        self.sequences = Histogram("verispec_batch_sequences", "Requests in each step's batch.",
                                   buckets=_SEQUENCE_BUCKETS, registry=r)
        self.step_seconds = Histogram("verispec_step_duration_seconds", "Wall time of each step of the batch.",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self._prefix_counts = prefix_counts
        self._seen_prefix = (0, 0)

    # -- worker.Observer ---------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, stats: GenerationStats, reason: str) -> None:
        method = stats.method
        self.prompt_tokens.labels(method).inc(stats.prompt_tokens)
        self.generated.labels(method).inc(stats.new_tokens)
        self.drafted.labels(method).inc(stats.drafted)
        self.accepted.labels(method).inc(stats.accepted)
        self.forwards.labels(method).inc(stats.target_forwards)
        self.drafts.labels(method).inc(stats.drafts)
        self.draft_tokens.labels(method).inc(stats.drafted)
        self.accepted_draft_tokens.labels(method).inc(stats.accepted)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_per_position.labels(method, str(position)).inc(count)
        self.generations.labels(method, reason).inc()

    def failed(self, method: str, user_error: bool) -> None:
        self.generations.labels(method, "invalid" if user_error else "error").inc()

    def step(self, rows: int, sequences: int, seconds: float) -> None:
        if rows:
            self.rows.observe(rows)
            self.sequences.observe(sequences)
            self.step_seconds.observe(seconds)
        queried, hit = self._prefix_counts()
        seen_queried, seen_hit = self._seen_prefix
        if queried > seen_queried:
            self.prefix_queries.inc(queried - seen_queried)
        if hit > seen_hit:
            self.prefix_hits.inc(hit - seen_hit)
        self._seen_prefix = (max(queried, seen_queried), max(hit, seen_hit))

    def chunk_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def per_output_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    # -- HTTP -------------------------------------------------------------------------------------
    def request(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
