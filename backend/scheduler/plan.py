"""What the scheduler decides for one step, and what the step returns (its tokens, their timing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.request import Sequence
from backend.scheduler.step_record import StepKind, StepTiming

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
    # Overlapped verify steps: the chunk was scheduled while the verify before it was in flight, as if that one
    # accepted every draft (its tokens, the drafts included, are on the device: that verify's chain wrote them); void
    # once that verify's output shows it accepted fewer (its output is dropped: the scheduler's `_void_successor`).
    optimistic: bool = False
    void: bool = False

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
    timing: StepTiming = field(default_factory=StepTiming)  # filled by the engine and the executor
    # Set by the engine once the step is built: its verify rows' next tokens and drafts are left on the device (the
    # early chain, backend/speculative.py), so the next step may be scheduled before this one is taken in.
    chains_on_device: bool = False
    # Speculative decoding: its rows draft for the next step (the engine may decide they do not: adaptive_speculation)
    proposes_drafts: bool = True
    started: float = 0.0  # set by the engine: time.perf_counter() where it began scheduling the step
    _scheduled: dict[Sequence, ScheduledChunk] = field(default_factory=dict, init=False, repr=False)  # seq -> chunk

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def plain_decoding(self) -> bool:
        """Speculative decoding: a step of decodes that neither verifies drafts nor proposes any (its rows decode as
        without speculation: the step after it may be scheduled before it is taken in, as then)."""
        return not (self.proposes_drafts or self.num_prefill_tokens or any(chunk.drafts for chunk in self.chunks))

    def has_chunk(self, seq: Sequence) -> bool:
        return seq in self._scheduled

    def chunk_of(self, seq: Sequence) -> ScheduledChunk | None:
        return self._scheduled.get(seq)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self._scheduled[chunk.seq] = chunk
        if chunk.is_decode:
            self.num_decode_tokens += chunk.num_tokens
        else:
            self.num_prefill_tokens += chunk.num_tokens


@dataclass
class StepOutput:
    """What a step produced, from the sampler or the verifier to the responses: per sampling row (plan order) the
    tokens it emits, in order (a verify row: its accepted drafts' successors too), or the error that failed the step.

    The scheduler's `update_from_output` is its one reader: it hands each row's token list and log-probabilities on
    to the request's `RequestOutput` as they are.
    """

    tokens: list[list[int]] = field(default_factory=list)
    # per sampling row, each emitted token's log-probabilities (None for a row that did not ask), when any row asked
    logprobs: "list[list[TokenLogprobs] | None] | None" = None
    # Rows whose request the step ended by its output constraint: None, the grammar's end was reached (finish_reason
    # "stop"); a message, it could not go on (finish_reason "error").
    ends: dict[int, str | None] = field(default_factory=dict)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # speculative decoding: each row's next drafts
    # Verify rows whose tokens are accepted drafts alone, no token after them (the grammar allowed none there): every
    # token of theirs is an accepted draft, where a verify row's last token is otherwise the one after its drafts.
    drafts_alone: set[int] = field(default_factory=set)
    timing: StepTiming = field(default_factory=StepTiming)
    error: str | None = None
    # The sampler's tokens, one per row, where it drew them (a tensor on the logits' device) until they are read to
    # the host into `tokens` (`read_sampled`).
    sampled: object = None

    def read_sampled(self, host_tokens: list[int]) -> "StepOutput":
        """The sampled tokens as read to the host: one token per row."""
        self.tokens, self.sampled = [[token] for token in host_tokens], None
        return self

    def row_logprobs(self, row: int) -> "list[TokenLogprobs] | None":
        return None if self.logprobs is None else self.logprobs[row]
