"""scripts/bench_speculative.py's step cost and projected speed-up, on step records made up here."""

from __future__ import annotations

import argparse
import math
import sys
import weakref

import bench_speculative
import pytest
from estimate_decode_step import parse_rates

from backend.scheduler.step_record import StepKind, StepRecord, StepTiming


def _record(time: float, kind: StepKind, running: int, decode_tokens: int) -> StepRecord:
    return StepRecord(0, kind, time, 0 if kind is StepKind.DECODE else 16, decode_tokens, running, 0, 0, 0, False)


def test_a_step_costs_the_time_to_the_next_steps_scheduling_when_every_request_verifies():
    records = [_record(0.0, StepKind.PREFILL, 2, 0),  # prefill: left out
               _record(0.5, StepKind.DECODE, 2, 6),  # 2 rows x (1 + 2): 0.1 s
               _record(0.6, StepKind.DECODE, 2, 6),  # 0.3 s
               _record(0.9, StepKind.DECODE, 2, 4),  # 2 rows x (1 + 1): left out at k = 2
               _record(1.0, StepKind.DECODE, 2, 6),  # 0.2 s
               _record(1.2, StepKind.DECODE, 1, 3)]  # one request left: left out
    assert bench_speculative.step_cost_s(records, 2, 2) == pytest.approx(0.2)
    assert bench_speculative.step_cost_s(records, 2, 1) == pytest.approx(0.1)  # the step of 2 x (1 + 1) tokens
    assert bench_speculative.step_cost_s(records, 2, 3) is None


def test_the_static_share_counts_the_decode_steps_that_ran_at_a_static_shape():
    records = [_record(0.0, StepKind.PREFILL, 2, 0)] + [_record(0.1 * i, StepKind.DECODE, 2, 6) for i in range(1, 5)]
    for record, static in zip(records, [False, True, False, True, True]):
        record.timing = StepTiming(static_shape=static)
    assert bench_speculative.static_share(records) == pytest.approx(0.75)  # the prefill step left out
    assert bench_speculative.static_share(records[:1]) == 1.0


def test_the_projected_speed_up_is_the_tokens_a_step_emits_over_its_cost():
    rates = parse_rates("0.77,0.38")
    assert bench_speculative.expected_tokens_per_step(rates, 0) == 1.0
    assert bench_speculative.expected_tokens_per_step(rates, 2) == pytest.approx(2.15)
    assert math.isnan(bench_speculative.expected_tokens_per_step(rates, 3))  # no rate given: not projected
    args = argparse.Namespace(concurrency=[8], acceptance=rates)
    cells = [(0, "-"), (2, "static")]
    costs = {(8, 0, "-"): [0.010, 0.012, 0.011], (8, 2, "static"): [0.020, 0.018, None]}
    accepted = {(8, 0, "-"): [1.0] * 3, (8, 2, "static"): [1.5, 1.5, 1.5]}
    rows = bench_speculative.step_cost_rows(args, cells, costs, accepted)
    verify = rows[1]
    assert verify["runs"] == 2  # a run without a full step at k = 2 is left out
    assert (verify["cost_ratio_min"], verify["cost_ratio_max"]) == (1.5, 2.0)
    assert verify["projected_speedup_max"] == pytest.approx(2.15 / 1.5, abs=1e-3)
    assert verify["speedup_at_measured_acceptance"] == pytest.approx(1.5 / 1.75, abs=1e-3)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rates("0.7,1.3")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot increase"):  # (vLLM's per-position rates)
        parse_rates("0.38,0.77")


def test_each_engine_is_freed_before_the_next_is_built(tiny_checkpoint, monkeypatch):
    """At V4-Flash's widths an engine holds 15-19 GiB: the run builds one engine a k and run, and each must be gone
    (its parts refer to each other: only a collection frees them) before the next is built."""
    alive, seen = weakref.WeakSet(), []
    real = bench_speculative.LLMEngine

    def counting_engine(config):
        seen.append(len(alive))
        engine = real(config)
        alive.add(engine)
        return engine

    monkeypatch.setattr(bench_speculative, "LLMEngine", counting_engine)
    monkeypatch.setattr(sys, "argv", ["bench_speculative.py", "--checkpoint", str(tiny_checkpoint), "--ks", "0", "1",
                                      "--concurrency", "1", "--runs", "2", "--max-tokens", "4", "--prompt-tokens", "4"])
    bench_speculative.main()
    assert seen == [0] * 5  # (the first engine, read for the vocabulary, then k = 0 and 1 twice)
