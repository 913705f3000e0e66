"""scripts/bench_sampling.py compares like with like: on CPU the sampler's rows filtered together draw the same seeded
tokens as the old way, each row filtered on the host and drawn by torch.multinomial (the same noise off the same
generators)."""

from __future__ import annotations

import bench_sampling
import torch

from backend.request import SamplingParams
from backend.sampler import Sampler, SamplerState


def test_rows_drawn_together_are_the_tokens_each_row_drew_alone():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(2)) * 3
    for params in bench_sampling.PARAMETER_SETS.values():
        draws = []
        for draw in (Sampler().sample, bench_sampling.per_row_on_the_host):
            states = [SamplerState(SamplingParams(**{**vars(params), "seed": row}), [1]) for row in range(16)]
            draws.append([draw(logits, states).tolist() for _ in range(3)])  # (each state's generator goes on)
        assert draws[0] == draws[1], params
        assert len({token for step in draws[0] for token in step}) > 3
