"""Sampler and incremental detokenizer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from backend.detokenizer import IncrementalDetokenizer
from backend.request import SamplingParams, Sequence
from backend.sampler import Sampler, filter_logits


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1], p) for i, p in enumerate(params)]


def test_greedy_is_argmax():
    logits = _logits()
    assert Sampler().sample(logits, _seqs([SamplingParams()] * 4)) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch_neighbours():
    logits = _logits()
    seeded = SamplingParams(temperature=1.0, seed=1234)
    first = [Sampler().sample(logits[1:2], _seqs([seeded]))[0] for _ in range(3)]
    # The same request in a batch with others draws from its own generator.
    mixed = Sampler().sample(logits, _seqs([SamplingParams(temperature=1.0, seed=9), seeded, SamplingParams(), seeded]))
    assert first == [first[0]] * 3 and mixed[1] == first[0]
    draws = {tuple(Sampler().sample(logits, _seqs([SamplingParams(temperature=1.0, seed=s)] * 4))) for s in range(8)}
    assert len(draws) > 1  # different seeds give different samples


def test_a_request_keeps_its_generator_across_steps_and_finish_drops_it():
    logits = _logits(rows=1)
    params = SamplingParams(temperature=1.0, seed=7)
    seq, fresh = _seqs([params, params])
    sampler = Sampler()
    draws = [sampler.sample(logits, [seq])[0] for _ in range(6)]
    assert draws == [sampler.sample(logits, [fresh])[0] for _ in range(6)]  # one stream per request
    assert seq.generator is not None
    seq.finish()
    assert seq.generator is None


def test_top_k_top_p_min_p_restrict_the_candidates():
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -1.0])
    kept = lambda p: torch.isfinite(filter_logits(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.5)) == [0]
    assert kept(SamplingParams(temperature=1.0, top_p=0.8)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, min_p=0.2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0)) == [0, 1, 2, 3, 4]
    samples = Sampler().sample(logits.expand(64, -1), _seqs([SamplingParams(temperature=5.0, top_k=2, seed=i)
                                                             for i in range(64)]))
    assert set(samples) == {0, 1}


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -1),
                                         ("min_p", 1.5), ("seed", -3), ("stop", [""]), ("stop_token_ids", [-1])])
def test_invalid_sampling_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


def test_incremental_text_never_splits_a_multibyte_character(tokenizer):
    text = "Hello, 世界! Привет — こんにちは 🙂 done"
    ids = tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len([p for p in pieces if p])  # some tokens were held back mid-character


def test_stop_string_truncates_and_is_never_streamed_in_part(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog").ids
    detok = IncrementalDetokenizer(tokenizer, stop=["fox jumps"])
    pieces = []
    for t in ids:
        pieces.append(detok.add(t))
        if detok.stopped:
            break
    assert detok.stopped and "".join(pieces) + detok.flush() == "The quick brown "
