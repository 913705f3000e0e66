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
- The scheduler owns the waiting queue, the running set and the decision of each step. It
  allocates the pages a step needs (`memory.extend`) while building the plan, frees a sequence's
  pages when it leaves the running set, and on preemption resets `num_computed_tokens` to 0.
- The ENGINE advances `seq.num_computed_tokens` and appends to `seq.output_ids`, before calling
  `on_step_done`; the scheduler never touches token lists. `on_step_done` checks the advance.

Policies (SchedulerConfig.policy), see docs/design.md "Scheduling" and docs/seed-bug-report.md:
- `prefill_first`: the historical `prefill(budget) or decode()` with budget = prefill_chunk_tokens:
  running prefills in admission order, then admissions, may share one step. With
  `decode_interleave_every=N`, after N consecutive prefill steps one decode step is taken if a
  decode is runnable (never an idle step instead); any decode step restarts the count.
- `mixed`: every step carries every runnable decode (1 token each) plus prefill tokens within
  min(prefill_chunk_tokens, max_num_batched_tokens - decodes); config validation
  (max_num_batched_tokens >= max_running_requests) keeps that >= 1 whenever a prefill can run.
- `itl_target_ms`: the prefill tokens of a step are sized by StepCostModel so the predicted step
  time stays under the target, never below min_prefill_chunk_tokens (prefill always progresses).
  With `mixed` it bounds every step; with `prefill_first` it caps each prefill step.

Admission is FCFS by (priority, arrival), strictly in order: a head that does not fit blocks the
queue rather than being overtaken. Memory shortage: a decode that cannot extend preempts the most
recently admitted running sequence (recompute: pages freed, num_computed_tokens = 0, requeued at
the front of its priority); a prefill continuation takes a smaller chunk or waits. A sequence
that cannot extend while running alone is failed (FinishReason.ERROR) instead of retried forever.
Sequences the scheduler ends (cancelled or failed) come back in `plan.aborted`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol

from backend.config import POLICIES, ConfigError
from backend.request import FinishReason, Sequence, SequenceStatus
from backend.step_record import StepCounters, StepKind, StepLog, StepRecord

if TYPE_CHECKING:
    from backend.config import EngineConfig

logger = logging.getLogger(__name__)

__all__ = [
    "MemoryManager",
    "SchedulerConfig",
    "ScheduledChunk",
    "StepPlan",
    "StepFeatures",
    "StepCostModel",
    "Scheduler",
    "StepKind",
]


class MemoryManager(Protocol):
    """The paged memory as the scheduler sees it (implemented by backend.kv_manager).

    Called from the engine thread only, except `can_ever_fit`, which `Scheduler.add` calls from
    the submitting thread and must therefore be a pure function of the pool geometry.
    `can_extend(seq, n)` must be monotone in n (if n tokens fit, fewer fit too).
    """

    def has_free_slot(self) -> bool:
        """A per-request compressor-state slot is free."""

    def can_extend(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Pages exist for positions [seq.num_computed_tokens, + num_new_tokens)."""

    def extend(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate them (the first call also takes a slot); raises page_allocator.OutOfPages."""

    def free(self, seq: Sequence) -> None:
        """Return every page and the slot of `seq` (idempotent)."""

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Could a request of this many positions fit in an empty engine."""

    def derived_prefill_chunk_tokens(self, max_running_requests: int) -> int:
        """The largest prefill chunk the window pool allows with that many requests running."""

    def usage(self) -> dict[str, float]:
        """Pool name -> fraction of its pages in use."""


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class SchedulerConfig:
    """Scheduling knobs; `from_engine_config` takes them from EngineConfig.

    `decode_interleave_every` only applies to `prefill_first` and is rejected with `mixed` (whose
    steps all carry decodes): a knob that silently does nothing is worse than an error.
    `prefill_chunk_tokens=None` means: ask the memory manager (see Scheduler.prefill_chunk_tokens).
    """

    policy: str = "prefill_first"
    decode_interleave_every: int | None = None
    prefill_chunk_tokens: int | None = None
    itl_target_ms: float | None = None
    max_running_requests: int = 16
    max_num_batched_tokens: int = 8192
    # Prefill progress floor under an ITL target (clamped to the chunk budget).
    min_prefill_chunk_tokens: int = 16
    step_log: str | None = None  # JSON-lines path, one line per step
    step_history: int = 10_000  # records kept in memory (a bounded deque)
    # Per-observation weight decay of the step-cost model: ~1 / (1 - decay) steps of memory
    # (a long memory resists timing noise; a real change of speed is caught by drift detection).
    cost_model_decay: float = 0.98

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_engine_config(cls, config: "EngineConfig") -> "SchedulerConfig":
        return cls(
            policy=config.policy,
            decode_interleave_every=config.decode_interleave_every,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            itl_target_ms=config.itl_target_ms,
            max_running_requests=config.max_running_requests,
            max_num_batched_tokens=config.max_num_batched_tokens,
            step_log=config.step_log,
        )

    def validate(self) -> None:
        """Raise ConfigError naming the parameter."""
        _require(self.policy in POLICIES, "policy", self.policy, " or ".join(POLICIES))
        if self.decode_interleave_every is not None:
            _require(_is_int(self.decode_interleave_every) and self.decode_interleave_every >= 1,
                     "decode_interleave_every", self.decode_interleave_every, "an integer >= 1")
            _require(self.policy == "prefill_first", "decode_interleave_every", self.decode_interleave_every,
                     "unset with policy 'mixed' (every mixed step already carries the decodes)")
        _require(_is_int(self.max_running_requests) and self.max_running_requests >= 1,
                 "max_running_requests", self.max_running_requests, "an integer >= 1")
        # Every running request's decode must fit one step, and with one request still in
        # prefill the mixed budget (max_num_batched_tokens - decodes) stays >= 1.
        _require(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= self.max_running_requests,
                 "max_num_batched_tokens", self.max_num_batched_tokens,
                 f"an integer >= max_running_requests ({self.max_running_requests})")
        if self.prefill_chunk_tokens is not None:
            _require(_is_int(self.prefill_chunk_tokens) and
                     1 <= self.prefill_chunk_tokens <= self.max_num_batched_tokens,
                     "prefill_chunk_tokens", self.prefill_chunk_tokens,
                     f"an integer in [1, max_num_batched_tokens={self.max_num_batched_tokens}]")
        if self.itl_target_ms is not None:
            _require(self.itl_target_ms > 0, "itl_target_ms", self.itl_target_ms, "> 0")
        _require(_is_int(self.min_prefill_chunk_tokens) and self.min_prefill_chunk_tokens >= 1,
                 "min_prefill_chunk_tokens", self.min_prefill_chunk_tokens, "an integer >= 1")
        _require(_is_int(self.step_history) and self.step_history >= 1, "step_history", self.step_history, ">= 1")
        _require(0.0 < self.cost_model_decay <= 1.0, "cost_model_decay", self.cost_model_decay, "in (0, 1]")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"parameter {name!r}: invalid value {value!r} (expected {expected})")


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------


@dataclass
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of seq.token_ids() in this step."""

    seq: Sequence
    num_tokens: int
    start: int  # seq.num_computed_tokens when the step was scheduled
    is_decode: bool  # the single last-sampled token of a decoding sequence
    samples: bool  # the chunk reaches seq.num_tokens: the engine samples a token for it

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    """One step's decision.

    A plan without chunks (`kind is None`, `step_index is None`) carries no forward: it only
    reports sequences the scheduler ended (`aborted`) while nothing was runnable. The engine sends
    their final responses and need not call on_step_done (doing so is a no-op).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Sequences the scheduler ended this step; each is FINISHED with finish_reason CANCELLED
    # (abort) or ERROR (could not fit in the memory); pages are already freed.
    aborted: list[Sequence] = field(default_factory=list)
    # Sequences sent back to the waiting queue this step (recompute later; outputs kept).
    preempted: list[Sequence] = field(default_factory=list)
    kind: StepKind | None = None
    step_index: int | None = None
    predicted_s: float | None = None  # the step-cost model's prediction, when it has data
    _scheduled: set[int] = field(default_factory=set, init=False, repr=False)  # id() of seqs with a chunk

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def has_chunk(self, seq: Sequence) -> bool:
        return id(seq) in self._scheduled

    def _add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self._scheduled.add(id(chunk.seq))


# --------------------------------------------------------------------------------------------
# Step-cost model (for itl_target_ms)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFeatures:
    """What a step's cost is modelled on.

    `attention_pairs` approximates attention work: a chunk of n tokens after c computed ones
    attends over about n * (c + (n + 1) / 2) (query, key) pairs; a decode over c + 1.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    attention_pairs: float = 0.0

    @classmethod
    def of(cls, chunks: Iterable[ScheduledChunk]) -> "StepFeatures":
        features = cls()
        for chunk in chunks:
            features = features.plus(chunk.num_tokens, chunk.start, is_decode=chunk.is_decode)
        return features

    def plus(self, num_tokens: int, context: int, *, is_decode: bool = False) -> "StepFeatures":
        pairs = self.attention_pairs + num_tokens * (context + (num_tokens + 1) / 2)
        if is_decode:
            return StepFeatures(self.prefill_tokens, self.decode_tokens + num_tokens, pairs)
        return StepFeatures(self.prefill_tokens + num_tokens, self.decode_tokens, pairs)

    def vector(self) -> list[float]:
        # Scaled so that typical values are O(1..100): keeps the normal equations well conditioned.
        return [1.0, self.prefill_tokens / 1e3, self.decode_tokens / 1e2, self.attention_pairs / 1e8]


class StepCostModel:
    """Online linear model of step time: t = w . [1, prefill, decode, attention] (StepFeatures).

    Fitted by exponentially weighted ridge least squares: each observation multiplies the
    weight of all earlier ones by `decay`, so a machine that gets slower (thermal throttling, a
    neighbour on the GPU) is followed within a few steps. When an observation misses its
    prediction by more than `drift_tolerance`, history is discounted by an extra `drift_decay`:
    a real change of machine speed is adopted quickly, while ordinary noise keeps the long memory.
    Coefficients other than the intercept are kept >= 0 (see _solve), so predictions grow with
    the work, which keeps the budget search monotone.
    """

    NUM_FEATURES = 4

    def __init__(self, decay: float = 0.98, ridge: float = 1e-6, drift_tolerance: float = 0.25,
                 drift_decay: float = 0.1):
        self.decay = decay
        self.ridge = ridge
        self.drift_tolerance = drift_tolerance
        self.drift_decay = drift_decay
        n = self.NUM_FEATURES
        self._gram = [[0.0] * n for _ in range(n)]  # sum of w * x x^T
        self._moment = [0.0] * n  # sum of w * x * t
        self._coef: list[float] | None = None
        self.num_observations = 0
        self.max_prefill_seen = 0  # the budget search never extrapolates past 2x this

    def observe(self, features: StepFeatures, duration_s: float) -> None:
        predicted = self.predict(features)
        discount = self.decay
        if predicted is not None and abs(duration_s - predicted) > self.drift_tolerance * predicted:
            discount *= self.drift_decay
        x = features.vector()
        for i in range(self.NUM_FEATURES):
            self._moment[i] = discount * self._moment[i] + x[i] * duration_s
            for j in range(self.NUM_FEATURES):
                self._gram[i][j] = discount * self._gram[i][j] + x[i] * x[j]
        self._coef = None
        self.num_observations += 1
        self.max_prefill_seen = max(self.max_prefill_seen, features.prefill_tokens)

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted step time in seconds, or None before the first observation."""
        if self.num_observations == 0:
            return None
        if self._coef is None:
            self._coef = self._solve()
        return sum(w * x for w, x in zip(self._coef, features.vector()))

    def max_prefill_tokens(self, target_s: float, base: StepFeatures, context: int, lo: int, hi: int) -> int:
        """The most prefill tokens in [lo, hi] whose step (base + them) is predicted <= target_s.

        `context` is the computed length of the sequence the tokens will mostly go to. Returns lo
        when even lo misses the target (prefill must progress) and lo before any observation;
        never more than twice the largest prefill observed, so a young model is not trusted far
        outside its data.
        """
        hi = max(lo, min(hi, 2 * self.max_prefill_seen))
        if self.num_observations == 0:
            return lo

        def fits(num_tokens: int) -> bool:
            return self.predict(base.plus(num_tokens, context)) <= target_s

        if fits(hi):
            return hi
        if not fits(lo):
            return lo
        while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _solve(self) -> list[float]:
        """Least squares with the work coefficients kept >= 0 (all but the intercept).

        A negative coefficient is dropped (fixed at 0) and the rest refitted, the active-set idea
        of non-negative least squares. Merely clamping it would not do: prefill tokens and
        attention pairs are nearly collinear while one long prompt is prefilled, so a fit often
        pairs a too-large prefill cost with a negative attention cost; clamping the latter alone
        would then predict far too slow a step and starve the prefill.
        """
        active = list(range(self.NUM_FEATURES))
        while True:
            matrix = [[self._gram[i][j] for j in active] + [self._moment[i]] for i in active]
            for k in range(len(active)):
                matrix[k][k] += self.ridge
            solution = dict(zip(active, _solve_linear(matrix)))
            negative = [i for i in active[1:] if solution[i] < 0]
            if not negative:
                return [solution.get(i, 0.0) for i in range(self.NUM_FEATURES)]
            active.remove(min(negative, key=solution.__getitem__))


def _solve_linear(augmented: list[list[float]]) -> list[float]:
    """Gaussian elimination with partial pivoting on an n x (n + 1) augmented matrix."""
    n = len(augmented)
    a = [row[:] for row in augmented]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for row in range(col + 1, n):
            factor = a[row][col] / a[col][col]
            for k in range(col, n + 1):
                a[row][k] -= factor * a[col][k]
    x = [0.0] * n
    for row in range(n - 1, -1, -1):
        x[row] = (a[row][n] - sum(a[row][k] * x[k] for k in range(row + 1, n))) / a[row][row]
    return x


# --------------------------------------------------------------------------------------------
# The scheduler
# --------------------------------------------------------------------------------------------


@dataclass
class _Inflight:
    plan: StepPlan
    record: StepRecord
    features: StepFeatures


class Scheduler:
    """Owns the waiting queue, the running set and chunked-prefill progress; plans each step.

    Threads: `add`, `abort`, `has_work`, `wait_for_work`, `wake` and the `num_*` properties may
    be called from any thread; everything else from the engine thread only. Requests added or
    aborted from other threads take effect at the next `schedule()` call.
    """

    def __init__(self, config: SchedulerConfig, memory: MemoryManager):
        self.config = config
        self.memory = memory
        self.prefill_chunk_tokens = self._resolve_prefill_chunk_tokens()
        self.min_prefill_chunk_tokens = min(config.min_prefill_chunk_tokens, self.prefill_chunk_tokens)
        self.cost_model = StepCostModel(decay=config.cost_model_decay)
        self.records: deque[StepRecord] = deque(maxlen=config.step_history)
        self.counters = StepCounters()
        self._step_log = StepLog(config.step_log) if config.step_log else None
        # Engine-thread state.
        self._waiting: list[Sequence] = []  # sorted by (priority, rank)
        self._running: list[Sequence] = []  # in admission order: the last is the preemption victim
        self._ranks: dict[int, int] = {}  # id(seq) -> queue rank; negative ranks jump the queue
        self._back_ranks = itertools.count()
        self._front_ranks = itertools.count(-1, -1)
        self._inflight: _Inflight | None = None
        self._next_step_index = 0
        # Shared with other threads, under _lock.
        self._lock = threading.Lock()
        self._work_changed = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._abort_requests: set[str] = set()
        self._live_ids: set[str] = set()

    def _resolve_prefill_chunk_tokens(self) -> int:
        explicit = self.config.prefill_chunk_tokens
        if explicit is not None:
            logger.info("prefill_chunk_tokens = %d (explicit)", explicit)
            return explicit
        derived = self.memory.derived_prefill_chunk_tokens(self.config.max_running_requests)
        _require(_is_int(derived) and derived >= 1, "prefill_chunk_tokens", derived,
                 f">= 1 when derived from the window pool with max_running_requests="
                 f"{self.config.max_running_requests}; enlarge the window pool, lower "
                 "max_running_requests or set prefill_chunk_tokens")
        chunk = min(derived, self.config.max_num_batched_tokens)
        logger.info("prefill_chunk_tokens = %d (derived from the memory pools: %d for max_running_requests=%d, "
                    "capped by max_num_batched_tokens=%d)", chunk, derived, self.config.max_running_requests,
                    self.config.max_num_batched_tokens)
        return chunk

    # --- any thread ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError if it is not fresh, its id is in use, or it can never fit.

        "Can never fit" is judged on the request's longest possible length, prompt + max_tokens - 1
        positions (the last sampled token is never fed back): a request accepted here can always
        finish once it runs alone, so it is never failed half-way for lack of memory.
        """
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.output_ids:
            raise ValueError(f"request {seq.request_id!r}: only fresh sequences can be added")
        if not seq.prompt_ids:
            raise ValueError(f"request {seq.request_id!r}: the prompt is empty")
        positions = len(seq.prompt_ids) + seq.sampling.max_tokens - 1
        if not self.memory.can_ever_fit(positions):
            raise ValueError(
                f"request {seq.request_id!r}: prompt ({len(seq.prompt_ids)} tokens) + max_tokens "
                f"({seq.sampling.max_tokens}) needs {positions} positions, more than the memory pools can "
                "ever hold; shorten the prompt or lower max_tokens")
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
        plan = StepPlan()
        self._take_arrivals_and_aborts(plan)
        self._build(plan)
        if not plan.chunks:
            return plan if plan.aborted else None
        self._commit(plan, time.monotonic() if now is None else now)
        return plan

    def on_step_done(self, plan: StepPlan, duration_s: float, finished: Iterable[Sequence] = ()) -> None:
        """The engine ran `plan`, advanced num_computed_tokens, and reports the sequences that finished.

        Finished sequences leave the running set and their memory is freed (the engine sets
        finish_reason; the scheduler sets status FINISHED). `duration_s` feeds the step-cost model
        and the step record, which is then written to the step log.
        """
        finished = list(finished)
        if plan.step_index is None:  # a report-only plan: nothing ran
            if finished:
                raise ValueError("a plan without chunks cannot finish sequences")
            return
        if self._inflight is None or plan is not self._inflight.plan:
            raise RuntimeError(f"on_step_done() for step {plan.step_index}, which is not the step in flight")
        self._check_advanced(plan, finished)
        for seq in finished:
            self._retire(seq)
        inflight, self._inflight = self._inflight, None
        inflight.record.duration_s = duration_s
        self.cost_model.observe(inflight.features, duration_s)
        if self._step_log is not None:
            self._step_log.write(inflight.record)

    def close(self) -> None:
        """Close the step log."""
        if self._step_log is not None:
            self._step_log.close()
            self._step_log = None

    # --- arrivals, aborts, retirement ---------------------------------------------------------

    def _take_arrivals_and_aborts(self, plan: StepPlan) -> None:
        with self._lock:
            arrivals, self._inbox = self._inbox, []
            aborts, self._abort_requests = self._abort_requests, set()
        for seq in arrivals:
            self._enqueue(seq, front=False)
        if aborts:
            for seq in [s for s in self._running + self._waiting if s.request_id in aborts]:
                self._end(plan, seq, FinishReason.CANCELLED)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Insert into waiting: FCFS within a priority, lower priority value first; `front` jumps its class."""
        self._ranks[id(seq)] = next(self._front_ranks if front else self._back_ranks)
        seq.status = SequenceStatus.WAITING
        bisect.insort(self._waiting, seq, key=self._waiting_key)

    def _waiting_key(self, seq: Sequence) -> tuple[int, int]:
        return seq.priority, self._ranks[id(seq)]

    def _end(self, plan: StepPlan, seq: Sequence, reason: FinishReason) -> None:
        """The scheduler finishes `seq` itself (cancelled, or cannot fit); reported in plan.aborted."""
        if seq in self._waiting:
            self._waiting.remove(seq)
        self._retire(seq)
        seq.finish_reason = reason
        plan.aborted.append(seq)
        if reason is FinishReason.CANCELLED:
            self.counters.num_cancelled += 1
        else:
            self.counters.num_failed += 1

    def _retire(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            raise ValueError(f"request {seq.request_id!r} finished but is not in the running set")
        self.memory.free(seq)
        self._ranks.pop(id(seq), None)
        seq.status = SequenceStatus.FINISHED
        with self._lock:
            self._live_ids.discard(seq.request_id)
            self._abort_requests.discard(seq.request_id)

    def _check_advanced(self, plan: StepPlan, finished: list[Sequence]) -> None:
        done = {id(seq) for seq in finished}
        for chunk in plan.chunks:
            if id(chunk.seq) not in done and chunk.seq.num_computed_tokens != chunk.end:
                raise RuntimeError(
                    f"request {chunk.seq.request_id!r}: num_computed_tokens is {chunk.seq.num_computed_tokens}, "
                    f"expected {chunk.end}; the engine advances it before on_step_done()")

    # --- building a step ----------------------------------------------------------------------

    def _build(self, plan: StepPlan) -> None:
        """Fill plan.chunks by the policy; if memory blocks every candidate, free memory and retry.

        Each retry preempts or fails at least one sequence, so the loop is bounded.
        """
        for _ in range(len(self._running) + len(self._waiting) + 1):
            if self.config.policy == "mixed":
                self._build_mixed(plan)
            else:
                self._build_prefill_first(plan)
            if plan.chunks or not (self._running or self._waiting):
                return
            if self._running:
                self._make_room(plan, self._running[0], 1)  # the oldest request must progress
            else:
                # Admission failed in an empty engine: the memory manager contradicts can_ever_fit.
                self._end(plan, self._waiting[0], FinishReason.ERROR)
                logger.warning("request %r failed: it does not fit in an empty engine", plan.aborted[-1].request_id)

    def _build_prefill_first(self, plan: StepPlan) -> None:
        """`prefill(budget) or decode()`, with an interleaved decode step every N prefill steps."""
        every = self.config.decode_interleave_every
        if every is not None and self.counters.prefill_streak >= every and self._has_running_decode():
            self._schedule_decodes(plan)
            if plan.chunks:
                return
        self._schedule_prefills(plan, self._prefill_budget(plan))
        if not plan.chunks:
            self._schedule_decodes(plan)

    def _build_mixed(self, plan: StepPlan) -> None:
        """Every runnable decode, then prefill tokens within min(chunk budget, batched tokens - decodes)."""
        self._schedule_decodes(plan)
        room = self.config.max_num_batched_tokens - plan.num_tokens  # >= 1 while prefill is possible
        self._schedule_prefills(plan, min(self._prefill_budget(plan), room))

    def _has_running_decode(self) -> bool:
        return any(seq.is_decode for seq in self._running)

    def _schedule_decodes(self, plan: StepPlan) -> None:
        """One token for each running decode, oldest first, preempting the newest on memory shortage."""
        for seq in list(self._running):
            if plan.num_tokens >= self.config.max_num_batched_tokens:
                return
            if seq in self._running and seq.is_decode and not plan.has_chunk(seq):
                if self._make_room(plan, seq, 1):
                    self._add_chunk(plan, seq, 1)

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> None:
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

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Move waiting requests to running, strictly in queue order (no skipping a blocked head)."""
        if plan.preempted and self._running:
            return  # do not re-admit what this step just evicted while others still hold memory
        left = budget
        while left > 0 and self._waiting and self._can_admit_another():
            seq = self._waiting[0]
            num_tokens = min(seq.num_uncomputed_tokens, left)
            if not self.memory.can_extend(seq, num_tokens):
                return
            self._waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            self._add_chunk(plan, seq, num_tokens)
            left -= num_tokens

    def _can_admit_another(self) -> bool:
        return len(self._running) < self.config.max_running_requests and self.memory.has_free_slot()

    def _fit_chunk(self, seq: Sequence, num_tokens: int) -> int:
        """The largest chunk <= num_tokens whose pages exist (can_extend is monotone); 0 if none."""
        if self.memory.can_extend(seq, num_tokens):
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
        while not self.memory.can_extend(seq, num_tokens):
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
        self.memory.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._enqueue(seq, front=True)
        plan.preempted.append(seq)
        logger.debug("preempted request %r (%d tokens to recompute)", seq.request_id, seq.num_tokens)

    def _add_chunk(self, plan: StepPlan, seq: Sequence, num_tokens: int) -> None:
        self.memory.extend(seq, num_tokens)
        start = seq.num_computed_tokens
        plan._add(ScheduledChunk(seq, num_tokens, start, is_decode=seq.is_decode,
                                 samples=start + num_tokens == seq.num_tokens))

    # --- prefill budget -----------------------------------------------------------------------

    def _prefill_budget(self, plan: StepPlan) -> int:
        """Prefill tokens allowed in this step: the chunk budget, or less under an ITL target.

        With `mixed` the target bounds the whole step (decodes already in `plan` included); with
        `prefill_first` it caps each prefill step, so a decode waits at most about
        decode_interleave_every * itl_target_ms.
        """
        if self.config.itl_target_ms is None:
            return self.prefill_chunk_tokens
        candidate = self._next_prefill_candidate(plan)
        context = candidate.num_computed_tokens if candidate is not None else 0
        return self.cost_model.max_prefill_tokens(
            self.config.itl_target_ms / 1e3, StepFeatures.of(plan.chunks), context,
            lo=self.min_prefill_chunk_tokens, hi=self.prefill_chunk_tokens)

    def _next_prefill_candidate(self, plan: StepPlan) -> Sequence | None:
        for seq in self._running:
            if seq.is_prefill and not plan.has_chunk(seq):
                return seq
        return self._waiting[0] if self._waiting else None

    # --- bookkeeping --------------------------------------------------------------------------

    def _commit(self, plan: StepPlan, now: float) -> None:
        plan.step_index = self._next_step_index
        self._next_step_index += 1
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
        )
        self.counters.observe(record)
        self.records.append(record)
        self._inflight = _Inflight(plan, record, features)
