"""backend/serving/metrics.py against a fake of pb_utils' metric API."""

import threading
import time

import pytest
from fake_pb_utils import FakeFamily, FakePbUtils

from backend.serving.metrics import ITL_BUCKETS, TTFT_BUCKETS, RequestTimer, ServingMetrics


@pytest.fixture
def metrics():
    FakeFamily.created = {}
    return ServingMetrics(FakePbUtils, "dsv4")


def series(family, **labels):
    found = [m for m in FakeFamily.created[family].metrics if all(m.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, found
    return found[0]


def test_timer_gives_ttft_then_itl():
    timer = RequestTimer(start=10.0)
    assert timer.tick(10.5) == ("ttft", 0.5)
    assert timer.tick(10.75) == ("itl", 0.25)


def test_histograms_have_sorted_buckets(metrics):
    assert TTFT_BUCKETS == sorted(TTFT_BUCKETS) and ITL_BUCKETS == sorted(ITL_BUCKETS)
    timer = RequestTimer()
    metrics.on_tokens(timer)
    metrics.on_tokens(timer)
    assert len(series("dsv4_time_to_first_token_seconds").observed) == 1
    assert len(series("dsv4_inter_token_latency_seconds").observed) == 1


def test_counters_advance_by_the_change_in_cumulative_stats(metrics):
    metrics.update({"steps_by_kind": {"prefill": 3, "decode": 0}, "decode_stalls": 1, "num_preemptions": 0,
                    "num_itl_infeasible": 0, "num_draft_tokens": 6, "num_accepted_tokens": 2})
    metrics.update({"steps_by_kind": {"prefill": 5, "decode": 2}, "decode_stalls": 1, "num_preemptions": 2,
                    "num_itl_infeasible": 4, "num_draft_tokens": 15, "num_accepted_tokens": 9})
    assert series("dsv4_engine_steps_total", kind="prefill").value == 5
    assert series("dsv4_engine_steps_total", kind="decode").value == 2
    assert series("dsv4_decode_stalls_total").value == 1
    assert series("dsv4_preemptions_total").value == 2
    assert series("dsv4_itl_infeasible_steps_total").value == 4
    assert series("dsv4_spec_draft_tokens_total").value == 15
    assert series("dsv4_spec_accepted_tokens_total").value == 9


def test_gauges_mirror_the_latest_stats(metrics):
    stats = {
        "longest_prefill_streak": 4, "num_running": 2, "num_waiting": 1,
        "pool_usage": {"window": 0.5, "csa": 0.25}, "pages_used": {"window": 8, "csa": 2},
    }
    metrics.update(stats)
    metrics.update({**stats, "num_running": 0, "pool_usage": {"window": 0.0, "csa": 0.0}})
    assert series("dsv4_longest_prefill_streak").value == 4
    assert series("dsv4_num_requests_running").value == 0
    assert series("dsv4_pool_usage_ratio", pool="window").value == 0.0
    assert series("dsv4_pool_pages_used", pool="csa").value == 2
    assert series("dsv4_num_requests_waiting").labels == {"model": "dsv4"}


def test_finished_requests_by_reason(metrics):
    for reason in ("stop", "length", "stop"):
        metrics.on_finished(reason)
    assert series("dsv4_requests_finished_total", finish_reason="stop").value == 2
    assert series("dsv4_requests_finished_total", finish_reason="length").value == 1


def test_rejections_and_prefix_cache_counters(metrics):
    cache = {"hits": 2, "cached_tokens": 512, "queried_tokens": 900, "evictions": 1, "entries": 3,
             "pages": {"window": 16, "csa": 4}}
    metrics.update({"num_rejected_queue_full": 1, "prefix_cache": cache})
    metrics.update({"num_rejected_queue_full": 3, "prefix_cache": {**cache, "cached_tokens": 640,
                                                                   "queried_tokens": 1000,
                                                                   "pages": {"window": 8, "csa": 4}}})
    assert series("dsv4_requests_rejected_total", reason="queue_full").value == 3
    assert series("dsv4_prefix_cache_hit_tokens_total").value == 640
    assert series("dsv4_prefix_cache_queried_tokens_total").value == 1000
    assert series("dsv4_prefix_cache_evictions_total").value == 1
    assert series("dsv4_prefix_cache_pages", pool="window").value == 8
    metrics.update({"prefix_cache": None})  # caching off: nothing breaks


def test_a_total_that_goes_back_counts_again_only_past_what_was_counted(metrics):
    """(No total of the engine's goes back today; one that did, say a rank's stats replaced, must not be counted
    twice on its way up again.)"""
    for rejected in (3, 1, 2, 4):
        metrics.update({"num_rejected_queue_full": rejected})
    assert series("dsv4_requests_rejected_total", reason="queue_full").value == 4


def test_grammar_counters_and_compile_times(metrics):
    metrics.update({"grammars": {"compiled": 2, "cache_hits": 5, "cached": 2}})
    metrics.update({"grammars": {"compiled": 3, "cache_hits": 9, "cached": 3}})
    metrics.on_grammar_compiles([0.004])
    metrics.on_grammar_compiles([])
    assert series("dsv4_grammar_compiles_total").value == 3
    assert series("dsv4_grammar_cache_hits_total").value == 9
    assert series("dsv4_grammar_compile_seconds").observed == [0.004]


def test_every_series_carries_the_model_version_when_one_is_given():
    """Two versions of the model loaded together (poll mode) would otherwise share each series, and the first to
    unload would delete the other's."""
    FakeFamily.created = {}
    metrics = ServingMetrics(FakePbUtils, "dsv4", "2")
    metrics.update({"num_running": 1, "pool_usage": {"window": 0.5}, "steps_by_kind": {"decode": 1}})
    metrics.on_finished("stop")
    created = [m for family in FakeFamily.created.values() for m in family.metrics]
    assert created and all(m.labels["model"] == "dsv4" and m.labels["version"] == "2" for m in created)


class _OneAtATimeMetric:
    """A metric as the Python backend's stub has it: each operation writes the metric's one shared-memory message and
    sends it with the GIL released (a sleep here), so two at once on the same metric corrupt it: counted."""

    overlaps = 0

    def __init__(self, labels, buckets=None):
        self.labels, self.busy = labels, False

    def _operation(self, value):
        if self.busy:
            _OneAtATimeMetric.overlaps += 1
        self.busy = True
        time.sleep(0.0005)
        self.busy = False

    increment = set = observe = _operation


def test_two_threads_never_operate_on_one_metric_at_once(monkeypatch):
    """The execute thread counts a refused request's end while the response thread counts another's and mirrors the
    stats: each metric sees one operation at a time (tritonserver crashed in Metric::Increment otherwise)."""
    FakeFamily.created = {}
    monkeypatch.setattr("fake_pb_utils.FakeMetric", _OneAtATimeMetric)
    _OneAtATimeMetric.overlaps = 0
    metrics = ServingMetrics(FakePbUtils, "dsv4")
    stats = {"steps_by_kind": {"decode": 1}, "num_running": 1, "num_waiting": 0}

    def refusals():
        for _ in range(200):
            metrics.on_finished("error")

    def responses():
        for i in range(200):
            metrics.on_finished("error")
            metrics.update({**stats, "steps_by_kind": {"decode": i + 1}})

    threads = [threading.Thread(target=refusals), threading.Thread(target=responses)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _OneAtATimeMetric.overlaps == 0
    assert len(FakeFamily.created["dsv4_requests_finished_total"].metrics) == 1  # (one series, made once)
