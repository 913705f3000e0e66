"""The engine: one thread that owns the device and runs schedule -> prepare -> forward -> sample -> postprocess.

    engine = LLMEngine(EngineConfig(checkpoint=...))
    engine.start()                                   # the loop thread
    engine.submit(Sequence(...), on_output)          # from any thread; returns at once
    engine.abort(request_id)                         # from any thread; effective at the next step
    engine.shutdown()

`on_output(RequestOutput)` is called on the engine thread once per step that produced text or
tokens for the request, and exactly once with `finished=True`. `generate()` runs the same loop on
the caller's thread for offline use (scripts, tests, benchmarks).

Start-up order: the config was validated when it was built; the checkpoint's config.json is read,
the memory pools are sized and the chunk budget resolved — so a deployment that cannot work fails
before any weight is read — and only then are the weights loaded.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from backend.chat import ChatTemplate
from backend.config import ConfigError, EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.host_memory import keep_freed_host_memory
from backend.memory.kv_manager import KVCacheManager
from backend.model.checkpoint import load_weights
from backend.model.config import load_model_config
from backend.model.deepseek_v4 import DeepseekV4Model
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.model.graph_runner import DecodeGraphs
from backend.parallel.comm import Communicator
from backend.parallel.group import RankGroup, RankGroupError
from backend.parallel.layout import ParallelLayout
from backend.request import (EngineUnavailable, FinishReason, RequestLimits, RequestOutput, SamplingParams, Sequence,
                             TokenLogprobs)
from backend.sampler import Sampler, apply_penalties
from backend.scheduler import Scheduler, StepPlan, resolve_prefill_chunk_tokens
from kernels.dispatch import KernelDispatch, default_mode

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        checkpoint = Path(config.checkpoint)
        self.model_config, self.weight_format, self.kv, prefill_chunk_tokens = plan_deployment(
            config, self.device, self.dtype)
        self.scheduler = Scheduler(config, self.kv, prefill_chunk_tokens)
        self.tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self.chat_template = ChatTemplate.from_checkpoint(checkpoint)  # None: `messages` requests are refused
        self.eos_token_ids = _eos_token_ids(checkpoint, self.model_config)
        self.limits = RequestLimits(self.model_config.vocab_size, config.max_tokens_limit,
                                    self.kv.max_request_positions())
        self.layout = ParallelLayout(config.tensor_parallel_size, config.expert_parallel_size)
        # Several ranks: the workers start loading their shards while this rank loads its own.
        self.group = RankGroup.start(config, self.layout) if self.layout.world_size > 1 else None
        self.model = load_model(config, self.model_config, self.weight_format, self.device, self.dtype, self.layout,
                                self.group.comm if self.group else Communicator())
        self.kernels = self.model.kernels
        if self.group is not None:
            self.group.wait_ready()
            if self.kv.prefix_cache is not None:
                self.kv.prefix_cache.mirror = True  # its copies go to the workers with each step
        self.unavailable: str | None = None  # why this instance can no longer serve (a rank is gone)
        self.num_rejected_queue_full = 0
        self.decode_graphs = (DecodeGraphs(self.model, self.kv, config.max_running_requests,
                                           capture=self.device == "cuda")
                              if config.resolved_cuda_graphs() else None)
        self.sampler = Sampler()
        self.cpu_threads = config.cpu_threads or _default_cpu_threads()
        self.small_step_tokens = SMALL_STEP_TOKENS  # steps below this run on one intra-op thread
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = self._snapshot_stats()
        logger.info("engine ready: device=%s dtype=%s weights=%s kernels=%s capacity=%s bytes/token=%s "
                    "prefill_chunk_tokens=%d", self.device, self.dtype, self.weight_format, self.kernels.mode,
                    self.kv.capacity(), self.kv.bytes_per_token(), self.scheduler.prefill_chunk_tokens)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # --- any thread ---------------------------------------------------------------------------------
    def submit(self, seq: Sequence, on_output: Callable[[RequestOutput], None]) -> None:
        """The admission gate: queue a request, or raise ValueError with a message for the client.

        Checks what this deployment allows (RequestLimits: vocabulary, max_tokens_limit, the
        positions the memory can ever hold) and that the id is not in use (Scheduler.add).
        """
        if self.unavailable:
            raise EngineUnavailable(f"the model cannot serve: {self.unavailable}")
        limit = self.config.max_queue_size
        if limit is not None and self.scheduler.num_waiting >= limit:
            self.num_rejected_queue_full += 1
            raise EngineUnavailable(f"the queue is full ({limit} requests waiting, max_queue_size); retry later")
        self.limits.check(seq.prompt_ids, seq.sampling)
        seq.on_output = on_output
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.sampling.stop)
        seq.stop_ids = frozenset(seq.sampling.stop_token_ids) | frozenset(
            () if seq.sampling.ignore_eos else self.eos_token_ids)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.scheduler.close()
        if self.group is not None:
            self.group.close()
            self.group = None

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
            "num_itl_infeasible": counters.num_itl_infeasible,
            "num_timed_out": counters.num_timed_out,
            "num_rejected_queue_full": self.num_rejected_queue_full,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "pool_usage": self.kv.usage(),
            "pages_used": self.kv.pages_used(),
            "unavailable": self.unavailable,
            "prefix_cache": self.kv.prefix_cache.snapshot_stats() if self.kv.prefix_cache is not None else None,
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
                if out.logprobs is not None:
                    results[index].setdefault("logprobs", []).extend(out.logprobs)
                if out.finished:
                    results[index]["finish_reason"] = out.finish_reason.value
                    results[index]["error"] = out.error
                    results[index]["num_cached_tokens"] = out.num_cached_tokens
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
            self._send_final(seq, error=_scheduler_error(seq) or self.unavailable)
        if not plan.chunks:
            return
        started = time.perf_counter()
        try:
            finished = self._run(plan)
        except Exception as exc:
            logger.exception("forward failed; failing the %d requests of step %s", len(plan.chunks), plan.step_index)
            if isinstance(exc, RankGroupError):  # no later step can run: end every request, refuse new ones
                self.unavailable = str(exc)
                self.scheduler.abort_all()
            failed = [chunk.seq for chunk in plan.chunks]
            for seq in failed:
                seq.finish_reason = FinishReason.ERROR
            self.scheduler.on_step_done(plan, time.perf_counter() - started, failed, forward_failed=True)
            for seq in failed:
                self._send_final(seq, error=f"internal error: {exc}")
            return
        self.scheduler.on_step_done(plan, time.perf_counter() - started, [seq for seq, _, _ in finished])
        for seq, final_text, logprobs in finished:
            self._send(seq, [seq.output_ids[-1]], final_text, finished=True, logprobs=logprobs)

    def _run(self, plan: StepPlan) -> list[tuple[Sequence, str, TokenLogprobs | None]]:
        """Prepare + forward + sample + postprocess; returns (finished sequence, its last text, its last token's
        log-probabilities) triples."""
        _use_intra_op_threads(1 if plan.num_tokens < self.small_step_tokens else self.cpu_threads)
        rows = [BatchRow(c.seq.pages, c.seq.token_ids()[c.start:c.end], c.start, c.samples,
                         tuple((s.position, s.slot) for s in c.snapshots)) for c in plan.chunks]
        if self.decode_graphs is not None and self.decode_graphs.accepts(rows):
            logits = self.decode_graphs.forward(rows)  # every decode row samples: logits align with `sampling`
        elif self.group is not None:  # every rank runs this batch (built on the host, broadcast)
            logits = self.group.forward(self.model, self.kv, build_forward_batch(rows, self.kv, "cpu"))
        else:
            logits = self.model.forward(build_forward_batch(rows, self.kv, self.device), self.kv)
        sampling = [c.seq for c in plan.chunks if c.samples]
        logits = apply_penalties(logits, sampling)
        tokens = self.sampler.sample(logits, sampling)
        logprobs = (self.sampler.logprobs(logits, sampling, tokens)
                    if any(seq.sampling.logprobs is not None for seq in sampling) else [None] * len(tokens))
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens = chunk.end
        finished = []
        for seq, token, token_logprobs in zip(sampling, tokens, logprobs):
            final_text = self._append_token(seq, token, token_logprobs)
            if final_text is not None:
                finished.append((seq, final_text, token_logprobs))
        return finished

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> str | None:
        """Record a sampled token; stream it, or return the final text if the request is done."""
        seq.output_ids.append(token)
        is_stop_token = token in seq.stop_ids
        text = "" if is_stop_token else seq.detokenizer.add(token)
        if is_stop_token or seq.detokenizer.stopped:
            seq.finish_reason = FinishReason.STOP
        elif len(seq.output_ids) >= seq.sampling.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        else:
            self._send(seq, [token], text, finished=False, logprobs=logprobs)
            return None
        return text + seq.detokenizer.flush()

    def _send_final(self, seq: Sequence, error: str | None) -> None:
        """The final response of a request ended without a last token (cancelled, timed out or failed)."""
        text = seq.detokenizer.flush() if seq.finish_reason in (FinishReason.CANCELLED, FinishReason.TIMEOUT) else ""
        self._send(seq, [], text, finished=True, error=error)

    def _send(self, seq: Sequence, token_ids: list[int], text: str, finished: bool, error: str | None = None,
              logprobs: TokenLogprobs | None = None):
        try:
            seq.on_output(RequestOutput(seq.request_id, token_ids, text, finished,
                                        seq.finish_reason if finished else None, len(seq.prompt_ids),
                                        len(seq.output_ids), error, None if logprobs is None else [logprobs],
                                        seq.num_cached_tokens or 0))
        except Exception:  # a broken consumer must not take the engine down
            logger.exception("on_output callback failed for request %r", seq.request_id)


# Steps with fewer tokens (decodes, small mixed steps) are thousands of tiny ops: one intra-op thread
# runs them as fast as two on the main thread, while two in a worker thread (a second OpenMP team)
# made them 1.2-1.35x slower; prefill chunks gain from the cores (bench_engine_thread.py).
SMALL_STEP_TOKENS = 64


_threads_before_engines: int | None = None  # torch's intra-op threads before an engine first changed them


def _use_intra_op_threads(count: int) -> None:
    global _threads_before_engines
    if torch.get_num_threads() != count:
        if _threads_before_engines is None:
            _threads_before_engines = torch.get_num_threads()
        torch.set_num_threads(count)


def _default_cpu_threads() -> int:
    """torch's thread count as the process set it: not what an earlier engine's last small step left (a
    second engine in one process would otherwise run its prefills on one thread)."""
    return _threads_before_engines or torch.get_num_threads()


def _memory_pools(config: EngineConfig, model_config, dtype, device) -> KVCacheManager:
    """The pools the config asks for; ConfigError when they could not serve a single request."""
    kv = KVCacheManager(model_config, num_tokens=config.num_tokens, swa_full_tokens_ratio=config.swa_full_tokens_ratio,
                        page_size=config.page_size, max_running_requests=config.max_running_requests, dtype=dtype,
                        device=device)
    if kv.max_request_positions() == 0:
        window = kv.window_pool
        raise ConfigError(
            f"parameter 'swa_full_tokens_ratio': the window pool holds {window.num_pages} pages of {config.page_size} "
            f"positions (num_tokens * swa_full_tokens_ratio), fewer than one sliding window needs "
            f"({window.pages_per_running_request()}); raise num_tokens or swa_full_tokens_ratio")
    return kv


def resolve_weight_format(config: EngineConfig, model_config, device: str) -> str:
    """`auto`: keep a quantized checkpoint quantized on CUDA (V4-Flash does not fit any GPU in bf16),
    dequantize on CPU; `fp8` needs a quantized checkpoint."""
    quantized = model_config.quantization_config is not None
    if config.weight_format == "auto":
        return "fp8" if quantized and device == "cuda" else "dequantize"
    if config.weight_format == "fp8" and not quantized:
        raise ConfigError("parameter 'weight_format': 'fp8' needs a quantized (FP8) checkpoint; this one has no "
                          "quantization_config")
    return config.weight_format


def plan_deployment(config: EngineConfig, device, dtype) -> tuple:
    """Everything decided before a weight is read: (model config, weight format, memory pools on
    `device`, prefill chunk budget). Raises ConfigError / UnsupportedCheckpoint naming what to change."""
    if str(device) == "cpu":  # every rank plans its pools here: its CPU steps' temporaries are reused from now on
        keep_freed_host_memory()
    model_config = load_model_config(config.checkpoint)
    ParallelLayout(config.tensor_parallel_size, config.expert_parallel_size).check(model_config)
    weight_format = resolve_weight_format(config, model_config, config.resolved_device())
    kv = _memory_pools(config, model_config, dtype, device)
    if config.enable_prefix_caching:
        kv.enable_prefix_caching(math.lcm(128, config.page_size), config.prefix_cache_entries,
                                 config.prefix_cache_end_entries)
    return model_config, weight_format, kv, resolve_prefill_chunk_tokens(config, kv)


def load_model(config: EngineConfig, model_config, weight_format: str, device, dtype, layout: ParallelLayout,
               comm: Communicator) -> DeepseekV4Model:
    """This rank's shard of the model (all of it on one rank), with its kernel dispatch."""
    weights = load_weights(config.checkpoint, model_config, dtype, device, weight_format, layout=layout)
    kernels = KernelDispatch(default_mode(config.use_reference_kernels))
    return DeepseekV4Model(model_config, weights, device, dtype, kernels, layout=layout, comm=comm)


def check_deployment(config: EngineConfig) -> int:
    """plan_deployment without allocating anything (the pools on the meta device); returns the
    prefill chunk budget. What make_model_repository.py checks before writing a repository."""
    return plan_deployment(config, "meta", config.resolved_dtype())[3]


def _scheduler_error(seq: Sequence) -> str | None:
    if seq.finish_reason is FinishReason.ERROR:
        return "the request no longer fits in the memory pools"
    return None


def _eos_token_ids(checkpoint: Path, config) -> list[int]:
    path = checkpoint / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return config.eos_token_ids
