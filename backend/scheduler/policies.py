"""Scheduling policies and prefill budgets: small objects the scheduler consults once per step.

A policy decides what a step carries, using the scheduler's building blocks (`schedule_decodes`,
`schedule_prefills`, `prefill_budget`); a budget decides how many prefill tokens a step may take.
See docs/seed-bug-report.md for the failure they answer and docs/scheduling.md for the rules:

- `PrefillFirst`: the historical `prefill(budget) or decode()`; with `interleave_every=N`, after N
  consecutive prefill steps one decode step if a decode is runnable (never an idle step instead);
  any step that carries a decode restarts the count. The count is the policy's own state.
- `Mixed`: every step carries every runnable decode plus prefill tokens within
  min(budget, max_num_batched_tokens - decodes).
- `FixedBudget`: prefill_chunk_tokens every step.
- `ItlTargetBudget`: the most prefill tokens the step-cost model predicts (at its 90th percentile)
  to fit the target, never below a minimum chunk (prefill always progresses) and never more than
  twice the sequence's previous chunk (a trust region: one mispredicted step can at most double).
  With `mixed` it bounds every step; with `prefill_first` it caps each prefill step. The budget is sized for
  the step's first prefill chunk; each further chunk (another running prefill, an admission) gets what the step
  has left at its own context (`more_tokens`), possibly none. A step that
  could not meet the target even with the minimum chunk is flagged infeasible (plan, step record,
  counter, metric) and logged once with the predicted floor; it still takes the minimum chunk.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Protocol

from backend.config import ConfigError
from backend.scheduler.cost_model import StepCostModel, StepFeatures
from backend.scheduler.plan import StepPlan
from backend.scheduler.step_record import StepKind

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.request import Sequence
    from backend.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Policy(Protocol):
    def build(self, scheduler: "Scheduler", plan: StepPlan) -> None:
        """Fill plan.chunks through the scheduler's building blocks."""

    def on_step(self, kind: StepKind) -> None:
        """A step of this kind was committed."""


class PrefillFirst:
    def __init__(self, interleave_every: int | None = None):
        self.interleave_every = interleave_every
        self.prefill_streak = 0  # consecutive prefill-only steps ending at the latest one

    def build(self, scheduler: "Scheduler", plan: StepPlan) -> None:
        every = self.interleave_every
        if every is not None and self.prefill_streak >= every and scheduler.has_running_decode():
            scheduler.schedule_decodes(plan)
            if plan.chunks:
                return
        scheduler.schedule_prefills(plan, scheduler.prefill_budget(plan))
        if not plan.chunks:
            scheduler.schedule_decodes(plan)

    def on_step(self, kind: StepKind) -> None:
        self.prefill_streak = self.prefill_streak + 1 if kind is StepKind.PREFILL else 0


class Mixed:
    def build(self, scheduler: "Scheduler", plan: StepPlan) -> None:
        scheduler.schedule_decodes(plan)
        room = scheduler.max_num_batched_tokens - plan.num_tokens  # >= 1 while prefill is possible
        scheduler.schedule_prefills(plan, min(scheduler.prefill_budget(plan), room))

    def on_step(self, kind: StepKind) -> None:
        pass


def make_policy(config: "EngineConfig") -> Policy:
    if config.policy == "mixed":
        return Mixed()
    return PrefillFirst(config.decode_interleave_every)


class FixedBudget:
    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    def tokens(self, plan: StepPlan, candidate: "Sequence | None", context: int) -> int:
        return self.chunk_tokens

    def more_tokens(self, plan: StepPlan, candidate: "Sequence", context: Callable[[], int], left: int) -> int:
        return left


class ItlTargetBudget:
    def __init__(self, target_ms: float, cost_model: StepCostModel, min_tokens: int, max_tokens: int):
        self.target_s = target_ms / 1e3
        self.cost_model = cost_model
        self.min_tokens = min(min_tokens, max_tokens)
        self.max_tokens = max_tokens
        self._warned = False

    def tokens(self, plan: StepPlan, candidate: "Sequence | None", context: int) -> int:
        """Prefill tokens for this step; `candidate` is the sequence they will mostly go to, its chunk starting at
        position `context`."""
        if candidate is None:
            return self.max_tokens  # nothing to prefill: the budget is not used
        base = StepFeatures.of(plan.chunks)
        hi = self.max_tokens
        if candidate.last_chunk_tokens:
            hi = max(self.min_tokens, min(hi, 2 * candidate.last_chunk_tokens))
        floor_s = self.cost_model.predict_upper(base.plus(self.min_tokens, context))
        if floor_s is not None and floor_s > self.target_s:
            plan.itl_infeasible = True
            self._warn_once(floor_s, base, context)
            return self.min_tokens
        return self.cost_model.max_prefill_tokens(self.target_s, base, context, lo=self.min_tokens, hi=hi)

    def more_tokens(self, plan: StepPlan, candidate: "Sequence", context: Callable[[], int], left: int) -> int:
        """Prefill tokens, at most `left`, for a further chunk of a step that carries a prefill chunk already (its
        budget was sized for that one): as many as the step, with what it carries, is predicted to take within the
        target at this chunk's own context (`context()`: where it starts); 0 when none (the minimum chunk is the
        first one's alone)."""
        if self.cost_model.num_observations == 0:
            return left  # (nothing learned yet: the first chunk took the minimum)
        hi = min(left, 2 * candidate.last_chunk_tokens) if candidate.last_chunk_tokens else left
        return self.cost_model.max_prefill_tokens(self.target_s, StepFeatures.of(plan.chunks), context(), lo=0, hi=hi)

    def _warn_once(self, floor_s: float, base: StepFeatures, context: int) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "itl_target_ms=%g cannot be met: a step with %d decodes and the minimum %d-token prefill chunk at "
                "context %d is predicted at %.1f ms (90th percentile; the model's fixed cost is %.1f ms); such steps "
                "take the minimum chunk and are counted as infeasible (dsv4_itl_infeasible_steps_total)",
                self.target_s * 1e3, base.decode_tokens, self.min_tokens, context, floor_s * 1e3,
                (self.cost_model.predict(StepFeatures()) or 0.0) * 1e3)


def resolve_prefill_chunk_tokens(config: "EngineConfig", memory) -> int:
    """The step's prefill chunk budget: explicit, or derived from the window pool (logged either way).

    Called once, when the memory manager exists; a derived budget below one token is a deployment
    error (ConfigError naming the parameters to change).
    """
    if config.prefill_chunk_tokens is not None:
        logger.info("prefill_chunk_tokens = %d (explicit)", config.prefill_chunk_tokens)
        return config.prefill_chunk_tokens
    derived = memory.derived_prefill_chunk_tokens(config.max_running_requests)
    if derived < 1:
        raise ConfigError(
            f"parameter 'prefill_chunk_tokens': derived value {derived} from the window pool with "
            f"max_running_requests={config.max_running_requests} is < 1; enlarge the window pool "
            "(num_tokens, swa_full_tokens_ratio), lower max_running_requests or set prefill_chunk_tokens")
    chunk = min(derived, config.max_num_batched_tokens)
    if derived <= memory.page_size:  # (the window pool's windows left no room for a chunk's: one page is the floor)
        logger.warning("prefill_chunk_tokens = %d (one page): the window pool holds hardly more than the windows of "
                       "max_running_requests=%d requests; prompts prefill a page a step. Lower max_running_requests, "
                       "raise num_tokens or swa_full_tokens_ratio, or set prefill_chunk_tokens", chunk,
                       config.max_running_requests)
    logger.info("prefill_chunk_tokens = %d (derived from the memory pools: %d for max_running_requests=%d, "
                "capped by max_num_batched_tokens=%d)", chunk, derived, config.max_running_requests,
                config.max_num_batched_tokens)
    return chunk
