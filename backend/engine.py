"""The engine: the admission gate, the placement of requests on data-parallel ranks, and rank 0's engine loop.

    engine = LLMEngine(EngineConfig(checkpoint=...))
    engine.start()                                   # the loop thread
    engine.submit(Sequence(...), on_output)          # from any thread; returns at once
    engine.abort(request_id)                         # from any thread; effective at the next step
    engine.shutdown()

`on_output(RequestOutput)` is called once per step that produced a token for the request, and exactly once with
`finished=True`: on the engine thread for the requests this process serves, on the `dsv4-ranks` thread for those of
other data-parallel ranks. The outputs carry token ids, not text: detokenization and stop strings are the
consumer's, off the engine thread (backend/output_processor.py; the Triton adapter runs it on its response thread).
`generate()` runs the same loop on the caller's thread for offline use (scripts, tests, benchmarks), with the output
processor inline.

The loop itself is rank 0's `EngineCore` (backend/engine_core.py): schedule step N+1, build and launch it while step
N runs, take step N's output in, send its outputs (overlap scheduling; backend/executor.py).

Data-parallel attention (`data_parallel_size` W > 1, backend/model/parallel_layout.py): every rank is a whole engine
over its own pools; ranks 1.. run theirs in their own processes (backend/parallel/data_parallel.py). This engine places
each arriving request on a rank (`_place`: the least loaded, unless a rank that served its prompt's first cache
block is loaded little more), sends it there (or queues it in its own core for rank 0), and passes each rank's
outputs on as they come back. Starvation guarantees, ITL targets, preemption, the prefix cache, grammars and
speculative decoding are each rank's own, as on one rank; cancels and deadlines of another rank's requests are
decided here (`_end_elsewhere`), so that nothing reaches a client after its request ended.

Start-up order: the config was validated when it was built; the checkpoint's config.json is read, the
deployment resolved and the memory pools sized (backend/deployment.py), the chunk budget resolved — so a
deployment that cannot work fails before any weight is read — and only then are the weights loaded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Callable

from backend.chat import chat_format
from backend.config import EngineConfig
from backend.deployment import load_model, plan_deployment
from backend.engine_core import EngineCore, eos_token_ids, grammar_service, load_tokenizer, tokenizer_directory
from backend.host_memory import freeze_start_up_heap, thaw_heap
from backend.output_processor import OutputProcessor
from backend.model.comm import Communicator
from backend.model.config import checkpoint_directory, load_model_config
from backend.parallel.data_parallel import OutputBatch
from backend.parallel.group import RankGroup, check_devices
from backend.parallel.messages import Arrival, Cancel
from backend.parallel.sync import ALONE
from backend.request import (SHUTTING_DOWN, EngineUnavailable, FinishReason, RequestLimits, RequestOutput,
                             SamplingParams, Sequence)
from backend.rank_main import worker_main
from backend.runner import make_runner
from backend.scheduler.scheduler import clock
from backend.scheduler.step_record import StepCounters
from backend.structured.grammar import COMPILE_SECONDS_KEPT

__all__ = ["LLMEngine", "tokenizer_directory"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        check_devices(config)
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        tokenizer = tokenizer_directory(config)
        model_config = load_model_config(config.checkpoint, config.hf_overrides)  # (checked before any pool is made)
        self.tokenizer = load_tokenizer(tokenizer, model_config.vocab_size,
                                        built_in=tokenizer != checkpoint_directory(config.checkpoint))
        self.deployment = plan_deployment(config, self.device, self.dtype, model_config)
        self.model_config, self.weight_format, self.kv = (self.deployment.model_config, self.deployment.weight_format,
                                                          self.deployment.kv)
        self.chat_template = chat_format(tokenizer, config.chat_template)  # `messages` -> prompt text
        self.eos_token_ids = eos_token_ids(config, self.model_config)
        # Structured outputs: the grammars of constrained requests, compiled on their own threads.
        self.grammars = grammar_service(config, self.model_config)
        self.limits = RequestLimits(self.model_config.vocab_size, config.max_tokens_limit,
                                    self.kv.max_request_positions())
        self.layout = self.deployment.layout
        # Several ranks: the workers start loading their shards while this rank loads its own.
        self.group = RankGroup.start(config, self.layout, worker_main) if self.layout.world_size > 1 else None
        try:
            self.model = load_model(config, self.deployment, self.device, self.dtype, self.layout,
                                    self.group.comm if self.group else Communicator())
            if self.group is not None:
                self.group.wait_ready()
            self.kernels = self.model.kernels
            sync = self.group.sync if self.group is not None else ALONE
            follows = self.group if self.group is not None and not self.layout.data_parallel else None
            # (the runner captures the decode steps' graphs: on a GPU, where memory may still run out)
            self.core = EngineCore(config, self.kv, make_runner(config, self.model, self.kv, follows, sync),
                                   self.kernels, self.grammars, send=self._send_all, rank=0, sync=sync,
                                   elsewhere=self._served_elsewhere)
        except BaseException as exc:  # (the workers, and the process group, go with this rank's failure)
            if self.group is not None:
                self.group.broken = self.group.broken or f"rank 0 failed to start: {exc}"
                self.group.close(timeout=5.0)
            self.grammars.close()
            raise
        self.unavailable: str | None = None  # why this instance can no longer serve (a rank is gone)
        self.num_rejected_queue_full = 0
        self.ranks = [DataParallelRank(r) for r in range(config.data_parallel_size)]
        self._placement_lock = threading.Lock()
        self._placed: dict[str, Placement] = {}  # live request -> where it went, and where its outputs go
        self._by_handle: dict[int, Placement] = {}  # the live requests other ranks serve, by their handle
        self._delivering = 0  # last outputs taken out of the placements, not yet handed to their consumers
        # One delivery at a time (rank 0's engine thread, the thread that takes in other ranks' outputs): a request's
        # outputs reach its consumer in the order they were looked up, none after its last. (Reentrant: a consumer
        # that aborts a request never waits on itself.)
        self._delivery_lock = threading.RLock()
        self._with_deadline: set[Placement] = set()  # those of them whose deadline rank 0 keeps, not yet passed
        # the other ranks' grammar compile times, not yet taken (bounded as a rank's own: `COMPILE_SECONDS_KEPT`)
        self._ranks_compile_seconds: deque[float] = deque(maxlen=COMPILE_SECONDS_KEPT)
        self._handles = itertools.count()
        # Prefix-cache affinity over ranks: a prompt's first cache block -> the rank last given a prompt starting so
        # (the rank whose cache may hold it), at most as many as the ranks' caches have entries.
        cache = self.kv.prefix_cache
        self._affinity_tokens = cache.block_tokens if cache is not None and len(self.ranks) > 1 else None
        self._affinity: OrderedDict[int, DataParallelRank] = OrderedDict()
        self._max_affinity = config.prefix_cache_entries * len(self.ranks)
        self._thread: threading.Thread | None = None
        self._froze_heap = False
        self._stop = threading.Event()
        self._local_stats = self.core.snapshot()
        self._receiver: threading.Thread | None = None
        if len(self.ranks) > 1:  # the other ranks' outputs, passed on as they come
            self._receiver = threading.Thread(target=self._receive_loop, name="dsv4-ranks", daemon=True)
            self._receiver.start()
        logger.info("engine ready: device=%s dtype=%s weights=%s kernels=%s overlap=%s capacity=%s bytes/token=%s "
                    "prefill_chunk_tokens=%d num_speculative_tokens=%d ranks=%d", self.device, self.dtype,
                    self.weight_format, self.kernels.mode, self.overlap, self.kv.capacity(), self.kv.bytes_per_token(),
                    self.scheduler.prefill_chunk_tokens, self.num_speculative_tokens, self.layout.world_size)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # Rank 0's engine, as the scripts and tests reach into it.
    scheduler = property(lambda self: self.core.scheduler)
    executor = property(lambda self: self.core.executor)
    runner = property(lambda self: self.core.runner)
    decode_graphs = property(lambda self: self.core.runner.graphs)
    overlap = property(lambda self: self.core.overlap)
    num_speculative_tokens = property(lambda self: self.core.num_speculative_tokens)

    # --- any thread ---------------------------------------------------------------------------------
    def submit(self, seq: Sequence, on_output: Callable[[RequestOutput], None]) -> None:
        """The admission gate: queue a request on the rank that will serve it, or raise ValueError with a message
        for the client.

        Checks what this deployment allows (RequestLimits: vocabulary, max_tokens_limit, the positions the memory
        can ever hold), the grammar (parsed here), and that the id is not in use; a full queue (max_queue_size, per
        rank) is refused with EngineUnavailable.
        """
        # (rank 0's core knows first: it fails its requests before this engine's step sees it, and a client that
        # got that failure may send its next request at once)
        unavailable = self.unavailable or self.core.unavailable
        if unavailable:
            raise EngineUnavailable(f"the model cannot serve: {unavailable}")
        self.limits.check(seq.prompt_ids, seq.sampling)
        stop_ids = frozenset(seq.sampling.stop_token_ids) | frozenset(
            () if seq.sampling.ignore_eos else self.eos_token_ids)
        placed = self._place(seq, on_output)
        try:
            added = self._queue(seq, stop_ids, placed)
        except BaseException:
            self._unplace(seq.request_id)
            raise
        if not added:
            self._unplace(seq.request_id)
            self.num_rejected_queue_full += 1
            limit = self.config.max_queue_size
            raise EngineUnavailable(f"the queue is full ({limit} requests waiting, max_queue_size); retry later")
        if self.core.sync.lock_step:  # every rank takes up its agreements again (backend/parallel/sync.py)
            self.core.sync.wake()
            self.group.links.wake_all(but=placed.rank.rank)
            self.scheduler.wake()

    def _queue(self, seq: Sequence, stop_ids: frozenset[int], placed: "Placement") -> bool:
        """Queue `seq` on its rank: rank 0's own scheduler, or the rank's process (whose queue rank 0 counts as the
        requests it sent there that have had no output yet)."""
        limit = self.config.max_queue_size
        if placed.rank.rank == 0:
            self.core.prepare(seq, stop_ids)
            seq.arrival_s = clock()  # (its deadline counts from here, not from the scheduler's next take-in)
            added = self.core.add(seq, max_waiting=limit)
            with self._placement_lock:
                placed.queued, cancelled = True, placed.cancelled_while_queued
            if added and cancelled:  # (an abort came while it was being prepared: it ends at the next step)
                self.core.abort(seq.request_id)
            return added
        if seq.sampling.guided_decoding is not None:  # refused here if invalid; the rank compiles it
            self.grammars.check(seq.sampling.guided_decoding)
        if limit is not None:  # (a look at every placement: only where a limit asks for it)
            with self._placement_lock:
                if sum(1 for p in self._by_handle.values() if p.rank is placed.rank and not p.num_output) > limit:
                    return False
        if seq.sampling.timeout_ms is not None:  # (rank 0 keeps it, by its clock: Arrival)
            placed.deadline_s = clock() + seq.sampling.timeout_ms / 1000.0
            with self._placement_lock:
                self._with_deadline.add(placed)
        sampling = replace(seq.sampling, timeout_ms=None)
        self.group.links.send(placed.rank.rank, Arrival(placed.handle, seq.request_id, seq.prompt_ids, sampling,
                                                        seq.priority, stop_ids))
        return True

    def abort(self, request_id: str) -> bool:
        with self._placement_lock:
            placed = self._placed.get(request_id)
        if placed is None:
            return False
        if placed.rank.rank == 0:
            with self._placement_lock:
                if not placed.queued:  # (still being prepared, a grammar parsed: `_queue` aborts it once queued)
                    placed.cancelled_while_queued = True
                    return True
            return self.core.abort(request_id)
        return self._end_elsewhere(placed, FinishReason.CANCELLED)

    def _end_elsewhere(self, placed: "Placement", reason: FinishReason) -> bool:
        """End another rank's request here, as its own scheduler would at its next step: from now on what the rank
        sends for it is dropped (the steps it ran before the Cancel reached it), and its last output, when the rank
        has freed it, carries `reason`. False if it had ended already."""
        with self._placement_lock:
            if placed.ending is not None or self._placed.get(placed.request_id) is not placed:
                return False
            placed.ending = reason
        self.group.links.send(placed.rank.rank, Cancel(placed.request_id, reason, placed.handle))
        return True

    def _expire_elsewhere(self) -> None:
        """Other ranks' requests past their deadline end (rank 0 keeps their deadlines: Arrival)."""
        if not self._with_deadline:  # (the common case, on every batch the ranks send: no look at the placements)
            return
        now = clock()
        with self._placement_lock:
            expired = [p for p in self._with_deadline if now >= p.deadline_s]
            self._with_deadline.difference_update(expired)
        for placed in expired:
            self._end_elsewhere(placed, FinishReason.TIMEOUT)

    def rank_of(self, request_id: str) -> int | None:
        """The data-parallel rank serving a live request (0 on one rank), or None."""
        with self._placement_lock:
            placed = self._placed.get(request_id)
        return placed.rank.rank if placed is not None else None

    def _place(self, seq: Sequence, on_output: Callable[[RequestOutput], None]) -> "Placement":
        """Where `seq` goes: the rank with the least load, counted in tokens (its live requests' prompts and
        max_tokens: what they will hold in memory and compute), so that the ranks' memory use and tokens per step
        stay balanced; but a prompt whose first prefix-cache block an earlier prompt started with goes where that
        one went (its cache may hold the prefix), unless that rank's load exceeds the least by more than this
        request's own. Raises ValueError if the id is live on any rank."""
        load = len(seq.prompt_ids) + seq.sampling.max_tokens
        block = self._affinity_tokens
        key = hash(tuple(seq.prompt_ids[:block])) if block and len(seq.prompt_ids) > block else None
        with self._placement_lock:
            if self.unavailable:  # (`_fail_everywhere` may have looked at the placements since submit() checked)
                raise EngineUnavailable(f"the model cannot serve: {self.unavailable}")
            if self._stop.is_set():  # (no loop would serve it, nor end it)
                raise EngineUnavailable(SHUTTING_DOWN)
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
            if not rank.load:  # (an idle rank may be silent: in lock-step, while every rank is idle, none sends)
                rank.heard_at = time.monotonic()
            rank.load += load
            placed = Placement(rank, load, on_output, seq.request_id, len(seq.prompt_ids), next(self._handles))
            self._placed[seq.request_id] = placed
            if rank.rank:
                self._by_handle[placed.handle] = placed
        return placed

    def _unplace(self, request_id: str) -> "Placement | None":
        with self._placement_lock:
            return self._unplace_locked(request_id)

    def _unplace_locked(self, request_id: str) -> "Placement | None":
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            placed.rank.load -= placed.load
            self._by_handle.pop(placed.handle, None)
            self._with_deadline.discard(placed)
        return placed

    def start(self) -> None:
        """Serve: the loop thread. What is alive now lives as long as the engine, so the collector stops walking it
        (backend/host_memory.py: a full collection of it held every running request ~100 ms now and then)."""
        if self._thread is None:
            if not self._froze_heap:
                logger.info("froze %d start-up objects out of the garbage collector's walks", freeze_start_up_heap())
                self._froze_heap = True
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop, the executor, the grammar threads and the worker ranks within `timeout` seconds in all: a
        step in flight ends first; threads that outlast the budget are left (they are daemons) rather than waited for
        (tritonserver kills a model that takes longer to unload than its exit timeout)."""
        deadline = time.monotonic() + timeout
        with self._placement_lock:  # (a submit placing a request now sees it, or its request is ended below)
            self._stop.set()
        self.scheduler.wake()
        quiet = True  # (no step still running on this rank: the workers may be told to stop)
        if self._thread is not None:
            self._thread.join(_left(deadline))
            quiet = not self._thread.is_alive()
            self._thread = None
        quiet = self.core.close(_left(deadline)) and quiet
        if self.group is not None and not quiet:  # (a Stop sent now could cross that step's messages)
            self.group.broken = self.group.broken or "shut down with a step still running"
        if quiet:  # (else the loop is still in a collective, with a rank that does not answer: the group ends them)
            self._end_lock_step()
        self.grammars.close()
        polling = False  # (a socket is not to be closed under a thread polling it: ZeroMQ's are not thread-safe)
        if self._receiver is not None:  # (it sees the stop within one poll of 0.1 s: it gets that, budget or not)
            self._receiver.join(max(_left(deadline), RECEIVER_STOP_S))
            polling = self._receiver.is_alive()
            self._receiver = None
        if self.group is not None:
            if polling:
                logger.warning("the data-parallel links stay open: the thread taking in the ranks' outputs still runs")
            self.group.close(_left(deadline), close_links=not polling)
            self.group = None
        self._end_unfinished()
        if self._froze_heap:  # (this engine's objects become collectable)
            thaw_heap()
            self._froze_heap = False

    def _end_unfinished(self) -> None:
        """Every request still placed gets its one final output, an error: no loop serves it any more."""
        with self._placement_lock:
            unfinished = list(self._placed.values())
        if unfinished:
            self._send_all([placed.failed(SHUTTING_DOWN) for placed in unfinished])

    def _end_lock_step(self) -> None:
        """Ranks in lock-step that are still agreeing (not all idle) leave their loops at one last agreement."""
        sync = self.core.sync
        if sync.lock_step and sync.ready() and not sync.broken:
            try:
                sync.agree(0, False, stop=True)
            except Exception:  # noqa: BLE001 (a broken group: its workers are terminated)
                logger.warning("the data-parallel ranks could not be told to stop; they are terminated")

    def stats(self) -> dict:
        """A snapshot of the counters and pool usage, safe to read from any thread: rank 0's as its engine thread
        left it after its latest step, the other data-parallel ranks' as they last sent theirs.

        With data parallelism: the ranks' counters, requests and prefix caches added up, pool usage the mean over the
        ranks (their pools are alike), and each rank's own under "ranks".
        """
        snapshots = [self._local_stats] + [rank.snapshot or _idle_snapshot(rank.rank, self._local_stats)
                                           for rank in self.ranks[1:]]
        counters = StepCounters.total([s["counters"] for s in snapshots])
        ranks = [{**{k: v for k, v in s.items() if k not in ("counters", "prefix_cache")},
                  "num_preemptions": s["counters"].num_preemptions, "load_tokens": rank.load}
                 for rank, s in zip(self.ranks, snapshots)]
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
            "prefix_cache": _added_up([s["prefix_cache"] for s in snapshots])
            if self.kv.prefix_cache is not None else None,
            # (each rank compiles its own requests' grammars; rank 0 only parses those of the others)
            "grammars": _added_up([self.grammars.stats()] + [s.get("grammars") for s in snapshots[1:]]),
        }

    def take_grammar_compile_seconds(self) -> list[float]:
        """Structured outputs: the grammar compile times recorded since the last call, on every rank (any thread)."""
        with self._placement_lock:
            elsewhere = list(self._ranks_compile_seconds)
            self._ranks_compile_seconds.clear()
        return self.grammars.take_compile_seconds() + elsewhere

    # --- offline use --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[dict]:
        """Submit every prompt at once (so they batch), run to completion on this thread (the outputs of other
        data-parallel ranks come in on their receiving thread meanwhile)."""
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
                    results[index]["error"] = out.error
                    results[index]["num_cached_tokens"] = out.num_cached_tokens
                    results[index]["finish_reason"] = out.finish_reason.value
            return on_output

        for i, (ids, p) in enumerate(zip(prompts, params)):
            seq = Sequence(f"offline-{i}-{time.monotonic_ns()}", list(ids), p)
            processor.add(seq.request_id, p)
            self.submit(seq, collect(i))
        unfinished = lambda: any(r["finish_reason"] is None for r in results)  # noqa: E731
        while unfinished():
            if not self.step() and unfinished():  # (a step with nothing to run may still end a request: a timeout)
                if not (self.scheduler.num_awaiting_grammar or self._served_elsewhere()) and unfinished():
                    raise RuntimeError("engine idle with unfinished requests")  # (asked again: one may end meanwhile)
                self._wait_for_work(timeout=0.05)  # a grammar being compiled, or other ranks' requests
        self.drain()
        return results

    def drain(self) -> None:
        """Run until nothing is in flight or left to do: the step launched for requests that have ended, the aborts
        of requests that stopped at a stop string (offline use, on the caller's thread)."""
        while self.step():
            pass

    def _served_elsewhere(self) -> bool:
        """Whether another rank serves a request still, or its last output is on its way to the consumer."""
        with self._placement_lock:
            return bool(self._by_handle) or self._delivering > 0

    # --- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.step():
                    self._wait_for_work(timeout=0.1)
            except Exception:  # keep serving: the step's own failures were reported to its requests
                logger.exception("engine step failed")

    def _wait_for_work(self, timeout: float) -> bool:
        """Until rank 0 has work, or, in lock-step, a request placed on another rank woke the ranks' agreements."""
        sync = self.core.sync
        return self.scheduler.wait_for_work(timeout, also=sync.ready if sync.lock_step else None)

    def step(self) -> bool:
        """One iteration of rank 0's engine (EngineCore.step); False when there was nothing to do."""
        went_on = self.core.step()
        if self.core.unavailable and not self.unavailable:  # its group broke: no rank can serve
            self._fail_everywhere(self.core.unavailable)
        self._local_stats = self.core.snapshot()
        return went_on

    # --- outputs --------------------------------------------------------------------------------------
    def _send_all(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their requests' consumers (a request's last: its placement ends), under one look at the
        placements, one call at a time."""
        with self._delivery_lock:
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._placement_lock:
            placements = [self._unplace_locked(out.request_id) if out.finished else self._placed.get(out.request_id)
                          for out in outputs]
            delivering = sum(1 for out, placed in zip(outputs, placements) if out.finished and placed is not None)
            self._delivering += delivering  # (unplaced, not yet delivered: still served, for _served_elsewhere)
        try:
            for output, placed in zip(outputs, placements):
                if placed is None:  # (failed here already)
                    continue
                try:
                    placed.on_output(output)
                except Exception:  # a broken consumer must not take the engine down
                    logger.exception("on_output callback failed for request %r", output.request_id)
        finally:
            with self._placement_lock:
                self._delivering -= delivering

    def _receive_loop(self) -> None:
        """The other data-parallel ranks' outputs (and stats), passed on as they come; a rank gone fails every
        request and the engine refuses later ones."""
        links, next_check = self.group.links, 0.0
        while not self._stop.is_set():
            batch = links.receive(timeout_s=0.1)
            self._expire_elsewhere()
            links.flush()  # (what a rank's full inbox refused, as far as it takes messages again)
            if batch is not None:
                self._take_outputs(batch)
            if time.monotonic() >= next_check:  # (on a clock: the other ranks' outputs may never pause)
                next_check = time.monotonic() + 0.1
                if self.group is not None and self.group.check():
                    self._fail_everywhere(self.group.broken)
                    return
                gone = links.gone()
                if gone and not self._stop.is_set():  # (at a shutdown the ranks leave as told)
                    self._fail_everywhere(f"data-parallel rank {gone[0]} is gone: its connection to rank 0 dropped "
                                          "(its process exited or was killed)")
                    return
                silent = self._silent_rank()
                if silent is not None:
                    self._fail_everywhere(silent)
                    return

    def _silent_rank(self) -> str | None:
        """Why another rank is taken for hung: requests are placed on it and it has sent nothing for
        collective_timeout_s (a rank at work sends its stats every STATS_EVERY_S, its outputs every step; a rank whose
        process died is the group's check on this node, and its dropped connection on any). Without expert
        parallelism the ranks meet in no collective that would time out, and its requests, cancels included, would
        wait forever."""
        limit, now = self.config.collective_timeout_s, time.monotonic()
        with self._placement_lock:
            rank = next((r for r in self.ranks[1:] if r.load and now - r.heard_at > limit), None)
        if rank is None:
            return None
        return (f"data-parallel rank {rank.rank} sent nothing for {now - rank.heard_at:.0f} s with requests on it "
                f"(collective_timeout_s={limit:g})")

    def _take_outputs(self, batch: OutputBatch) -> None:
        """Another rank's outputs of a step, as the requests' RequestOutputs."""
        self.ranks[batch.rank].heard_at = time.monotonic()
        if batch.stats is not None:
            with self._placement_lock:  # (the compile times until take_grammar_compile_seconds)
                if not self.unavailable:  # (once failed, its stats stay what `_fail_everywhere` left)
                    self.ranks[batch.rank].snapshot = batch.stats
                self._ranks_compile_seconds.extend(batch.stats.get("grammar_compile_seconds", []))
        rows = list(batch.rows())
        with self._placement_lock:
            placements = [self._by_handle.get(row[0]) for row in rows]
        outputs = []
        for placed, (_, tokens, reason, cached, error, logprobs) in zip(placements, rows):
            if placed is None:  # (failed here already)
                continue
            if placed.ending is not None:  # ended here: only the rank's word that it let go of it passes
                if reason is None:
                    continue
                tokens, reason, error, logprobs = [], placed.ending, None, None
            placed.num_output += len(tokens)
            outputs.append(RequestOutput(placed.request_id, tokens, "", reason is not None, reason,
                                         placed.num_input, placed.num_output, error, logprobs, cached))
        self._send_all(outputs)
        self.scheduler.wake()  # (generate() may wait for these)

    def _fail_everywhere(self, reason: str) -> None:
        """A rank is gone: every live request ends with an error (rank 0's at its next step, the others' now), the
        surviving ranks stop, later requests are refused."""
        with self._placement_lock:
            if self.unavailable:
                return
            self.unavailable = reason
        self.core.fail_all(reason)
        with self._placement_lock:
            elsewhere = list(self._by_handle.values())
        self._send_all([placed.failed(reason) for placed in elsewhere])
        with self._placement_lock:  # (what they last sent would stay in the gauges: nothing runs there any more)
            for rank in self.ranks[1:]:
                if rank.snapshot is not None:
                    rank.snapshot = _stopped_snapshot(rank.snapshot)
        if self.group is not None and self.group.links is not None:
            self.group.links.stop_all()
        self.scheduler.wake()


@dataclass(eq=False)
class DataParallelRank:
    """One data-parallel rank as rank 0 sees it: the load placed on it and (another rank's) its latest stats."""

    rank: int
    load: int = 0  # tokens of its live requests (prompt + max_tokens), under the engine's placement lock
    snapshot: dict | None = None  # EngineCore.snapshot() as the rank last sent it
    heard_at: float = 0.0  # (another rank) when it last sent anything, or got requests while idle (time.monotonic)


@dataclass(eq=False, slots=True)
class Placement:
    """A live request as the engine placed it: its rank, the load it counts there, where its outputs go; for another
    rank's request, what its outputs need from here."""

    rank: DataParallelRank
    load: int
    on_output: Callable[[RequestOutput], None]
    request_id: str
    num_input: int
    handle: int
    num_output: int = field(default=0)
    deadline_s: float | None = None  # another rank's request with timeout_ms: when it passes, by clock()
    ending: FinishReason | None = None  # another rank's request ended here (_end_elsewhere), its rank not yet told
    queued: bool = False  # a request of rank 0's own: its scheduler has it (aborts go there)
    cancelled_while_queued: bool = False  # a request of rank 0's own aborted before it was queued

    def failed(self, error: str) -> RequestOutput:
        """The request's final output when the engine ends it with `error` (no step of its reports it)."""
        return RequestOutput(self.request_id, [], "", True, FinishReason.ERROR, self.num_input, self.num_output, error,
                             None, 0)


RECEIVER_STOP_S = 0.5  # what the thread taking in other ranks' outputs gets to end, past a shutdown's budget


def _idle_snapshot(rank: int, like: dict) -> dict:
    """A rank that has sent no stats yet: nothing running, nothing used (its pools are like rank 0's), nothing
    counted."""
    return {**_stopped_snapshot(like), "rank": rank, "counters": StepCounters(), "num_steps": 0, "prefix_cache": None}


def _stopped_snapshot(snapshot: dict) -> dict:
    """A rank's last stats once the engine failed: its counts kept (the metrics' counters never go back), nothing
    running, waiting, used or cached any more."""
    cache = snapshot["prefix_cache"]
    return {**snapshot, "num_running": 0, "num_waiting": 0, "pages_held_by_requests": None,
            "pool_usage": {pool: 0.0 for pool in snapshot["pool_usage"]},
            "pages_used": {pool: 0 for pool in snapshot["pages_used"]},
            "prefix_cache": cache and {**cache, "entries": 0, "pages": {pool: 0 for pool in cache["pages"]}}}


def _added_up(stats: list[dict | None]) -> dict:
    """Data-parallel ranks' counts added up key by key, nested dicts too (the prefix caches' and the grammar services'
    stats: each rank has its own; a rank yet to send its own counts nothing)."""
    present = [s for s in stats if s is not None]
    return {key: _added_up([s[key] for s in present]) if isinstance(value, dict) else sum(s[key] for s in present)
            for key, value in present[0].items()}


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
