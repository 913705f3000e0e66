"""The iteration-level scheduler (plain Python, no torch): who gets tokens in the next forward.

- `scheduler`: `Scheduler` — the cross-thread inbox, the queues, admission, preemption, token
  accounting, page release after a step — and the `MemoryManager` and `PrefixCacheHooks` protocols
  it works through.
- `policies`: what a step carries (`PrefillFirst` with its interleave counter, `Mixed`) and how
  many prefill tokens it may take (`FixedBudget`, `ItlTargetBudget`); the derived chunk budget.
- `cost_model`: the step-cost model behind the ITL target.
- `plan`: `StepPlan` and `ScheduledChunk`, one step's decision; `StepOutput`, what it returned (the sampler's and
  the verifier's one result type).
- `step_record`: one record per step with its `StepTiming`, counters, the JSON-lines step log.
"""

from backend.scheduler.cost_model import StepCostModel, StepFeatures
from backend.scheduler.plan import ScheduledChunk, StepOutput, StepPlan
from backend.scheduler.policies import resolve_prefill_chunk_tokens
from backend.scheduler.scheduler import MemoryManager, NoPrefixCache, PrefixCacheHooks, Scheduler
from backend.scheduler.step_record import StepCounters, StepKind, StepLog, StepRecord, StepTiming

__all__ = ["MemoryManager", "NoPrefixCache", "PrefixCacheHooks", "ScheduledChunk", "Scheduler",
           "StepCostModel", "StepCounters", "StepFeatures", "StepKind", "StepLog", "StepOutput", "StepPlan",
           "StepRecord", "StepTiming", "resolve_prefill_chunk_tokens"]
