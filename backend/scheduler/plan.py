"""What the scheduler decides for one step: the chunks of one forward, and who it ended or preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.request import Sequence
from backend.scheduler.step_record import StepKind


@dataclass
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of seq.token_ids() in this step."""

    seq: Sequence
    num_tokens: int
    start: int  # seq.num_computed_tokens when the step was scheduled
    is_decode: bool  # the single last-sampled token of a decoding sequence
    samples: bool  # the chunk reaches seq.num_tokens: the engine samples a token for it
    # block boundaries inside the chunk whose state the step keeps (prefix caching; ReservedSnapshot)
    snapshots: list = field(default_factory=list)

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
    itl_infeasible: bool = False  # the ITL target could not be met even with the minimum prefill chunk
    num_cached_tokens: int = 0  # prompt positions admissions in this step took from the prefix cache
    _scheduled: set[Sequence] = field(default_factory=set, init=False, repr=False)  # seqs with a chunk

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
        return seq in self._scheduled

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self._scheduled.add(chunk.seq)
