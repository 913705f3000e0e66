"""What the scheduler decides for one step, what the step returns, and what the engine then reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.request import Sequence
from backend.scheduler.step_record import StepKind

if TYPE_CHECKING:
    from backend.request import TokenLogprobs


@dataclass(eq=False, slots=True)
class ScheduledChunk:
    """Compute tokens [start, start + num_tokens) of the sequence in this step."""

    seq: Sequence
    num_tokens: int
    start: int  # seq.num_computed_tokens when the step was scheduled
    is_decode: bool  # the single last-sampled token of a decoding sequence
    samples: bool  # the chunk reaches seq.num_tokens: the step samples a token for it
    # Which life of the sequence this chunk belongs to (seq.num_preemptions when scheduled): a preemption while the
    # step is in flight makes its chunk stale (the memory it computed into is gone).
    epoch: int = 0
    # block boundaries in (start, end] whose state the step keeps (prefix caching; ReservedSnapshot)
    snapshots: list = field(default_factory=list)
    # Speculative decoding: a decode that verifies these draft tokens (its chunk: the last token, then them), and
    # the positions from `start` its pages were allocated for (the verify's, and the draft chain's after it).
    drafts: tuple[int, ...] = ()
    allocated: int = 0

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    """One step's decision.

    A plan without chunks (`kind is None`, `step_index is None`) carries no forward: it only
    reports sequences the scheduler ended (`aborted`) while nothing was runnable. The engine sends
    their final responses; no output follows.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Sequences the scheduler ended this step; each is FINISHED with finish_reason CANCELLED
    # (abort), TIMEOUT (past its deadline) or ERROR (could not fit in the memory); memory already freed.
    aborted: list[Sequence] = field(default_factory=list)
    # Sequences sent back to the waiting queue this step (recompute later; outputs kept).
    preempted: list[Sequence] = field(default_factory=list)
    kind: StepKind | None = None
    step_index: int | None = None
    predicted_s: float | None = None  # the step-cost model's prediction, when it has data
    itl_infeasible: bool = False  # the ITL target could not be met even with the minimum prefill chunk
    num_cached_tokens: int = 0  # prompt positions admissions in this step took from the prefix cache
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    host_s: float = 0.0  # the engine's time to schedule, build and launch this step (set by the engine)
    _scheduled: set[Sequence] = field(default_factory=set, init=False, repr=False)  # seqs with a chunk

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def has_chunk(self, seq: Sequence) -> bool:
        return seq in self._scheduled

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self._scheduled.add(chunk.seq)
        if chunk.is_decode:
            self.num_decode_tokens += chunk.num_tokens
        else:
            self.num_prefill_tokens += chunk.num_tokens


@dataclass
class StepOutput:
    """What a step returned: a token per sampling chunk, in plan order, or the error that failed it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list["TokenLogprobs | None"] | None = None  # per sampling chunk, when any request asked
    duration_s: float = 0.0  # the step's device time
    error: str | None = None
    # Sampling rows (by index in `tokens`) whose request the step ended by its output constraint: None, the
    # grammar's end was reached (finish_reason "stop"); a message, it could not go on (finish_reason "error").
    row_ends: dict[int, str | None] = field(default_factory=dict)
    mask_fill_s: float = 0.0  # filling the constrained rows' token masks (host time, beside the forward)
    grammar_accept_s: float = 0.0  # advancing their grammars by the sampled tokens (host time, after sampling)
    # Speculative decoding (backend/speculative.py), by sampling row: the tokens a verify row emits after its first
    # (`tokens[row]`): its accepted drafts' successors; their log-probabilities; the drafts for the row's next step.
    more_tokens: dict[int, list[int]] = field(default_factory=dict)
    more_logprobs: dict[int, list] = field(default_factory=dict)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    draft_s: float = 0.0  # the draft layer's forwards (inside duration_s)
    # Data-parallel attention: the rows every rank's MoE exchange computed for nothing in this lock-step forward (each
    # rank padded to the largest rank's tokens: ranks x largest - all tokens)
    dp_padding_tokens: int = 0

    def row_tokens(self, row: int) -> list[int]:
        """Every token sampling row `row` emitted, in order."""
        return [self.tokens[row], *self.more_tokens.get(row, ())]

    def row_logprobs(self, row: int) -> list | None:
        if self.logprobs is None or self.logprobs[row] is None:
            return None
        return [self.logprobs[row], *self.more_logprobs.get(row, ())]


@dataclass
class SeqUpdate:
    """What a step's output did to one request: its new tokens (none: it failed), and whether it ended."""

    seq: Sequence
    tokens: list[int]
    logprobs: "list[TokenLogprobs] | None"
    finished: bool
    error: str | None = None
