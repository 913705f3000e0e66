"""Sampler and incremental detokenizer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tokenizers import Tokenizer

from backend.detokenizer import IncrementalDetokenizer
from backend.request import SamplingParams
from backend.sampler import (HeldStops, Sampler, SamplerState, apply_penalties, filter_logits, filter_logits_rows,
                             hold_stops)


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _seqs(params: list[SamplingParams]) -> list[SamplerState]:
    """One request's sampler state per parameter set (prompt [1])."""
    return [SamplerState(p, [1]) for p in params]


def _sample(logits, states) -> list[int]:
    return Sampler().sample(logits, states).tolist()


def test_greedy_is_argmax():
    logits = _logits()
    assert _sample(logits, _seqs([SamplingParams()] * 4)) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch_neighbours():
    logits = _logits()
    seeded = SamplingParams(temperature=1.0, seed=1234)
    first = [_sample(logits[1:2], _seqs([seeded]))[0] for _ in range(3)]
    # The same request in a batch with others draws from its own generator.
    mixed = _sample(logits, _seqs([SamplingParams(temperature=1.0, seed=9), seeded, SamplingParams(), seeded]))
    assert first == [first[0]] * 3 and mixed[1] == first[0]
    draws = {tuple(_sample(logits, _seqs([SamplingParams(temperature=1.0, seed=s)] * 4))) for s in range(8)}
    assert len(draws) > 1  # different seeds give different samples


def test_a_request_keeps_its_generator_across_steps():
    logits = _logits(rows=1)
    params = SamplingParams(temperature=1.0, seed=7)
    state, fresh = _seqs([params, params])
    draws = [_sample(logits, [state])[0] for _ in range(6)]
    assert draws == [_sample(logits, [fresh])[0] for _ in range(6)]  # one stream per request
    assert len(set(draws)) > 1 and state.generator is not None


def test_top_k_top_p_min_p_restrict_the_candidates():
    logits = torch.tensor([4.0, 3.0, 1.0, 0.0, -1.0])
    kept = lambda p: torch.isfinite(filter_logits(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.5)) == [0]
    assert kept(SamplingParams(temperature=1.0, top_p=0.8)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, min_p=0.2)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0)) == [0, 1, 2, 3, 4]
    samples = _sample(logits.expand(64, -1).clone(), _seqs([SamplingParams(temperature=5.0, top_k=2, seed=i)
                                                            for i in range(64)]))
    assert set(samples) == {0, 1}


def test_rows_filtered_together_cut_what_each_row_filtered_alone_cuts():
    """filter_logits_rows (the sampler's: every sampled row at once, where the logits are) against filter_logits row
    by row, each row with its own temperature and cuts, and rows with none beside rows with all three."""
    logits = _logits(rows=7, vocab=300, seed=3)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.5, min_p=0.1),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=2.0, top_k=1),
              SamplingParams(temperature=1.0, top_k=300, top_p=0.95)]
    together = filter_logits_rows(logits, params)
    for row, p in enumerate(params):
        alone = filter_logits(logits[row], p)
        assert torch.equal(torch.isfinite(together[row]), torch.isfinite(alone)), p
        assert torch.allclose(together[row][torch.isfinite(alone)], alone[torch.isfinite(alone)]), p
    assert torch.isfinite(together[0]).all() and torch.isfinite(together[5]).sum() == 1


def test_sampled_rows_are_distributed_as_their_filtered_distributions():
    """2000 draws of each of 3 rows sampled together (temperature and cuts of their own, a seed each but the first):
    each row's draws follow its own filtered distribution (Pearson's chi-square, p = 0.001)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3]] * 3)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=2.0, top_p=0.8)]
    # (row 0 without a seed: its noise comes off the device's generator)
    states = _seqs([dataclasses.replace(p, seed=40 + i if i else None) for i, p in enumerate(params)])
    draws = [Sampler().sample(logits, states).tolist() for _ in range(2000)]
    for row, p in enumerate(params):
        expected = torch.softmax(filter_logits(logits[row], p), -1) * len(draws)
        observed = torch.bincount(torch.tensor([d[row] for d in draws]), minlength=6).float()
        kept = expected > 0
        assert (observed[~kept] == 0).all(), (row, observed)
        statistic = float(((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())
        assert statistic < {2: 10.828, 3: 13.816, 4: 16.266, 6: 20.515}[int(kept.sum())], (row, statistic)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2),
                                         ("min_p", 1.5), ("seed", 2**64), ("stop", [""]), ("stop_token_ids", [-1])])
def test_invalid_sampling_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_vllms_spellings_of_no_cut_and_of_greedy_are_taken():
    """top_k -1 (vLLM's and its Triton backend's "all tokens") is no cut; a temperature below 1e-5 is greedy, as vLLM
    takes it (dividing by 1e-40 overflowed: token 0 drawn, a NaN log-probability)."""
    assert SamplingParams(top_k=-1).top_k == 0
    tiny = SamplingParams(temperature=1e-40, logprobs=1)
    assert tiny.temperature == 0.0
    logits = torch.tensor([[0.1, 0.2, 0.3, 2.0]])
    assert _sample(logits, _seqs([tiny])) == [3]
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_the_most_likely_token_survives_any_top_p_and_any_repetition_penalty():
    """A top_p or repetition_penalty below float32's smallest number rounds to 0 there: top-p still keeps the first
    token (as vLLM), and a seen token's logit divided by the penalty is the largest float, not inf (whose softmax is
    NaN: token 0 drawn, NaN log-probabilities)."""
    logits = torch.tensor([[0.1, 0.2, 3.0, 0.3]])
    for params in (SamplingParams(temperature=1.0, top_p=1e-50, logprobs=1),
                   SamplingParams(temperature=1.0, top_p=1e-50, top_k=3, logprobs=1)):
        assert torch.isfinite(filter_logits(logits[0], params)).nonzero().flatten().tolist() == [2]
        rows = filter_logits_rows(logits.repeat(2, 1), [params, SamplingParams(temperature=1.0)])
        assert torch.isfinite(rows[0]).sum() == 1 and torch.isfinite(rows[1]).all()
        assert _sample(logits, _seqs([params])) == [2]
    for temperature in (1.0, 0.5):  # (times 1 / temperature after the penalty)
        state = SamplerState(SamplingParams(temperature=temperature, repetition_penalty=1e-50, logprobs=1), [1])
        output = Sampler().step(logits, [state])
        assert output.sampled.tolist() == [1] and math.isfinite(output.logprobs[0][0].logprob)


def test_top_p_applies_to_what_min_p_left_renormalised_as_in_vllm_v1():
    """Probabilities [.40, .35, .10, .10, .05], min_p 0.2 (keeps >= .08: four tokens), top_p 0.78: over the four
    renormalised (.421, .368, .105, .105) the first two reach it; top-p over the distribution before min-p kept
    three."""
    logits = torch.tensor([0.40, 0.35, 0.10, 0.10, 0.05]).log()
    params = SamplingParams(temperature=1.0, min_p=0.2, top_p=0.78)
    kept = torch.isfinite(filter_logits(logits, params)).nonzero().flatten().tolist()
    assert kept == [0, 1]
    assert torch.equal(filter_logits_rows(logits[None], [params])[0], filter_logits(logits, params))


def test_a_rows_filtered_logits_do_not_depend_on_its_batchs_temperatures():
    """One operation whether the batch shares one temperature (a number) or not (a column): times the reciprocal. On
    CUDA a division by a number is computed as that product and a division by a column is not (an ulp apart: a seeded
    row's draws would depend on its neighbours). The CPU divides both ways alike, so here this holds the code to one
    operation for both (a division for one and a product for the other differ in 20 of these 150 values)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)) * 4
    alike = [SamplingParams(temperature=0.7, top_p=0.9)] * 3
    mixed = alike[:2] + [SamplingParams(temperature=1.3)]
    assert torch.equal(filter_logits_rows(logits, alike)[:2], filter_logits_rows(logits, mixed)[:2])


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


def test_incremental_text_is_the_whole_outputs_text_and_decodes_a_window_per_token(tokenizer):
    """Random ids (broken UTF-8 sequences, special tokens, multi-byte characters split anywhere): what the pieces add up
    to is the whole output decoded at once, up to the last id that completes a character or past it (a U+FFFD of the
    text's own followed by more); each token decodes a few ids, not the whole output."""
    gen = torch.Generator().manual_seed(0)
    text_ids = tokenizer.encode("Hello, 世界! Привет — こんにちは 🙂 done").ids
    decoded_lengths = []
    decode = tokenizer.decode
    for trial in range(40):
        ids = torch.randint(0, tokenizer.get_vocab_size(), (int(torch.randint(1, 300, (1,), generator=gen)),),
                            generator=gen).tolist()
        if trial % 2:  # (mostly whole characters, a few random ids among them)
            ids = [t for i in range(len(ids)) for t in (text_ids[i % len(text_ids)], ids[i])][:len(ids)]
        detok = IncrementalDetokenizer(tokenizer)
        tokenizer.decode = lambda window, **kw: decoded_lengths.append(len(window)) or decode(window, **kw)
        try:
            pieces = "".join(detok.add(t) for t in ids)
        finally:
            del tokenizer.decode
        complete = max((j for j in range(len(ids) + 1) if not decode(ids[:j], skip_special_tokens=True)
                        .endswith("\ufffd")), default=0)
        whole, pieces = decode(ids, skip_special_tokens=True), pieces + detok.flush()
        assert whole.startswith(pieces) and len(pieces) >= len(decode(ids[:complete], skip_special_tokens=True))
    assert sorted(decoded_lengths)[int(0.99 * len(decoded_lengths))] <= 8  # (a window: a long output is no dearer)


def test_a_text_ending_in_its_own_replacement_character_goes_out_and_keeps_a_window(tokenizer):
    """U+FFFD that the model writes (a token of it, again and again): the text goes out as it comes, each token still
    decodes a few ids; a character split over tokens after it (special tokens between its bytes too) stays whole.
    One in an output's last few tokens is left out with the end, as an incomplete character is (as vLLM does)."""
    replacement = tokenizer.encode("\ufffd").ids
    tail = tokenizer.encode(" 🙂 done").ids
    ids = tokenizer.encode("ok ").ids + replacement * 400 + tail
    detok = IncrementalDetokenizer(tokenizer)
    decode, windows = tokenizer.decode, []
    tokenizer.decode = lambda window, **kw: windows.append(len(window)) or decode(window, **kw)
    try:
        pieces = [detok.add(t) for t in ids]
    finally:
        del tokenizer.decode
    assert len("".join(pieces[:len(ids) - len(tail)])) >= 390  # (not held back to the end)
    assert "".join(pieces) + detok.flush() == decode(ids) == "ok " + "\ufffd" * 400 + " 🙂 done"
    assert max(windows) <= 16
    ending = IncrementalDetokenizer(tokenizer)
    assert "".join(ending.add(t) for t in tokenizer.encode("ok \ufffd").ids) + ending.flush() == "ok "
    smile = tokenizer.encode("🙂").ids  # (4 byte tokens) with special tokens, which carry no byte, between them
    special = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    ids = tokenizer.encode("ok ").ids + replacement * 3 + smile[:1] + [special] * 3 + smile[1:] + tail
    between = IncrementalDetokenizer(tokenizer)
    assert "".join(between.add(t) for t in ids) + between.flush() == decode(ids, skip_special_tokens=True)


def test_a_run_of_special_tokens_keeps_the_window_and_the_end_keeps_whole_characters(tokenizer):
    """End-of-sequence tokens again and again (an ignore_eos benchmark): each decodes a few ids, not the whole run
    (it decoded the run at every token: 0.8 ms a token at 8,000). At the end, a last token holding a whole
    character and the start of another ("世" and two of "界"'s bytes) gives the whole one (it was left out too)."""
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    ids = tokenizer.encode("ok").ids + [eos] * 3000 + tokenizer.encode(" done").ids
    detok = IncrementalDetokenizer(tokenizer)
    decode, windows = tokenizer.decode, []
    tokenizer.decode = lambda window, **kw: windows.append(len(window)) or decode(window, **kw)
    try:
        text = "".join(detok.add(t) for t in ids) + detok.flush()
    finally:
        del tokenizer.decode
    assert text == "ok done" and max(windows) <= 8
    assert decode([497, 386]) == " prin世\ufffd"  # (the tiny checkpoint's tokenizer)
    ending = IncrementalDetokenizer(tokenizer)
    assert "".join(ending.add(t) for t in (497, 386)) + ending.flush() == " prin世"


def _streamed_until_stopped(tokenizer, text: str, stop: list[str]) -> tuple[bool, str]:
    """(whether a stop string ended it, the text streamed) for `text`'s tokens fed one at a time."""
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    pieces = []
    for t in tokenizer.encode(text).ids:
        pieces.append(detok.add(t))
        if detok.stopped:
            break
    return detok.stopped, "".join(pieces) + detok.flush()


def test_stop_string_truncates_and_is_never_streamed_in_part(tokenizer):
    assert _streamed_until_stopped(tokenizer, "The quick brown fox jumps over the lazy dog", ["fox jumps"]) == (
        True, "The quick brown ")


def test_of_two_stop_strings_in_one_token_the_earlier_one_ends_the_text(tokenizer):
    """'ro' holds both stops: the text ends before the first to occur ('r'), whatever their order in the list."""
    assert _streamed_until_stopped(tokenizer, "The quick brown fox", ["o", "r"]) == (True, "The quick b")


def test_with_min_tokens_a_stop_string_counts_only_where_it_ends_past_those_tokens(tokenizer):
    """vLLM's: a stop string that ends within the first min_tokens tokens' text is passed over; one ending later,
    even where it starts earlier, stops the text."""
    ids = tokenizer.encode("a fox and a fox and a fox").ids
    second_fox = [n for n in range(len(ids) + 1) if tokenizer.decode(ids[:n]).count("fox") == 2][0]
    assert tokenizer.decode(ids[:second_fox - 1]).endswith(" fo")  # (the second fox starts within them)

    def streamed(min_tokens: int, stop: str) -> tuple[str, bool]:
        detok = IncrementalDetokenizer(tokenizer, stop=[stop], min_tokens=min_tokens)
        pieces = []
        for t in ids:
            pieces.append(detok.add(t))
            if detok.stopped:
                break
        return "".join(pieces) + detok.flush(), detok.stopped

    assert streamed(0, "fox") == ("a ", True)
    assert streamed(second_fox - 1, "fox") == ("a fox and a ", True)  # (the second ends after them)
    assert streamed(second_fox, "fox") == ("a fox and a fox and a ", True)
    assert streamed(len(ids), "fox") == ("a fox and a fox and a fox", False)


def test_the_min_tokens_boundary_counts_text_held_back_at_a_split_character(tokenizer):
    """The second token holds "世" and the start of "界" (held back, not yet text when it comes): "世" is within the
    first two tokens' text, so with min_tokens 2 it is passed over (the boundary was taken before it: it stopped)."""
    ids = [497, 386, 236, 66]  # (the tiny checkpoint's tokenizer)
    assert [tokenizer.decode(ids[:n]) for n in (1, 2, 3)] == [" prin", " prin世\ufffd", " prin世界"]

    def streamed(min_tokens: int) -> tuple[str, bool]:
        detok = IncrementalDetokenizer(tokenizer, stop=["世"], min_tokens=min_tokens)
        text = ""
        for t in ids:
            text += detok.add(t)
            if detok.stopped:
                break
        return text + detok.flush(), detok.stopped

    assert streamed(1) == (" prin", True) and streamed(2) == (" prin世界a", False)


def test_min_tokens_holds_a_rows_stop_tokens_back_and_raw_logprobs_do_not_see_it():
    """A held row draws the best of the other tokens (greedy) and never a stop token (sampled); its raw
    log-probabilities are its logits' own, its processed ones give the held tokens none. A row whose grammar allows
    only its stop token keeps it (`guarded`): the grammar's end ends the request."""
    logits = _logits(rows=3, vocab=50)
    top2 = logits.topk(2, dim=-1).indices
    states = _seqs([SamplingParams(logprobs=2), SamplingParams(), SamplingParams(temperature=5.0, seed=1)])
    top_sampled = logits[2].topk(25).indices.tolist()
    held = {0: HeldStops(1, (int(top2[0, 0]),)), 2: HeldStops(1, tuple(top_sampled))}
    for raw in (True, False):
        output = Sampler(raw_logprobs=raw).step(logits.clone(), states, held=held)
        tokens = output.sampled.tolist()
        assert tokens[:2] == [int(top2[0, 1]), int(top2[1, 0])] and tokens[2] not in top_sampled
        chosen, top = output.logprobs[0][0].logprob, output.logprobs[0][0].top
        if raw:
            assert top[0][0] == int(top2[0, 0]) and chosen == pytest.approx(
                float(torch.log_softmax(logits[0], -1)[top2[0, 1]]), abs=1e-6)
        else:
            assert top[0][0] == int(top2[0, 1]) and int(top2[0, 0]) not in [token for token, _ in top]
    draws = {Sampler().step(logits.clone(), _seqs([SamplingParams(temperature=5.0, seed=s)] * 3),
                            held={2: HeldStops(1, tuple(top_sampled))}).sampled[2].item() for s in range(40)}
    assert draws.isdisjoint(top_sampled) and len(draws) > 3
    only_stop = torch.full((2, 6), float("-inf"))
    only_stop[:, 3] = 1.0
    hold_stops(only_stop, [0, 1], [HeldStops(1, (3,))] * 2, guarded=[True, False])
    assert only_stop[0, 3] == 1.0 and only_stop[1, 3] == float("-inf")


def test_held_stops_cover_the_positions_before_the_min_tokens_th_output():
    """...and are held on the step's logits themselves where nothing reads them unheld: no grammar (its mask comes
    first), no raw log-probabilities."""
    state = SamplerState(SamplingParams(max_tokens=20, min_tokens=5), [1])
    assert HeldStops.of(state, frozenset({7, 2}), 0, 1, True) == HeldStops(1, (2, 7), in_place=True)
    assert HeldStops.of(state, frozenset({7}), 3, 4, True) == HeldStops(2, (7,), True)  # (3 drafts: outputs 3..6)
    assert HeldStops.of(state, frozenset({7}), 5, 1, True) is None
    assert HeldStops.of(state, frozenset(), 0, 1, True) is None  # (ignore_eos without stop ids: nothing to hold)
    assert HeldStops.of(SamplerState(SamplingParams(max_tokens=20), [1]), frozenset({7}), 0, 1, True) is None
    with_logprobs = SamplerState(SamplingParams(max_tokens=20, min_tokens=5, logprobs=1), [1])
    assert not HeldStops.of(with_logprobs, frozenset({7}), 0, 1, raw_logprobs=True).in_place
    assert HeldStops.of(with_logprobs, frozenset({7}), 0, 1, raw_logprobs=False).in_place


def test_logprobs_are_the_models_own_by_default_and_the_sampled_distributions_when_processed():
    """raw_logprobs (vLLM v1's default): every row's log_softmax of its logits, whatever its temperature, cuts and
    penalties; processed_logprobs: sampled rows' of the temperature-scaled logits after the top-k cut (cut tokens
    -inf), greedy rows' of their (penalised) logits. Rows that did not ask: None."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.1, 3.0, 0.2, 0.3], [1.0, 1.0, 1.0, 1.0]])
    sampled = SamplingParams(temperature=0.5, top_k=2, seed=1, logprobs=3)
    penalised = SamplingParams(logprobs=1, repetition_penalty=2.0)
    raw = torch.log_softmax(logits, dim=-1)
    for raw_logprobs in (True, False):
        seqs = _seqs([sampled, penalised, SamplingParams()])
        output = Sampler(raw_logprobs=raw_logprobs).step(logits.clone(), seqs)
        tokens = output.sampled.tolist()
        (first,), (second,), third = output.logprobs
        assert tokens[0] in (0, 1) and tokens[1] == 1 and third is None
        if raw_logprobs:
            assert abs(first.logprob - raw[0, tokens[0]].item()) < 1e-6
            assert first.top == [(i, pytest.approx(raw[0, i].item())) for i in (0, 1, 2)]
            assert abs(second.logprob - raw[1, 1].item()) < 1e-6
        else:
            scaled = torch.log_softmax(torch.tensor([2.0, 1.0]) / 0.5, dim=-1)
            assert abs(first.logprob - scaled[tokens[0]].item()) < 1e-6
            assert [t for t, _ in first.top[:2]] == [0, 1] and first.top[2][1] == float("-inf")
            # the prompt's token 1 penalised (3.0 / 2)
            expected = torch.log_softmax(torch.tensor([0.1, 1.5, 0.2, 0.3]), dim=-1)[1].item()
            assert abs(second.logprob - expected) < 1e-6


def test_a_tied_tokens_rank_counts_every_token_as_likely_as_it():
    """As vLLM's ranks: with four equal logits the drawn token ranks 4th, whichever it is."""
    seqs = _seqs([SamplingParams(logprobs=2)])
    (out,) = Sampler().logprobs(torch.zeros(1, 4), seqs, [0])
    assert out.rank == 4


def test_penalties_follow_openai_and_vllm_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    state = SamplerState(params, [1, 4])
    for token in (3, 3, 0):  # the request's outputs so far, as the sampler observes them
        apply_penalties(logits, [state])  # the first sampling sees the prompt
        state.observe(torch.tensor([token]))
    out = apply_penalties(logits, [state])
    # repetition over prompt (1, 4) and output (3, 0): positive / 2, negative * 2; then output counts 3: 2, 0: 1
    expected = torch.tensor([[2.0 / 2 - 0.5 - 0.25, -1.0 * 2, 0.5, 1.0 / 2 - 1.0 - 0.25, 0.0]])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0]]))  # the caller's logits untouched
    plain = _seqs([SamplingParams()])
    assert apply_penalties(logits, plain) is logits  # no penalty: no copy
    # greedy follows the penalised logits: a repeated top token gives way, and the state observes what it drew
    tokens = Sampler().step(logits, [state]).sampled
    assert tokens.tolist() == [2]
    assert apply_penalties(logits, [state])[0, 2] == 0.5 / 2 - 0.5 - 0.25


def test_logit_bias_and_allowed_token_ids_come_before_the_penalties_as_in_vllm():
    """OpenAI's logit_bias adds to its tokens' logits, vLLM's allowed_token_ids leaves every other token at -inf; both
    before the repetition penalty (which then divides a positive biased logit). JSON's string keys are taken."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, 0.0]])
    params = SamplingParams.from_dict({"logit_bias": {"1": 5.0, "4": -100}, "allowed_token_ids": [1, 2, 4],
                                       "repetition_penalty": 2.0})
    assert params.logit_bias == {1: 5.0, 4: -100.0}
    state = SamplerState(params, [1])  # (token 1 is in the prompt: repetition-penalised)
    out = apply_penalties(logits, [state])
    inf = float("inf")
    torch.testing.assert_close(out, torch.tensor([[-inf, (-1.0 + 5.0) / 2, 0.5, -inf, -100.0]]))
    assert Sampler().step(logits, [state]).sampled.tolist() == [1]
    assert SamplerState(SamplingParams(logit_bias={}), [1]).plain  # (an empty bias changes nothing)


def test_a_logit_bias_never_brings_back_a_token_allowed_token_ids_left_out():
    """allowed_token_ids' -inf stays -inf under any bias (a bias that assigned instead of adding would lift it)."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    state = SamplerState(SamplingParams(allowed_token_ids=[1], logit_bias={3: 5.0}), [1])
    assert Sampler().step(logits, [state]).sampled.tolist() == [1]


def test_a_presence_penalty_alone_applies():
    """presence_penalty with no other penalty or bias: the row is penalised (not taken for a plain one)."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.5]])
    state, sampler = SamplerState(SamplingParams(presence_penalty=2.0), [1]), Sampler()
    assert [sampler.step(logits, [state]).sampled.item() for _ in range(2)] == [3, 4]


@pytest.mark.parametrize("params,message", [
    (dict(logit_bias={3: -101.0}), "logit_bias must map token ids to numbers"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(temperature=True), "temperature"),
    (dict(n=2), "n must be 1"), (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logprobs=21), "logprobs"),
    (dict(timeout_ms=0), "timeout_ms"), (dict(logit_bias={3: 101.0}), "logit_bias must map token ids to numbers"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids"),
])
def test_out_of_range_serving_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)
    assert SamplingParams(logprobs=20).logprobs == 20  # (OpenAI's most: taken)


def _grammar(constraint: dict, tokenizer, vocab_size: int, eos: int):
    from backend.structured.grammar import GrammarService

    service = GrammarService(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
    grammar = service.prepare(SamplingParams.from_dict({"guided_decoding": constraint}).guided_decoding)
    grammar.future.result(timeout=30)
    service.close()
    return grammar


def test_grammar_masks_come_before_sampling_and_end_the_row_on_its_stop_token(tiny_checkpoint):
    """Row 0 may only say "no" or "yes" (its best logit is never allowed); row 1 has no grammar and is untouched."""
    grammar = _grammar({"choice": ["no", "yes"]}, tiny_checkpoint / "tokenizer.json", 512, eos=1)
    states = [SamplerState(SamplingParams(), [1], grammar), SamplerState(SamplingParams(), [1])]
    assert not states[0].plain and states[1].plain
    sampler, text, generator = Sampler(), [], torch.Generator().manual_seed(0)
    for _ in range(8):
        logits = torch.randn(2, 512, generator=generator)
        logits[0, ord("x") - 29] = 100.0  # (some token the grammar never allows is the best one)
        sampled = sampler.step(logits.clone(), states)
        assert sampled.sampled[1] == logits[1].argmax() and sampled.timing.mask_fill_s > 0
        text.append(int(sampled.sampled[0]))
        if sampled.ends:
            break
    assert sampled.ends == {0: None} and text[-1] == 1 and grammar.done  # ended on the stop token
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).decode(text[:-1]) in ("no", "yes")
    again = sampler.step(logits.clone(), states)  # a step already in flight for the ended request: left alone
    assert again.sampled[0] == logits[0].argmax() and not again.ends


def test_a_row_that_no_token_can_continue_is_left_unmasked_and_reported(tmp_path):
    """A word-level vocabulary "a", "b", "</s>" and the regex "ac": after "a" nothing fits."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    path = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="</s>")).save(str(path))
    grammar = _grammar({"regex": "ac"}, path, 3, eos=2)
    state = SamplerState(SamplingParams(), [0], grammar)
    sampler = Sampler()
    first = sampler.step(torch.tensor([[0.0, 5.0, 1.0]]), [state])
    assert first.sampled.tolist() == [0] and not first.ends  # only "a" fits
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    second = sampler.step(logits.clone(), [state])
    assert second.ends == {0: "the output constraint cannot be continued: no token of this model's vocabulary "
                                   "fits it"}
    assert second.sampled.tolist() == [1] and grammar.done  # unmasked (its token is not kept)
