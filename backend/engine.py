"""The engine: schedule -> build -> launch on its thread; the forward and the sampler on the executor's.

    engine = LLMEngine(EngineConfig(checkpoint=...))
    engine.start()                                   # the loop thread
    engine.submit(Sequence(...), on_output)          # from any thread; returns at once
    engine.abort(request_id)                         # from any thread; effective at the next step
    engine.shutdown()

`on_output(RequestOutput)` is called on the engine thread once per step that produced a token for the
request, and exactly once with `finished=True`. The outputs carry token ids, not text: detokenization and
stop strings are the consumer's, off the engine thread (backend/output_processor.py; the Triton adapter
runs it on its response thread). `generate()` runs the same loop on the caller's thread for offline use
(scripts, tests, benchmarks), with the output processor inline.

The loop (`step()`), with `overlap_scheduling` (the default):

    schedule step N+1 -> build its batch -> launch it      while step N runs on the executor
    wait for step N's output -> update the scheduler -> report its tokens

so the host's work for a step hides behind the device's work for the step before (backend/executor.py:
the tokens step N samples feed step N+1 on the device). Without overlap each step is scheduled, run and
reported before the next. The engine thread only schedules, builds, launches and reports.

Data-parallel attention (`data_parallel_size` W > 1, backend/parallel/layout.py): each rank serves its own
requests over its own pools, and this engine decides for all of them. It keeps one scheduler per rank, each over
that rank's page bookkeeping (rank 0's pools are real, the others' are planned on the meta device: the memory lives
in the worker processes), places each arriving request on the least loaded rank (`_place`), and in every step
schedules each rank, runs all ranks' batches as one lock-step forward (`StepExecutor.submit_data_parallel`), and gives
each rank's scheduler its own output. Starvation guarantees, ITL targets, preemption, deadlines and the prefix
cache are each rank's scheduler's, as on one rank. With overlap, all ranks' step N+1 is scheduled and built while
their step N runs, as on one rank (each rank's sampled tokens kept in its own last-token buffer).

Start-up order: the config was validated when it was built; the checkpoint's config.json is read, the
deployment resolved and the memory pools sized (backend/deployment.py), the chunk budget resolved — so a
deployment that cannot work fails before any weight is read — and only then are the weights loaded.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer

from backend.chat import ChatTemplate
from backend.config import DEFAULT_CHECKPOINT, EngineConfig
from backend.deployment import load_model, plan_deployment
from backend.executor import StepExecutor, StepHandle, StepJob, default_cpu_threads
from backend.memory.kv_manager import KVCacheManager
from backend.model.config import checkpoint_directory
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.model.graph_runner import DecodeGraphs
from backend.model.staging import BatchStager
from backend.model.static_batch import static_key
from backend.output_processor import OutputProcessor
from backend.parallel.comm import Communicator
from backend.parallel.group import RankGroup, RankGroupError
from backend.runner import Forward, GroupRunner, ModelRunner, StepCopies
from backend.request import EngineUnavailable, FinishReason, RequestLimits, RequestOutput, SamplingParams, Sequence
from backend.sampler import SamplerState
from backend.scheduler import Scheduler, StepPlan, resolve_prefill_chunk_tokens
from backend.scheduler.step_record import StepCounters
from backend.speculative import DraftRow, SpecJob
from backend.structured.grammar import GrammarService

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        checkpoint, tokenizer = checkpoint_directory(config.checkpoint), tokenizer_directory(config)
        self.deployment = plan_deployment(config, self.device, self.dtype)
        self.model_config, self.weight_format, self.kv = (self.deployment.model_config, self.deployment.weight_format,
                                                          self.deployment.kv)
        prefill_chunk_tokens = resolve_prefill_chunk_tokens(config, self.kv)
        # Speculative decoding (backend/speculative.py): a verify's emitted count decides where the next step starts,
        # so its steps are not overlapped.
        self.num_speculative_tokens = config.num_speculative_tokens
        self.overlap = config.overlap_scheduling and not self.num_speculative_tokens
        work_changed = threading.Condition(threading.Lock())  # every rank's scheduler wakes the one loop

        def scheduler(kv, rank: int) -> Scheduler:
            return Scheduler(config, kv, prefill_chunk_tokens, prefix_cache=kv.prefix_cache,
                             max_steps_in_flight=2 if self.overlap else 1, rank=rank, work_changed=work_changed)

        self.ranks = [DataParallelRank(0, self.kv, scheduler(self.kv, 0))] + [
            DataParallelRank(r, kv, scheduler(kv, r)) for r in range(1, config.data_parallel_size)
            for kv in [plan_deployment(config, "meta", self.dtype).kv]]  # pages without memory: it is the rank's
        self.scheduler = self.ranks[0].scheduler
        self._placement_lock = threading.Lock()
        self._placed: dict[str, Placement] = {}  # live request -> where it went, and where its outputs go
        # Prefix-cache affinity over ranks: a prompt's first cache block -> the rank last given a prompt starting so
        # (the rank whose cache may hold it), at most as many as the ranks' caches have entries.
        cache = self.kv.prefix_cache
        self._affinity_tokens = cache.block_tokens if cache is not None and len(self.ranks) > 1 else None
        self._affinity: OrderedDict[int, DataParallelRank] = OrderedDict()
        self._max_affinity = config.prefix_cache_entries * len(self.ranks)
        self.tokenizer = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
        self.chat_template = ChatTemplate.from_checkpoint(tokenizer)  # None: `messages` requests are refused
        self.eos_token_ids = _eos_token_ids(checkpoint, self.model_config)
        # Structured outputs: the grammars of constrained requests, compiled on their own thread.
        self.grammars = GrammarService(tokenizer / "tokenizer.json", vocab_size=self.model_config.vocab_size,
                                       stop_token_ids=self.eos_token_ids)
        self.limits = RequestLimits(self.model_config.vocab_size, config.max_tokens_limit,
                                    self.kv.max_request_positions())
        self.layout = self.deployment.layout
        # Several ranks: the workers start loading their shards while this rank loads its own.
        self.group = RankGroup.start(config, self.layout) if self.layout.world_size > 1 else None
        self.model = load_model(config, self.deployment, self.device, self.dtype, self.layout,
                                self.group.comm if self.group else Communicator())
        self.kernels = self.model.kernels
        if self.group is not None:
            self.group.wait_ready()
        self.unavailable: str | None = None  # why this instance can no longer serve (a rank is gone)
        self.num_rejected_queue_full = 0
        keep_streams = bool(self.num_speculative_tokens)  # the draft layer reads the verify's residual streams
        self.decode_graphs = (DecodeGraphs(self.model, self.kv, config.max_running_requests,
                                           capture=self.device == "cuda", return_streams=keep_streams)
                              if config.resolved_cuda_graphs() else None)
        if self.group is not None and not self.layout.data_parallel:  # every rank runs every step
            self.runner = GroupRunner(self.group, self.model, self.kv, self.decode_graphs, keep_streams)
        else:
            self.runner = ModelRunner(self.model, self.kv, self.decode_graphs, keep_streams)
        self.executor = StepExecutor(self.runner, self.kernels, asynchronous=self.overlap,
                                     cpu_threads=config.cpu_threads or default_cpu_threads())
        self._stager = BatchStager(self.device, depth=2)
        self._in_flight: deque[list] = deque()  # launched (one (plan, handle) per rank), output not taken in yet
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._stats = self._snapshot_stats()
        logger.info("engine ready: device=%s dtype=%s weights=%s kernels=%s overlap=%s capacity=%s bytes/token=%s "
                    "prefill_chunk_tokens=%d num_speculative_tokens=%d", self.device, self.dtype, self.weight_format,
                    self.kernels.mode, self.overlap, self.kv.capacity(), self.kv.bytes_per_token(),
                    self.scheduler.prefill_chunk_tokens, self.num_speculative_tokens)

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
        self.limits.check(seq.prompt_ids, seq.sampling)
        seq.stop_ids = frozenset(seq.sampling.stop_token_ids) | frozenset(
            () if seq.sampling.ignore_eos else self.eos_token_ids)
        if seq.sampling.guided_decoding is not None:  # parsed here (a bad grammar is refused), compiled later
            seq.grammar = self.grammars.prepare(seq.sampling.guided_decoding)
        seq.sampler_state = SamplerState(seq.sampling, seq.prompt_ids, seq.grammar)
        limit = self.config.max_queue_size
        rank = self._place(seq, on_output)
        try:
            added = rank.scheduler.add(seq, max_waiting=limit)
        except BaseException:
            self._unplace(seq.request_id)
            raise
        if not added:
            self._unplace(seq.request_id)
            self.num_rejected_queue_full += 1
            raise EngineUnavailable(f"the queue is full ({limit} requests waiting, max_queue_size); retry later")

    def abort(self, request_id: str) -> bool:
        with self._placement_lock:
            placed = self._placed.get(request_id)
        return placed is not None and placed.rank.scheduler.abort(request_id)

    def rank_of(self, request_id: str) -> int | None:
        """The data-parallel rank serving a live request (0 on one rank), or None."""
        with self._placement_lock:
            placed = self._placed.get(request_id)
        return placed.rank.rank if placed is not None else None

    def _place(self, seq: Sequence, on_output: Callable[[RequestOutput], None]) -> "DataParallelRank":
        """The rank that serves `seq`: the one with the least load, counted in tokens (its live requests' prompts and
        max_tokens: what they will hold in memory and compute), so that the ranks' memory use and tokens per step
        stay balanced; but a prompt whose first prefix-cache block an earlier prompt started with goes where that
        one went (its cache may hold the prefix), unless that rank's load exceeds the least by more than this
        request's own. Raises ValueError if the id is live on any rank."""
        load = len(seq.prompt_ids) + seq.sampling.max_tokens
        block = self._affinity_tokens
        key = hash(tuple(seq.prompt_ids[:block])) if block and len(seq.prompt_ids) > block else None
        with self._placement_lock:
            if seq.request_id in self._placed:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            rank = min(self.ranks, key=lambda r: (r.load, r.rank))
            owner = self._affinity.get(key) if key is not None else None
            if owner is not None and owner.load <= rank.load + load:
                rank = owner
            if key is not None:
                self._affinity[key] = rank
                self._affinity.move_to_end(key)
                if len(self._affinity) > self._max_affinity:
                    self._affinity.popitem(last=False)
            rank.load += load
            self._placed[seq.request_id] = Placement(rank, load, on_output)
        return rank

    def _unplace(self, request_id: str) -> None:
        with self._placement_lock:
            self._unplace_locked(request_id)

    def _unplace_locked(self, request_id: str) -> "Placement | None":
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            placed.rank.load -= placed.load
        return placed

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop, the executor, the grammar threads and the worker ranks within `timeout` seconds in all: a
        step in flight ends first; threads that outlast the budget are left (they are daemons) rather than waited for
        (tritonserver kills a model that takes longer to unload than its exit timeout)."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self.scheduler.wake()
        if self._thread is not None:
            self._thread.join(_left(deadline))
            self._thread = None
        self.executor.close(_left(deadline))
        for rank in self.ranks:
            rank.scheduler.close()
        self.grammars.close()
        if self.group is not None:
            self.group.close(_left(deadline))
            self.group = None

    def stats(self) -> dict:
        """A snapshot of the counters and pool usage, safe to read from any thread.

        The engine thread refreshes it after every step (and at start); readers get the latest
        complete snapshot and never see structures the engine thread is changing.
        """
        return self._stats

    def _snapshot_stats(self) -> dict:
        """With data parallelism: the ranks' counters, requests and prefix caches added up, pool usage the mean over the
        ranks (their pools are alike), and each rank's own under "ranks"."""
        counters = StepCounters.total([rank.scheduler.counters for rank in self.ranks])
        ranks = [{"rank": rank.rank, "num_running": rank.scheduler.num_running,
                  "num_waiting": rank.scheduler.num_waiting, "pool_usage": rank.kv.usage(),
                  "pages_used": rank.kv.pages_used(), "load_tokens": rank.load} for rank in self.ranks]
        return {
            "steps_by_kind": dict(counters.steps_by_kind),
            "longest_prefill_streak": counters.longest_prefill_streak,
            "decode_stalls": counters.decode_stalls,
            "num_preemptions": counters.num_preemptions,
            "num_itl_infeasible": counters.num_itl_infeasible,
            "num_draft_tokens": counters.num_draft_tokens,
            "num_accepted_tokens": counters.num_accepted_tokens,
            "mean_accepted_length": counters.mean_accepted_length,
            "num_timed_out": counters.num_timed_out,
            "num_rejected_queue_full": self.num_rejected_queue_full,
            "num_running": sum(r["num_running"] for r in ranks),
            "num_waiting": sum(r["num_waiting"] for r in ranks),
            "pool_usage": {pool: sum(r["pool_usage"][pool] for r in ranks) / len(ranks)
                           for pool in ranks[0]["pool_usage"]},
            "pages_used": {pool: sum(r["pages_used"][pool] for r in ranks) for pool in ranks[0]["pages_used"]},
            "ranks": ranks,
            "unavailable": self.unavailable,
            "prefix_cache": _total_cache_stats([rank.kv.prefix_cache.snapshot_stats() for rank in self.ranks])
            if self.kv.prefix_cache is not None else None,
            "grammars": self.grammars.stats(),
        }

    def take_grammar_compile_seconds(self) -> list[float]:
        """Structured outputs: the grammar compile times recorded since the last call (any thread)."""
        return self.grammars.take_compile_seconds()

    # --- offline use --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[dict]:
        """Submit every prompt at once (so they batch), run to completion on this thread."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        results = [{"output_ids": [], "text": "", "finish_reason": None} for _ in prompts]
        processor = OutputProcessor(self.tokenizer, self.abort)

        def collect(index):
            def on_output(raw: RequestOutput):
                out = processor.process(raw)
                if out is None:
                    return
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
            seq = Sequence(f"offline-{i}-{time.monotonic_ns()}", list(ids), p)
            processor.add(seq.request_id, p)
            self.submit(seq, collect(i))
        while any(r["finish_reason"] is None for r in results):
            if not self.step():
                if not any(rank.scheduler.num_awaiting_grammar for rank in self.ranks):
                    raise RuntimeError("engine idle with unfinished requests")
                self._wait_for_work(timeout=1.0)  # a grammar being compiled
        self.drain()
        return results

    def drain(self) -> None:
        """Run until nothing is in flight or left to do: the step launched for requests that have ended, the aborts
        of requests that stopped at a stop string (offline use, on the caller's thread)."""
        while self._in_flight or any(rank.scheduler.has_work() for rank in self.ranks):
            if not self.step():
                break

    # --- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.step():
                    self._wait_for_work(timeout=0.1)
            except Exception:  # keep serving: the step's own failures were reported to its requests
                logger.exception("engine step failed")

    def _wait_for_work(self, timeout: float) -> bool:
        return Scheduler.wait_for_any([rank.scheduler for rank in self.ranks], timeout)

    def step(self) -> bool:
        """One iteration: schedule and launch a step (on every data-parallel rank at once), and take in the output of
        the one launched before it (with overlap) or of this one; False when there was nothing to do."""
        started = time.perf_counter()
        plans = [rank.scheduler.schedule() for rank in self.ranks]
        launched = self._launch(plans)
        if launched is not None:
            host_s = time.perf_counter() - started
            for plan, handle in launched:
                if handle is not None:
                    plan.timing.host_s = host_s
        took_in = bool(self._in_flight)
        if took_in:
            self._take_in(self._in_flight.popleft())
        if launched is not None:
            if self.overlap:
                self._in_flight.append(launched)
            else:
                self._take_in(launched)
        self._stats = self._snapshot_stats()
        return any(plan is not None for plan in plans) or took_in

    def _launch(self, plans: list[StepPlan | None]) -> list[tuple[StepPlan, StepHandle | None]] | None:
        """Report what each rank's scheduler ended, build each rank's batch on the host and hand them to the executor
        (returns at once with overlap): one (plan, handle) per rank, the handle None where the rank has no step (with
        data parallelism it still takes part in the forward's MoE exchanges); None when no rank has one."""
        jobs, failed = [], {}
        for rank, plan in zip(self.ranks, plans):
            for seq in plan.aborted if plan is not None else ():
                self._report_end(seq, error=_scheduler_error(seq) or self.unavailable)
            job = None
            if plan is not None and plan.chunks:
                try:
                    job = self._job(plan, rank.kv)
                except Exception as exc:  # the step is committed: its requests fail when it is taken in
                    logger.exception("building step %s (rank %d) failed", plan.step_index, rank.rank)
                    failed[rank.rank] = StepHandle.failed(exc)
            jobs.append(job)
        if not any(jobs):
            handles = [None] * len(jobs)
            if not failed:
                return None
        elif len(jobs) == 1:
            handles = [self.executor.submit(jobs[0])]
        else:  # data-parallel ranks: one lock-step forward
            handles = self.executor.submit_data_parallel(self.group, jobs)
        return [(plan, failed.get(rank.rank, handle)) for rank, plan, handle in zip(self.ranks, plans, handles)]

    def _job(self, plan: StepPlan, kv) -> StepJob:
        """The step's batch, built on the host over `kv` (its rank's pages), with what the executor needs to run it."""
        rows, samplers, from_device, plain, copies_after = [], [], False, True, []
        for chunk in plan.chunks:
            seq = chunk.seq
            known = chunk.end <= len(seq.token_ids) or bool(chunk.drafts)  # else the token of the step in flight
            from_device |= not known
            snapshots = ()
            if chunk.snapshots:  # inside the chunk: written by its plan; where it ends: copied after the forward
                snapshots = tuple((r.position, r.slot) for r in chunk.snapshots if r.copy_after is None)
                copies_after += [r.copy_after for r in chunk.snapshots if r.copy_after is not None]
            tokens = seq.token_ids[chunk.start:chunk.start + 1] + list(chunk.drafts) if chunk.drafts else (
                seq.token_ids[chunk.start:chunk.end] if known else [0])
            rows.append(BatchRow(seq.pages, tokens, chunk.start, chunk.samples, snapshots, not known,
                                 num_logits=1 + len(chunk.drafts)))
            if chunk.samples:
                samplers.append(seq.sampler_state)
                plain &= seq.sampler_state.plain
        spec = self._spec_job(plan) if self.num_speculative_tokens else None
        graphs = self.decode_graphs
        key = static_key(rows) if graphs is not None and graphs.accepts(rows) else None
        batch = build_forward_batch(rows, kv, pad_to=key)
        cache = kv.prefix_cache
        copies = StepCopies(cache.take_pending() if cache is not None else [], copies_after)
        return StepJob(self._forward(batch, copies, key, from_device), samplers, plain, spec, plan.timing)

    def _forward(self, batch, copies: StepCopies, key, reads_previous_tokens: bool) -> Forward:
        """The step's Forward (backend/runner.py). A group's batch goes out as host tensors; otherwise a dynamic step's
        is packed and copied to the device from here (ordered after the steps launched before it), a static one's
        packed for the runner to copy into its graph's buffers, in step order."""
        staged = self._stager.stage(batch) if self.group is None or key is not None else None
        if key is None and self.group is None:
            batch = self._stager.to_device(staged)
        return Forward(batch, copies, key, staged, reads_previous_tokens)

    def _spec_job(self, plan: StepPlan) -> SpecJob:
        """What the draft layer needs of a step (backend/speculative.py): each position's next token where the host
        knows it (-1 where this step emits it), and each sampling row's drafts and pages."""
        next_ids, rows = [], []
        for chunk in plan.chunks:
            seq = chunk.seq
            if chunk.drafts:
                next_ids += [-1] * chunk.num_tokens
            else:
                following = seq.token_ids[chunk.start + 1:chunk.end + 1]
                next_ids += following + [-1] * (chunk.num_tokens - len(following))
            if chunk.samples:
                rows.append(DraftRow(seq.request_id, seq.pages, chunk.drafts, chunk.start + chunk.allocated,
                                     wants_drafts=seq.grammar is None))
        return SpecJob(torch.tensor(next_ids, dtype=torch.long), rows, self.num_speculative_tokens)

    def _take_in(self, launched: list[tuple[StepPlan, StepHandle | None]]) -> None:
        """A step's outputs (`_launch`), each rank's to its scheduler."""
        for rank, (plan, handle) in zip(self.ranks, launched):
            if handle is not None:
                self._take_in_rank(plan, handle, rank.scheduler)

    def _take_in_rank(self, plan: StepPlan, handle: StepHandle, scheduler: Scheduler) -> None:
        """One rank's step output: its scheduler's accounting, then each request's token (or its failure)."""
        output = handle.result()
        if output.error is not None:
            logger.error("step %s failed (%s); failing its %d requests", plan.step_index, output.error,
                         len(plan.chunks))
            if isinstance(handle.exception, RankGroupError):  # no later step can run: end every request
                self.unavailable = str(handle.exception)
                for rank in self.ranks:
                    rank.scheduler.abort_all()
        for out in scheduler.update_from_output(plan, output):
            self._send(out)

    def _report_end(self, seq: Sequence, error: str | None) -> None:
        """The final output of a request the scheduler ended (cancelled, timed out or failed)."""
        self._send(RequestOutput.of(seq, [], finished=True, error=error))

    def _send(self, output: RequestOutput) -> None:
        """An output to its request's consumer (the request's last: its placement ends)."""
        with self._placement_lock:
            placed = self._placed.get(output.request_id) if not output.finished else self._unplace_locked(
                output.request_id)
        if placed is None:
            return
        try:
            placed.on_output(output)
        except Exception:  # a broken consumer must not take the engine down
            logger.exception("on_output callback failed for request %r", output.request_id)


@dataclass(eq=False)
class DataParallelRank:
    """One data-parallel rank as the engine sees it: its page bookkeeping, its scheduler, the load placed on it."""

    rank: int
    kv: KVCacheManager
    scheduler: Scheduler
    load: int = 0  # tokens of its live requests (prompt + max_tokens), under the engine's placement lock


@dataclass(eq=False, slots=True)
class Placement:
    """A live request as the engine placed it: its rank, the load it counts there, where its outputs go."""

    rank: DataParallelRank
    load: int
    on_output: Callable[[RequestOutput], None]


def _total_cache_stats(snapshots: list[dict]) -> dict:
    """Data-parallel ranks' prefix-cache stats (PrefixCache.snapshot_stats) added up."""
    if len(snapshots) == 1:
        return snapshots[0]
    total = {key: sum(s[key] for s in snapshots) for key in snapshots[0] if key != "pages"}
    total["pages"] = {pool: sum(s["pages"][pool] for s in snapshots) for pool in snapshots[0]["pages"]}
    return total


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _scheduler_error(seq: Sequence) -> str | None:
    if seq.finish_reason is FinishReason.ERROR:
        return seq.error or "the request no longer fits in the memory pools"
    return None


def tokenizer_directory(config: EngineConfig) -> Path:
    """Where the tokenizer is: the checkpoint's directory; with load_format=dummy and no tokenizer.json there, the
    built-in checkpoint's. Its vocabulary may then be smaller than the model's (512 against V4's 129,280): the ids
    beyond it are served as ids, and decode to no text (tokenizers skips ids it does not know)."""
    directory = checkpoint_directory(config.checkpoint)
    if config.load_format == "dummy" and not (directory / "tokenizer.json").is_file():
        logger.warning("no tokenizer.json in %s: using the built-in checkpoint's (%s)", directory, DEFAULT_CHECKPOINT)
        return DEFAULT_CHECKPOINT
    return directory


def _eos_token_ids(checkpoint: Path, config) -> list[int]:
    path = checkpoint / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return config.eos_token_ids
