"""Requests as the engine and the scheduler see them.

A `Sequence` is one request's whole engine-side state, in one object: its tokens, how many of them
already have their keys/values in the pools (`num_computed_tokens`), its sampling parameters, its
status, and what the engine attaches at submit (the stop ids, the sampler's state, the queue rank and
the handle of its pages; its outputs go where the engine placed it, `RequestOutput.of`). The scheduler ends it (`finish()`) and frees
its memory.

Token accounting, one owner (the scheduler, backend/scheduler/scheduler.py):
- `token_ids` is the prompt followed by the outputs known on the host; it only grows (in place), so
  per-step work never copies a context;
- `num_placeholders` counts tokens sampled by steps still in flight: their values are on the device
  (the next step reads them there) and reach the host one step later;
- `num_tokens = len(token_ids) + num_placeholders`, and the tokens `[num_computed_tokens,
  num_tokens)` still need a forward;
- scheduling a step advances `num_computed_tokens` over its chunks and adds a placeholder for each
  chunk that reaches `num_tokens` (it samples); the step's output replaces the placeholder with the
  token (`append_output`);
- a prefill is a sequence with more than one uncomputed token, a decode one with exactly one: the
  last sampled token. A sequence whose sampled tokens already reach `max_tokens` is neither: it only
  waits for its last result.
Preemption (recompute) sets `num_computed_tokens = 0`: the prompt and the outputs already
streamed are prefilled again, and generation resumes where it stopped.

Validation, each rule once: `SamplingParams` checks its own values when built (`from_dict` also
coerces what clients send); `RequestLimits.check` holds what a deployment allows (vocabulary,
max_tokens_limit, positions) and is called by `LLMEngine.submit`, the only admission gate.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from backend.errors import is_int, is_number
from backend.structured.params import GUIDED_KEYS, GuidedDecoding, guided_decoding_from_sampling

if TYPE_CHECKING:
    from backend.memory.kv_manager import RequestPages
    from backend.sampler import SamplerState
    from backend.structured.grammar import RequestGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class EngineUnavailable(ValueError):
    """The engine cannot take the request: its queue is full (max_queue_size), or it can no longer serve at all
    (a rank of its group is gone, or it is shutting down). Answered with Triton's UNAVAILABLE code."""


SHUTTING_DOWN = "the model is shutting down"  # the error of a request the engine's shutdown ends, or refuses


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # aborted by the client
    TIMEOUT = "timeout"  # not finished within its timeout_ms (the tokens so far were delivered)
    ERROR = "error"  # rejected or failed inside the engine


# --- sampling parameters ----------------------------------------------------------------------------

MAX_TOP_LOGPROBS = 20  # as OpenAI's API allows
MAX_LOGIT_BIAS = 100.0  # as OpenAI's API allows
SAMPLING_EPS = 1e-5  # a temperature below this is greedy (vLLM's _SAMPLING_EPS)
# Every stop string is looked for in every token's new text, on the thread that sends every request's responses:
# bounded, so one request cannot slow the others' streams (OpenAI's API takes 4, TGI 4 by default)
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 64, 1024


@dataclass
class SamplingParams:
    """Per-request decoding parameters; a bad value raises ValueError naming the field."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or below SAMPLING_EPS, as vLLM) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's spelling) means no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: no stop token (eos, stop_token_ids) is drawn and no stop string ends the output before this many output
    # tokens (backend/sampler.py `HeldStops`, backend/detokenizer.py); a grammar's end still ends it. Above max_tokens
    # it is max_tokens (vLLM refuses it; genai-perf may send a max_tokens below its output length).
    min_tokens: int = 0
    timeout_ms: int | None = None  # from submission: a request not finished by then ends with finish_reason "timeout"
    # Log-probabilities (vLLM's meaning): None: none; k >= 0: each generated token's, and the k most likely
    # tokens' of the same distribution (backend/sampler.py says which distribution).
    logprobs: int | None = None
    # Penalties on tokens already in the request (backend/sampler.py): OpenAI's frequency / presence penalties
    # over the generated tokens, vLLM's (HF's) repetition penalty over prompt and generated tokens.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias (token id -> a bias in [-100, 100] added to its logit) and vLLM's allowed_token_ids (every
    # other token's logit -inf), before the penalties, as vLLM applies them (backend/sampler.py)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    n: int = 1  # completions per request: only 1 (accepted because OpenAI clients send it)
    # The output constraint (backend/structured/params.py): from `guided_decoding`, `structured_outputs` or
    # `response_format` in what clients send.
    guided_decoding: GuidedDecoding | None = None

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check_range("temperature", self.temperature, 0.0, 100.0, "[0, 100]")
        if self.temperature < SAMPLING_EPS:  # (dividing by it overflows: the argmax, as vLLM takes it)
            self.temperature = 0.0
        _check_range("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be a non-negative integer (0 or -1: no cut), got {self.top_k!r}")
        self.top_k = max(self.top_k, 0)
        _check_range("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")  # (OpenAI's range)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r:.200}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters, "
                             f"got {len(self.stop)} of up to {max(map(len, self.stop))}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        self.min_tokens = min(self.min_tokens, self.max_tokens)
        if self.timeout_ms is not None and (not is_int(self.timeout_ms) or not 1 <= self.timeout_ms <= 2 ** 53):
            # (up to 2^53: every such count of milliseconds is a float, which deadlines are computed in)
            raise ValueError(f"timeout_ms must be a positive integer (milliseconds) up to 2^53, got "
                             f"{self.timeout_ms!r}")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, "(0, 10]", low_open=True)
        if self.logit_bias is not None and not (
                isinstance(self.logit_bias, dict) and all(is_int(t) and t >= 0 for t in self.logit_bias)
                and all(_in_range(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for b in self.logit_bias.values())):
            raise ValueError(f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {self.logit_bias!r:.200}")
        if self.allowed_token_ids is not None and not (
                isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                             f"{self.allowed_token_ids!r:.200}")
        if not is_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1: one completion per request (send the request again for more), got {self.n!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecoding):
            raise ValueError(f"guided_decoding must be a GuidedDecoding, got {type(self.guided_decoding).__name__}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs (top log-probabilities per token) must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.logprobs!r}")

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], where: str = "sampling_parameters") -> "SamplingParams":
        """Coerce what clients send (numbers as numeric strings, booleans as "true" / "false", `stop` as one string)
        and build; unknown keys and bad values raise ValueError naming them."""
        unknown = sorted(set(params) - SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in {where}; known: {sorted(SAMPLING_KEYS)}")
        kwargs: dict[str, Any] = {"guided_decoding": guided_decoding_from_sampling(params, where)}
        for key, value in without_unset_nulls(params).items():
            if key in GUIDED_KEYS:
                continue
            if key in VLLM_FIXED_KEYS:
                fixed = VLLM_FIXED_KEYS[key]
                value = _as_bool(value) if isinstance(fixed, bool) else _as_int(value, key)
                if type(value) is not type(fixed) or value != fixed:  # (1 is no True, nor True a 1)
                    raise ValueError(f"{key}={json.dumps(value)} is not supported here (only {json.dumps(fixed)}, "
                                     "vLLM's default)")
                continue
            if key == "logprobs" and isinstance(flag := _as_bool(value), bool):
                # (Triton's OpenAI frontend up to 25.11 sends chat's boolean `logprobs`, false unless asked for;
                # the vLLM backend takes it as int(): true asks for 1)
                if flag:
                    kwargs[key] = 1
            elif key in _INT_KEYS:
                kwargs[key] = _as_int(value, key)
            elif key in _FLOAT_KEYS:
                kwargs[key] = _as_float(value, key)
            elif key == "ignore_eos":
                kwargs[key] = _as_bool(value)
            elif key == "stop":
                kwargs[key] = [value] if isinstance(value, str) else value
            elif key == "logit_bias" and isinstance(value, dict):  # (JSON's keys are strings: "50256": -100)
                kwargs[key] = {_as_int(token, "a logit_bias token id"): _as_float(bias, f"logit_bias[{token!r}]")
                               for token, bias in value.items()}
            else:
                kwargs[key] = value
        return cls(**kwargs)


_INT_KEYS = ("max_tokens", "top_k", "seed", "min_tokens", "timeout_ms", "logprobs", "n")
# Keys whose JSON null means "not given", as vLLM's SamplingParams takes None for them (Triton's vLLM backend passes
# them through as they come)
_NULL_IS_UNSET = ("seed", "logprobs", "stop", "stop_token_ids", "timeout_ms", "ignore_eos", "skip_special_tokens",
                  "spaces_between_special_tokens", "include_stop_str_in_output", "best_of", "logit_bias",
                  "allowed_token_ids")
# vLLM's sampling parameters this engine always applies at vLLM's default: accepted at that value (clients that send
# vLLM's whole parameter set send them: Triton's OpenAI frontend up to 25.12 sends completions' best_of 1), refused
# otherwise. Text skips special tokens; a stop string is left out; one completion is drawn (n is 1).
VLLM_FIXED_KEYS = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                   "include_stop_str_in_output": False, "best_of": 1}


def without_unset_nulls(params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` less the keys whose null means "not given" (_NULL_IS_UNSET) where they are null."""
    return {key: value for key, value in params.items() if value is not None or key not in _NULL_IS_UNSET}
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
SAMPLING_KEYS = frozenset([f.name for f in fields(SamplingParams)] + [*GUIDED_KEYS, *VLLM_FIXED_KEYS])


def _check_range(name: str, value: Any, low: float, high: float, text: str, low_open: bool = False) -> None:
    if not _in_range(value, low, high, low_open):
        raise ValueError(f"{name} must be in {text}, got {value!r}")


def _in_range(value: Any, low: float, high: float, low_open: bool = False) -> bool:
    return is_number(value) and math.isfinite(value) and (low < value if low_open else low <= value) and value <= high


def _as_int(value: Any, key: str) -> int:
    if is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"{key} must be an integer, got {value!r}")


def _as_bool(value: Any) -> Any:
    """A boolean, or the string "true" / "false" (any case) as one, by value, as numbers come as numeric strings (the
    vLLM backend's parser takes strings for its boolean keys, and clients written for it may send them so; its
    `bool()` makes any non-empty one true, "false" too); anything else is left for the parameters' own check to
    refuse."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number, got {value!r}")
    try:
        number = float(value) if isinstance(value, (int, float, str)) else None
    except (ValueError, OverflowError):  # (an integer past float's range)
        number = None
    if number is None or not math.isfinite(number):
        raise ValueError(f"{key} must be a finite number, got {value!r}")
    return number


# --- what a deployment allows -----------------------------------------------------------------------


@dataclass(frozen=True)
class RequestLimits:
    """What the served engine accepts; built once by the engine from its config and its memory."""

    vocab_size: int
    max_tokens_limit: int
    max_request_positions: int  # KVCacheManager.max_request_positions(): the one capacity rule

    def check(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError with a client-facing message if this deployment cannot serve the request."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not (is_int(t) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
        if sampling.max_tokens > self.max_tokens_limit:
            raise ValueError(f"max_tokens must be at most {self.max_tokens_limit}, got {sampling.max_tokens}")
        for name, ids in (("stop_token_ids", sampling.stop_token_ids), ("logit_bias", sampling.logit_bias or ()),
                          ("allowed_token_ids", sampling.allowed_token_ids or ())):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        # The last sampled token is never fed back, so a request needs prompt + max_tokens - 1 positions.
        positions = len(prompt_ids) + sampling.max_tokens - 1
        if positions > self.max_request_positions:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) needs {positions} "
                f"positions, more than the {self.max_request_positions} positions this deployment supports; "
                "shorten the prompt or lower max_tokens")


# --- outputs ----------------------------------------------------------------------------------------


@dataclass(slots=True)
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
    logprobs: list["TokenLogprobs"] | None = None  # one per new token, when the request asked for them
    num_cached_tokens: int = 0  # of the prompt's positions, those restored from the prefix cache

    @classmethod
    def of(cls, seq: "Sequence", token_ids: list[int], logprobs: "list[TokenLogprobs] | None" = None,
           finished: bool = False, error: str | None = None) -> "RequestOutput":
        """`seq`'s output after a step: its new tokens (the step's own list), or its end."""
        return cls(seq.request_id, token_ids, "", finished, seq.finish_reason if finished else None,
                   len(seq.prompt_ids), len(seq.output_ids), error, logprobs, seq.num_cached_tokens or 0)


@dataclass
class TokenLogprobs:
    """A generated token's log-probability and the `logprobs` most likely tokens' (best first), all of one
    distribution (backend/sampler.py says which: `logprobs_mode`)."""

    logprob: float
    rank: int = 1  # the number of tokens at least as likely as this one (ties rank last, as vLLM ranks them)
    top: list[tuple[int, float]] = field(default_factory=list)


# --- the request ------------------------------------------------------------------------------------


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: its tokens, its progress, and everything the engine holds for it."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first among waiting requests
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_placeholders: int = 0  # sampled by steps in flight, not yet on the host
    # Prompt positions restored from the prefix cache when it was first admitted (None before; a request
    # readmitted after preemption keeps its first count, as vLLM's num_cached_tokens does)
    num_cached_tokens: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Attached by the engine (submit) and the scheduler.
    stop_ids: frozenset[int] = field(default=frozenset(), repr=False)
    # The sampler's per-request state (generator, penalty counts): touched only where steps run
    # (backend/sampler.py), created by the engine at submit.
    sampler_state: "SamplerState | None" = field(default=None, repr=False)
    queue_rank: int = 0  # position in the waiting queue within its priority; negative: requeued in front
    arrival_rank: int | None = None  # its first queue_rank: the order it came in, which a preemption does not change
    # The start of its aging and deadline, by the scheduler's clock: when the engine took it (LLMEngine.submit), or
    # where none stamped it (a scheduler on its own, another data-parallel rank's), when the scheduler took it in.
    arrival_s: float | None = None
    last_chunk_tokens: int = 0  # its latest prefill chunk (the ITL budget grows a chunk at most 2x)
    pages: "RequestPages | None" = field(default=None, repr=False)  # set by the memory manager
    # Its output constraint's grammar (backend/structured/grammar.py), set at submit; the scheduler admits the
    # request once it is compiled.
    grammar: "RequestGrammar | None" = field(default=None, repr=False)
    error: str | None = None  # why it ended with finish_reason "error", for the client
    # The prefix cache's digests of its first blocks (backend/memory/prefix_cache.py), kept because its tokens
    # only ever grow: a long prompt is hashed once, not at every chunk.
    block_digests: list[bytes] = field(default_factory=list, repr=False)
    # Speculative decoding: the draft tokens the last step proposed after its last token (the next decode verifies
    # them; backend/speculative.py).
    draft_tokens: list[int] = field(default_factory=list, repr=False)
    # The prompt and the known outputs, grown in place by append_output (never rebuilt).
    token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = [*self.prompt_ids, *self.output_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders - self.num_computed_tokens

    # is_decode / is_prefill run for every running request at every step: written out, not through the others.
    @property
    def is_decode(self) -> bool:
        """Exactly one token left to compute: the last sampled one (on the host or in flight); unless the tokens
        sampled so far reach max_tokens: then there is nothing more to compute, the last result is awaited."""
        sampled = len(self.output_ids) + self.num_placeholders
        return (len(self.token_ids) + self.num_placeholders - self.num_computed_tokens == 1 and sampled > 0
                and sampled < self.sampling.max_tokens)

    @property
    def is_prefill(self) -> bool:
        left = len(self.token_ids) + self.num_placeholders - self.num_computed_tokens
        return left > 1 or (left == 1 and not self.output_ids and not self.num_placeholders)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_output(self, token: int) -> None:
        """A sampled token reached the host (the scheduler retires its placeholder)."""
        self.output_ids.append(token)
        self.token_ids.append(token)

    def finish(self, reason: FinishReason) -> None:
        """Mark the request ended (the scheduler frees its memory; the engine sends its final response)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
