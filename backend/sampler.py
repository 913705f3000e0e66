"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator.

Greedy rows (temperature 0) are one argmax over the batch; sampled rows are drawn one by one from
their own `torch.Generator`, so a request with a seed gets the same tokens whatever it is batched
with.

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

from backend.request import SamplingParams, Sequence, TokenLogprobs


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


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Logits [R, V] with each row's penalties applied (see the module docstring); `logits` itself when no row
    has any."""
    rows = [r for r, seq in enumerate(seqs) if has_penalties(seq.sampling)]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        params, seq = seqs[row].sampling, seqs[row]
        line = logits[row]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), dtype=torch.long,
                                device=line.device)
            values = line[seen]
            line[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if seq.output_ids and (params.frequency_penalty or params.presence_penalty):
            counts = torch.bincount(torch.tensor(seq.output_ids, device=line.device), minlength=line.shape[0])
            line -= (params.frequency_penalty * counts + params.presence_penalty * (counts > 0)).to(line.dtype)
    return logits


class Sampler:
    """Draws one token per row; the per-request generator lives on the request (`seq.generator`).

    `logits` passed to both methods are the penalised ones (`apply_penalties`, which the engine calls first)."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of logits [R, V], row r for seqs[r]."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.sampling.temperature > 0.0:
                probs = torch.softmax(filter_logits(logits[row].cpu(), seq.sampling), dim=-1)
                tokens[row] = int(torch.multinomial(probs, 1, generator=_generator(seq)).item())
        return tokens


    def logprobs(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs | None]:
        """For each row whose request asked for them, the sampled token's log-probability and the top ones."""
        out: list[TokenLogprobs | None] = []
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            k = seq.sampling.logprobs
            if k is None:
                out.append(None)
                continue
            dist = sampling_log_probs(logits[row].cpu(), seq.sampling)
            top = torch.topk(dist, k) if k else None
            out.append(TokenLogprobs(float(dist[token]), int((dist > dist[token]).sum()) + 1,
                                     [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))))
        return out


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [V] of the distribution a row is sampled from (see the module docstring)."""
    if params.temperature > 0.0:
        return torch.log_softmax(filter_logits(logits, params), dim=-1)
    return torch.log_softmax(logits.float(), dim=-1)


def _generator(seq: Sequence) -> torch.Generator:
    """The request's generator, seeded on first use (from its seed, or from entropy)."""
    if seq.generator is None:
        seq.generator = torch.Generator()
        if seq.sampling.seed is not None:
            seq.generator.manual_seed(seq.sampling.seed)
        else:
            seq.generator.seed()
    return seq.generator
