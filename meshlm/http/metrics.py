"""Prometheus metrics for /metrics: the engine's state read at scrape time, and the latencies of finished
requests."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshlm.serve.engine import Engine, Request

MEDIA_TYPE = CONTENT_TYPE_LATEST  # Prometheus' text format, what /metrics answers in


class Metrics:
    """Prometheus metrics: the engine's state read at scrape time, and the latencies of finished requests."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        self.engine = engine
        self.ttft = Histogram(
            "meshlm_time_to_first_token_seconds", "From submission to the first token", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )  # fmt: skip
        self.latency = Histogram(
            "meshlm_request_seconds", "From submission to the last token", registry=self.registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )  # fmt: skip
        self.registry.register(self)

    def observe(self, rows: Sequence[Request]) -> None:
        """The latencies of a request's rows that produced a token and were not cancelled."""
        now = time.perf_counter()
        for row in rows:
            if row.first_token is not None and not row.cancelled:
                self.ttft.observe(row.first_token - row.submitted)
                self.latency.observe(now - row.submitted)

    def collect(self) -> Iterator[Any]:
        s = self.engine.snapshot()
        gauges = {
            "meshlm_queue_depth": ("Rows waiting for a slot", s.queued),
            "meshlm_running_rows": ("Rows being generated", s.running),
            "meshlm_kv_pages_used": ("KV cache pages held by rows", s.kv_pages_used),
            "meshlm_kv_pages_total": ("KV cache pages", s.kv_pages),
            "meshlm_tokens_per_second": ("Generated tokens per second over the last few seconds", s.tokens_per_second),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "meshlm_generated_tokens": ("Tokens generated", s.tokens_generated),
            "meshlm_prompt_tokens": ("Prompt tokens taken in", s.prompt_tokens),
            "meshlm_prefix_cache_lookup_tokens": (
                "Prompt tokens looked up in the prefix cache",
                s.prefix_cache_lookups,
            ),
            "meshlm_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            "meshlm_decode_calls": ("Decode chunks run", s.decode_calls),
            "meshlm_prefill_calls": ("Prefills run", s.prefill_calls),
            "meshlm_compiles_since_warm_up": (
                "XLA compilations since the engine was warmed up",
                s.compiles_since_warm_up,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
