"""The iteration-level scheduler: who gets tokens in the next forward, and the owner of token accounting.

One step is one engine forward over a ragged batch. The engine drives the scheduler like this:

    plan = scheduler.schedule(now=time.monotonic())     # StepPlan, or None: nothing to schedule now
    send final responses for plan.aborted               # cancelled, timed out or failed by the scheduler
    if plan.chunks:
        run the forward and the sampler over plan.chunks (asynchronously): a StepOutput
    ... later, in step order:
    outputs = scheduler.update_from_output(plan, output)   # one RequestOutput per request the step advanced
    send each; the finished ones are the requests' final responses

With overlap (`max_steps_in_flight=2`) the engine schedules step N+1 before step N's output is in:
the scheduler counts the tokens step N samples as placeholders (`Sequence.num_placeholders`), so a
request that sampled in step N decodes in step N+1 with a token that only the device knows yet. What
the output then says (a stop token, max_tokens) is learnt one step late: a request that ended in step N
may have a decode in step N+1, whose token is dropped (never streamed); a request whose sampled tokens
already reach max_tokens gets no further step.

Ownership (the token accounting rule itself is in backend/request.py):
- The scheduler owns the waiting queue, the running set, the decision of each step, and every
  token count: it advances `num_computed_tokens` when it commits a step and appends each sampled
  token when the step's output comes in (`update_from_output`), where it also decides the stops
  that need no text (stop token ids, max_tokens; stop strings are the output processor's, which
  aborts the request).
- Every page decision is the scheduler's too: it allocates the pages a step needs while building the
  plan (which first releases the window pages the request's window slid past), frees a sequence's
  memory (`memory.free`) when it leaves the running set, and on preemption resets `num_computed_tokens`
  to 0.
  Freeing while a later step is in flight is safe: steps run in order on one stream (or the executor's
  one thread), so a page given to another request is written only after the steps that read it.
- What a step carries is the policy's choice (backend/scheduler/policies.py), and how many
  prefill tokens it may take the budget's.

Admission is strictly in queue order (a head that does not fit blocks the queue rather than being
overtaken; so does a preempted head whose last token is still in flight, for one step). The order is by
priority with aging: the key is priority * priority_aging_s + arrival time (lower first; ties in arrival
order), so one priority level is worth priority_aging_s seconds of waiting, and a request is never
overtaken by one that arrived more than (its priority - the other's) * priority_aging_s later: under any
stream of better-priority arrivals its wait is bounded (priority_aging_s 0: strict priority, FCFS within a
priority, and no such bound). Memory shortage: a decode that cannot extend preempts the running sequence
latest in that order (the worst priority, then the latest arrival; itself, if that is it), never a more urgent one
for a less urgent one (recompute: memory freed, num_computed_tokens = 0, requeued at the front of its priority,
admitted again once all it held fits beside the running requests); a prefill continuation takes a smaller chunk
or waits (so does the first chunk of a request admitted into an empty engine). A sequence that cannot extend while
running alone waits for the take-in of a step in flight (whose prefix-cache snapshots pin pages until then); with
none, it is failed (FinishReason.ERROR) instead of retried forever.
Deadlines: a request with `timeout_ms` that has not finished that long after it arrived (`Sequence.arrival_s`: its
submission to the engine) ends, waiting or running, at the next schedule() with FinishReason.TIMEOUT (its memory
freed).
Sequences the scheduler ends at schedule() (cancelled, timed out or failed) come back in `plan.aborted`.
Whether a request can ever fit is the engine's admission gate (RequestLimits); the scheduler
only guards against a memory manager that contradicts it.

Speculative decoding (backend/speculative.py): a decode whose request has draft tokens is a verify chunk, its last
token and the drafts (all k of them while the pools hold their positions: the take-in keeps no more tokens than
max_tokens allows), with pages for the draft chain after them; its output may
emit several tokens, each checked for a stop, and `_settle_verify` moves the request's position back past the
rejected drafts (a pointer move: nothing they wrote is read before it is written again). A verify in flight counts
1 + k placeholders (what it emits at most). With overlap, where the step in flight leaves its rows' next tokens and
drafts on the device (`StepPlan.chains_on_device`), each of its rows gets the next verify at once, as if every draft
were accepted (`ScheduledChunk.optimistic`: its tokens and drafts are read on the device); when the take-in shows a
row accepted fewer, that next chunk is void (`_void_successor`: its placeholders retired, its output dropped, its
positions given up like rejected drafts'), and the row's next verify starts where it stands.

Structured outputs: an arrival with a grammar (`seq.grammar`) waits aside until it is compiled (off the engine
thread), then joins the waiting queue; a grammar that failed to compile ends it with its message (`seq.error`).
Requests without one never wait for it. A step's output may end a request by its grammar (`output.ends`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from backend.request import FinishReason, RequestOutput, Sequence, SequenceStatus
from backend.scheduler.cost_model import StepCostModel, StepFeatures
from backend.scheduler.plan import ScheduledChunk, StepOutput, StepPlan
from backend.scheduler.policies import FixedBudget, ItlTargetBudget, make_policy
from backend.scheduler.step_record import StepCounters, StepKind, StepLog, StepRecord, mean_accepted_length

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

    def try_extend(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Allocate them (the first call also takes a slot), all or nothing; False when they do not exist.
        Window pages before the window of seq.num_computed_tokens are released first.

        The pages are held by `seq.pages`, which `free(seq)` gives back.
        """

    def free(self, seq: Sequence) -> None:
        """Give back everything `seq` holds (idempotent)."""

    def release_slid_out(self, seq: Sequence, next_pos: int) -> None:
        """`seq` computes from `next_pos` on: drop the window pages no later token reads (try_extend does it too)."""

    def evict_cached_until(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Evict prefix-cache entries until `seq`'s next tokens fit (none where they could not); whether they do."""

    def evictable_pages(self) -> object:
        """The pages only prefix-cache entries hold (what evicting them all would free), for can_extend_evicting."""

    def can_extend_evicting(self, seq: Sequence, num_new_tokens: int, evictable: object) -> bool:
        """can_extend, counting `evictable` (evictable_pages(), nothing changed since) as free; evicts nothing;
        monotone in n."""

    def usage(self) -> dict[str, float]:
        """Pool name -> fraction of its pages in use."""

    def max_request_positions(self) -> int:
        """The most positions one request may hold (the admission gate's capacity rule)."""


class PrefixCacheHooks(Protocol):
    """What the scheduler asks of the prefix cache (backend/memory/prefix_cache.py; `NoPrefixCache` when off)."""

    block_tokens: int | None  # its blocks' length: only a chunk across a boundary reserves (None: nothing does)

    def match(self, seq: Sequence) -> int:
        """Restore the memory of the longest cached prefix of `seq` (holding nothing) into it; the positions restored
        (the scheduler counts them computed)."""

    def cached_length(self, seq: Sequence) -> int:
        """The positions `match` would restore now (0: none), restoring nothing."""

    def record_admission(self, num_tokens: int, num_cached: int, readmission: bool = False) -> None:
        """A request of `num_tokens` positions was admitted (again, after a preemption), `num_cached` restored."""

    def reserve(self, seq: Sequence, start: int, end: int) -> list:
        """Snapshot slots for the block boundaries in (start, end] a step computes."""

    def keep_reserved(self, seq: Sequence, reserved: list, emitted: int | None = None) -> None:
        """The step's output is in: its reserved boundaries become entries (`emitted`: the token sampled after the
        chunk, not yet appended)."""

    def release_reserved(self, reserved: list) -> None:
        """The reserved boundaries are void."""

    def register_end(self, seq: Sequence, length: int) -> None:
        """`seq` finished having computed `length` positions: keep its state there."""


class NoPrefixCache:
    """Prefix caching off."""

    block_tokens = None

    def match(self, seq: Sequence) -> int:
        return 0

    def cached_length(self, seq: Sequence) -> int:
        return 0

    def record_admission(self, num_tokens: int, num_cached: int, readmission: bool = False) -> None:
        pass

    def reserve(self, seq: Sequence, start: int, end: int) -> list:
        return []

    def keep_reserved(self, seq: Sequence, reserved: list, emitted: int | None = None) -> None:
        pass

    def release_reserved(self, reserved: list) -> None:
        pass

    def register_end(self, seq: Sequence, length: int) -> None:
        pass


@dataclass
class _Inflight:
    plan: StepPlan
    record: StepRecord
    features: StepFeatures


class Scheduler:
    """Owns the waiting queue, the running set, chunked-prefill progress and token accounting; plans each step.

    `config` is a validated EngineConfig (policy, decode_interleave_every, itl_target_ms,
    max_running_requests, max_num_batched_tokens, step_log); `prefill_chunk_tokens` is the resolved
    chunk budget (policies.resolve_prefill_chunk_tokens); `max_steps_in_flight` is 2 when the engine
    schedules a step while the previous one runs (overlap), 1 otherwise.

    Threads: `add`, `abort`, `has_work`, `wait_for_work`, `wake` and the `num_*` properties may
    be called from any thread; everything else from the engine thread only. Requests added or
    aborted from other threads take effect at the next `schedule()` call.
    """

    def __init__(self, config: "EngineConfig", memory: MemoryManager, prefill_chunk_tokens: int, *,
                 prefix_cache: PrefixCacheHooks | None = None, max_steps_in_flight: int = 1,
                 cost_model: StepCostModel | None = None, step_history: int = 10_000,
                 min_prefill_chunk_tokens: int = MIN_PREFILL_CHUNK_TOKENS, rank: int = 0):
        if not isinstance(prefill_chunk_tokens, int) or prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be a positive integer, got {prefill_chunk_tokens!r}")
        self.memory = memory
        self.rank = rank  # data parallelism: the rank whose requests and pools this scheduler serves
        self.prefix_cache: PrefixCacheHooks = prefix_cache or NoPrefixCache()
        self.max_steps_in_flight = max_steps_in_flight
        self.max_running_requests = config.max_running_requests
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.num_speculative_tokens = config.num_speculative_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.priority_aging_s = config.priority_aging_s
        # Without an ITL target the model's predictions are only recorded: it refits every 16 steps, not each.
        self.cost_model = cost_model or StepCostModel(refit_every=1 if config.itl_target_ms is not None else 16)
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
        self._awaiting_grammar: list[Sequence] = []  # arrived, queued once their grammar is compiled
        self._running: list[Sequence] = []  # in admission order: the last is the preemption victim
        self._by_id: dict[str, Sequence] = {}  # the waiting and running ones
        self._with_deadline: set[Sequence] = set()
        self._back_ranks = itertools.count()
        self._front_ranks = itertools.count(-1, -1)
        self._inflight: deque[_Inflight] = deque()  # committed steps whose output is not in yet, oldest first
        self._next_step_index = 0
        # Shared with other threads, under _lock.
        self._work_changed = threading.Condition(threading.Lock())
        self._lock = self._work_changed
        self._inbox: list[Sequence] = []
        self._abort_requests: dict[str, FinishReason] = {}  # request id -> how it ends
        self._grammar_compiled = False  # a grammar some arrival awaits is ready: schedule() queues it
        self._live_ids: set[str] = set()  # every request added and not finished: ids are unique among them

    # --- any thread ---------------------------------------------------------------------------

    def add(self, seq: Sequence, max_waiting: int | None = None) -> bool:
        """Queue a new request. Raises ValueError if it is not fresh or its id is in use.

        Returns False, queueing nothing, when `max_waiting` requests already wait: the count and the
        enqueue are one step under the lock, so concurrent arrivals cannot both take the last place.
        """
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.output_ids:
            raise ValueError(f"request {seq.request_id!r}: only fresh sequences can be added")
        with self._lock:
            if seq.request_id in self._live_ids:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            if max_waiting is not None and self._num_waiting_locked() >= max_waiting:
                return False
            self._live_ids.add(seq.request_id)
            self._inbox.append(seq)
            self._work_changed.notify_all()
        if seq.grammar is not None:
            seq.grammar.future.add_done_callback(lambda _: self._on_grammar_compiled())
        return True

    def _on_grammar_compiled(self) -> None:
        with self._work_changed:
            self._grammar_compiled = True
            self._work_changed.notify_all()

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """Ask to end a request (cancelled; or timed out, as rank 0 decides for another data-parallel rank's
        requests); takes effect at the next schedule(), which reports it in plan.aborted.

        Returns False when no such request is live (unknown, or already finished).
        """
        with self._lock:
            if request_id not in self._live_ids:
                return False
            self._abort_requests.setdefault(request_id, reason)
            self._work_changed.notify_all()
            return True

    def abort_all(self, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """abort() every live request (ERROR: the engine can no longer run a step)."""
        with self._lock:
            self._abort_requests.update(dict.fromkeys(self._live_ids, reason))
            self._work_changed.notify_all()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued: arrived, awaiting their grammar, or waiting for admission."""
        with self._lock:
            return self._num_waiting_locked()

    @property
    def num_awaiting_grammar(self) -> int:
        return len(self._awaiting_grammar)

    def _num_waiting_locked(self) -> int:
        return len(self._inbox) + len(self._awaiting_grammar) + len(self._waiting)

    def has_work(self) -> bool:
        """Anything to schedule: queued or running requests, or aborts to report."""
        with self._lock:
            return self._has_work_locked()

    def wait_for_work(self, timeout: float | None = None, also: Callable[[], bool] | None = None) -> bool:
        """Block until has_work() (add/abort from another thread), or `also()` when a `wake()` asks, or timeout;
        returns whether either holds."""
        with self._work_changed:
            return self._work_changed.wait_for(lambda: self._has_work_locked() or (also is not None and also()),
                                               timeout)

    def wake(self) -> None:
        """Wake wait_for_work() callers, e.g. so that the engine loop notices a shutdown."""
        with self._work_changed:
            self._work_changed.notify_all()

    def _has_work_locked(self) -> bool:
        return bool(self._inbox or self._abort_requests or self._grammar_compiled or self._waiting or self._running)

    # --- engine thread ------------------------------------------------------------------------

    def schedule(self, now: float | None = None, ahead: bool = False) -> StepPlan | None:
        """Decide the next step, allocate its pages and advance its requests' token counts.

        Returns None when nothing can be scheduled now (no work, or only requests waiting for the
        output of a step in flight), a plan without chunks when there are only ended sequences to
        report, otherwise a forward plan, whose output must come back through update_from_output().
        `ahead` (where `can_schedule_ahead`): the running requests' next verifies only; arrivals and aborts
        are taken at the next step.
        """
        if len(self._inflight) >= self.max_steps_in_flight:
            raise RuntimeError(f"schedule() called with {len(self._inflight)} steps in flight, the most allowed; "
                               "update_from_output() comes first")
        now = clock() if now is None else now
        plan = StepPlan()
        if not ahead:
            self._take_arrivals_and_aborts(plan, now)
        self._build(plan)
        if not plan.chunks:
            return plan if plan.aborted else None
        self._commit(plan, now)
        return plan

    def can_schedule_ahead(self, now: float | None = None) -> bool:
        """Whether the next step may be scheduled before the one in flight is taken in (overlapped verify steps): that
        one leaves its rows' next tokens and drafts on the device (`StepPlan.chains_on_device`), every running request
        has its verify in it and room for k drafts after it, and nothing else waits to be scheduled (an arrival, a
        queued or preempted request, a prefill, an abort, a deadline passed, a grammar compiled or past its compile
        deadline). The next step then holds those verifies
        alone: rows of one width, a static step whose drafts the device chains, like the one before it."""
        if not (self._running and self._inflight and self._inflight[-1].plan.chains_on_device):
            return False
        with self._lock:
            if self._inbox or self._abort_requests or self._grammar_compiled or self._waiting:
                return False
        if any(seq.grammar.ready for seq in self._awaiting_grammar):  # (one past its compile deadline: no callback)
            return False
        if self._with_deadline:  # (a deadline passed: it ends at the next step taken in full)
            now = clock() if now is None else now
            if any(_past_deadline(seq, now) for seq in self._with_deadline):
                return False
        cap, k = self._position_cap, self.num_speculative_tokens
        return all(seq.num_placeholders and seq.is_decode and cap - seq.num_computed_tokens >= 2 * k
                   for seq in self._running)

    def update_from_output(self, plan: StepPlan, output: StepOutput) -> list[RequestOutput]:
        """The output of the oldest step in flight: append each sampled token, end the requests it stops, keep the
        prefix states it reached; returns what to report, in plan order (the step's token lists, not copied).

        A token of a request that ended meanwhile (cancelled, timed out, stopped by the step before) is dropped. A
        failed step (`output.error`) fails every request it carried; nothing it may have half-written is kept.
        """
        if not self._inflight or plan is not self._inflight[0].plan:
            raise RuntimeError(f"update_from_output() for step {plan.step_index}, which is not the oldest in flight")
        inflight = self._inflight.popleft()
        record = inflight.record
        outputs = (self._fail_step(plan, output.error) if output.error is not None
                   else self._apply(plan, output, record))
        record.mean_accepted_length = mean_accepted_length(record.num_verifies, record.num_accepted_tokens)
        record.timing = output.timing
        if output.error is None:
            self.cost_model.observe(inflight.features, output.timing.duration_s)
        self._log_step(record)
        return outputs

    def _log_step(self, record: StepRecord) -> None:
        """The step's line in the step log. A log that cannot be written (a full disk) ends there, with an error
        logged: the step's outputs are reported all the same."""
        if self._step_log is None:
            return
        log = self._step_log
        try:
            log.write(record)
        except OSError:
            logger.exception("writing the step log %s failed: it ends here; serving goes on", log.path)
            self._step_log = None
            with contextlib.suppress(OSError):  # (closing flushes: the same full disk)
                log.close()

    def _apply(self, plan: StepPlan, output: StepOutput, record: StepRecord) -> list[RequestOutput]:
        """(Once per sampling row every step: what only some rows need is looked at only where it is there.)"""
        outputs, cache, row = [], self.prefix_cache, -1
        tokens, ends, drafts, logprobs = output.tokens, output.ends, output.drafts, output.logprobs
        for chunk in plan.chunks:
            seq = chunk.seq
            row += chunk.samples
            if chunk.void:  # (its verify before it accepted fewer drafts: `_void_successor` settled it)
                continue
            if chunk.snapshots and not chunk.drafts:  # the step computed these states, whatever became of the request
                cache.keep_reserved(seq, chunk.snapshots, tokens[row][0] if chunk.samples and tokens[row] else None)
            if seq.status is SequenceStatus.FINISHED or not chunk.samples:  # (ended while the step ran: dropped)
                self._keep_verified_snapshots(chunk, 0)
                continue
            seq.num_placeholders -= 1 + len(chunk.drafts)
            if ends and ends.get(row) is not None:
                self._keep_verified_snapshots(chunk, 0)
                seq.error = ends[row]  # the constraint cannot go on: the token is not kept
                self._retire(seq, FinishReason.ERROR)
                outputs.append(RequestOutput.of(seq, [], finished=True, error=seq.error))
                continue
            emitted = tokens[row]
            kept, reason = self._append(seq, emitted, grammar_ended=bool(ends) and row in ends)
            row_logprobs = logprobs[row] if logprobs is not None else None
            if kept < len(emitted):
                emitted, row_logprobs = emitted[:kept], row_logprobs and row_logprobs[:kept]
            if chunk.drafts:
                accepted = len(tokens[row]) - (row not in output.drafts_alone)  # (its last is not a draft)
                self._keep_verified_snapshots(chunk, accepted)  # (once its tokens are known: they key them)
                if len(tokens[row]) < 1 + len(chunk.drafts):
                    self._void_successor(seq)
                if seq.num_preemptions == chunk.epoch:
                    self._settle_verify(seq, chunk, len(tokens[row]), accepted, record,
                                        seq.sampling.max_tokens - len(seq.output_ids) + kept)
            if drafts or seq.draft_tokens:
                seq.draft_tokens = drafts.get(row, [])
            if reason is not None:
                if seq.num_preemptions == chunk.epoch:  # (preempted meanwhile, it holds no memory to keep)
                    cache.register_end(seq, chunk.start + kept if chunk.drafts else chunk.end)
                self._retire(seq, reason)
            outputs.append(RequestOutput.of(seq, emitted, row_logprobs, finished=reason is not None))
        return outputs

    @staticmethod
    def _append(seq: Sequence, emitted: list[int], grammar_ended: bool) -> tuple[int, FinishReason | None]:
        """Append the tokens a row emitted, up to the first that ends the request (a verify emits its accepted
        drafts' successors too: each stop holds per token); (how many were kept, why it ended or None). A stop token
        ends it only as its min_tokens-th output or later, as vLLM's check_stop has it (the sampler holds them back
        before; one a grammar left as all it allowed, earlier, is an output like any other)."""
        kept, reason, stop_ids, max_tokens = 0, None, seq.stop_ids, seq.sampling.max_tokens
        min_tokens = seq.sampling.min_tokens
        for token in emitted:
            seq.append_output(token)
            kept += 1
            stops = token in stop_ids and len(seq.output_ids) >= min_tokens
            if stops or (grammar_ended and kept == len(emitted)):  # (a grammar's end: its last token)
                reason = FinishReason.STOP
            elif len(seq.output_ids) >= max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        return kept, reason

    def _keep_verified_snapshots(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """A verify's prefix states become cache entries up to its accepted drafts' positions (the state at its first
        position's end always stands); those of rejected drafts are void. (Nothing for any other chunk.)"""
        if not (chunk.drafts and chunk.snapshots):
            return
        valid_end = chunk.start + 1 + num_accepted
        self.prefix_cache.keep_reserved(chunk.seq, [r for r in chunk.snapshots if r.position <= valid_end])
        self.prefix_cache.release_reserved([r for r in chunk.snapshots if r.position > valid_end])

    def _settle_verify(self, seq: Sequence, chunk: ScheduledChunk, num_emitted: int, num_accepted: int,
                       record: StepRecord, could_emit: int) -> None:
        """A verify step computed positions [start, start + 1 + drafts) and emitted `num_emitted` tokens, the first
        `num_accepted` of them its drafts: the last token's and the accepted drafts' positions stand, the rejected
        drafts' are given up by moving the request's position back (to its last token's: a row of drafts alone
        computes its last draft again, as its last token). Nothing is copied: what those positions wrote is never
        read before it is written again (their window and compressed entries lie past every later query's causal
        reach until recomputed, and the rings keep more positions than a window reads: backend/speculative.py). The
        tallies count the drafts the request `could_emit` (what max_tokens left it, less the token after them):
        those past it only kept the step's shape."""
        if num_emitted < 1 + len(chunk.drafts):  # (all accepted: it stands where the step scheduled it, or past)
            seq.num_computed_tokens = chunk.start + num_emitted
        counted = min(len(chunk.drafts), could_emit - 1)
        for tally in (self.counters, record):  # the running totals and the step's own
            tally.num_draft_tokens += counted
            tally.num_accepted_tokens += min(num_accepted, counted)
            tally.num_verifies += 1

    def _void_successor(self, seq: Sequence) -> None:
        """`seq`'s verify just taken in accepted fewer drafts than the verify after it, in flight, was scheduled for
        (`ScheduledChunk.optimistic`): that chunk is void. Its placeholders are retired now and its output dropped at
        its take-in; what it computed lies past the request's position, as rejected drafts' positions do, and its
        snapshots are released."""
        chunk = self._inflight[0].plan.chunk_of(seq) if self._inflight else None
        if chunk is not None and chunk.optimistic:
            chunk.void = True
            seq.num_placeholders -= 1 + len(chunk.drafts)
            self.prefix_cache.release_reserved(chunk.snapshots)

    def _fail_step(self, plan: StepPlan, error: str) -> list[RequestOutput]:
        outputs = []
        for chunk in plan.chunks:
            if chunk.void:  # (not the request's step: it stands where the step before left it)
                continue
            self.prefix_cache.release_reserved(chunk.snapshots)
            self._void_later_chunks(chunk.seq)
            if chunk.seq.status is not SequenceStatus.FINISHED:
                self._retire(chunk.seq, FinishReason.ERROR)
                outputs.append(RequestOutput.of(chunk.seq, [], finished=True, error=error))
        return outputs

    def _void_later_chunks(self, seq: Sequence) -> None:
        """A step of `seq` failed: its chunks in the steps in flight after it (scheduled before the failure was taken
        in) read what the failed step never wrote, so their prefix states are no cache entries: void, their
        snapshots released."""
        for inflight in self._inflight:
            chunk = inflight.plan.chunk_of(seq)
            if chunk is not None and not chunk.void:
                chunk.void = True
                self.prefix_cache.release_reserved(chunk.snapshots)

    def close(self) -> None:
        """Close the step log."""
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None

    # --- arrivals, aborts, retirement ---------------------------------------------------------

    def _take_arrivals_and_aborts(self, plan: StepPlan, now: float) -> None:
        with self._lock:  # (the arrivals move to their queues under it: add() counts each all the while)
            arrivals, self._inbox = self._inbox, []
            aborts, self._abort_requests = self._abort_requests, {}
            self._grammar_compiled = False
            for seq in arrivals:
                if seq.arrival_s is None:
                    seq.arrival_s = now
                self._by_id[seq.request_id] = seq
                if seq.sampling.timeout_ms is not None:
                    self._with_deadline.add(seq)
                if seq.grammar is not None:
                    self._awaiting_grammar.append(seq)
                else:
                    self._enqueue(seq, front=False)
        if self._awaiting_grammar:
            self._queue_compiled(plan)
        for request_id, reason in aborts.items():
            seq = self._by_id.get(request_id)
            if seq is not None:
                self._end(plan, seq, reason)
        if self._with_deadline:
            for seq in [s for s in self._with_deadline if _past_deadline(s, now)]:
                self._end(plan, seq, FinishReason.TIMEOUT)  # its memory is freed; the tokens it got were streamed

    def _queue_compiled(self, plan: StepPlan) -> None:
        """Arrivals whose grammar is compiled join the waiting queue (in arrival order, under the lock: add() counts
        each all the while); one that failed ends."""
        failed = []
        with self._lock:
            for seq in [s for s in self._awaiting_grammar if s.grammar.ready]:
                self._awaiting_grammar.remove(seq)
                if seq.grammar.error is not None:
                    failed.append(seq)
                else:
                    self._enqueue(seq, front=False)
        for seq in failed:
            seq.error = seq.grammar.error
            self._end(plan, seq, FinishReason.ERROR)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Insert into waiting by `_waiting_key`; `front` (a preempted request) goes before its equals."""
        seq.queue_rank = next(self._front_ranks if front else self._back_ranks)
        if seq.arrival_rank is None:
            seq.arrival_rank = seq.queue_rank
        seq.status = SequenceStatus.WAITING
        bisect.insort(self._waiting, seq, key=self._waiting_key)

    def _waiting_key(self, seq: Sequence) -> tuple:
        """Admission order: priority aged by waiting time (see the module docstring), then queue rank."""
        return self._aged_priority(seq), seq.queue_rank

    def _eviction_key(self, seq: Sequence) -> tuple:
        """Which running request a memory shortage evicts first: the largest key, latest in queue order as it came in
        (a preemption requeues a request in front, but does not make it an earlier arrival: the order of evictions
        stays fixed, so the request first in it always progresses, and two cannot evict each other in turn)."""
        return self._aged_priority(seq), seq.arrival_rank

    def _aged_priority(self, seq: Sequence) -> float:
        if not self.priority_aging_s:  # 0 or None: strict priority
            return seq.priority
        return seq.priority * self.priority_aging_s + seq.arrival_s

    def _end(self, plan: StepPlan, seq: Sequence, reason: FinishReason) -> None:
        """The scheduler ends `seq` itself (cancelled, timed out, or cannot fit); reported in plan.aborted."""
        self._retire(seq, reason)
        plan.aborted.append(seq)
        if reason is FinishReason.TIMEOUT:
            self.counters.num_timed_out += 1

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """`seq` leaves the scheduler, waiting or running: FINISHED with `reason`, its memory freed."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        elif seq in self._awaiting_grammar:
            self._awaiting_grammar.remove(seq)
        seq.finish(reason)
        self.memory.free(seq)
        self._by_id.pop(seq.request_id, None)
        self._with_deadline.discard(seq)
        with self._lock:
            self._live_ids.discard(seq.request_id)
            self._abort_requests.pop(seq.request_id, None)

    # --- building a step ----------------------------------------------------------------------

    def _build(self, plan: StepPlan) -> None:
        """Fill plan.chunks by the policy; if memory blocks every runnable candidate, free memory and retry.

        The retries are bounded. Nothing is runnable while every request waits for the output of a step in
        flight, or while a request alone waits for the memory a step in flight pins: the plan stays empty, and
        the step's take-in comes first.
        """
        for _ in range(len(self._running) + len(self._waiting) + 1):
            self.policy.build(self, plan)
            if plan.chunks:
                return
            runnable = next((s for s in self._running if s.is_decode or s.is_prefill), None)
            if runnable is not None:
                self._allocate_or_preempt(plan, runnable, 1)  # the oldest runnable request must progress
            elif (self._waiting and not self._running and not self._waiting[0].num_placeholders
                  and not self._inflight):  # (a step in flight may pin pages its take-in frees: wait for it)
                # Admission failed in an empty engine: the memory contradicts the admission gate.
                self._end(plan, self._waiting[0], FinishReason.ERROR)
                logger.warning("request %r failed: it does not fit in an empty engine", plan.aborted[-1].request_id)
            else:
                return

    # Building blocks of the policies.

    def has_running_decode(self) -> bool:
        return any(seq.is_decode for seq in self._running)

    def schedule_decodes(self, plan: StepPlan) -> None:
        """One token for each running decode, oldest first, preempting the latest in queue order on memory shortage.
        (Once per running request every step: the common case, a decode whose pages are already there, is kept
        short.)"""
        running, limit, memory = SequenceStatus.RUNNING, self.max_num_batched_tokens, self.memory
        speculative = bool(self.num_speculative_tokens)
        in_flight = self._inflight[-1].plan if self._inflight else None  # (a request with placeholders is in it)
        # (a verify in flight: the next one starts past all its drafts, where it left them on the device; a plain step
        # in flight: its token is read on the device, as without speculation)
        after_verify = speculative and in_flight is not None and not in_flight.plain_decoding
        for seq in list(self._running):  # (a copy: preemption changes the list)
            if plan.num_prefill_tokens + plan.num_decode_tokens >= limit:
                return
            if seq.status is running and seq.is_decode and not plan.has_chunk(seq):
                optimistic = after_verify and seq.num_placeholders > 0
                if optimistic and not in_flight.chains_on_device:
                    continue  # (its next start waits for the output)
                drafts, allocated = self._verify_positions(seq, optimistic) if speculative else ((), 1)
                if memory.try_extend(seq, allocated) or self._allocate_or_preempt(plan, seq, allocated):
                    plan.add(ScheduledChunk(seq, 1 + len(drafts), seq.num_computed_tokens, True, True,
                                            seq.num_preemptions, drafts=drafts, allocated=allocated,
                                            optimistic=optimistic))

    def _verify_positions(self, seq: Sequence, optimistic: bool = False) -> tuple[tuple[int, ...], int]:
        """With speculative decoding, a decode of `seq`: the draft tokens it verifies and the positions from its start
        to allocate, its own and the draft chain's k - 1 after its last accepted one, so that every verify drafts k
        tokens for the next. All its drafts, also past `max_tokens` (the take-in keeps no more than that, and rows
        of one width keep a step's static shape), unless their positions would pass what the pools hold for one
        request (`_position_cap`). `optimistic`: the k drafts its verify in flight chained (stand-ins here)."""
        k, room = self.num_speculative_tokens, self._position_cap - seq.num_computed_tokens
        source = (0,) * k if optimistic else seq.draft_tokens
        drafts = tuple(source[:max(0, room - k)]) if source else ()
        return drafts, min(len(drafts) + k, max(1, room))  # (at least its own position)

    @functools.cached_property
    def _position_cap(self) -> int:
        """The positions one request may reach: admission's prompt + max_tokens - 1 at most
        (`max_request_positions`), and the draft chain's k - 1 past them."""
        return self.memory.max_request_positions() + max(0, self.num_speculative_tokens - 1)

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
                allowed = self._allowed(plan, seq, left)
                if allowed <= 0:
                    continue  # (its context leaves it nothing this step; another's may leave it some)
                num_tokens = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, allowed))
                if num_tokens:
                    self._add_chunk(plan, seq, num_tokens, is_decode=False)
                    left -= num_tokens
        self._admit(plan, left)

    def _allowed(self, plan: StepPlan, seq: Sequence, left: int) -> int:
        """The prefill tokens `seq`'s next chunk may take of the `left` the step has: all of them for the step's first
        prefill chunk (the budget was sized for it), what the budget allows a further one at its own context."""
        if not plan.num_prefill_tokens:
            return left
        return self.budget.more_tokens(plan, seq, lambda: self._chunk_context(seq), left)

    def _chunk_context(self, seq: Sequence) -> int:
        """Where `seq`'s next chunk starts: a request holding no memory is restored from the prefix cache at
        admission (as `_admit` matches it), so from where its cached prefix ends."""
        return self.prefix_cache.cached_length(seq) if seq.pages is None else seq.num_computed_tokens

    def prefill_budget(self, plan: StepPlan) -> int:
        """Prefill tokens allowed in this step, given the chunks already in `plan`: sized for the request they will
        mostly go to, at the context its chunk starts from (a waiting request's: where its cached prefix ends)."""
        candidate = self._next_prefill_candidate(plan)
        if candidate is None:
            return self.budget.tokens(plan, None, 0)
        return self.budget.tokens(plan, candidate, self._chunk_context(candidate))

    def _next_prefill_candidate(self, plan: StepPlan) -> Sequence | None:
        """The running request whose prompt is prefilled next, else the waiting head if it can be admitted."""
        for seq in self._running:
            if seq.is_prefill and not plan.has_chunk(seq):
                return seq
        return self._waiting[0] if self._waiting and self._can_admit_another() else None

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Move waiting requests to running, strictly in queue order (no skipping a blocked head)."""
        if plan.preempted and self._running:
            return  # do not re-admit what this step just evicted while others still hold memory
        left = budget
        while left > 0 and self._waiting and self._can_admit_another():
            seq = self._waiting[0]
            if seq.num_placeholders:
                return  # preempted while its last token was in flight: admitted once that token is in
            if seq.num_preemptions and self._running and not self.memory.fits_whole(seq, self.memory.evictable_pages()):
                return  # (a preempted request comes back once all it held fits again: else the running requests'
                # growth evicts it again, and its prompt is recomputed chunk by chunk for nothing, step after step)
            allowed = self._allowed(plan, seq, left)
            if allowed <= 0:
                return  # (strictly in queue order: nothing admitted past it)
            cached = 0 if seq.pages is not None else self.prefix_cache.match(seq)
            if cached:
                seq.num_computed_tokens = cached  # the positions the restored pages hold
            num_tokens = min(seq.num_uncomputed_tokens, allowed)
            if not self._allocate(seq, num_tokens):
                alone = not self._running and seq.num_tokens <= self.memory.max_request_positions()
                num_tokens, cached = self._fit_alone(seq, num_tokens, cached) if alone else (0, cached)
                if not num_tokens:
                    if cached:  # it waits holding nothing, like every waiting request
                        self.memory.free(seq)
                        seq.num_computed_tokens = 0
                    return
            self._waiting.pop(0)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
            plan.num_cached_tokens += cached
            self.prefix_cache.record_admission(seq.num_tokens, cached, readmission=seq.num_preemptions > 0)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            self._add_chunk(plan, seq, num_tokens, is_decode=False)
            left -= num_tokens

    def _fit_alone(self, seq: Sequence, num_tokens: int, cached: int) -> tuple[int, int]:
        """In an empty engine the whole chunk of a head whose prompt the engine holds did not fit: (the largest chunk
        that does, allocated; the positions restored), the restored prefix given up where nothing fits beside it. It
        is not failed for its chunk's size (a running prefill's chunks are fitted alike)."""
        fitted = self._fit_chunk(seq, num_tokens)
        if not fitted and cached:
            self.memory.free(seq)
            seq.num_computed_tokens = cached = 0
            fitted = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, num_tokens))
        return fitted, cached

    def _allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """try_extend, evicting prefix-cache entries first when they hold the pages it needs."""
        return self.memory.try_extend(seq, num_tokens) or (self._fits(seq, num_tokens)
                                                           and self.memory.try_extend(seq, num_tokens))

    def _fits(self, seq: Sequence, num_tokens: int) -> bool:
        """can_extend, evicting prefix-cache entries first when they hold the pages it needs."""
        return self.memory.can_extend(seq, num_tokens) or self.memory.evict_cached_until(seq, num_tokens)

    def _can_admit_another(self) -> bool:
        return len(self._running) < self.max_running_requests and self.memory.has_free_slot()

    def _fit_chunk(self, seq: Sequence, num_tokens: int) -> int:
        """Allocate the largest chunk <= num_tokens whose pages exist, or would once prefix-cache entries holding them
        are evicted (then evicted); its size, 0 if none. (Both are monotone in the chunk's size.)"""
        if seq.pages is not None:  # (a request admitted now holds nothing yet)
            self.memory.release_slid_out(seq, seq.num_computed_tokens)
        if not self._fits(seq, num_tokens):
            evictable = self.memory.evictable_pages()  # (once: each count walks every page the cache holds)
            lo, hi = 0, num_tokens  # invariant: lo fits (0 trivially), hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.memory.can_extend_evicting(seq, mid, evictable) else (lo, mid)
            num_tokens = lo if lo and self._fits(seq, lo) else 0  # (_fits evicts the entries `lo` needs gone)
        if num_tokens and not self.memory.try_extend(seq, num_tokens):
            raise RuntimeError(f"request {seq.request_id!r}: {num_tokens} tokens fit but could not be allocated")
        return num_tokens

    def _allocate_or_preempt(self, plan: StepPlan, seq: Sequence, num_tokens: int) -> bool:
        """Allocate `num_tokens` for `seq`, preempting running sequences without a chunk, latest in queue order first,
        until it can.

        Returns False when `seq` itself was the latest (it is preempted) or is alone and still
        cannot extend: it waits for the take-in of a step in flight, or with none is failed with ERROR
        rather than retried forever.
        """
        while not self._allocate(seq, num_tokens):  # cached-only pages went first, in _allocate
            victim = max((s for s in self._running if not plan.has_chunk(s)), key=self._eviction_key)
            if victim is seq and len(self._running) == 1:
                if self._inflight:  # (pages the step in flight pins, its prefix-cache snapshots', come back at its
                    return False  # take-in: this request waits a step for them, holding what it holds)
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
        self.memory.free(seq)
        seq.num_computed_tokens = seq.last_chunk_tokens = 0
        seq.draft_tokens = []  # (its recompute drafts anew)
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._enqueue(seq, front=True)
        plan.preempted.append(seq)
        logger.debug("preempted request %r (%d tokens to recompute)", seq.request_id, seq.num_tokens)

    def _add_chunk(self, plan: StepPlan, seq: Sequence, num_tokens: int, is_decode: bool,
                   drafts: tuple[int, ...] = (), allocated: int = 0) -> None:
        """A chunk of `seq`, its pages allocated; the token counts move when the plan is committed. A verify (drafts)
        computes the last token and its drafts, and samples."""
        start = seq.num_computed_tokens
        samples = bool(drafts) or start + num_tokens == seq.num_tokens
        if not is_decode:
            seq.last_chunk_tokens = num_tokens
            if samples and self.num_speculative_tokens > 1:  # the draft chain's k - 1 positions after the prompt
                allocated = self._chain_lookahead(seq, num_tokens)
        plan.add(ScheduledChunk(seq, num_tokens, start, is_decode, samples, seq.num_preemptions, drafts=drafts,
                                allocated=allocated or num_tokens))

    def _chain_lookahead(self, seq: Sequence, num_tokens: int) -> int:
        """A prompt's last chunk: its positions and, where the pools have them now, the draft chain's after it (so
        that the request's first verify carries k drafts, as the others' do)."""
        wanted = min(num_tokens + self.num_speculative_tokens - 1, self._position_cap - seq.num_computed_tokens)
        return wanted if self.memory.try_extend(seq, wanted) else num_tokens

    # --- bookkeeping --------------------------------------------------------------------------

    def _commit(self, plan: StepPlan, now: float) -> None:
        plan.step_index = self._next_step_index
        self._next_step_index += 1
        decode_stalled = len(plan.chunks) < len(self._running) and any(
            seq.is_decode for seq in self._running if not plan.has_chunk(seq))
        cache, block = self.prefix_cache, self.prefix_cache.block_tokens
        for chunk in plan.chunks:  # the step computes these tokens; the sampling ones add a token in flight
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            if block is not None and start // block != end // block:  # block boundaries the step snapshots
                chunk.snapshots = cache.reserve(seq, start, end)
            seq.num_computed_tokens = end
            if chunk.samples:  # (a verify: what it emits at most, where the next one may start)
                seq.num_placeholders += 1 + len(chunk.drafts)
        plan.kind = StepKind.of(plan.num_prefill_tokens, plan.num_decode_tokens)
        plan.itl_infeasible &= plan.num_prefill_tokens > 0  # (sized for a prefill it could not admit: none carried)
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
            decode_stalled=decode_stalled,
            pool_usage=dict(self.memory.usage()),
            predicted_s=plan.predicted_s,
            itl_infeasible=plan.itl_infeasible,
            num_cached_tokens=plan.num_cached_tokens,
            rank=self.rank,
        )
        self.counters.observe(record)
        self.policy.on_step(plan.kind)
        self.records.append(record)
        self._inflight.append(_Inflight(plan, record, features))


def clock() -> float:
    """The scheduler's clock: arrivals, aging and deadlines (rank 0's engine reads it for the deadlines of requests
    another data-parallel rank serves)."""
    return time.monotonic()


def _past_deadline(seq: Sequence, now: float) -> bool:
    timeout_ms = seq.sampling.timeout_ms
    return timeout_ms is not None and (now - seq.arrival_s) * 1000.0 >= timeout_ms
