"""The engine against transformers' DeepSeek-V4 (fp32, CPU), on two different random checkpoints.

Logits agree to 1e-4 for a full prefill, a chunked prefill at unaligned boundaries, token-by-token
decode past several windows and HCA boundaries, and a ragged batch of 8 requests at different
stages. CSA selections agree with the reference's except at demonstrated near-ties.
"""

from __future__ import annotations

import random

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams, Sequence

from .harness import EngineHarness, Reference, Tracked, compare, selection_margin


@pytest.fixture(scope="module")
def reference(checkpoint):
    return Reference(checkpoint)


@pytest.fixture(scope="module")
def harness(checkpoint):
    return EngineHarness(checkpoint)


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (length,), generator=g).tolist()


def _check(harness, reference, tracked: Tracked, min_compared: float = 0.9):
    ref_logits, ref_records = reference.run(tracked.seq.prompt_ids)
    cfg = harness.config
    result = compare(tracked, ref_logits, ref_records, cfg.csa_rate, cfg.index_topk)
    harness.free(tracked)
    harness.kv.check()
    # A comparison that skipped most positions would prove nothing.
    assert result.positions_compared >= min_compared * len(tracked.logits), result
    return result


def _unaligned_cuts(total: int, seed: int) -> list[int]:
    """Chunk sizes summing to `total` whose boundaries avoid multiples of 4, 128 and the page size."""
    rng = random.Random(seed)
    cuts, pos = [], 0
    while pos < total:
        size = rng.randint(1, 150)
        while (pos + size) % 4 == 0 and pos + size < total:
            size += 1
        size = min(size, total - pos)
        cuts.append(size)
        pos += size
    return cuts


def test_full_prefill(harness, reference):
    tracked = Tracked(Sequence("full", _prompt(600, 1)))
    harness.step([(tracked, 600)])
    _check(harness, reference, tracked)


def test_chunked_prefill_at_unaligned_boundaries(harness, reference):
    tracked = Tracked(Sequence("chunked", _prompt(700, 2)))
    cuts = _unaligned_cuts(700, seed=3)
    boundaries = [sum(cuts[: i + 1]) for i in range(len(cuts) - 1)]
    assert boundaries and all(b % 4 and b % 16 for b in boundaries)
    for n in cuts:
        harness.step([(tracked, n)])
    _check(harness, reference, tracked)


def test_token_by_token_decode_past_windows_and_hca_boundaries(harness, reference):
    tracked = Tracked(Sequence("decode", _prompt(420, 4)))
    harness.step([(tracked, 90)])
    for _ in range(330):  # positions 90..419: past 3 windows and the HCA boundaries at 128, 256, 384
        harness.step([(tracked, 1)])
    _check(harness, reference, tracked)


def test_ragged_batch_of_8_requests_at_different_stages(harness, reference):
    lengths = [1, 5, 140, 260, 300, 390, 513, 650]
    done_before = [0, 4, 131, 127, 259, 1, 400, 512]  # computed before the shared forward
    in_batch = [1, 1, 9, 133, 1, 389, 113, 138]  # tokens in the shared forward
    requests = [Tracked(Sequence(f"r{i}", _prompt(n, 10 + i))) for i, n in enumerate(lengths)]
    for tracked, done in zip(requests, done_before):
        pos = 0
        for n in _unaligned_cuts(done, seed=done):
            harness.step([(tracked, n)])
            pos += n
    harness.step(list(zip(requests, in_batch)))
    for tracked, done, n, total in zip(requests, done_before, in_batch, lengths):
        assert done + n <= total
        tracked.seq.prompt_ids = tracked.seq.prompt_ids[: done + n]
        _check(harness, reference, tracked)


def test_greedy_outputs_match_reference_generate(checkpoint, reference):
    engine = LLMEngine(EngineConfig(checkpoint=str(checkpoint), device="cpu", max_running_requests=8,
                                    prefill_chunk_tokens=97))
    lengths = [1, 2, 33, 128, 129, 300, 513, 700]
    prompts = [_prompt(n, 100 + n) for n in lengths]
    results = engine.generate(prompts, SamplingParams(max_tokens=12))
    for prompt, result in zip(prompts, results):
        expected = reference.greedy(prompt, 12)
        assert result["output_ids"] == expected, f"prompt of {len(prompt)} tokens"
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())


def test_near_tie_margin_is_measured_on_the_cut():
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.5, 2.0 - 1e-7, 0.0, 0.0, 0.0]])
    # position 31 with rate 4 sees all 8 entries; top-2 cuts between 2.0 and 2.0 - 1e-7
    assert selection_margin(scores.expand(32, -1), 31, 4, 2) < 1e-6
    assert selection_margin(scores.expand(32, -1), 31, 4, 1) == pytest.approx(1.0 / 3.0)
    assert selection_margin(scores.expand(32, -1), 7, 4, 2) is None  # only 2 causal entries: no cut


def test_logprobs_are_the_reference_models_log_softmax(tiny_checkpoint):
    """Greedy: each generated token's log-probability, and the top 5, equal log_softmax of the transformers
    model's logits at that position (the full sequence run once through the reference)."""
    import torch.nn.functional as F

    prompt = torch.randint(2, 500, (37,), generator=torch.Generator().manual_seed(8)).tolist()
    engine = LLMEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", dtype="float32"))
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5))
    ids = prompt + result["output_ids"]
    reference = Reference(tiny_checkpoint)
    logits, _ = reference.run(ids[:-1])
    expected = F.log_softmax(logits[len(prompt) - 1:], dim=-1)  # the positions that produced the outputs
    assert len(result["logprobs"]) == 6
    for step, (token, got) in enumerate(zip(result["output_ids"], result["logprobs"])):
        assert abs(got.logprob - expected[step, token].item()) < 1e-4
        top = torch.topk(expected[step], 5)
        assert [t for t, _ in got.top] == top.indices.tolist()
        assert max(abs(lp - want) for (_, lp), want in zip(got.top, top.values.tolist())) < 1e-4
        assert got.top[0][0] == token  # greedy picks the most likely
