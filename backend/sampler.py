"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator.

Everything here runs where the steps run (backend/executor.py), on the request's `SamplerState`:
its generator and, with penalties, the tokens it has seen. The state is created at submit and
touched only there, so a step in flight and the host thread never share it; the tokens a step
samples are observed by the state at once, so the next step's penalties include them even while
the host has not seen them yet.

Greedy rows (temperature 0) are one argmax over the batch; sampled rows are drawn one by one from
their own `torch.Generator` (on the host), so a request with a seed gets the same tokens whatever it
is batched with.

Penalties (`apply_penalties`, rows whose request sets them; the others are not touched or copied):
  repetition_penalty r (vLLM / HF): every token in the prompt or the output so far has its logit divided
      by r where positive, multiplied by r where negative;
  frequency_penalty f and presence_penalty p (OpenAI): logit[t] -= f * count(t in the output) + p * [t in
      the output].
Greedy rows take the argmax of the penalised logits, sampled rows sample from them.

Log-probabilities (`Sampler.logprobs`, for requests with `logprobs` set) are those of the distribution
the token was drawn from: with temperature > 0, log_softmax of the penalised, temperature-scaled logits
after the top-k / top-p / min-p cut (tokens cut away have -inf); greedy, log_softmax of the (penalised)
logits themselves (temperature 1, nothing cut): without penalties, the model's own log-probability.
"""

from __future__ import annotations

import torch

from backend.request import SamplingParams, TokenLogprobs


class SamplerState:
    """One request's sampling state: its generator (seeded on first use) and, with penalties, the tokens seen
    (prompt and outputs, for the repetition penalty) and the output counts (frequency / presence)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]):
        self.params = params
        self.prompt_ids = prompt_ids
        self.has_penalties = (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                              or params.presence_penalty != 0.0)
        # Greedy, no penalties, no log-probabilities: its token is the argmax of its logits, nothing more.
        self.plain = params.temperature == 0.0 and not self.has_penalties and params.logprobs is None
        self.generator: torch.Generator | None = None
        self._seen: torch.Tensor | None = None  # bool [V]
        self._counts: torch.Tensor | None = None  # long [V]

    def penalize(self, line: torch.Tensor) -> None:
        """Apply this request's penalties to its logits row [V], in place."""
        params = self.params
        self._ensure(line)
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            line.copy_(torch.where(self._seen, torch.where(line > 0, line / r, line * r), line))
        if params.frequency_penalty or params.presence_penalty:
            counts = self._counts
            line -= (params.frequency_penalty * counts + params.presence_penalty * (counts > 0)).to(line.dtype)

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

    def draw(self, probs: torch.Tensor) -> int:
        if self.generator is None:
            self.generator = torch.Generator()
            if self.params.seed is not None:
                self.generator.manual_seed(self.params.seed)
            else:
                self.generator.seed()
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with -inf outside the top-k / top-p / min-p sets."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first is always kept).
        drop_sorted = cumulative - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
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


class Sampler:
    """Draws one token per row; row r belongs to states[r]."""

    def step(self, logits: torch.Tensor, states: list[SamplerState],
             plain: bool = False) -> tuple[torch.Tensor, list | None]:
        """Penalties, one token per row (a [R] long tensor on the logits' device, already observed by the
        states), and the log-probabilities of the rows that asked (None when none did). `plain`: every state is
        (SamplerState.plain), so the tokens are the argmax."""
        if plain:
            return torch.argmax(logits, dim=-1), None
        logits = apply_penalties(logits, states)
        tokens = self.sample(logits, states)
        logprobs = None
        if any(state.params.logprobs is not None for state in states):
            logprobs = self.logprobs(logits, states, tokens.tolist())
        for row, state in enumerate(states):
            if state.has_penalties:
                state.observe(tokens[row:row + 1])
        return tokens, logprobs

    def sample(self, logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
        """One token per row of the (penalised) logits [R, V]: greedy on the device, sampled rows on the host."""
        tokens = torch.argmax(logits, dim=-1)
        for row, state in enumerate(states):
            if state.params.temperature > 0.0:
                probs = torch.softmax(filter_logits(logits[row].cpu(), state.params), dim=-1)
                tokens[row] = state.draw(probs)
        return tokens

    def logprobs(self, logits: torch.Tensor, states: list[SamplerState],
                 tokens: list[int]) -> list[TokenLogprobs | None]:
        """For each row whose request asked for them, the sampled token's log-probability and the top ones."""
        out: list[TokenLogprobs | None] = []
        for row, (state, token) in enumerate(zip(states, tokens)):
            k = state.params.logprobs
            if k is None:
                out.append(None)
                continue
            dist = sampling_log_probs(logits[row].cpu(), state.params)
            top = torch.topk(dist, k) if k else None
            out.append(TokenLogprobs(float(dist[token]), int((dist > dist[token]).sum()) + 1,
                                     [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))))
        return out


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [V] of the distribution a row is sampled from (see the module docstring)."""
    if params.temperature > 0.0:
        return torch.log_softmax(filter_logits(logits, params), dim=-1)
    return torch.log_softmax(logits.float(), dim=-1)
