"""Serving metrics, exported through Triton's custom-metrics API (`pb_utils.MetricFamily`).

The adapter passes the `triton_python_backend_utils` module in, so this file imports nothing from
tritonserver and can be tested with a fake. Families (all labelled with `model`, and `version` when the model has one):

    dsv4_time_to_first_token_seconds   histogram  arrival -> the response thread takes the first generated token
    dsv4_inter_token_latency_seconds   histogram  gap between consecutive outputs with tokens (one a step while the
                                                  response thread keeps up: a speculative step's tokens are one)
    dsv4_requests_finished_total       counter    by finish_reason (stop|length|cancelled|timeout|error)
    dsv4_requests_rejected_total       counter    by reason: queue_full (max_queue_size)
    dsv4_prefix_cache_hit_tokens_total counter    prompt positions served from the prefix cache
    dsv4_prefix_cache_queried_tokens_total counter  prompt positions of admitted requests (hit rate: hit / queried;
                                                    neither counts a preempted request's readmission)
    dsv4_prefix_cache_evictions_total  counter    prefix-cache entries evicted
    dsv4_prefix_cache_pages            gauge      by pool, pages the prefix cache's entries hold
    dsv4_engine_steps_total            counter    by kind (engine.stats()["steps_by_kind"])
    dsv4_decode_stalls_total           counter    engine.stats()["decode_stalls"]
    dsv4_preemptions_total             counter    engine.stats()["num_preemptions"]
    dsv4_itl_infeasible_steps_total    counter    steps the ITL target was out of reach even at the minimum chunk
    dsv4_longest_prefill_streak        gauge      consecutive prefill steps, the longest seen
    dsv4_num_requests_running          gauge
    dsv4_num_requests_waiting          gauge
    dsv4_pool_usage_ratio              gauge      by pool, fraction of its pages in use
    dsv4_pool_pages_used               gauge      by pool
    dsv4_rank_requests_running         gauge      by rank: data parallelism, each rank's running requests
    dsv4_rank_requests_waiting         gauge      by rank
    dsv4_rank_pool_usage_ratio         gauge      by rank and pool (the unlabelled families above are the ranks' sum,
                                                  pool usage their mean)
    dsv4_grammar_compile_seconds       histogram  structured outputs: compiling a grammar (cache misses)
    dsv4_grammar_compiles_total        counter    grammars compiled
    dsv4_grammar_cache_hits_total      counter    constrained requests whose grammar was cached (or being compiled)
    dsv4_spec_draft_tokens_total       counter    speculative decoding: draft tokens verified
    dsv4_spec_accepted_tokens_total    counter    speculative decoding: draft tokens accepted (rate: accepted / draft)
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
GRAMMAR_COMPILE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


@dataclass
class RequestTimer:
    """Per-request clock: the first output with tokens is a TTFT, each later one an ITL."""

    start: float = field(default_factory=time.monotonic)
    last: float | None = None

    def tick(self, now: float | None = None) -> tuple[str, float]:
        now = time.monotonic() if now is None else now
        kind, since = ("ttft", self.start) if self.last is None else ("itl", self.last)
        self.last = now
        return kind, now - since


def _one_thread_at_a_time(method):
    """A ServingMetrics method under the object's lock.

    The Python backend's stub is not thread-safe per metric: an operation (`increment`, `observe`, `set`) writes the
    metric's one shared-memory message and sends it with the GIL released, so two threads on the same metric at once
    (a refusal counted on the execute thread while the response thread counts another request's end) freed the
    message one of them sent; tritonserver then read a freed one and crashed in Metric::Increment. Creating the same
    series from two threads at once made it twice."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class ServingMetrics:
    """Owns the metric families; `update(stats)` mirrors `engine.stats()` into them."""

    def __init__(self, pb_utils, model_name: str, model_version: str = "") -> None:
        self._lock = threading.Lock()  # (every metric operation: `_one_thread_at_a_time`)
        family = pb_utils.MetricFamily
        # (as Triton's own metrics and its vLLM backend's: two versions of the model loaded together, in poll mode,
        # would otherwise share each series, each setting the other's gauges and adding to its counters)
        self._labels = {"model": model_name, **({"version": model_version} if model_version else {})}
        self._families = {
            name: family(name=name, description=description, kind=getattr(family, kind))
            for name, description, kind in (
                ("dsv4_time_to_first_token_seconds", "Time from arrival to the first generated token", "HISTOGRAM"),
                ("dsv4_inter_token_latency_seconds",
                 "Time between consecutive outputs with tokens (a step's; a speculative step's tokens are one)",
                 "HISTOGRAM"),
                ("dsv4_requests_finished_total", "Finished requests by finish reason", "COUNTER"),
                ("dsv4_requests_rejected_total", "Requests refused at arrival, by reason", "COUNTER"),
                ("dsv4_prefix_cache_hit_tokens_total", "Prompt positions served from the prefix cache", "COUNTER"),
                ("dsv4_prefix_cache_queried_tokens_total", "Prompt positions of admitted requests (not their "
                 "readmissions after a preemption), looked up in the prefix cache", "COUNTER"),
                ("dsv4_prefix_cache_evictions_total", "Prefix-cache entries evicted", "COUNTER"),
                ("dsv4_prefix_cache_pages", "Pages the prefix cache's entries hold", "GAUGE"),
                ("dsv4_engine_steps_total", "Engine steps by kind", "COUNTER"),
                ("dsv4_decode_stalls_total", "Steps that left a runnable decode unscheduled", "COUNTER"),
                ("dsv4_preemptions_total", "Requests preempted (recomputed) for lack of memory", "COUNTER"),
                ("dsv4_itl_infeasible_steps_total",
                 "Steps whose ITL target could not be met even with the minimum prefill chunk", "COUNTER"),
                ("dsv4_longest_prefill_streak", "Longest run of consecutive prefill steps", "GAUGE"),
                ("dsv4_num_requests_running", "Requests running in the engine", "GAUGE"),
                ("dsv4_num_requests_waiting", "Requests waiting in the engine", "GAUGE"),
                ("dsv4_pool_usage_ratio", "Fraction of a memory pool's pages in use", "GAUGE"),
                ("dsv4_pool_pages_used", "Pages in use in a memory pool", "GAUGE"),
                ("dsv4_rank_requests_running", "Requests running on a data-parallel rank", "GAUGE"),
                ("dsv4_rank_requests_waiting", "Requests waiting on a data-parallel rank", "GAUGE"),
                ("dsv4_rank_pool_usage_ratio", "Fraction of a data-parallel rank's memory pool's pages in use",
                 "GAUGE"),
                ("dsv4_grammar_compile_seconds", "Time to compile a structured-output grammar", "HISTOGRAM"),
                ("dsv4_grammar_compiles_total", "Structured-output grammars compiled", "COUNTER"),
                ("dsv4_grammar_cache_hits_total", "Constrained requests whose grammar came from the cache",
                 "COUNTER"),
                ("dsv4_spec_draft_tokens_total", "Speculative decoding: draft tokens verified", "COUNTER"),
                ("dsv4_spec_accepted_tokens_total", "Speculative decoding: draft tokens accepted", "COUNTER"),
            )
        }
        self._closed = False
        self._metrics: dict[tuple, object] = {}
        self._counted: dict[tuple, float] = {}  # last cumulative value seen, per counter series
        self.ttft = self._metric("dsv4_time_to_first_token_seconds", buckets=TTFT_BUCKETS)
        self.itl = self._metric("dsv4_inter_token_latency_seconds", buckets=ITL_BUCKETS)
        self.grammar_compile = self._metric("dsv4_grammar_compile_seconds", buckets=GRAMMAR_COMPILE_BUCKETS)

    def _metric(self, family: str, buckets: list[float] | None = None, **labels: str):
        key = (family, tuple(sorted(labels.items())))
        if key not in self._metrics:
            all_labels = {**self._labels, **labels}
            extra = {"buckets": buckets} if buckets else {}
            self._metrics[key] = self._families[family].Metric(labels=all_labels, **extra)
        return self._metrics[key]

    @_one_thread_at_a_time
    def close(self) -> None:
        """Delete every metric, then every family, now; later calls do nothing. Each deletes itself in tritonserver
        as it is destroyed, so this must run while the server still listens to the stub (`finalize`)."""
        self._closed = True
        self.ttft = self.itl = self.grammar_compile = None
        self._metrics.clear()
        self._families.clear()

    @_one_thread_at_a_time
    def on_tokens(self, timer: RequestTimer) -> None:
        kind, seconds = timer.tick()
        if not self._closed:
            (self.ttft if kind == "ttft" else self.itl).observe(seconds)

    @_one_thread_at_a_time
    def on_grammar_compiles(self, seconds: list[float]) -> None:
        """The compilations that ended since the last call (LLMEngine.take_grammar_compile_seconds)."""
        for value in seconds if not self._closed else ():
            self.grammar_compile.observe(value)

    @_one_thread_at_a_time
    def on_finished(self, finish_reason: str) -> None:
        if not self._closed:
            self._metric("dsv4_requests_finished_total", finish_reason=str(finish_reason)).increment(1)

    @_one_thread_at_a_time
    def update(self, stats: dict) -> None:
        """Mirror one `engine.stats()` snapshot; counters advance by the change since the last one."""
        if self._closed:
            return
        for kind, count in stats.get("steps_by_kind", {}).items():
            self._advance("dsv4_engine_steps_total", count, kind=str(kind))
        counters = (("dsv4_decode_stalls_total", "decode_stalls"), ("dsv4_preemptions_total", "num_preemptions"),
                    ("dsv4_itl_infeasible_steps_total", "num_itl_infeasible"),
                    ("dsv4_spec_draft_tokens_total", "num_draft_tokens"),
                    ("dsv4_spec_accepted_tokens_total", "num_accepted_tokens"))
        for family, key in counters:
            if key in stats:
                self._advance(family, stats[key])
        if "num_rejected_queue_full" in stats:
            self._advance("dsv4_requests_rejected_total", stats["num_rejected_queue_full"], reason="queue_full")
        cache = stats.get("prefix_cache")
        if cache:
            self._advance("dsv4_prefix_cache_hit_tokens_total", cache["cached_tokens"])
            self._advance("dsv4_prefix_cache_queried_tokens_total", cache["queried_tokens"])
            self._advance("dsv4_prefix_cache_evictions_total", cache["evictions"])
            for pool, pages in cache["pages"].items():
                self._metric("dsv4_prefix_cache_pages", pool=str(pool)).set(float(pages))
        grammars = stats.get("grammars")
        if grammars:
            self._advance("dsv4_grammar_compiles_total", grammars["compiled"])
            self._advance("dsv4_grammar_cache_hits_total", grammars["cache_hits"])
        gauges = (
            ("dsv4_longest_prefill_streak", "longest_prefill_streak"),
            ("dsv4_num_requests_running", "num_running"),
            ("dsv4_num_requests_waiting", "num_waiting"),
        )
        for family, key in gauges:
            if key in stats:
                self._metric(family).set(float(stats[key]))
        for pool, fraction in stats.get("pool_usage", {}).items():
            self._metric("dsv4_pool_usage_ratio", pool=str(pool)).set(float(fraction))
        for pool, pages in stats.get("pages_used", {}).items():
            self._metric("dsv4_pool_pages_used", pool=str(pool)).set(float(pages))
        for rank in stats.get("ranks", ()):
            label = str(rank["rank"])
            self._metric("dsv4_rank_requests_running", rank=label).set(float(rank["num_running"]))
            self._metric("dsv4_rank_requests_waiting", rank=label).set(float(rank["num_waiting"]))
            for pool, fraction in rank["pool_usage"].items():
                self._metric("dsv4_rank_pool_usage_ratio", rank=label, pool=str(pool)).set(float(fraction))

    def _advance(self, family: str, cumulative: float, **labels: str) -> None:
        key = (family, tuple(sorted(labels.items())))
        delta = float(cumulative) - self._counted.get(key, 0.0)
        metric = self._metric(family, **labels)  # created at 0 so the series shows up at once
        if delta > 0:  # (a total that went back, were there one, counts again only past what was counted)
            metric.increment(delta)
            self._counted[key] = float(cumulative)
