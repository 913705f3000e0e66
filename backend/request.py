"""Requests as the engine and the scheduler see them.

A `Sequence` is one request's whole state: its tokens, how many of them already have their
keys/values in the pools (`num_computed_tokens`), its sampling parameters and its status.
Everything else (pages, compressor slots) is owned by the memory manager and keyed by
`request_id`.

Token accounting, the one rule the scheduler and engine share:
- `num_tokens = len(prompt_ids) + len(output_ids)`;
- the tokens `[num_computed_tokens, num_tokens)` still need a forward;
- a step that computes the last of them yields logits, and a new token is sampled;
- a prefill is a sequence with more than one uncomputed token, a decode one with exactly one.
Preemption (recompute) sets `num_computed_tokens = 0`: the prompt and the outputs already
streamed are prefilled again, and generation resumes where it stopped.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # aborted by the client
    ERROR = "error"  # rejected or failed inside the engine


@dataclass
class SamplingParams:
    """Per-request decoding parameters (validated by `validate()`)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, max_tokens_limit: int | None = None) -> None:
        """Raise ValueError naming the offending field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise ValueError(f"max_tokens must be at most {max_tokens_limit}, got {self.max_tokens}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer below 2**63, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step: new tokens and text, or the end."""

    request_id: str
    new_token_ids: list[int]
    new_text: str  # incremental text; never splits a UTF-8 character
    finished: bool
    finish_reason: FinishReason | None
    num_input_tokens: int
    num_output_tokens: int
    error: str | None = None  # set when finish_reason is ERROR


_request_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first among waiting requests
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    arrival_index: int = field(default_factory=lambda: next(_request_counter))
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Exactly one token left to compute: the last sampled one."""
        return self.num_uncomputed_tokens == 1 and len(self.output_ids) > 0

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode and self.num_uncomputed_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
