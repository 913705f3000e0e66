"""Every data-parallel rank runs its own engine (backend/engine_core.py, backend/parallel/data_parallel.py).

Speculative decoding with structured outputs and seeded sampling over DP=2 (+EP=2: the ranks in lock-step, each
step's draft passes agreed on at once) gives the single rank's tokens, and so do static draft chains on data-parallel
ranks (a rank idle, ranks with different row counts, a rank drafting pass by pass beside one running its chain), and
constrained rows ending after their passes were agreed on; what a rank sends rank 0 per step stays within 32 bytes a
request; the other ranks' stats reach rank 0's.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.parallel.data_parallel import OutputBatch, RankLink, RankLinks
from backend.parallel.messages import Wake
from backend.request import FinishReason, RequestOutput, SamplingParams, TokenLogprobs
from backend.structured.params import guided_decoding_from_sampling

# (ranks out of step fail in two minutes, not the default ten)
POOLS = dict(device="cpu", num_tokens=8192, page_size=16, swa_full_tokens_ratio=0.5, collective_timeout_s=120)


def _params() -> list[SamplingParams]:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    return [SamplingParams(max_tokens=16, temperature=0.8, seed=11, logprobs=2),
            SamplingParams(max_tokens=24, guided_decoding=guided_decoding_from_sampling(
                {"guided_decoding": {"json": schema}}, "test")),
            SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=5, repetition_penalty=1.2),
            SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]


@pytest.mark.parametrize("dp,ep", [(2, 2), (2, 1)])
def test_speculative_decoding_with_a_schema_and_seeded_sampling_over_ranks_gives_the_single_rank_tokens(
        parallel_checkpoint, dp, ep):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (5, 80, 200, 33, 140)]
    settings = dict(checkpoint=str(parallel_checkpoint), num_speculative_tokens=2, **POOLS)
    single = LLMEngine(EngineConfig(**settings))
    try:
        expected = single.generate(prompts, _params())
    finally:
        single.shutdown()
    engine = LLMEngine(EngineConfig(data_parallel_size=dp, expert_parallel_size=ep, **settings))
    try:
        got = engine.generate(prompts, _params())
        ranks = {engine.rank_of(f"x{i}") for i in range(1)}  # (nothing live: None)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert ranks == {None}
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in expected]
    for one, many in zip(expected, got):
        for a, b in zip(one.get("logprobs") or [], many.get("logprobs") or []):
            assert a.rank == b.rank and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert stats["num_draft_tokens"] > 0 and all(rank["num_steps"] > 0 for rank in stats["ranks"])


def test_an_output_batch_carries_a_request_in_at_most_32_bytes():
    """128 requests of one token each, a few of them ending (one with an error, one with log-probabilities): the
    frames a rank sends are at most 32 bytes a request, and come back as they were, handles past 2^31 included (rank
    0 numbers every placement it makes: at 1,000 requests a second it passes 2^31 in 25 days)."""
    outputs = [RequestOutput(f"r{i}", [1000 + i], "", i % 40 == 0, FinishReason.LENGTH if i % 40 == 0 else None, 50,
                             3, None, None, 128 * (i % 2)) for i in range(128)]
    outputs[7] = RequestOutput("r7", [], "", True, FinishReason.ERROR, 50, 3, "the constraint cannot go on")
    handles = {out.request_id: 2**31 - 64 + i for i, out in enumerate(outputs)}
    plain = OutputBatch.of(3, outputs, handles, None).frames()
    assert sum(len(frame) for frame in plain) <= 32 * len(outputs)
    outputs[9] = RequestOutput("r9", [5, 6], "", False, None, 50, 3, None, [TokenLogprobs(-0.5, 1, [(5, -0.5)]),
                                                                             TokenLogprobs(-1.0, 2, [(4, -0.2)])])
    back = list(OutputBatch.from_frames(OutputBatch.of(3, outputs, handles, {"rank": 3}).frames()).rows())
    assert [(h, t, r, c, e) for h, t, r, c, e, _ in back] == [
        (handles[o.request_id], o.new_token_ids, o.finish_reason, o.num_cached_tokens, o.error) for o in outputs]
    assert back[9][5][1].top == [(4, -0.2)] and back[8][5] is None


def test_each_side_sees_the_others_connection_drop():
    """Rank 0's sockets and a rank's, connected as a group connects them (over TCP on loopback): once a side's
    process is gone (its sockets closed), the other side knows it at once, whichever node it is on."""
    links, link = RankLinks(), RankLink()
    try:
        link.connect(links.address)
        links.connect({1: link.address})
        links.send(1, Wake())  # (the connection is up)
        assert link.receive(timeout_s=5) == [Wake()]
        assert links.gone() == [] and not link.rank_0_gone()
        link.close()  # (the rank's process exits)
        deadline = time.monotonic() + 5
        while not links.gone() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert links.gone() == [1]
    finally:
        links.close()
    links, link = RankLinks(), RankLink()
    try:
        link.connect(links.address)
        links.connect({1: link.address})
        link.send(OutputBatch.of(1, [], {}, {"rank": 1}))  # (the connection is up)
        assert links.receive(timeout_s=5).stats == {"rank": 1}
        links.close()  # (rank 0's process exits)
        deadline = time.monotonic() + 5
        while not link.rank_0_gone() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert link.rank_0_gone()
    finally:
        link.close()


def _single_rank_tokens(checkpoint, prompts, params, **settings) -> list[list[int]]:
    single = LLMEngine(EngineConfig(checkpoint=str(checkpoint), **settings, **POOLS))
    try:
        return [r["output_ids"] for r in single.generate(prompts, params)]
    finally:
        single.shutdown()


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2, expert_parallel_size=2),
                                    dict(tensor_parallel_size=2, expert_parallel_size=2)])
def test_static_decode_steps_with_several_ranks_give_the_single_rank_tokens(parallel_checkpoint, layout):
    """cuda_graphs=True on CPU runs the padded static steps as a GPU does: every rank of a tensor/expert-parallel
    group on the same key, data-parallel ranks each on their own (padded to the largest's); each key's first step runs
    eagerly and records its graph (a closure off CUDA), later ones replay it. A rank recording a graph makes its MoE
    exchanges as often as the ranks replaying theirs (a warm-up run before the capture put the ranks out of step)."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (3, 40, 150, 70, 9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = _single_rank_tokens(parallel_checkpoint, prompts, params)
    engine = LLMEngine(EngineConfig(checkpoint=str(parallel_checkpoint), cuda_graphs=True, **layout, **POOLS))
    try:
        assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected
        assert engine.decode_graphs.keys  # rank 0's decodes ran at static shapes
        if "data_parallel_size" not in layout:  # (with DP=2 here rank 0 has the fewer rows: rank 1 records, 0 never)
            assert engine.decode_graphs.recorded
    finally:
        engine.shutdown()


def _steps(step_log) -> list[dict]:
    """The step log's records, each with its rank and whether a static chain drafted after it."""
    return [json.loads(line) for line in step_log.read_text().splitlines()]


@pytest.mark.parametrize("ep, k", [(2, 1), (2, 2), (2, 3), (1, 2)])
def test_data_parallel_ranks_draft_with_static_chains_and_give_the_single_rank_tokens(parallel_checkpoint, tmp_path,
                                                                                       ep, k):
    """After their static verify steps data-parallel ranks draft with static chains (cuda_graphs=True on CPU: eagerly
    at the padded shapes), in lock-step (EP=2) at counts agreed once per step: rank 0's chains see the other rank
    idle (its requests done) and with another row count than its own, every agreement has k passes; the tokens are
    the single rank's."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (3, 40, 150, 70, 9)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 14, 20, 8, 5)]
    expected = _single_rank_tokens(parallel_checkpoint, prompts, params)
    step_log = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(checkpoint=str(parallel_checkpoint), cuda_graphs=True, num_speculative_tokens=k,
                                    data_parallel_size=2, expert_parallel_size=ep, step_log=str(step_log), **POOLS))
    runner, agreed, chains = engine.core.runner, [], []  # rank 0's agreements and its static chains' counts
    agree, draft_chain = runner.agree_drafts, runner.draft_chain
    runner.agree_drafts = lambda counts: agreed.append(agree(counts)) or agreed[-1]
    runner.draft_chain = lambda chain, first_inputs=None: chains.append(chain.dp_token_counts) or draft_chain(
        chain, first_inputs)
    try:
        assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected
    finally:
        engine.shutdown()
    static = Counter(r["rank"] for r in _steps(step_log) if r["static_drafts"])
    assert static[0] == len(chains) > 0 and static[1] > 0  # both ranks drafted with static chains
    if ep > 1:
        assert all(len(passes) == k for passes in agreed)
        firsts = [passes[0] for passes in chains]  # (rank 0's, rank 1's) tokens in each chain's first pass
        assert any(other == 0 for _, other in firsts)  # rank 1 idle
        assert any(0 < other != own for own, other in firsts)  # rank 1 with another row bucket


@pytest.mark.parametrize("k", [2, 3])
def test_a_rank_drafting_pass_by_pass_keeps_in_step_with_a_rank_running_its_static_chain(parallel_checkpoint,
                                                                                          tmp_path, k):
    """DP=2+EP=2, one request a rank: rank A's is sampled (seeded, draft_sampling=sample: it drafts pass by pass,
    drawing on the host), rank B's greedy (its static chain); each step's k passes agreed at once line up, and the
    tokens are the single rank's (the seeded one's too)."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (30, 34)]
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, ignore_eos=True)]
    speculative = dict(num_speculative_tokens=k, cuda_graphs=True, draft_sampling="sample")
    expected = _single_rank_tokens(parallel_checkpoint, prompts, params, **speculative)
    step_log = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(checkpoint=str(parallel_checkpoint), **speculative, data_parallel_size=2,
                                    expert_parallel_size=2, step_log=str(step_log), **POOLS))
    try:
        assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected
    finally:
        engine.shutdown()
    verifies = [r for r in _steps(step_log) if r["num_verifies"]]
    static = {rank: any(r["static_drafts"] for r in verifies if r["rank"] == rank) for rank in (0, 1)}
    assert {r["rank"] for r in verifies} == {0, 1} and sorted(static.values()) == [False, True]


def test_a_grammar_ending_rows_after_the_agreement_keeps_the_ranks_in_step(parallel_checkpoint):
    """DP=2+EP=2, k=3, constrained requests on both ranks: a row whose grammar takes no more drafts leaves its rank's
    later passes after their counts were agreed, so a pass brings fewer tokens than declared (rank 0's are counted);
    the exchange still pads to the agreed largest, and the tokens are the single rank's."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=24, guided_decoding=guided_decoding_from_sampling(
        {"guided_decoding": {"json": schema}}, "test"))
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (5, 30, 12, 44)]
    settings = dict(checkpoint=str(parallel_checkpoint), num_speculative_tokens=3, **POOLS)
    expected = _single_rank_tokens(parallel_checkpoint, prompts, params, num_speculative_tokens=3)
    engine = LLMEngine(EngineConfig(data_parallel_size=2, expert_parallel_size=2, **settings))
    runner, fewer = engine.core.runner, []
    draft = runner.draft
    runner.draft = lambda step: fewer.append(step.batch.num_tokens < step.dp_token_counts[0]) or draft(step)
    try:
        assert [r["output_ids"] for r in engine.generate(prompts, params)] == expected
    finally:
        engine.shutdown()
    assert any(fewer)
