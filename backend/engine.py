"""The engine: one thread that owns the device and runs schedule -> forward -> sample -> postprocess.

    engine = LLMEngine(EngineConfig(checkpoint=...))
    engine.start()                                   # the loop thread
    engine.submit(Sequence(...), on_output)          # from any thread; returns at once
    engine.abort(request_id)                         # from any thread; effective at the next step
    engine.shutdown()

`on_output(RequestOutput)` is called on the engine thread once per step that produced text or
tokens for the request, and exactly once with `finished=True`. `generate()` runs the same loop on
the caller's thread for offline use (scripts, tests, benchmarks).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.forward_batch import BatchRow, build_forward_batch
from backend.kv_manager import KVCacheManager
from backend.model import DeepseekV4Model
from backend.model_config import load_model_config
from backend.request import FinishReason, RequestOutput, SamplingParams, Sequence
from backend.sampler import Sampler
from backend.scheduler import Scheduler, SchedulerConfig, StepPlan
from backend.weights import load_weights
from kernels import dispatch

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    """Engine-side state of a request that is not finished yet."""

    seq: Sequence
    on_output: Callable[[RequestOutput], None]
    detokenizer: IncrementalDetokenizer
    stop_ids: set[int] = field(default_factory=set)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        if config.use_reference_kernels:  # one switch for the whole process (or DSV4_REFERENCE_KERNELS=1)
            dispatch.set_force_reference(True)
        checkpoint = Path(config.checkpoint)
        self.model_config = load_model_config(checkpoint)
        weights = load_weights(checkpoint, self.model_config, self.dtype, self.device)
        self.model = DeepseekV4Model(self.model_config, weights, self.device, self.dtype)
        self.kv = KVCacheManager(
            self.model_config, num_tokens=config.num_tokens, swa_full_tokens_ratio=config.swa_full_tokens_ratio,
            page_size=config.page_size, max_running_requests=config.max_running_requests, dtype=self.dtype,
            device=self.device)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config), self.kv)
        self.tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self.eos_token_ids = _eos_token_ids(checkpoint, self.model_config)
        self.vocab_size = self.model_config.vocab_size
        self.max_request_tokens = self.kv.max_request_tokens()
        self.max_prompt_tokens = self.max_request_tokens - 1
        self.sampler = Sampler()
        self._live: dict[str, _Live] = {}
        self._submit_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = self._snapshot_stats()
        logger.info("engine ready: device=%s dtype=%s capacity=%s bytes/token=%s prefill_chunk_tokens=%d",
                    self.device, self.dtype, self.kv.capacity(), self.kv.bytes_per_token(),
                    self.scheduler.prefill_chunk_tokens)

    # --- any thread ---------------------------------------------------------------------------------
    def submit(self, seq: Sequence, on_output: Callable[[RequestOutput], None]) -> None:
        """Queue a request; raises ValueError with a clear message if it is invalid or can never fit."""
        self._validate(seq)
        live = _Live(seq, on_output, IncrementalDetokenizer(self.tokenizer, seq.sampling.stop),
                     set(seq.sampling.stop_token_ids) | (set() if seq.sampling.ignore_eos else set(self.eos_token_ids)))
        with self._submit_lock:  # one live entry per request id, even when two threads race
            if self._live.setdefault(seq.request_id, live) is not live:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
        try:
            self.scheduler.add(seq)
        except ValueError:
            self._live.pop(seq.request_id, None)
            raise

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.scheduler.close()

    def stats(self) -> dict:
        """A snapshot of the counters and pool usage, safe to read from any thread.

        The engine thread refreshes it after every step (and at start); readers get the latest
        complete snapshot and never see structures the engine thread is changing.
        """
        return self._stats

    def _snapshot_stats(self) -> dict:
        counters = self.scheduler.counters
        return {
            "steps_by_kind": dict(counters.steps_by_kind),
            "longest_prefill_streak": counters.longest_prefill_streak,
            "decode_stalls": counters.decode_stalls,
            "num_preemptions": counters.num_preemptions,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "pool_usage": self.kv.usage(),
            "pages_used": self.kv.pages_used(),
        }

    # --- offline use --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[dict]:
        """Submit every prompt at once (so they batch), run to completion on this thread."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        results = [{"output_ids": [], "text": "", "finish_reason": None} for _ in prompts]

        def collect(index):
            def on_output(out: RequestOutput):
                results[index]["output_ids"].extend(out.new_token_ids)
                results[index]["text"] += out.new_text
                if out.finished:
                    results[index]["finish_reason"] = out.finish_reason.value
                    results[index]["error"] = out.error
            return on_output

        for i, (ids, p) in enumerate(zip(prompts, params)):
            self.submit(Sequence(f"offline-{i}-{time.monotonic_ns()}", list(ids), p), collect(i))
        while any(r["finish_reason"] is None for r in results):
            if not self.step():
                raise RuntimeError("engine idle with unfinished requests")
        return results

    # --- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.step():
                    self.scheduler.wait_for_work(timeout=0.1)
            except Exception:  # keep serving: step() already failed the requests of the bad step
                logger.exception("engine step failed")

    def step(self) -> bool:
        """One scheduler decision and at most one forward; False when there was nothing to do."""
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        try:
            self._execute(plan)
        finally:
            self._stats = self._snapshot_stats()
        return True

    def _execute(self, plan: StepPlan) -> None:
        for seq in plan.aborted:
            self._finish_now(seq, seq.finish_reason or FinishReason.CANCELLED)
        if not plan.chunks:
            return
        started = time.perf_counter()
        try:
            finished = self._run(plan)
        except Exception as exc:
            logger.exception("forward failed; failing the %d requests of step %s", len(plan.chunks), plan.step_index)
            finished = self._fail_plan(plan)
            self.scheduler.on_step_done(plan, time.perf_counter() - started, finished)
            for seq in finished:
                self._finish_now(seq, FinishReason.ERROR, error=f"internal error: {exc}")
            return
        self.scheduler.on_step_done(plan, time.perf_counter() - started, [seq for seq, _ in finished])
        for seq, final_text in finished:
            self._emit_final(seq, final_text)

    def _run(self, plan: StepPlan) -> list[tuple[Sequence, str]]:
        """Forward + sample + postprocess; returns (finished sequence, its last text) pairs."""
        rows = [BatchRow(c.seq.request_id, c.seq.token_ids()[c.start:c.end], c.start, c.samples) for c in plan.chunks]
        batch = build_forward_batch(rows, self.kv, self.device)
        logits = self.model.forward(batch, self.kv)
        sampling = [c for c in plan.chunks if c.samples]
        tokens = self.sampler.sample(logits, [c.seq.request_id for c in sampling], [c.seq.sampling for c in sampling])
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens = chunk.end
        finished = []
        for chunk, token in zip(sampling, tokens):
            result = self._append_token(chunk.seq, token)
            if result is not None:
                finished.append((chunk.seq, result))
        for chunk in plan.chunks:
            if all(chunk.seq is not seq for seq, _ in finished):
                self.kv.release_slid_out(chunk.seq)
        return finished

    def _append_token(self, seq: Sequence, token: int) -> str | None:
        """Record a sampled token; stream it, or return the final text if the request is done."""
        live = self._live[seq.request_id]
        seq.output_ids.append(token)
        is_stop_token = token in live.stop_ids
        text = "" if is_stop_token else live.detokenizer.add(token)
        if is_stop_token or live.detokenizer.stopped:
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        else:
            self._send(live, [token], text, finished=False)
            return None
        return text + live.detokenizer.flush()

    def _send(self, live: _Live, token_ids: list[int], text: str, finished: bool, error: str | None = None):
        seq = live.seq
        try:
            live.on_output(RequestOutput(seq.request_id, token_ids, text, finished,
                                         seq.finish_reason if finished else None, len(seq.prompt_ids),
                                         len(seq.output_ids), error))
        except Exception:  # a broken consumer must not take the engine down
            logger.exception("on_output callback failed for request %r", seq.request_id)

    def _emit_final(self, seq: Sequence, final_text: str) -> None:
        live = self._live.pop(seq.request_id)
        self.sampler.release(seq.request_id)
        self._send(live, [seq.output_ids[-1]], final_text, finished=True)

    def _finish_now(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """A request ended by the scheduler (cancelled, cannot fit) or by a failed step."""
        live = self._live.pop(seq.request_id, None)
        self.sampler.release(seq.request_id)
        if live is None:
            return
        seq.finish_reason = reason
        if reason is FinishReason.ERROR and error is None:
            error = "the request no longer fits in the memory pools"
        self._send(live, [], live.detokenizer.flush() if reason is FinishReason.CANCELLED else "", True, error)

    def _fail_plan(self, plan: StepPlan) -> list[Sequence]:
        seqs = []
        for chunk in plan.chunks:
            chunk.seq.finish_reason = FinishReason.ERROR
            seqs.append(chunk.seq)
        return seqs

    def _validate(self, seq: Sequence) -> None:
        if not seq.prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in seq.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
        seq.sampling.validate(self.config.max_tokens_limit)
        total = len(seq.prompt_ids) + seq.sampling.max_tokens
        if total > self.max_request_tokens:
            raise ValueError(f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.sampling.max_tokens}) "
                             f"exceeds the {self.max_request_tokens} positions this deployment supports")


def _eos_token_ids(checkpoint: Path, config) -> list[int]:
    path = checkpoint / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return config.eos_token_ids
