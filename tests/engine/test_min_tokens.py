"""min_tokens through the engine (vLLM's meaning): no stop token is drawn before a request's min_tokens-th output, and
speculative decoding, static steps and overlapped verifies emit exactly what a plain engine emits; a grammar's end
still ends a constrained request before it.

Each request's stop token is one its free run (the same prompt without min_tokens) draws early: held back, the greedy
row takes the best of the other tokens instead, which the request's own raw log-probabilities (the model's
distribution, which the hold does not change) show."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from backend.engine_core import VerifyOverlap
from backend.model.graph_runner import HELD_STOP_SLOTS
from backend.request import SamplingParams
from backend.speculative import Drafter

from .test_speculative import _engine, _generate, _ids, _prompts, _record_chain_holds

MIN_TOKENS = 12


@pytest.fixture(scope="module")
def held_runs(tiny_checkpoint):
    """Prompts, each with a stop token its free run draws as its 2nd to 4th output, and the plain engine's greedy
    runs with that stop and min_tokens (raw log-probabilities, the 5 best of each position)."""
    prompts = _prompts([1, 7, 130, 260], seed=3)
    free = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5)
    free_runs = _ids(_generate(_engine(tiny_checkpoint), prompts, free))
    params = []
    for tokens in free_runs:
        at = next(j for j in range(1, 4) if tokens[j] not in tokens[:j])
        params.append(dataclasses.replace(free, stop_token_ids=[tokens[at]], min_tokens=MIN_TOKENS))
    stopped = _generate(_engine(tiny_checkpoint), prompts, [dataclasses.replace(p, min_tokens=0) for p in params])
    assert all(r["finish_reason"] == "stop" and len(r["output_ids"]) <= 4 for r in stopped)  # (without the hold)
    return prompts, params, _generate(_engine(tiny_checkpoint), prompts, params)


def test_greedy_rows_take_the_best_token_that_is_not_a_stop_until_min_tokens(held_runs):
    _, params, results = held_runs
    for p, result in zip(params, results):
        tokens, stop = result["output_ids"], p.stop_token_ids[0]
        assert len(tokens) >= MIN_TOKENS and stop not in tokens[:MIN_TOKENS]
        for i, (token, logprobs) in enumerate(zip(tokens, result["logprobs"])):
            best = [t for t, _ in logprobs.top if i >= MIN_TOKENS or t != stop][0]
            assert token == best, (i, token, logprobs.top)
        assert result["finish_reason"] == ("stop" if tokens[-1] == stop else "length")


@pytest.mark.parametrize("logprobs", [5, None])
@pytest.mark.parametrize("k, settings", [(1, {}), (3, {}), (2, {"cuda_graphs": True}),
                                         (1, {"cuda_graphs": True, "max_running_requests": 8})])
def test_speculative_decoding_holds_stops_at_each_verified_position(tiny_checkpoint, held_runs, monkeypatch, k,
                                                                    settings, logprobs):
    """Drafts from the held runs, 30 % corrupted, so verifies span the min_tokens-th output and some propose the stop
    token where it is held: the same tokens and endings as the plain engine. Without log-probabilities the holds are
    made on the step's logits (`HeldStops.in_place`), with raw ones on copies. (cuda_graphs: static verify steps; at
    k = 1 without log-probabilities the draft chain follows the verify on the device, and the next verify is
    scheduled before the one in flight is taken in: made to pay here, as tests/engine/test_verify_overlap.py does.)"""
    monkeypatch.setattr(VerifyOverlap, "pays", lambda overlap: True)
    chain_early, chained = Drafter.chain_early, []  # (what each verify's chain_early gave, and the step's holds)

    def recording_chain_early(*args):
        chained.append((chain_early(*args), args[-1]))
        return chained[-1][0]

    monkeypatch.setattr(Drafter, "chain_early", recording_chain_early)
    prompts, params, expected = held_runs
    params = [dataclasses.replace(p, logprobs=logprobs) for p in params]
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k, **settings)
    got = _generate(engine, prompts, params, dict(enumerate(_ids(expected))))
    assert _ids(got) == _ids(expected)
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in expected]
    assert 0 < engine.stats()["num_accepted_tokens"] < engine.stats()["num_draft_tokens"]
    chained_while_held = sum(chain is not None and bool(held) for chain, held in chained)
    if k == 1 and settings.get("cuda_graphs") and logprobs is None:
        assert chained_while_held > 3
    else:
        assert chained_while_held == 0


@pytest.mark.parametrize("k", [0, 2])
def test_sampled_rows_never_draw_a_held_stop(tiny_checkpoint, k):
    """Every token the free runs drew early made a stop token: sampled (seeded) requests draw none of them before
    min_tokens, with and without drafts, and they still end on one after it."""
    prompts = _prompts([5, 40, 90, 17], seed=4)
    sampled = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in range(len(prompts))]
    free_runs = _ids(_generate(_engine(tiny_checkpoint), prompts, sampled))
    stops = sorted({t for tokens in free_runs for t in tokens[:6]})
    params = [dataclasses.replace(p, stop_token_ids=stops, min_tokens=MIN_TOKENS) for p in sampled]
    free_stopped = _generate(_engine(tiny_checkpoint), prompts, [dataclasses.replace(p, min_tokens=0) for p in params])
    assert all(len(r["output_ids"]) < MIN_TOKENS for r in free_stopped)  # (without the hold)
    results = _generate(_engine(tiny_checkpoint, num_speculative_tokens=k), prompts, params)
    for result in results:
        tokens = result["output_ids"]
        assert len(tokens) >= MIN_TOKENS and not set(tokens[:MIN_TOKENS]) & set(stops), tokens
    assert any(r["finish_reason"] == "stop" for r in results)


@pytest.mark.parametrize("k", [0, 2])
def test_a_grammars_end_still_ends_a_request_before_min_tokens(tiny_checkpoint, k):
    """A choice of short words: once one is complete the grammar allows only its end-of-sequence token, which the
    hold leaves (else no token could follow): the request ends there with `stop`, its text the word."""
    params = SamplingParams.from_dict({"max_tokens": 30, "min_tokens": 20,
                                       "guided_decoding": {"choice": ["yes", "no"]}})
    results = _generate(_engine(tiny_checkpoint, num_speculative_tokens=k), _prompts([4, 30], seed=6), params)
    assert [(r["finish_reason"], r["error"]) for r in results] == [("stop", None)] * 2
    assert all(r["text"] in ("yes", "no") and len(r["output_ids"]) < 20 for r in results)


@pytest.mark.parametrize("k", [0, 2])
def test_a_stop_token_a_grammar_leaves_alone_before_min_tokens_is_an_output(tiny_checkpoint, k):
    """The choice's first token is a stop token here: held back, nothing else would be allowed, so the row keeps it,
    and it does not end the request before min_tokens (vLLM's check_stop); the grammar's end does."""
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    first = engine.tokenizer.encode("yes", add_special_tokens=False).ids[0]
    params = SamplingParams.from_dict({"max_tokens": 30, "min_tokens": 20, "stop_token_ids": [first],
                                       "guided_decoding": {"choice": ["yes"]}})
    (result,) = _generate(engine, _prompts([5], seed=2), params)
    assert (result["finish_reason"], result["text"]) == ("stop", "yes") and result["output_ids"][0] == first


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_stop_token_that_is_all_allowed_token_ids_allow_is_an_output_before_min_tokens(tiny_checkpoint, k,
                                                                                      temperature):
    """allowed_token_ids of one stop token: held back, nothing would be left (every logit -inf, an argmax of token 0),
    so the row keeps it, as a grammar's row keeps a stop that is all the grammar allows; it is an output until the
    min_tokens-th, which ends the request."""
    stop = 7
    params = SamplingParams(max_tokens=30, min_tokens=5, stop_token_ids=[stop], allowed_token_ids=[stop],
                            temperature=temperature, seed=1)
    results = _generate(_engine(tiny_checkpoint, num_speculative_tokens=k), _prompts([6, 25], seed=8), params)
    assert [(r["output_ids"], r["finish_reason"]) for r in results] == [([stop] * 5, "stop")] * 2


@pytest.mark.parametrize("k", [0, 2])
def test_the_hold_ends_at_the_min_tokens_th_output(tiny_checkpoint, k):
    """A free greedy run draws t_m as its output m (0-based), each new there: with stop [t_m] and min_tokens m the
    request emits the free run's first m tokens and then stops on t_m, which is no longer held; with stop [t_(m-1)]
    it is still held at output m - 1, so the request goes on past it."""
    prompts = _prompts([9, 70], seed=7)
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = _ids(_generate(_engine(tiny_checkpoint), prompts, free))
    cases, expected = [], []
    for prompt, tokens in zip(prompts, runs):
        m = next(m for m in range(MIN_TOKENS, 20)
                 if tokens[m - 1] not in tokens[:m - 1] and tokens[m] not in tokens[:m])
        cases += [(prompt, dataclasses.replace(free, stop_token_ids=[tokens[m]], min_tokens=m)),
                  (prompt, dataclasses.replace(free, stop_token_ids=[tokens[m - 1]], min_tokens=m))]
        expected.append(tokens[:m + 1])
    results = _generate(_engine(tiny_checkpoint, num_speculative_tokens=k), [p for p, _ in cases],
                        [params for _, params in cases])
    for i, want in enumerate(expected):
        stops_there, held_there = results[2 * i], results[2 * i + 1]
        assert (stops_there["output_ids"], stops_there["finish_reason"]) == (want, "stop")
        assert held_there["output_ids"][:len(want) - 2] == want[:-2] and len(held_there["output_ids"]) > len(want) - 1
        assert held_there["output_ids"][len(want) - 2] != want[-2]


def _record_drafts(monkeypatch) -> list[tuple[int, int, SamplingParams]]:
    """Every draft the draft layer proposes, as (the output it drafts, 0-based; the token; the request's params)."""
    propose, drafted = Drafter.propose, []

    def recording(self, batch, job, output, states, *args, **kwargs):
        drafts = propose(self, batch, job, output, states, *args, **kwargs)
        for r, proposed in drafts.items():
            first = job.rows[r].position + len(output.tokens[r]) + 1 - len(states[r].prompt_ids)  # (its first draft's)
            drafted.extend((first + j, token, states[r].params) for j, token in enumerate(proposed))
        return drafts

    monkeypatch.setattr(Drafter, "propose", recording)
    return drafted


@pytest.mark.parametrize("temperature, k, settings", [
    (0.0, 2, {}), (1.0, 2, {"draft_sampling": "sample"}),
    (0.0, 2, {"cuda_graphs": True}),  # a static chain of two passes (a CUDA graph on CUDA)
    (0.0, 1, {"cuda_graphs": True}),  # the chain that follows the verify on the device (`Drafter.chain_early`)
])
def test_drafts_propose_no_stop_token_before_min_tokens(tiny_checkpoint, monkeypatch, temperature, k, settings):
    """The stops are the tokens the draft layer itself proposes for a free run's first outputs: held back, the target
    never emits them there, so a draft of one would be a draft lost. The draft layer proposes its best other token
    instead, as the target does (argmax drafts, drafts drawn from the draft distribution, and a static chain's, which
    take the HELD_STOP_SLOTS stops drafted most)."""
    static = bool(settings.get("cuda_graphs"))
    if static:
        monkeypatch.setattr(VerifyOverlap, "pays", lambda overlap: True)  # (k = 1: the verify chains on the device)
    chains_holding = _record_chain_holds(monkeypatch)
    prompts = _prompts([3, 50, 140], seed=5)
    free = [SamplingParams(max_tokens=MIN_TOKENS + 8, temperature=temperature, seed=s, ignore_eos=True)
            for s in range(len(prompts))]
    drafted = _record_drafts(monkeypatch)
    _generate(_engine(tiny_checkpoint, num_speculative_tokens=k, **settings), prompts, free)
    early = Counter(token for output, token, _ in drafted if output < MIN_TOKENS)
    stops = sorted(token for token, _ in early.most_common(HELD_STOP_SLOTS if static else None))
    drafted.clear()
    params = [dataclasses.replace(p, stop_token_ids=stops, min_tokens=MIN_TOKENS) for p in free]
    results = _generate(_engine(tiny_checkpoint, num_speculative_tokens=k, **settings), prompts, params)
    assert all(len(r["output_ids"]) >= MIN_TOKENS for r in results)
    held = [token for output, token, _ in drafted if output < MIN_TOKENS]
    assert len(held) > k * MIN_TOKENS and not set(held) & set(stops), held
    # The hold ends at the min_tokens-th output (output MIN_TOKENS, 0-based), where the target may stop: drafted there.
    # (Static chains: four stops are seldom drafted just there; tests/engine/test_draft_chain.py holds their drafts
    # to the eager chain's under the same holds.)
    assert static or any(token in stops for output, token, _ in drafted if output == MIN_TOKENS)
    assert (sum(chains_holding) > 3) == static  # (the static chains held them, not eager passes)
