"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a per-request seeded generator.

Greedy rows (temperature 0) are one argmax over the batch; sampled rows are drawn one by one from
their own `torch.Generator`, so a request with a seed gets the same tokens whatever it is batched
with.
"""

from __future__ import annotations

import torch

from backend.request import SamplingParams, Sequence


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


class Sampler:
    """Draws one token per row; the per-request generator lives on the request (`seq.generator`)."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of logits [R, V], row r for seqs[r]."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if seq.sampling.temperature > 0.0:
                probs = torch.softmax(filter_logits(logits[row].cpu(), seq.sampling), dim=-1)
                tokens[row] = int(torch.multinomial(probs, 1, generator=_generator(seq)).item())
        return tokens


def _generator(seq: Sequence) -> torch.Generator:
    """The request's generator, seeded on first use (from its seed, or from entropy)."""
    if seq.generator is None:
        seq.generator = torch.Generator()
        if seq.sampling.seed is not None:
            seq.generator.manual_seed(seq.sampling.seed)
        else:
            seq.generator.seed()
    return seq.generator
