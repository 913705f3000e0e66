"""Requests that end every way a request can end, side by side, run to completion: what the overlap on/off
(tests/engine/test_overlap.py) and the one-rank/data-parallel (tests/parallel/test_data_parallel.py) comparisons
compare.

`with_endings` gives each request one ending, in turn: a stop token id, a stop string, a cancel (engine.abort from
the request's own output callback once it has streamed a given number of tokens), a deadline (`timeout_ms`,
passed when the scheduler's clock, a fake one, is moved forward from another such callback), or its max_tokens.
The points are taken from a free run of the same requests, so that each ending lands mid-stream. Callbacks run in
step order on the thread that drives the engine, so where a cancel or a deadline lands does not depend on timing:
two loops that differ only in how they overlap must report the same outputs, token for token, including nothing
after a request's final output.
"""

from __future__ import annotations

import dataclasses
import time
import types
from dataclasses import dataclass, field

import pytest

from backend.output_processor import OutputProcessor
from backend.request import RequestOutput, SamplingParams, Sequence

# The endings, given to the requests in this order.
ENDINGS = ("stop token", "stop string", "cancel", "deadline", "length")
# How far the deadline's clock moves: past any timeout_ms the requests carry.
CLOCK_JUMP_S = 3600.0
DEADLINE_MS = 1000


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams
    cancel_at: int | None = None  # engine.abort once this many tokens were streamed
    expire_at: int | None = None  # the clock passes every deadline once this many tokens were streamed


@dataclass
class Stream:
    """What one request reported: every engine output as it came (anything after the final included), and what a
    client got out of them (text, stop strings applied)."""

    raw: list[tuple] = field(default_factory=list)  # (token ids, finished, finish reason, error) per engine output
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = field(default=None, compare=False)  # (compared within rounding: assert_same_logprobs)
    finish_reason: str | None = None

    @property
    def ends_once(self) -> bool:
        """Exactly one final output, and nothing after it."""
        return [finished for _, finished, *_ in self.raw] == [False] * (len(self.raw) - 1) + [True]

    @property
    def num_streamed(self) -> int:
        return sum(len(tokens) for tokens, *_ in self.raw)


class FakeClock:
    """The scheduler's clock (arrivals and deadlines), standing still unless moved."""

    def __init__(self, monkeypatch, start: float = 1000.0):
        import backend.scheduler.scheduler as scheduler_module

        self.now = start
        real = scheduler_module.time
        monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(
            monotonic=lambda: self.now, perf_counter=real.perf_counter, time=real.time))

    def advance(self, seconds: float) -> None:
        self.now += seconds


def with_endings(prompts: list[list[int]], params: list[SamplingParams], free_runs: list[dict]) -> list[Request]:
    """Each request (its prompt, its params) with the next ending of ENDINGS, placed by its free run (`generate`'s
    result for the same prompt and params): a stop token or a stop string from the second half of what it produced,
    a cancel after a third of it, a deadline that passes after half of it."""
    requests = []
    for i, (prompt, base, free) in enumerate(zip(prompts, params, free_runs)):
        ending, tokens = ENDINGS[i % len(ENDINGS)], free["output_ids"]
        half = len(tokens) // 2
        if ending == "stop token":
            stop_at = next(j for j in range(half, len(tokens)) if tokens[j] not in tokens[:j])
            requests.append(Request(prompt, dataclasses.replace(base, stop_token_ids=[tokens[stop_at]])))
        elif ending == "stop string":
            requests.append(Request(prompt, dataclasses.replace(base, stop=[_stop_string(free["text"])])))
        elif ending == "cancel":
            requests.append(Request(prompt, base, cancel_at=max(1, len(tokens) // 3)))
        elif ending == "deadline":
            requests.append(Request(prompt, dataclasses.replace(base, timeout_ms=DEADLINE_MS), expire_at=max(1, half)))
        else:
            requests.append(Request(prompt, base))
    return requests


def _stop_string(text: str) -> str:
    """Three printable ASCII characters from the second half of `text`, not blank at either end, that first occur
    there."""
    for start in range(len(text) // 2, len(text) - 2):
        candidate = text[start:start + 3]
        if candidate.isascii() and candidate.isprintable() and candidate.strip() == candidate \
                and text.index(candidate) == start:
            return candidate
    raise AssertionError(f"no stop string to take from {text!r}")


def run(engine, requests: list[Request], clock: FakeClock) -> list[Stream]:
    """Submit every request, then drive the engine on this thread until all have ended and nothing is in flight."""
    processor = OutputProcessor(engine.tokenizer, engine.abort)
    streams = [Stream() for _ in requests]
    for i, (request, stream) in enumerate(zip(requests, streams)):
        seq = Sequence(f"ending-{i}", list(request.prompt), request.params)
        processor.add(seq.request_id, request.params)
        engine.submit(seq, _on_output(engine, processor, clock, request, stream))
    while any(stream.finish_reason is None for stream in streams):
        if not engine.step():  # (rank 0 idle: another data-parallel rank may still serve requests, as in generate())
            assert engine._served_elsewhere(), "the engine went idle with requests unfinished"
            engine._wait_for_work(timeout=0.05)
    engine.drain()
    # (a request ended by its stop string is aborted: on another data-parallel rank its last output comes after)
    deadline = time.monotonic() + 30
    while engine._placed and time.monotonic() < deadline:
        engine._wait_for_work(timeout=0.05)
    assert not engine._placed, f"requests still placed: {sorted(engine._placed)}"
    return streams


def _on_output(engine, processor: OutputProcessor, clock: FakeClock, request: Request, stream: Stream):
    def on_output(raw: RequestOutput) -> None:
        before = stream.num_streamed
        stream.raw.append((list(raw.new_token_ids), raw.finished, raw.finish_reason, raw.error))
        if _reached(request.cancel_at, before, stream.num_streamed) and not raw.finished:
            engine.abort(raw.request_id)
        if _reached(request.expire_at, before, stream.num_streamed):
            clock.advance(CLOCK_JUMP_S)
        out = processor.process(raw)
        if out is None:
            return
        stream.output_ids += out.new_token_ids
        stream.text += out.new_text
        if out.logprobs is not None:
            stream.logprobs = (stream.logprobs or []) + out.logprobs
        if out.finished:
            stream.finish_reason = out.finish_reason.value

    return on_output


def _reached(point: int | None, before: int, after: int) -> bool:
    return point is not None and before < point <= after


def assert_same_logprobs(got: list[Stream], expected: list[Stream], tolerance: float = 1e-5) -> None:
    """Log-probabilities of the same tokens and ranks, within float rounding (rows batched with other rows need not
    round alike). (A helper module's asserts are not rewritten by pytest: each says what differs.)"""
    for i, (one, other) in enumerate(zip(got, expected)):
        assert [lp.rank for lp in one.logprobs or []] == [lp.rank for lp in other.logprobs or []], f"request {i}"
        for a, b in zip(one.logprobs or [], other.logprobs or []):
            assert [t for t, _ in a.top] == [t for t, _ in b.top], f"request {i}: {a} != {b}"
            values = [a.logprob] + [p for _, p in a.top], [b.logprob] + [p for _, p in b.top]
            assert values[0] == pytest.approx(values[1], abs=tolerance), f"request {i}: {a} != {b}"


def finish_reasons(streams: list[Stream]) -> set[str]:
    return {stream.finish_reason for stream in streams}
