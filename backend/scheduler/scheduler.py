"""The iteration-level scheduler: who gets tokens in the next forward.

One step is one engine forward over a ragged batch. The engine drives the scheduler like this:

    plan = scheduler.schedule(now=time.monotonic())     # StepPlan, or None: no work at all
    if plan is None:
        scheduler.wait_for_work(timeout)                # woken by add() / abort()
        continue
    send final responses for plan.aborted               # cancelled or failed by the scheduler
    if plan.chunks:
        forward over plan.chunks; for each chunk advance seq.num_computed_tokens by num_tokens,
        and where chunk.samples, append the sampled token to seq.output_ids
        scheduler.on_step_done(plan, duration_s=..., finished=[seqs that finished])

Ownership (the token accounting rule itself is in backend/request.py):
- The scheduler owns the waiting queue, the running set and the decision of each step, and every
  page decision: it allocates the pages a step needs (`memory.extend`) while building the plan,
  releases window pages that slid out after the step (`on_step_done`), frees a sequence's pages
  when it leaves the running set (`seq.finish()`), and on preemption resets
  `num_computed_tokens` to 0.
- The ENGINE advances `seq.num_computed_tokens` and appends to `seq.output_ids`, before calling
  `on_step_done`; the scheduler never touches token lists. `on_step_done` checks the advance.
- What a step carries is the policy's choice (backend/scheduler/policies.py), and how many
  prefill tokens it may take the budget's.

Admission is strictly in queue order (a head that does not fit blocks the queue rather than being
overtaken). The order is by priority with aging: the key is priority * priority_aging_s + arrival
time (lower first; ties in arrival order), so one priority level is worth priority_aging_s seconds of
waiting, and a request is never overtaken by one that arrived more than (its priority - the other's)
* priority_aging_s later: under any stream of better-priority arrivals its wait is bounded
(priority_aging_s 0: strict priority, FCFS within a priority, and no such bound). Memory shortage: a decode that cannot extend preempts the most
recently admitted running sequence (recompute: pages freed, num_computed_tokens = 0, requeued at
the front of its priority); a prefill continuation takes a smaller chunk or waits. A sequence
that cannot extend while running alone is failed (FinishReason.ERROR) instead of retried forever.
Deadlines: a request with `timeout_ms` that has not finished that long after it arrived ends, waiting
or running, at the next schedule() with FinishReason.TIMEOUT (its pages freed).
Sequences the scheduler ends (cancelled, timed out or failed) come back in `plan.aborted`.
Whether a request can ever fit is the engine's admission gate (RequestLimits); the scheduler
only guards against a memory manager that contradicts it.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol

from backend.request import FinishReason, Sequence, SequenceStatus
from backend.scheduler.cost_model import StepCostModel, StepFeatures
from backend.scheduler.plan import ScheduledChunk, StepPlan
from backend.scheduler.policies import FixedBudget, ItlTargetBudget, make_policy
from backend.scheduler.step_record import StepCounters, StepKind, StepLog, StepRecord

if TYPE_CHECKING:
    from backend.config import EngineConfig

logger = logging.getLogger(__name__)

# Prefill progress floor under an ITL target (clamped to the chunk budget).
MIN_PREFILL_CHUNK_TOKENS = 16


class MemoryManager(Protocol):
    """The paged memory as the scheduler sees it (implemented by backend.memory.kv_manager).

    Called from the engine thread only. `can_extend(seq, n)` must be monotone in n (if n tokens
    fit, fewer fit too).
    """

    def has_free_slot(self) -> bool:
        """A per-request compressor-state slot is free."""

    def can_extend(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Pages exist for positions [seq.num_computed_tokens, + num_new_tokens)."""

    def extend(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate them (the first call also takes a slot); raises page_allocator.OutOfPages.

        The pages are held by `seq.pages`, a handle whose `release()` gives all of them back: the
        scheduler frees a request with `seq.release_pages()` (preemption) or `seq.finish()`.
        """

    def release_slid_out(self, seq: Sequence) -> None:
        """After a forward: drop the window pages no later token of `seq` reads."""

    def usage(self) -> dict[str, float]:
        """Pool name -> fraction of its pages in use."""


@dataclass
class _Inflight:
    plan: StepPlan
    record: StepRecord
    features: StepFeatures


class Scheduler:
    """Owns the waiting queue, the running set and chunked-prefill progress; plans each step.

    `config` is a validated EngineConfig (policy, decode_interleave_every, itl_target_ms,
    max_running_requests, max_num_batched_tokens, step_log); `prefill_chunk_tokens` is the resolved
    chunk budget (policies.resolve_prefill_chunk_tokens).

    Threads: `add`, `abort`, `has_work`, `wait_for_work`, `wake` and the `num_*` properties may
    be called from any thread; everything else from the engine thread only. Requests added or
    aborted from other threads take effect at the next `schedule()` call.
    """

    def __init__(self, config: "EngineConfig", memory: MemoryManager, prefill_chunk_tokens: int, *,
                 cost_model: StepCostModel | None = None, step_history: int = 10_000,
                 min_prefill_chunk_tokens: int = MIN_PREFILL_CHUNK_TOKENS):
        if not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be a positive integer, got {prefill_chunk_tokens!r}")
        self.memory = memory
        self.max_running_requests = config.max_running_requests
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.priority_aging_s = config.priority_aging_s
        self.prefix_cache = getattr(memory, "prefix_cache", None)  # backend/memory/prefix_cache.py, or None
        self.cost_model = cost_model or StepCostModel()
        self.policy = make_policy(config)
        if config.itl_target_ms is None:
            self.budget = FixedBudget(prefill_chunk_tokens)
        else:
            self.budget = ItlTargetBudget(config.itl_target_ms, self.cost_model, min_prefill_chunk_tokens,
                                          prefill_chunk_tokens)
        self.records: deque[StepRecord] = deque(maxlen=step_history)
        self.counters = StepCounters()
        self._step_log = StepLog(config.step_log) if config.step_log else None
        # Engine-thread state.
        self._waiting: list[Sequence] = []  # sorted by (priority, queue_rank)
        self._running: list[Sequence] = []  # in admission order: the last is the preemption victim
        self._back_ranks = itertools.count()
        self._front_ranks = itertools.count(-1, -1)
        self._inflight: _Inflight | None = None
        self._next_step_index = 0
        # Shared with other threads, under _lock.
        self._lock = threading.Lock()
        self._work_changed = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._abort_requests: set[str] = set()
        self._live_ids: set[str] = set()  # every request added and not finished: ids are unique among them

    # --- any thread ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError if it is not fresh or its id is in use."""
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.output_ids:
            raise ValueError(f"request {seq.request_id!r}: only fresh sequences can be added")
        with self._lock:
            if seq.request_id in self._live_ids:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self._live_ids.add(seq.request_id)
            self._inbox.append(seq)
            self._work_changed.notify_all()

    def abort(self, request_id: str) -> bool:
        """Ask to cancel a request; takes effect at the next schedule(), which reports it in plan.aborted.

        Returns False when no such request is live (unknown, or already finished).
        """
        with self._lock:
            if request_id not in self._live_ids:
                return False
            self._abort_requests.add(request_id)
            self._work_changed.notify_all()
            return True

    def abort_all(self) -> None:
        """abort() every live request (the engine can no longer run a step)."""
        with self._lock:
            self._abort_requests.update(self._live_ids)
            self._work_changed.notify_all()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._inbox) + len(self._waiting)

    def has_work(self) -> bool:
        """Anything to schedule: queued or running requests, or aborts to report."""
        with self._lock:
            return self._has_work_locked()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until has_work() (add/abort from another thread) or timeout; returns has_work()."""
        with self._work_changed:
            return self._work_changed.wait_for(self._has_work_locked, timeout)

    def wake(self) -> None:
        """Wake wait_for_work() callers, e.g. so that the engine loop notices a shutdown."""
        with self._work_changed:
            self._work_changed.notify_all()

    def _has_work_locked(self) -> bool:
        return bool(self._inbox or self._abort_requests or self._waiting or self._running)

    # --- engine thread ------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan | None:
        """Decide the next step and allocate its pages.

        Returns None when there is no work at all, a plan without chunks when there is only
        aborted sequences to report, otherwise a forward plan; the engine must call
        on_step_done(plan, ...) before the next schedule().
        """
        if self._inflight is not None:
            raise RuntimeError(f"schedule() called before on_step_done() for step {self._inflight.plan.step_index}")
        now = time.monotonic() if now is None else now
        plan = StepPlan()
        self._take_arrivals_and_aborts(plan, now)
        self._build(plan)
        if not plan.chunks:
            return plan if plan.aborted else None
        self._commit(plan, now)
        return plan

    def on_step_done(self, plan: StepPlan, duration_s: float, finished: Iterable[Sequence] = (),
                     forward_failed: bool = False) -> None:
        """The engine ran `plan`, advanced num_computed_tokens, and reports the sequences that finished.

        Finished sequences leave the running set and their memory is freed (the engine sets
        finish_reason; the scheduler finishes them); the others give back the window pages they
        moved past. `duration_s` feeds the step-cost model and the step record, which is then
        written to the step log. `forward_failed`: the forward raised (every chunk's request is in
        `finished`, with an error); nothing it may have half-written is kept by the prefix cache.
        """
        finished = list(finished)
        if plan.step_index is None:  # a report-only plan: nothing ran
            if finished:
                raise ValueError("a plan without chunks cannot finish sequences")
            return
        if self._inflight is None or plan is not self._inflight.plan:
            raise RuntimeError(f"on_step_done() for step {plan.step_index}, which is not the step in flight")
        self._check_advanced(plan, finished)
        if self.prefix_cache is not None:
            self._keep_prefixes(plan, finished, forward_failed)
        for seq in finished:
            self._retire(seq)
        for chunk in plan.chunks:
            if not chunk.seq.is_finished:
                self.memory.release_slid_out(chunk.seq)
        inflight, self._inflight = self._inflight, None
        inflight.record.duration_s = duration_s
        self.cost_model.observe(inflight.features, duration_s)
        if self._step_log is not None:
            self._step_log.write(inflight.record)

    def _keep_prefixes(self, plan: StepPlan, finished: list[Sequence], forward_failed: bool) -> None:
        """The states the step reached at block boundaries (inside its chunks and where they end), and where
        requests ended."""
        cache = self.prefix_cache
        if forward_failed:
            for chunk in plan.chunks:
                cache.release_reserved(chunk.snapshots)
            return
        for chunk in plan.chunks:
            cache.keep_reserved(chunk.seq, chunk.snapshots)
            cache.register(chunk.seq)
        for seq in finished:
            cache.register_end(seq)

    def close(self) -> None:
        """Close the step log."""
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None

    # --- arrivals, aborts, retirement ---------------------------------------------------------

    def _take_arrivals_and_aborts(self, plan: StepPlan, now: float) -> None:
        with self._lock:
            arrivals, self._inbox = self._inbox, []
            aborts, self._abort_requests = self._abort_requests, set()
        for seq in arrivals:
            seq.arrival_s = now
            self._enqueue(seq, front=False)
        if aborts:
            for seq in [s for s in self._running + self._waiting if s.request_id in aborts]:
                self._end(plan, seq, FinishReason.CANCELLED)
        for seq in [s for s in self._running + self._waiting if _past_deadline(s, now)]:
            self._end(plan, seq, FinishReason.TIMEOUT)  # its pages are freed; the tokens it got were streamed

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Insert into waiting by `_waiting_key`; `front` (a preempted request) goes before its equals."""
        seq.queue_rank = next(self._front_ranks if front else self._back_ranks)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self._waiting, seq, key=self._waiting_key)

    def _waiting_key(self, seq: Sequence) -> tuple:
        """Admission order: priority aged by waiting time (see the module docstring), then queue rank."""
        if not self.priority_aging_s:  # 0 or None: strict priority
            return seq.priority, seq.queue_rank
        return seq.priority * self.priority_aging_s + seq.arrival_s, seq.queue_rank

    def _end(self, plan: StepPlan, seq: Sequence, reason: FinishReason) -> None:
        """The scheduler finishes `seq` itself (cancelled, or cannot fit); reported in plan.aborted."""
        if seq in self._waiting:
            self._waiting.remove(seq)
        seq.finish_reason = reason
        self._retire(seq)
        plan.aborted.append(seq)
        if reason is FinishReason.CANCELLED:
            self.counters.num_cancelled += 1
        elif reason is FinishReason.TIMEOUT:
            self.counters.num_timed_out += 1
        else:
            self.counters.num_failed += 1

    def _retire(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            raise ValueError(f"request {seq.request_id!r} finished but is not in the running set")
        seq.finish()
        with self._lock:
            self._live_ids.discard(seq.request_id)
            self._abort_requests.discard(seq.request_id)

    def _check_advanced(self, plan: StepPlan, finished: list[Sequence]) -> None:
        done = set(finished)
        for chunk in plan.chunks:
            if chunk.seq not in done and chunk.seq.num_computed_tokens != chunk.end:
                raise RuntimeError(
                    f"request {chunk.seq.request_id!r}: num_computed_tokens is {chunk.seq.num_computed_tokens}, "
                    f"expected {chunk.end}; the engine advances it before on_step_done()")

    # --- building a step ----------------------------------------------------------------------

    def _build(self, plan: StepPlan) -> None:
        """Fill plan.chunks by the policy; if memory blocks every candidate, free memory and retry.

        Each retry preempts or fails at least one sequence, so the loop is bounded.
        """
        for _ in range(len(self._running) + len(self._waiting) + 1):
            self.policy.build(self, plan)
            if plan.chunks or not (self._running or self._waiting):
                return
            if self._running:
                self._make_room(plan, self._running[0], 1)  # the oldest request must progress
            else:
                # Admission failed in an empty engine: the memory contradicts the admission gate.
                self._end(plan, self._waiting[0], FinishReason.ERROR)
                logger.warning("request %r failed: it does not fit in an empty engine", plan.aborted[-1].request_id)

    # Building blocks of the policies.

    def has_running_decode(self) -> bool:
        return any(seq.is_decode for seq in self._running)

    def schedule_decodes(self, plan: StepPlan) -> None:
        """One token for each running decode, oldest first, preempting the newest on memory shortage."""
        for seq in list(self._running):
            if plan.num_tokens >= self.max_num_batched_tokens:
                return
            if seq in self._running and seq.is_decode and not plan.has_chunk(seq):
                if self._make_room(plan, seq, 1):
                    self._add_chunk(plan, seq, 1)

    def schedule_prefills(self, plan: StepPlan, budget: int) -> None:
        """Running prefills in admission order, then admissions from waiting, up to `budget` tokens.

        A running prefill short of memory gets a smaller chunk, or none this step: it does not
        preempt anyone (decodes do; and _build frees memory if nothing at all can run).
        """
        left = budget
        for seq in list(self._running):
            if left <= 0:
                return
            if seq.is_prefill and not plan.has_chunk(seq):
                num_tokens = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, left))
                if num_tokens:
                    self._add_chunk(plan, seq, num_tokens)
                    left -= num_tokens
        self._admit(plan, left)

    def prefill_budget(self, plan: StepPlan) -> int:
        """Prefill tokens allowed in this step, given the chunks already in `plan`."""
        return self.budget.tokens(plan, self._next_prefill_candidate(plan))

    def _next_prefill_candidate(self, plan: StepPlan) -> Sequence | None:
        for seq in self._running:
            if seq.is_prefill and not plan.has_chunk(seq):
                return seq
        return self._waiting[0] if self._waiting else None

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Move waiting requests to running, strictly in queue order (no skipping a blocked head)."""
        if plan.preempted and self._running:
            return  # do not re-admit what this step just evicted while others still hold memory
        left = budget
        while left > 0 and self._waiting and self._can_admit_another():
            seq = self._waiting[0]
            restored = self._restore_prefix(seq)
            cached = seq.num_computed_tokens if restored else 0
            num_tokens = min(seq.num_uncomputed_tokens, left)
            if not self._fits(seq, num_tokens):
                if restored:  # it waits holding nothing, like every waiting request
                    seq.release_pages()
                    seq.num_computed_tokens = 0
                return
            self._waiting.pop(0)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            if self.prefix_cache is not None:
                plan.num_cached_tokens += cached
                self.prefix_cache.record_admission(seq.num_tokens, cached)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            self._add_chunk(plan, seq, num_tokens)
            left -= num_tokens

    def _restore_prefix(self, seq: Sequence) -> bool:
        """Start `seq` after the longest cached prefix of its tokens (prefix caching); True when it did."""
        if self.prefix_cache is None or seq.num_computed_tokens or seq.pages is not None:
            return False
        entry = self.prefix_cache.lookup(seq)
        return entry is not None and self.prefix_cache.restore(seq, entry)

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """can_extend, evicting prefix-cache entries first when they hold the pages it needs."""
        if self.memory.can_extend(seq, num_tokens):
            return True
        return self.prefix_cache is not None and self.memory.evict_cached_until(
            lambda: self.memory.can_extend(seq, num_tokens))

    def _can_admit_another(self) -> bool:
        return len(self._running) < self.max_running_requests and self.memory.has_free_slot()

    def _fit_chunk(self, seq: Sequence, num_tokens: int) -> int:
        """The largest chunk <= num_tokens whose pages exist (can_extend is monotone); 0 if none."""
        if self._fits(seq, num_tokens):
            return num_tokens
        lo, hi = 0, num_tokens  # invariant: lo fits (0 trivially), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.memory.can_extend(seq, mid) else (lo, mid)
        return lo

    def _make_room(self, plan: StepPlan, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the newest running sequences without a chunk until `seq` can extend.

        Returns False when `seq` itself was the newest (it is preempted) or is alone and still
        cannot extend (it is failed with ERROR rather than retried forever).
        """
        while not self._fits(seq, num_tokens):  # cached-only pages go before any request is preempted
            victim = next(s for s in reversed(self._running) if not plan.has_chunk(s))
            if victim is seq and len(self._running) == 1:
                self._end(plan, seq, FinishReason.ERROR)
                logger.warning("request %r failed: it cannot extend by %d tokens even alone", seq.request_id,
                               num_tokens)
                return False
            self._preempt(plan, victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        """Recompute preemption: free everything, requeue at the front; outputs stay in seq.output_ids."""
        self._running.remove(seq)
        seq.release_pages()
        seq.num_computed_tokens = seq.last_chunk_tokens = 0
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._enqueue(seq, front=True)
        plan.preempted.append(seq)
        logger.debug("preempted request %r (%d tokens to recompute)", seq.request_id, seq.num_tokens)

    def _add_chunk(self, plan: StepPlan, seq: Sequence, num_tokens: int) -> None:
        self.memory.extend(seq, num_tokens)
        start, is_decode = seq.num_computed_tokens, seq.is_decode
        if not is_decode:
            seq.last_chunk_tokens = num_tokens
        plan.add(ScheduledChunk(seq, num_tokens, start, is_decode=is_decode, samples=start + num_tokens == seq.num_tokens))

    # --- bookkeeping --------------------------------------------------------------------------

    def _commit(self, plan: StepPlan, now: float) -> None:
        plan.step_index = self._next_step_index
        self._next_step_index += 1
        if self.prefix_cache is not None:  # the block boundaries inside prefill chunks, snapshotted by the step
            for chunk in plan.chunks:
                if not chunk.is_decode:
                    chunk.snapshots = self.prefix_cache.reserve(chunk.seq, chunk.start, chunk.end)
        plan.kind = StepKind.of(plan.num_prefill_tokens, plan.num_decode_tokens)
        features = StepFeatures.of(plan.chunks)
        plan.predicted_s = self.cost_model.predict(features)
        record = StepRecord(
            step_index=plan.step_index,
            kind=plan.kind,
            time=now,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_decode_tokens=plan.num_decode_tokens,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preempted=len(plan.preempted),
            num_aborted=len(plan.aborted),
            decode_stalled=any(seq.is_decode and not plan.has_chunk(seq) for seq in self._running),
            pool_usage=dict(self.memory.usage()),
            predicted_s=plan.predicted_s,
            itl_infeasible=plan.itl_infeasible,
            num_cached_tokens=plan.num_cached_tokens,
        )
        self.counters.observe(record)
        self.policy.on_step(plan.kind)
        self.records.append(record)
        self._inflight = _Inflight(plan, record, features)


def _past_deadline(seq: Sequence, now: float) -> bool:
    timeout_ms = seq.sampling.timeout_ms
    return timeout_ms is not None and (now - seq.arrival_s) * 1000.0 >= timeout_ms
