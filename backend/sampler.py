"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator.

Everything here runs where the steps run (backend/executor.py), on the request's `SamplerState`:
its generator and, with penalties, the tokens it has seen. The state is created at submit and
touched only there, so a step in flight and the host thread never share it; the tokens a step
samples are observed by the state at once, so the next step's penalties include them even while
the host has not seen them yet.

Greedy rows (temperature 0) are one argmax over the batch. Sampled rows are filtered together where the logits are
(`filter_logits_rows`: each row's temperature, top-k, top-p and min-p, a few batched kernels on a GPU instead of a
copy of each row to the host and a host sort of 129K values), then drawn there with exponential noise and one
argmax (no host sync): a seeded request's noise off its own `torch.Generator` on that device (one small launch a
row), so it gets the same tokens whatever it is batched with (with speculative decoding, while its drafts are the
same: docs/speculative.md); the other rows' in one launch.

Penalties (`apply_penalties`, rows whose request sets them; the others are not touched or copied), after the
request's logit_bias (OpenAI's: added to its tokens' logits) and allowed_token_ids (vLLM's: every other token -inf),
as vLLM applies those first:
  repetition_penalty r (vLLM / HF): every token in the prompt or the output so far has its logit divided
      by r where positive, multiplied by r where negative;
  frequency_penalty f and presence_penalty p (OpenAI): logit[t] -= f * count(t in the output) + p * [t in
      the output].
Greedy rows take the argmax of the penalised logits, sampled rows sample from them.

The cuts, in vLLM's (v1) order and meaning: temperature (a logit times 1/temperature), top-k (ties at the k-th kept),
min-p (probability at least min_p times the largest), then top-p over what those left, renormalised (the fewest
most likely tokens whose probability reaches top_p). Top-k and min-p commute (top-k keeps the largest); top-p
after min-p is what vLLM v1 computes, where its V0 took top-p before min-p.

Structured outputs (rows whose request has a grammar, backend/structured/grammar.py): before anything else, the
grammars of those rows fill their next-token bitmasks on the host, all rows in one call on XGrammar's threads (on
CUDA while the forward's kernels run); the masks go to the device in one copy from pinned memory and one kernel
sets the disallowed logits to -inf (kernels/token_bitmask.py): penalties, sampling and log-probabilities all see
the masked logits. After sampling the grammars accept their tokens, again in one call (that reads the tokens on the
host: on CUDA the one sync a step with constrained rows adds, on this thread). A row whose grammar reaches its
end, or allows no token at all, is reported in the step's `StepOutput.ends`. Speculative decoding masks its verify
rows and its drafts the same way (backend/speculative.py, through `HostMasks` and this sampler's fill pool), each
position with the grammar's mask after the drafts before it.

min_tokens (vLLM's): until a request has that many outputs, its stop tokens (eos unless ignore_eos, stop_token_ids)
are held back: their logits are -inf (`hold_stops`), at each row the step's plan says (`HeldStops`, built with the
step: a verify row holds them at the positions before the min_tokens-th output). Raw log-probabilities do not see the
hold (vLLM's raw ones are taken before its min-tokens processor); processed ones do. Where nothing reads a row's
logits unheld (no raw log-probabilities, no grammar, no allowed_token_ids), the hold is made on the step's logits
themselves before anything else (`HeldStops.in_place`: a greedy row then still samples, and accepts drafts, by the
logits' argmax); otherwise on a copy, after the grammar's mask and the penalties, and a row whose grammar or
allowed_token_ids allow nothing but a stop token keeps it (an output like any other before the min_tokens-th: the
grammar's end still ends the request, backend/scheduler/scheduler.py `_append`).

Log-probabilities (`Sampler.logprobs`, for requests with `logprobs` set), as vLLM's `logprobs_mode`: raw (the
default, as vLLM v1's), log_softmax of the model's logits (after an output constraint's mask, before penalties,
temperature and the cuts); processed, those of the distribution the token was drawn from: with temperature > 0,
log_softmax of the penalised, temperature-scaled logits after the top-k / top-p / min-p cut (tokens cut away have
-inf), greedy, log_softmax of the penalised logits. A token's rank counts the tokens at least as likely, itself
included (as vLLM's: ties rank last).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backend.request import SamplingParams, TokenLogprobs
from backend.scheduler.plan import StepOutput, StepTiming
from backend.structured.grammar import NO_TOKEN_CAN_FOLLOW, GrammarBatch
from kernels.dispatch import KernelDispatch

if TYPE_CHECKING:
    from backend.structured.grammar import RequestGrammar

NO_TOKEN_FITS = "the sampled token does not fit the output constraint"
NO_ALLOWED_TOKEN_FITS = "the output constraint allows none of allowed_token_ids here"


class SamplerState:
    """One request's sampling state: its generator (seeded on first use) and, with penalties, the tokens seen
    (prompt and outputs, for the repetition penalty) and the output counts (frequency / presence)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], grammar: "RequestGrammar | None" = None):
        self.params = params
        self.prompt_ids = prompt_ids
        self.grammar = grammar
        # (logit_bias and allowed_token_ids count as penalties here: the same rows' logits are adjusted, in one place)
        self.has_penalties = (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                              or params.presence_penalty != 0.0 or bool(params.logit_bias)
                              or params.allowed_token_ids is not None)
        # Its tokens narrowed (a grammar, allowed_token_ids): a hold leaves its stop tokens where they are all it
        # allows.
        self.narrowed = grammar is not None or params.allowed_token_ids is not None
        # Greedy, no penalties, no log-probabilities, no grammar: its token is the argmax of its logits.
        self.plain = (params.temperature == 0.0 and not self.has_penalties and params.logprobs is None
                      and grammar is None)
        self.generator: torch.Generator | None = None
        self._device_generator: torch.Generator | None = None  # (sampling on a GPU: Sampler.sample)
        self._seen: torch.Tensor | None = None  # bool [V]
        self._counts: torch.Tensor | None = None  # long [V]
        self._bias: torch.Tensor | None = None  # [V]: logit_bias, -inf outside allowed_token_ids (None: neither)
        # Speculative decoding: the distributions its sampled drafts were drawn from, where the logits are
        # (backend/speculative.py; empty for argmax drafts, each all on its draft).
        self.draft_probs: list[torch.Tensor] = []
        # A constrained row's: the grammar's mask before each of its drafts (with whether no token fit there) and the
        # drafts they were filled along, which the verify of those drafts needs again at the same positions.
        self.draft_masks: list[tuple[torch.Tensor, bool]] = []
        self.masked_drafts: list[int] = []
        # min_tokens: its HeldStops by positions held (`HeldStops.of`, where the host builds a step: only there)
        self.holds: dict[tuple[int, bool], HeldStops] = {}

    def penalize(self, line: torch.Tensor, pending: list[int] = ()) -> None:
        """Apply this request's penalties to its logits row [V], in place; `pending`: tokens that precede this
        position beyond those observed (a verify's drafts before it)."""
        params = self.params
        bias = self.bias_of(line)
        if bias is not None:
            line += bias
        seen, counts = self._seen, self._counts
        if pending:
            extra = torch.tensor(pending, dtype=torch.long, device=line.device)
            seen = seen.clone().index_fill_(0, extra, True)
            counts = counts.clone().index_add_(0, extra, torch.ones_like(extra))
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            line.copy_(torch.where(seen, torch.where(line > 0, line / r, line * r), line))
            line.clamp_(max=torch.finfo(line.dtype).max)  # (a tiny penalty's quotient: the largest, not inf)
        if params.frequency_penalty or params.presence_penalty:
            line -= (params.frequency_penalty * counts + params.presence_penalty * (counts > 0)).to(line.dtype)

    @functools.cached_property
    def allowed(self) -> frozenset[int] | None:
        """allowed_token_ids as a set (None: every token)."""
        ids = self.params.allowed_token_ids
        return None if ids is None else frozenset(ids)

    def first_disallowed(self, tokens: list[int]) -> int | None:
        """The index of the first of `tokens` outside allowed_token_ids, or None. A constrained row whose grammar
        allows none of them has every logit at -inf, whose argmax (or draw) is token 0: drawn, not allowed."""
        allowed = self.allowed
        return None if allowed is None else next((i for i, t in enumerate(tokens) if t not in allowed), None)

    @property
    def biased(self) -> bool:
        """Whether the request adds to its logits before its penalties (logit_bias, allowed_token_ids)."""
        return bool(self.params.logit_bias) or self.params.allowed_token_ids is not None

    @functools.cached_property
    def bias_key(self) -> tuple:
        """What tells requests' biases apart: equal keys, equal biases (a static draft chain's slots share them)."""
        allowed = self.params.allowed_token_ids
        return (tuple(sorted((self.params.logit_bias or {}).items())),
                None if allowed is None else tuple(sorted(set(allowed))))

    def bias_of(self, line: torch.Tensor) -> torch.Tensor | None:
        """What the request adds to a logits row like `line` [V] before its penalties: its logit_bias, and -inf outside
        its allowed_token_ids (None: neither)."""
        self._ensure(line)
        return self._bias

    def observe(self, token: torch.Tensor) -> None:
        """The token [1] sampled for this request (on the device: no host round trip)."""
        if self._seen is not None:
            self._seen.index_fill_(0, token, True)
            self._counts.index_add_(0, token, torch.ones_like(token))

    def _ensure(self, line: torch.Tensor) -> None:
        if self._seen is None:
            self._seen = torch.zeros(line.shape[0], dtype=torch.bool, device=line.device)
            self._seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=line.device)] = True
            self._counts = torch.zeros(line.shape[0], dtype=torch.long, device=line.device)
            self._bias = logit_bias(self.params, line)



    def generator_on(self, device: torch.device) -> torch.Generator:
        """The request's generator on `device`: the host one on CPU; on a GPU a second one, seeded alike."""
        if device.type == "cpu":
            return self._generator()
        if self._device_generator is None:
            self._device_generator = _seeded(torch.Generator(device=device), self.params.seed)
        return self._device_generator

    def uniform(self) -> float:
        """A draw from U[0, 1) off the request's generator (speculative decoding's acceptance test)."""
        return float(torch.rand(1, generator=self._generator()))

    def _generator(self) -> torch.Generator:
        if self.generator is None:
            self.generator = _seeded(torch.Generator(), self.params.seed)
        return self.generator


def logit_bias(params: SamplingParams, line: torch.Tensor) -> torch.Tensor | None:
    """What a request adds to its logits [V] before its penalties: logit_bias at its tokens, -inf outside
    allowed_token_ids; None where it sets neither."""
    if not params.logit_bias and params.allowed_token_ids is None:
        return None
    bias = torch.zeros_like(line)
    if params.allowed_token_ids is not None:
        bias.fill_(float("-inf"))
        bias[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=line.device)] = 0.0
    if params.logit_bias:
        tokens = torch.tensor(list(params.logit_bias), dtype=torch.long, device=line.device)
        bias[tokens] += torch.tensor(list(params.logit_bias.values()), dtype=line.dtype, device=line.device)
    return bias


def _seeded(generator: torch.Generator, seed: int | None) -> torch.Generator:
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator


_LARGEST = torch.finfo(torch.float32).max


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with -inf outside the top-k / top-p / min-p sets: one row, the definition
    `filter_logits_rows` (what the sampler runs) is tested against."""
    logits = (logits.float() * (1.0 / params.temperature)).clamp_(max=_LARGEST)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (top-p over what min-p left, renormalised)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first is always kept (also at a top_p
        # below float32's smallest number, which rounds to 0 there).
        drop_sorted = cumulative - sorted_probs >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def filter_logits_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`filter_logits` of every row of `logits` [R, V] at once (row r with params[r], temperature > 0), where the
    logits are: [R, V] float32. Each cut runs only when some row asks for it, and leaves the other rows whole."""
    device, vocab, rows = logits.device, logits.shape[-1], len(params)

    def per_row(values: list, dtype=torch.float32):
        """The rows' values: one Python number where every row has the same, else a column [R, 1] on the device."""
        if all(value == values[0] for value in values):
            return values[0]
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).view(rows, 1)

    # (times the reciprocal, whether one number or a column: a row's values do not depend on its batch's temperatures)
    # (clamped: a tiny repetition penalty's largest float, times 1 / temperature, would be inf again)
    logits = (logits.float() * per_row([1.0 / p.temperature for p in params])).clamp_(max=_LARGEST)
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    top_k = per_row(ks, torch.long)
    if isinstance(top_k, int) and top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    elif not isinstance(top_k, int):  # (rows without a cut: k = 0, their kth -inf)
        kth = logits.topk(max(ks), dim=-1).values.gather(1, top_k.clamp(min=1) - 1)
        logits = logits.masked_fill(logits < kth.masked_fill(top_k == 0, float("-inf")), float("-inf"))
    if not any(p.min_p > 0.0 or p.top_p < 1.0 for p in params):
        return logits
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        floor = per_row([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # (as filter_logits: drop a token when the tokens before it already reach top_p; rows at top_p 1 keep all)
        drop_sorted = cumulative - sorted_probs >= per_row([p.top_p for p in params])
        drop_sorted[:, 0] = False
        if not all(p.top_p < 1.0 for p in params):
            drop_sorted &= per_row([p.top_p < 1.0 for p in params], torch.bool)
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """Logits [R, V] with each row's penalties applied (see the module docstring); `logits` itself when no row
    has any."""
    rows = [r for r, state in enumerate(states) if state.has_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        states[row].penalize(logits[row])
    return logits


@dataclass(frozen=True)
class HeldStops:
    """A sampling row's stop tokens, held back (min_tokens) at its first `positions` logits rows (a verify row has
    1 + drafts of them)."""

    positions: int
    token_ids: tuple[int, ...]
    in_place: bool = False  # held on the step's logits before the sampler: nothing reads the row's logits unheld

    @classmethod
    def of(cls, state: SamplerState, stop_ids: frozenset[int], first_output: int, num_positions: int,
           raw_logprobs: bool) -> "HeldStops | None":
        """What a row whose logits rows draw outputs `first_output`, `first_output + 1`, ... (`num_positions` of them)
        holds back; None where it holds nothing. (`raw_logprobs`: the sampler's mode.)"""
        params = state.params
        positions = min(params.min_tokens - first_output, num_positions)
        if positions <= 0 or not stop_ids:
            return None
        hold = state.holds.get((positions, raw_logprobs))  # (a request's holds differ by their positions: made once)
        if hold is None:
            in_place = not state.narrowed and not (raw_logprobs and params.logprobs is not None)
            hold = state.holds[positions, raw_logprobs] = cls(positions, tuple(sorted(stop_ids)), in_place)
        return hold


def held_on_copies(held: dict[int, HeldStops] | None) -> dict[int, HeldStops]:
    """The holds of `held` (sampling row -> its hold) that the sampler or the verifier makes, on a copy."""
    return {row: hold for row, hold in (held or {}).items() if not hold.in_place}


def hold_stops(logits: torch.Tensor, rows: list[int], held: list[HeldStops], guarded: list[bool]) -> None:
    """-inf, in place, at each held row's stop tokens (logits rows `rows[i]` to `rows[i] + held[i].positions`); a
    `guarded` row (`SamplerState.narrowed`) keeps them where they are all it allows. Where the logits are, without a
    host sync."""
    pairs = [(row + p, token) for row, hold in zip(rows, held) for p in range(hold.positions)
             for token in hold.token_ids]
    at_rows, at_tokens = long_on([r for r, _ in pairs], logits.device), long_on([t for _, t in pairs], logits.device)
    values = logits[at_rows, at_tokens]
    logits.index_put_((at_rows, at_tokens), torch.full_like(values, float("-inf")))
    guarded_rows = sorted({row + p for row, hold, guard in zip(rows, held, guarded) if guard
                           for p in range(hold.positions)})
    if guarded_rows:  # (put back where nothing else is left)
        index = long_on(guarded_rows, logits.device)
        nothing_left = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        nothing_left[index] = torch.isinf(logits[index]).all(dim=-1)
        logits.index_put_((at_rows, at_tokens), torch.where(nothing_left[at_rows], values, logits[at_rows, at_tokens]))


class HostMasks:
    """Token masks on their way to the logits: int32 rows filled on the host (pinned for CUDA logits), each with the
    logits row it masks, sent in one copy and applied in place by one kernel (kernels/token_bitmask.py).

    Each user keeps its own: the copy does not wait, so a buffer is filled again only once something has read the
    logits it masked (the tokens drawn from them) back to the host."""

    def __init__(self, kernels: KernelDispatch):
        self.kernels = kernels
        self._masks: torch.Tensor | None = None  # int32 [rows, words], reused
        self._rows: torch.Tensor | None = None  # long [rows]

    def buffers(self, num_rows: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(masks [num_rows, words], their logits rows [num_rows]) to fill, for masks over `logits`."""
        words = (logits.shape[1] + 31) // 32
        if self._masks is None or self._masks.shape[0] < num_rows or self._masks.shape[1] != words:
            pinned = logits.is_cuda
            self._masks = torch.empty(max(num_rows, 8), words, dtype=torch.int32, pin_memory=pinned)
            self._rows = torch.empty(max(num_rows, 8), dtype=torch.long, pin_memory=pinned)
        return self._masks[:num_rows], self._rows[:num_rows]

    def apply(self, logits: torch.Tensor, num_rows: int) -> None:
        """-inf, in place, where the first `num_rows` masks filled do not allow a token."""
        if num_rows:
            masks = self._masks[:num_rows].to(logits.device, non_blocking=True)
            rows = self._rows[:num_rows].to(logits.device, non_blocking=True)
            self.kernels.apply_token_bitmask(logits, masks, rows)


class Sampler:
    """Draws one token per row; row r belongs to states[r]. `kernels` (kernels/dispatch.py) applies token masks;
    `grammars` fills them (its pool also serves speculative decoding's masks)."""

    def __init__(self, kernels: KernelDispatch | None = None, raw_logprobs: bool = True):
        self.kernels = kernels or KernelDispatch()
        self.raw_logprobs = raw_logprobs  # (EngineConfig.logprobs_mode)
        self.grammars = GrammarBatch()
        self._masks = HostMasks(self.kernels)

    @torch.inference_mode()  # (as `step`)
    def hold_in_place(self, logits: torch.Tensor, first_rows: list[int], held: dict[int, HeldStops]) -> None:
        """The step's `in_place` holds, on its logits (sampling row r's first logits row: first_rows[r])."""
        rows = sorted(row for row, hold in held.items() if hold.in_place)
        if rows:
            hold_stops(logits, [first_rows[row] for row in rows], [held[row] for row in rows], [False] * len(rows))

    @torch.inference_mode()  # (the logits are the forward's inference tensors; masks change them in place)
    def step(self, logits: torch.Tensor, states: list[SamplerState], plain: bool = False,
             timing: StepTiming | None = None, held: dict[int, HeldStops] | None = None) -> StepOutput:
        """Masks, penalties, held stops (`held`: row -> what it holds back on a copy; those `in_place` were held
        already), one token per row (already observed by the states), log-probabilities: a StepOutput whose tokens are
        still `sampled` (a [R] long tensor on the logits' device), its host times in `timing` (the step's record).
        `plain`: every state is (SamplerState.plain) and holds nothing but in place, so the tokens are the argmax."""
        output = StepOutput(timing=timing or StepTiming())
        if plain:
            output.sampled = torch.argmax(logits, dim=-1)
            return output
        constrained = [row for row, state in enumerate(states) if state.grammar is not None and not state.grammar.done]
        if constrained:
            output.timing.mask_fill_s += self._mask(logits, states, constrained, output.ends)
        masked, logits = logits, apply_penalties(logits, states)  # (a copy where a row has penalties)
        held = held_on_copies(held)
        if held:
            rows = sorted(held)
            logits = logits.clone() if logits is masked else logits  # (raw log-probabilities read `masked`)
            hold_stops(logits, rows, [held[row] for row in rows], [states[row].narrowed for row in rows])
        tokens = self.sample(logits, states)
        if any(state.params.logprobs is not None for state in states):
            of = masked if self.raw_logprobs else logits
            output.logprobs = [None if lp is None else [lp] for lp in self.logprobs(of, states, tokens.tolist())]
        for row, state in enumerate(states):
            if state.has_penalties:
                state.observe(tokens[row:row + 1])
        if constrained:
            output.timing.grammar_accept_s += self._accept(tokens, states, constrained, output.ends)
        output.sampled = tokens
        return output

    def _mask(self, logits: torch.Tensor, states: list[SamplerState], rows: list[int],
              row_ends: dict[int, str | None]) -> float:
        """The constrained rows' grammars fill their masks (one call); one copy and one kernel apply them (in place).
        A row whose mask allows nothing is left unmasked (its token is not kept) and reported. Returns the host time
        the masks took to fill."""
        started = time.perf_counter()
        masks, indices = self._masks.buffers(len(rows), logits)
        indices.copy_(torch.tensor(rows))
        for i in self.grammars.fill_or_unmask([states[row].grammar for row in rows], masks):
            row_ends[rows[i]] = NO_TOKEN_CAN_FOLLOW
        fill_s = time.perf_counter() - started
        # (the host buffers are refilled at the next step only after _accept has read this step's tokens)
        self._masks.apply(logits, len(rows))
        return fill_s

    def _accept(self, tokens: torch.Tensor, states: list[SamplerState], rows: list[int],
                row_ends: dict[int, str | None]) -> float:
        """The constrained rows' grammars accept their tokens (one call); a grammar that ends, or rejects its token,
        ends its row. Returns the host time it took."""
        started = time.perf_counter()
        host = tokens.tolist()
        for row in rows:
            if row not in row_ends and states[row].first_disallowed([host[row]]) is not None:
                row_ends[row] = NO_ALLOWED_TOKEN_FITS
            if row in row_ends:  # no token could follow, or none it may draw: the request fails
                states[row].grammar.done = True
        live = [row for row in rows if row not in row_ends]
        rejected, ended = self.grammars.accept([states[row].grammar for row in live], [host[row] for row in live])
        for i in rejected:
            row_ends[live[i]] = NO_TOKEN_FITS
        for i in ended:
            row_ends[live[i]] = None
        return time.perf_counter() - started

    def sample(self, logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
        """One token per row of the (penalised) logits [R, V], on their device: the argmax for greedy rows, a draw
        off its own generator for each sampled row (filtered together)."""
        tokens = torch.argmax(logits, dim=-1)
        rows = [row for row, state in enumerate(states) if state.params.temperature > 0.0]
        for part in row_shares(rows, logits.device):
            index = row_index(part, logits.device)
            tokens[index] = draw_rows(logits[index], [states[row] for row in part])[0]
        return tokens

    def logprobs(self, logits: torch.Tensor, states: list[SamplerState],
                 tokens: list[int]) -> list[TokenLogprobs | None]:
        """For each row whose request asked for them, the sampled token's log-probability, its rank and the top ones
        (of the raw `logits` or of the distribution each row samples from, as `raw_logprobs` says), computed where
        the logits are (rows in shares, as `sample`); the host reads only what it reports."""
        out: list[TokenLogprobs | None] = [None] * len(states)
        rows = [row for row, state in enumerate(states) if state.params.logprobs is not None]
        for part in row_shares(rows, logits.device):
            params = [states[row].params for row in part]
            of = logits[row_index(part, logits.device)]
            dist = torch.log_softmax(of.float(), dim=-1) if self.raw_logprobs else sampling_log_probs(of, params)
            chosen = dist.gather(1, long_on([tokens[row] for row in part], logits.device)[:, None])
            ranks = (dist >= chosen).sum(dim=1).tolist()
            top = dist.topk(max(p.logprobs for p in params), dim=-1)
            top_ids, top_values, chosen = top.indices.tolist(), top.values.tolist(), chosen.flatten().tolist()
            for i, (row, p) in enumerate(zip(part, params)):
                out[row] = TokenLogprobs(chosen[i], ranks[i],
                                         list(zip(top_ids[i][:p.logprobs], top_values[i][:p.logprobs])))
        return out


def draw_rows(logits: torch.Tensor, states: list[SamplerState]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R], probabilities [R, V]) of sampled rows `logits` [R, V]: each row's filtered distribution
    (filter_logits_rows) and a draw from it, where the logits are (`draws`)."""
    probs = filtered_probs(logits, [state.params for state in states])
    return draws(probs, states), probs


def draws(weights: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """A token [R] drawn from each row of `weights` [R, V] (probabilities, normalized or not) where they are:
    argmax(weights / noise) with Exp(1) noise, what torch.multinomial draws for one sample (the same token off the
    same generator) without its host syncs. A seeded request's noise comes off its own generator (a launch a row,
    `SamplerState.generator_on`), the other rows' in one launch off the device's own."""
    noise = torch.empty_like(weights)
    seeded = [row for row, state in enumerate(states) if state.params.seed is not None]
    if len(seeded) < len(states):
        noise.exponential_(1.0)
    for row in seeded:
        noise[row].exponential_(1.0, generator=states[row].generator_on(weights.device))
    return (weights / noise).argmax(dim=-1)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distributions [R, V] sampled rows `logits` [R, V] are drawn from: softmax(filter_logits_rows), in
    `row_shares`."""
    shares = row_shares(list(range(len(params))), logits.device)
    parts = [torch.softmax(filter_logits_rows(logits[part[0]:part[-1] + 1], [params[i] for i in part]), dim=-1)
             for part in shares]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_shares(rows: list[int], device: torch.device) -> list[list[int]]:
    """`rows` in the shares one batched computation over the vocabulary takes: all of them on a GPU; one at a time on
    a CPU, where a row of 129K logits and its sort stay in cache and a whole batch's do not."""
    share = max(1, len(rows) if device.type != "cpu" else 1)
    return [rows[start:start + share] for start in range(0, len(rows), share)]


def row_index(part: list[int], device: torch.device) -> "slice | torch.Tensor":
    """What picks the rows `part` of a [R, ...] tensor: a slice for one row (no index tensor), else their indices."""
    return slice(part[0], part[0] + 1) if len(part) == 1 else long_on(part, device)


def long_on(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)  # (from pageable memory: no wait)


def sampling_log_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities [R, V] of the distributions rows of `logits` [R, V] are sampled from (see the module
    docstring): with temperature > 0 the filtered logits' (filter_logits_rows), greedy the logits' own."""
    dist = logits.float()
    sampled = [row for row, p in enumerate(params) if p.temperature > 0.0]
    if sampled:
        index = long_on(sampled, logits.device)
        dist = dist.index_copy(0, index, filter_logits_rows(logits[index], [params[row] for row in sampled]))
    return torch.log_softmax(dist, dim=-1)
