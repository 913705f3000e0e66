"""Speculative decoding with the MTP layer: outputs exactly as without it, whatever the drafts.

The built-in checkpoint's MTP layer has random weights, so its drafts are almost always rejected. To exercise
acceptance, partial acceptance and the rollback of V4's state after it, `OracleDrafter` (a fake of one part: the
draft proposals) still runs the real MTP layer, then replaces its drafts by the reference continuation with some
tokens corrupted: the target model accepts some drafts, rejects the rest, and must still produce the reference
tokens. The acceptance rule for sampled requests is checked statistically on the verifier itself, and through the
engine with drafts of a known distribution (`ModeDrafter`). Constrained requests (a regex, a JSON schema) draft and
verify under their grammars' masks: the same greedy tokens and log-probabilities as without drafts, every sampled
output valid, every draft one the grammar takes (`GrammarCheckingDrafter`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
from collections import Counter

import jsonschema
import pytest
import torch

from backend.config import ConfigError, EngineConfig
from backend.engine import LLMEngine
from backend.model.graph_runner import DraftChains
from backend.request import SamplingParams
from backend.sampler import Sampler, SamplerState
from backend import speculative
from backend.speculative import Drafter, Verifier
from kernels.fp8_gemm import Fp8Weight


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


def _engine(checkpoint, **overrides) -> LLMEngine:
    settings = dict(checkpoint=str(checkpoint), device="cpu", page_size=16, max_running_requests=4,
                    prefill_chunk_tokens=64, num_tokens=8192)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


class OracleDrafter(Drafter):
    """The real draft layer runs; its proposals are then replaced by the reference outputs, each token corrupted with
    probability `error_rate` (so verifies accept some drafts and reject the rest). Where the step's chain ran on the
    device (`chain_early`), the drafts it left there for a verify scheduled before this step is taken in (overlapped
    verify steps) are replaced too. A row's next output is known from its position (`prompt_lengths`: request index ->
    its prompt's length), so that a row the scheduler voids (an overlapped verify past rejected drafts) counts
    nothing."""

    def __init__(self, drafter: Drafter, reference: dict[int, list[int]], error_rate: float, vocab: int,
                 prompt_lengths: dict[int, int]):
        super().__init__(drafter.runner, drafter.sampler, drafter.sample_drafts)
        self.reference, self.error_rate, self.vocab = reference, error_rate, vocab
        self.prompt_lengths = prompt_lengths
        self.random = random.Random(0)

    def propose(self, batch, job, output, states, ready=None, held=None):
        drafts = super().propose(batch, job, output, states, ready, held)
        firsts = job.first_logits_rows()  # (a row's state slot as the step had it: the request may be gone since)
        for r, proposed in drafts.items():
            row = job.rows[r]
            index = int(row.request_id.split("-")[1])
            done = row.position + len(output.tokens[r]) + 1 - self.prompt_lengths[index]  # (the first draft's output)
            truth = (self.reference[index][done:] + [0] * len(proposed))[:len(proposed)]
            drafts[r] = [(t + 1) % self.vocab if self.random.random() < self.error_rate else t for t in truth]
            if ready is not None and drafts[r]:  # (where the next verify may read them, on the device)
                kept = self.runner.last_tokens.view(-1, self.runner.tokens_per_slot)
                kept[batch.logits_slot[firsts[r]], 1:1 + len(drafts[r])] = torch.tensor(drafts[r])
        return drafts


def _record_chain_holds(monkeypatch) -> list[bool]:
    """For every static chain run, whether any of its rows held its stop tokens back."""
    run, holding = DraftChains.run, []

    def recording(self, chain, hidden, replay=True, first_inputs=None):
        holds = chain.holds if first_inputs is None else first_inputs.holds
        holding.append(bool(holds.any()))
        return run(self, chain, hidden, replay, first_inputs)

    monkeypatch.setattr(DraftChains, "run", recording)
    return holding


def _generate(engine: LLMEngine, prompts, params, reference=None, error_rate: float = 0.3):
    if reference is not None:
        engine.executor.drafter = OracleDrafter(engine.executor.drafter, reference, error_rate, engine.vocab_size,
                                                dict(enumerate(map(len, prompts))))
    results = engine.generate(prompts, params)
    engine.kv.check()
    assert all(held == 0 for held in engine.kv.pages_held_by_requests().values())  # nothing leaked
    return results


def _ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


@pytest.fixture(scope="module")
def greedy_reference(tiny_checkpoint):
    """k = 0 outputs of prompts from 1 to 600 tokens: chunked prefills (64) beside decodes, CSA (4) and HCA (128)
    windows closing inside verifies."""
    prompts = _prompts([1, 7, 130, 260, 600])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    return prompts, params, _ids(_generate(_engine(tiny_checkpoint), prompts, params))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_outputs_with_speculation_equal_those_without(tiny_checkpoint, greedy_reference, k):
    prompts, params, expected = greedy_reference
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    got = _generate(engine, prompts, params, dict(enumerate(expected)))
    assert _ids(got) == expected
    stats = engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # accepted and rejected drafts both
    assert stats["mean_accepted_length"] > 1.0


def test_the_checkpoints_own_draft_layer_changes_no_output(tiny_checkpoint, greedy_reference):
    """The real MTP drafts (random weights here: nearly all rejected) leave the outputs as they were."""
    prompts, params, expected = greedy_reference
    engine = _engine(tiny_checkpoint, num_speculative_tokens=2)
    assert _ids(_generate(engine, prompts, params)) == expected
    assert engine.stats()["num_draft_tokens"] > 0


def test_preemption_and_prefix_cache_hits_in_the_middle(tiny_checkpoint):
    prompts = _prompts([100, 100, 100, 100], seed=1)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = _ids(_generate(_engine(tiny_checkpoint), prompts, params))
    # 512 positions: four requests of 140 cannot all run at once (test_engine.py's preemption case).
    tight = _engine(tiny_checkpoint, num_speculative_tokens=3, num_tokens=512, swa_full_tokens_ratio=1.0)
    assert _ids(_generate(tight, prompts, params, dict(enumerate(expected)))) == expected
    assert tight.stats()["num_preemptions"] > 0
    # The same prompts again (their prefixes cached), extended: cache hits, then verifies from there.
    engine = _engine(tiny_checkpoint, num_speculative_tokens=2)
    _generate(engine, prompts, params, dict(enumerate(expected)))
    longer = [p + o[:30] for p, o in zip(prompts, expected)]
    again = _ids(_generate(_engine(tiny_checkpoint), longer, params))
    engine.executor.drafter.reference = dict(enumerate(again))
    engine.executor.drafter.prompt_lengths = dict(enumerate(map(len, longer)))
    got = _generate(engine, longer, params)
    assert _ids(got) == again
    assert all(r["num_cached_tokens"] > 0 for r in got)


def test_stops_and_max_tokens_hold_per_accepted_token(tiny_checkpoint, greedy_reference):
    """Drafts all correct (so whole runs are accepted): a stop token in the middle of an accepted run ends the
    output there, and max_tokens is never overshot."""
    prompts, _, expected = greedy_reference
    stop = expected[2][9]
    params = SamplingParams(max_tokens=13, ignore_eos=True, stop_token_ids=[stop])
    want = _generate(_engine(tiny_checkpoint), prompts, params)
    got = _generate(_engine(tiny_checkpoint, num_speculative_tokens=3), prompts, params,
                    dict(enumerate(expected)), error_rate=0.0)
    assert _ids(got) == _ids(want) and [r["finish_reason"] for r in got] == [r["finish_reason"] for r in want]
    assert got[2]["output_ids"][-1] == stop and len(got[2]["output_ids"]) <= 10
    assert all(len(r["output_ids"]) <= 13 for r in got)


def test_verifies_carry_every_draft_up_to_what_the_pools_hold_for_a_request(tiny_checkpoint):
    """Rows of one width keep a step's static shape, so a verify carries all k drafts also past max_tokens (the
    take-in keeps max_tokens tokens, the acceptance counts only the drafts that could be emitted); only a request
    whose positions reach what the pools hold for one request verifies fewer: the first request here fills them
    (prompt + max_tokens - 1 = max_request_positions), and still ends like the engine without drafts. (The pools
    cannot hold both requests whole: one is preempted on the way.)"""
    k = 3
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k, num_tokens=1024, swa_full_tokens_ratio=1.0)
    capacity = engine.limits.max_request_positions
    prompts = _prompts([capacity - 99, 30], seed=4)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    expected = _ids(_generate(_engine(tiny_checkpoint, num_tokens=1024, swa_full_tokens_ratio=1.0), prompts, params))
    chunks = []  # (request index, first position, draft count, positions allocated) of every decode
    build = engine.core._build

    def spy(plan):
        chunks.extend((int(c.seq.request_id.split("-")[1]), c.start, len(c.drafts), c.allocated)
                      for c in plan.chunks if c.is_decode)
        return build(plan)

    engine.core._build = spy
    got = _generate(engine, prompts, params, dict(enumerate(expected)), error_rate=0.0)
    assert _ids(got) == expected
    stats = engine.stats()  # every draft right: each one counted is accepted
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert sum(drafts == k for _, _, drafts, _ in chunks) > 0.9 * len(chunks)  # also the last ones before max_tokens
    # the verifies and their chains' positions: within the request's admitted ones and the chain's k - 1 after them
    assert all(start + allocated <= capacity + k - 1 for request, start, _, allocated in chunks if request == 0)
    assert max(start + allocated for request, start, _, allocated in chunks if request == 0) == capacity + k - 1


def test_sampled_requests_keep_their_seeds_and_logprobs(tiny_checkpoint):
    """Sampling with penalties and log-probabilities through verifies: the same seed gives the same tokens, every
    token has its log-probability."""
    prompts = _prompts([20, 50], seed=2)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, seed=11, logprobs=2, repetition_penalty=1.2,
                            frequency_penalty=0.3, ignore_eos=True)
    first = _generate(_engine(tiny_checkpoint, num_speculative_tokens=2), prompts, params)
    second = _generate(_engine(tiny_checkpoint, num_speculative_tokens=2), prompts, params)
    assert _ids(first) == _ids(second)
    assert all(len(r["logprobs"]) == len(r["output_ids"]) == 24 for r in first)


def test_logit_bias_and_allowed_token_ids_hold_through_verifies(tiny_checkpoint, monkeypatch):
    """Greedy requests with a logit bias (one token pushed up, another banned) and with allowed tokens: verified drafts
    emit what plain decoding emits, every token among the allowed ones, never the banned one. The drafts themselves
    are drawn under the same bias (the draft layer's random weights would draft outside the allowed tokens, drafts
    the verify is bound to reject)."""
    drafted, draw = [], Drafter._draw

    def recording(self, logits, states, *args):
        tokens = draw(self, logits, states, *args)
        drafted.extend((state.params, token) for state, token in zip(states, tokens) if token is not None)
        return tokens

    monkeypatch.setattr(Drafter, "_draw", recording)
    prompts = _prompts([12, 40], seed=3)
    plain = _ids(_generate(_engine(tiny_checkpoint), prompts, SamplingParams(max_tokens=20, ignore_eos=True)))
    banned, pushed = plain[0][1], plain[1][3]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={banned: -100.0, pushed: 3.0}),
              SamplingParams(max_tokens=20, ignore_eos=True, allowed_token_ids=sorted(set(plain[1][::2])))]
    expected = _ids(_generate(_engine(tiny_checkpoint), prompts, params))
    assert banned not in expected[0] and expected[0] != plain[0]
    assert set(expected[1]) <= set(params[1].allowed_token_ids) and expected[1] != plain[1]
    for k in (1, 2):
        assert _ids(_generate(_engine(tiny_checkpoint, num_speculative_tokens=k), prompts, params)) == expected
    allowed = [token for params_, token in drafted if params_ is params[1]]
    biased = [token for params_, token in drafted if params_ is params[0]]
    assert len(allowed) >= 20 and set(allowed) <= set(params[1].allowed_token_ids)
    assert len(biased) >= 20 and banned not in biased


def test_a_verify_row_without_any_finite_logit_accepts_none_of_its_drafts():
    """A sampled row whose every logit is -inf (a grammar and allowed_token_ids that share no token) has p NaN at every
    draft: rejected, not accepted by a comparison NaN fails."""
    state = SamplerState(SamplingParams(temperature=1.0, seed=0), [1])
    targets = torch.full((3, 10), float("-inf"))
    (emitted,) = Verifier._rejection_sample([targets], [state], [[4, 5]])
    assert emitted[:-1] == []


@pytest.mark.parametrize("argmax_drafts", [False, True], ids=["drafts drawn from q", "argmax drafts"])
def test_rejection_sampling_preserves_the_target_distribution(argmax_drafts):
    """Leviathan et al.'s rule: whatever the draft distribution, each emitted token is distributed as the target's
    (checked over 20,000 verifies of 2 drafts: the first token's distribution, and the second's after a given
    first; Pearson's chi-square below its 0.001 critical value for 5 degrees of freedom). Argmax drafts keep no q
    (draft_sampling=argmax): the same rule with q all on the draft."""
    critical = 20.515  # chi-square, 5 degrees of freedom, p = 0.001
    vocab = 6
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 1.0, 0.0, 0.7],
                                  [0.0, 0.0, 1.0, 1.0, 2.0, -2.0]])
    draft_probs = [torch.softmax(torch.tensor([0.0, 2.0, 1.0, 0.0, 0.5, 0.0]), -1),
                   torch.softmax(torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0, 0.0]), -1)]
    target = torch.softmax(target_logits, -1)
    state = SamplerState(SamplingParams(temperature=1.0, seed=3), [0])
    verifier, drafts_gen = Verifier(Sampler()), torch.Generator().manual_seed(5)
    first, second = Counter(), Counter()
    for _ in range(20000):
        if argmax_drafts:
            drafts, state.draft_probs = [int(q.argmax()) for q in draft_probs], []
        else:
            drafts = [int(torch.multinomial(q, 1, generator=drafts_gen)) for q in draft_probs]
            state.draft_probs = list(draft_probs)
        emitted = verifier._rejection_sample([target_logits], [state], [drafts])[0]
        first[emitted[0]] += 1
        if emitted[0] == 1 and len(emitted) > 1:
            second[emitted[1]] += 1
    for counts, p in ((first, target[0]), (second, target[1])):
        observed = [counts[t] for t in range(vocab)]
        expected = [float(x) * sum(observed) for x in p]
        statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
        assert statistic < critical, (observed, expected)


def test_rows_verified_together_each_test_their_drafts_against_their_own_q():
    """Two sampled rows verified at once, the first verifying fewer drafts than it drew (a decode near its end): the
    second row's draft is tested against its own q (accepted half the time: p = 0.5, q = 1), not against the first
    row's unused one (q = 0.5 would accept it always)."""
    vocab = 4
    first, second = [SamplerState(SamplingParams(temperature=1.0, seed=seed), [0]) for seed in (1, 2)]
    half = torch.log(torch.tensor([0.5, 0.5, 1e-9, 1e-9]))  # p = 0.5 on tokens 0 and 1
    accepted = 0
    for _ in range(400):
        first.draft_probs = [torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.5, 0.5, 0.0, 0.0])]
        second.draft_probs = [torch.tensor([0.0, 1.0, 0.0, 0.0])]
        emitted = Verifier._rejection_sample([half.expand(2, vocab), half.expand(2, vocab)], [first, second],
                                             [[0], [1]])
        accepted += emitted[1][0] == 1 and len(emitted[1]) == 2
    assert 140 < accepted < 260, accepted


def test_speculation_without_a_draft_layer_or_beyond_the_limits_is_refused(tiny_checkpoint, tmp_path):
    import json
    import shutil

    no_mtp = tmp_path / "no-mtp"
    shutil.copytree(tiny_checkpoint, no_mtp)
    config = json.loads((no_mtp / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (no_mtp / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_speculative_tokens.*MTP layer"):
        _engine(no_mtp, num_speculative_tokens=1)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=9)
    with pytest.raises(ConfigError, match="num_speculative_tokens.*max_num_batched_tokens"):
        EngineConfig(num_speculative_tokens=3, max_running_requests=16, max_num_batched_tokens=32)
    # A window pool of 3 pages of 64 holds a decode's window (128 positions) but not one draft more.
    small_window = dict(page_size=64, num_tokens=768, swa_full_tokens_ratio=0.25, prefill_chunk_tokens=None)
    _engine(tiny_checkpoint, **small_window).shutdown()
    with pytest.raises(ConfigError, match="num_speculative_tokens.*window pool"):
        _engine(tiny_checkpoint, num_speculative_tokens=1, **small_window)


def test_a_declared_mtp_layer_missing_from_the_files_is_refused_before_any_weight_is_read(tiny_checkpoint, tmp_path):
    """What transformers' save_pretrained writes: config.json declares the MTP layer, the files do not hold it. The
    deployment check (what make_model_repository.py runs, reading no weight) names the parameter."""
    import shutil

    from safetensors.torch import load_file, save_file

    from backend.deployment import check_deployment

    no_mtp = tmp_path / "no-mtp-tensors"
    shutil.copytree(tiny_checkpoint, no_mtp)
    for path in no_mtp.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(path).items() if ".mtp." not in f".{k}"}, path)
    (no_mtp / "model.safetensors.index.json").unlink(missing_ok=True)
    config = EngineConfig(checkpoint=str(no_mtp), device="cpu", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="num_speculative_tokens.*files hold no mtp.0"):
        check_deployment(config)
    assert check_deployment(EngineConfig(checkpoint=str(no_mtp), device="cpu")) > 0  # and without drafts it serves
    check_deployment(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", num_speculative_tokens=2))


# Under DeepSeek's numerics on the quantized layout, a verify's 1 + k rows a request sum fp32 products in other orders
# than a decode's one row (last-bit differences), and the activations' roundings turn some of those into moves of
# hundredths of a logit on this random model (docs/numerics.md): where the two best tokens are that near, the two runs
# may pick differently.
NEAR_TIE = 0.1


def _part_at_near_ties(plain: list[dict], speculative: list[dict]) -> int:
    """Each speculative output is the plain one, or parts from it at a near-tie: at the first token they differ, the
    two runs' two best are the same two tokens, each run's within NEAR_TIE, each run picking its best. Returns how
    many outputs are identical."""
    identical = 0
    for a, b in zip(plain, speculative):
        at = next((i for i, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y), None)
        if at is None:
            identical += a["output_ids"] == b["output_ids"]
            continue
        tops = [out["logprobs"][at].top[:2] for out in (a, b)]
        assert [top[0][0] for top in tops] == [a["output_ids"][at], b["output_ids"][at]], tops
        assert {t for t, _ in tops[0]} == {t for t, _ in tops[1]}, tops
        assert all(top[0][1] - top[1][1] < NEAR_TIE for top in tops), tops
    return identical


def test_the_published_fp8_layout_speculates_the_same_tokens_up_to_rounding_near_ties(deepseek_published_checkpoint):
    """DeepSeek's layout with FP8 linears (the MTP layer's e_proj/h_proj among them) and MXFP4 experts, served with
    DeepSeek's numerics and the fp8 KV cache (the draft layer's window too): with k = 2 the greedy tokens of k = 0,
    parting only at a near-tie (`_part_at_near_ties`), most outputs whole."""
    near_tie = [85, 382, 280, 296, 104]  # (parts at its 22nd token on a 2-core AVX-512 machine: 0.026 apart)
    prompts = _prompts([5, 140, 5, 60], seed=3) + [near_tie]
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)
    settings = dict(weight_format="fp8", numerics="deepseek", kv_cache_dtype="fp8")
    plain = _generate(_engine(deepseek_published_checkpoint, **settings), prompts, params)
    engine = _engine(deepseek_published_checkpoint, num_speculative_tokens=2, **settings)
    assert isinstance(engine.model.w["model.mtp.0.e_proj.weight"], Fp8Weight) and engine.kv.kv_layout.fp8
    speculative = _generate(engine, prompts, params, dict(enumerate(_ids(plain))))
    assert _part_at_near_ties(plain, speculative) >= len(prompts) // 2
    assert engine.stats()["num_accepted_tokens"] > 0


def test_the_draft_forward_is_deepseeks_mtp_block(tiny_checkpoint):
    """`DeepseekV4Model.draft` over the engine's paged memory against DeepSeek's MTPBlock composed from transformers'
    own modules (scripts/train_mtp_draft.py's DraftLayer), from the reference model's residual streams: logits at
    every position of a 200-token prompt (its window sliding) within 1e-4."""
    import dataclasses
    import sys

    from transformers import DeepseekV4ForCausalLM

    from backend.model.checkpoint import load_weights
    from backend.model.forward_batch import BatchRow, build_forward_batch
    from backend.request import Sequence
    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    from train_mtp_draft import DraftLayer, main_model_streams, one_layer_config

    tokens = _prompts([201], seed=4)[0]
    reference = DeepseekV4ForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    streams = main_model_streams(reference, torch.tensor([tokens]))
    module = DraftLayer(one_layer_config(tiny_checkpoint)).eval()
    engine = _engine(tiny_checkpoint, num_speculative_tokens=1)
    weights = load_weights(tiny_checkpoint, engine.model_config, torch.float32, "cpu", draft_layers=1)
    module.load_engine_tensors({n: t for n, t in weights.items() if n.startswith("model.mtp.0.")})
    with torch.no_grad():
        hidden = module(reference.model.embed_tokens(torch.tensor([tokens[1:]])), streams[:, :-1])
        expected = torch.nn.functional.linear(hidden, reference.lm_head.weight)[0]

    seq = Sequence("draft-check", tokens[:-1])
    engine.kv.extend(seq, len(tokens) - 1)
    batch = build_forward_batch([BatchRow(seq.pages, tokens[:-1], 0, True)], engine.kv)
    _, main_streams = engine.model.forward(batch, engine.kv, return_streams=True)
    assert (main_streams - streams[0, :-1]).abs().max() < 1e-4  # the engine's streams are the reference's
    got, _ = engine.model.draft(dataclasses.replace(batch, input_ids=torch.tensor(tokens[1:])), engine.kv,
                                main_streams, torch.arange(len(tokens) - 1))
    engine.kv.free(seq)
    assert (got - expected).abs().max() < 1e-4


class ModeDrafter(Drafter):
    """A deterministic draft for sampled requests: after the outputs so far, the next token sampling picked most
    often after them without speculation, proposed with draft probability 1 (q = one-hot, kept as such with
    `keep_q`, else left out as the argmax drafts leave it). The rule must keep p whatever q is; with this q a draft is
    accepted with probability p(draft), often, and a rejection draws from p without it."""

    def __init__(self, drafter: Drafter, samples: list[list[int]], vocab: int, keep_q: bool = True):
        super().__init__(drafter.runner, drafter.sampler, drafter.sample_drafts)
        self.vocab, self.outputs, self.keep_q = vocab, {}, keep_q
        follows: dict[tuple, Counter] = {}
        for out in samples:
            for i in range(len(out)):
                follows.setdefault(tuple(out[:i]), Counter())[out[i]] += 1
        self.mode = {history: counts.most_common(1)[0][0] for history, counts in follows.items()}

    def propose(self, batch, job, output, states, ready=None, held=None):
        drafts = super().propose(batch, job, output, states, ready, held)
        for r, row in enumerate(job.rows):
            self.outputs.setdefault(row.request_id, []).extend(output.tokens[r])
        for r, proposed in drafts.items():
            history = list(self.outputs[job.rows[r].request_id])
            for _ in proposed:
                history.append(self.mode.get(tuple(history), 0))
            drafts[r] = history[len(history) - len(proposed):]
            states[r].draft_probs = [torch.nn.functional.one_hot(torch.tensor(d), self.vocab).float()
                                     for d in drafts[r]] if self.keep_q else []
        return drafts


def _homogeneity(first: list[int], second: list[int]) -> tuple[float, float]:
    """Pearson's chi-square statistic that two samples of equal size come from one distribution (categories
    expected fewer than 5 times pooled), and its critical value at p = 0.001 (Wilson-Hilferty)."""
    a, b, n = Counter(first), Counter(second), len(first)
    expected = {t: (a[t] + b[t]) / 2 for t in set(a) | set(b)}
    small = [t for t, e in expected.items() if e < 5]
    cells = [([a[t]], [b[t]], e) for t, e in expected.items() if e >= 5]
    if small:
        cells.append(([a[t] for t in small], [b[t] for t in small], sum(expected[t] for t in small)))
    statistic = sum((sum(x) - e) ** 2 / e + (sum(y) - e) ** 2 / e for x, y, e in cells)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3
    assert n == len(second) and df >= 2
    return statistic, critical


@pytest.mark.parametrize("keep_q", [True, False], ids=["q kept", "argmax drafts, no q"])
def test_sampled_tokens_are_distributed_as_without_speculation(tiny_checkpoint, keep_q):
    """400 seeded samples of 3 tokens from one prompt (temperature 1, top-k 6), without speculation and with k = 2
    drafts that are accepted or rejected often: the second and third tokens' distributions agree (chi-square
    homogeneity at p = 0.001), whether the draft distribution is kept (one-hot) or left out as argmax drafts leave
    it."""
    prompt, count = _prompts([12], seed=6)[0], 400

    def sample(engine, first_seed):
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=first_seed + i, ignore_eos=True)
                  for i in range(count)]
        return _ids(_generate(engine, [prompt] * count, params))

    _distributed_as_without_drafts(tiny_checkpoint, sample, keep_q)


def _distributed_as_without_drafts(checkpoint, sample, keep_q: bool = True, least_accepted: float = 0.1) -> None:
    """`sample(engine, first_seed)`'s outputs without speculation and with k = 2 drafts (`ModeDrafter`, accepted for
    between `least_accepted` and 90 % of them; a mode draft's acceptance is the probability of its token, about 22 %
    here, and which draws accept depends on how the verify spends the seeded generator: the bound leaves room for
    that): the second and third tokens' distributions agree (chi-square homogeneity at p = 0.001)."""
    without = sample(_engine(checkpoint, max_running_requests=16), 0)
    engine = _engine(checkpoint, num_speculative_tokens=2, max_running_requests=16)
    engine.executor.drafter = ModeDrafter(engine.executor.drafter, without, engine.vocab_size, keep_q)
    with_drafts = sample(engine, 10_000)
    stats = engine.stats()
    assert least_accepted * stats["num_draft_tokens"] < stats["num_accepted_tokens"] < 0.9 * stats["num_draft_tokens"]
    for position in (1, 2):
        statistic, critical = _homogeneity([o[position] for o in without], [o[position] for o in with_drafts])
        assert statistic < critical, (position, statistic, critical)


def test_verify_steps_at_static_shapes(tiny_checkpoint, greedy_reference):
    """cuda_graphs=True on CPU runs the padded static steps eagerly (what CUDA graphs replay on a GPU): verify steps
    whose rows all carry k drafts take keys of 1 + k tokens a row (the draft passes after them run eagerly), and the
    outputs stay those without speculation."""
    prompts, params, expected = greedy_reference
    engine = _engine(tiny_checkpoint, num_speculative_tokens=2, cuda_graphs=True)
    assert _ids(_generate(engine, prompts, params, dict(enumerate(expected)))) == expected
    assert 3 in {key.tokens_per_row for key in engine.decode_graphs.keys}


def test_verifies_across_prefix_blocks_stay_static_and_their_snapshots_serve_later_requests(tiny_checkpoint,
                                                                                          monkeypatch):
    """Decodes that verify across a prefix-cache block boundary (128 positions) keep the rings as they stand there,
    inside their static verify step: such steps keep their static shape (a CUDA graph on a GPU, where they used to
    run eagerly), outputs stay those without speculation, and requests that then continue those sequences restore
    the snapshots and produce what an engine without cache or drafts produces."""
    import backend.engine_core

    prompts = _prompts([100, 103, 230], seed=3)  # prefilled well before their decodes reach a boundary
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = _ids(_generate(_engine(tiny_checkpoint), prompts, params))
    inside_static = []  # static verify batches with a snapshot inside a row
    build = backend.engine_core.build_forward_batch

    def spy(rows, kv, **kwargs):
        if kwargs.get("pad_to") is not None:
            inside_static.append(sum(len(row.snapshots) for row in rows))
        return build(rows, kv, **kwargs)

    monkeypatch.setattr(backend.engine_core, "build_forward_batch", spy)
    # (the checkpoint's own draft layer: its drafts nearly all rejected, every decode row verifies two, so the
    # decode steps are static ones; the oracle's partly accepted chains end at different lengths)
    engine = _engine(tiny_checkpoint, num_speculative_tokens=2, cuda_graphs=True)
    assert _ids(_generate(engine, prompts, params)) == expected
    assert sum(inside_static) >= 2, inside_static
    decodes = [step for step in engine.scheduler.records if step.kind.value == "decode"]
    assert decodes and all(step.timing.static_shape for step in decodes)  # (what the step log records)
    longer = [p + o[:32] for p, o in zip(prompts, expected)]  # past the boundaries the decodes crossed
    again = _ids(_generate(_engine(tiny_checkpoint, enable_prefix_caching=False), longer, params))
    got = _generate(engine, longer, params)
    assert _ids(got) == again
    assert [r["num_cached_tokens"] for r in got] == [128, 128, 256]


def test_verify_rows_and_the_draft_layer_through_the_triton_kernels(tiny_checkpoint):
    """The GPU code path (the Triton kernels, under the interpreter here): verify rows of 1 + k tokens beside a
    prefill chunk, the draft layer's passes and its chain, with drafts partly accepted, give the tokens of the
    reference kernels without speculation."""
    prompts = _prompts([9, 70], seed=7)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = _ids(_generate(_engine(tiny_checkpoint), prompts, params))
    engine = _engine(tiny_checkpoint, num_speculative_tokens=2, prefill_chunk_tokens=32)
    engine.model.kernels.mode = "triton"
    assert _ids(_generate(engine, prompts, params, dict(enumerate(expected)))) == expected
    assert engine.stats()["num_accepted_tokens"] > 0


# --- constrained requests ------------------------------------------------------------------------------------------

REGEX = r"(\d{3}-){4}[a-z ]{12}"  # (a random model keeps to it only through the masks)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CONSTRAINTS = [{"regex": REGEX}, {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}]


def _constrained_params(temperature: float = 0.0, seed: int = 0, **extra) -> list[SamplingParams]:
    """A regex and a JSON schema twice each, and a request without a constraint beside them."""
    constrained = [SamplingParams.from_dict({"max_tokens": 96, "temperature": temperature, "seed": seed + i,
                                             "guided_decoding": constraint, **extra})
                   for i, constraint in enumerate(CONSTRAINTS * 2)]
    free = SamplingParams(max_tokens=24, temperature=temperature, seed=seed + 9, ignore_eos=True, **extra)
    return constrained + [free]


def _assert_valid(results, params) -> None:
    """Every constrained output is complete (its grammar's end) and in its language."""
    for r, p in zip(results, params):
        guided = p.guided_decoding
        if guided is None:
            continue
        assert r["finish_reason"] == "stop", (guided.spec, r)
        if guided.kind == "regex":
            assert re.fullmatch(guided.spec, r["text"]), r["text"]
        else:
            jsonschema.validate(json.loads(r["text"]), json.loads(guided.spec))


class GrammarCheckingDrafter(Drafter):
    """The real drafts, checked: each constrained row's are a path its grammar takes from where its matcher stands
    (so the matcher was rolled back to the emitted tokens), nothing after a draft that ends the grammar."""

    def __init__(self, drafter: Drafter):
        super().__init__(drafter.runner, drafter.sampler, drafter.sample_drafts)
        self.constrained_drafts = 0
        self.invalid: list[list[int]] = []  # draft chains their grammar does not take

    def propose(self, batch, job, output, states, ready=None, held=None):
        drafts = super().propose(batch, job, output, states, ready, held)
        for r, proposed in drafts.items():
            if states[r].grammar is None:
                continue
            matcher = states[r].grammar.matcher.fork()
            if not all(not matcher.is_terminated() and matcher.accept_token(token) for token in proposed):
                self.invalid.append(proposed)
            self.constrained_drafts += len(proposed)
        return drafts


@pytest.fixture(scope="module")
def constrained_reference(tiny_checkpoint):
    """k = 0 greedy outputs of the constrained requests alone (the engine's draft counters are then theirs)."""
    prompts, params = _prompts([3, 40, 9, 70], seed=8), _constrained_params()[:4]
    results = _generate(_engine(tiny_checkpoint), prompts, params)
    _assert_valid(results, params)
    return prompts, params, results


@pytest.mark.parametrize("k", [1, 2, 3])
def test_constrained_greedy_outputs_with_speculation_equal_those_without(tiny_checkpoint, constrained_reference, k):
    """Drafts from the reference outputs, 30 % corrupted (a corrupted draft is mostly one the grammar cannot take;
    the true ones run up to the grammar's stop token): the same tokens and endings as without drafts, and the
    engine's counters show drafts of constrained rows proposed, some accepted, some rejected."""
    prompts, params, expected = constrained_reference
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    got = _generate(engine, prompts, params, dict(enumerate(_ids(expected))))
    assert _ids(got) == _ids(expected)
    assert [r["finish_reason"] for r in got] == [r["finish_reason"] for r in expected]
    stats = engine.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert stats["mean_accepted_length"] > 1.0


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_that_end_a_grammar_count_as_accepted(tiny_checkpoint, constrained_reference, k):
    """Every draft right (the reference outputs, uncorrupted): each constrained request's last drafts run to its
    grammar's end, where the verify emits those drafts alone (no token can follow them). Every draft is accepted, and
    the counters (what the metrics and step records report) say so."""
    prompts, params, expected = constrained_reference
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    got = _generate(engine, prompts, params, dict(enumerate(_ids(expected))), error_rate=0.0)
    assert _ids(got) == _ids(expected)
    stats = engine.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"], stats


@pytest.mark.parametrize("k", [1, 2])
def test_drafts_accepted_before_a_token_that_cannot_fit_are_kept_as_without_drafts(tiny_checkpoint, k):
    """choice "abc" / "abd" with allowed_token_ids "a" and "b" (and the end): the grammar forces "a", "b", then
    allows only what allowed_token_ids leaves out, so the request fails there. The draft layer drafts "b" after "a"
    (its drafts are masked by the grammar); the verify's token after it is the one that cannot fit. Without drafts
    the outputs are "ab", then: the end at max_tokens 2, a stop at a stop token "b", the error otherwise; with drafts
    the same. (Before, the whole verify's tokens were dropped and the request failed at once.)"""
    engine = _engine(tiny_checkpoint)
    a, b = 66, 67
    assert engine.tokenizer.decode([a, b]) == "ab"
    constrained = {"guided_decoding": {"choice": ["abc", "abd"]}, "allowed_token_ids": [1, a, b]}
    params = [SamplingParams.from_dict({**constrained, **extra})
              for extra in ({"max_tokens": 2}, {"max_tokens": 16, "stop_token_ids": [b]}, {"max_tokens": 16})]
    expected = _generate(engine, [[5, 6, 7]] * 3, params)
    assert [(r["output_ids"], r["finish_reason"]) for r in expected] == [([a, b], "length"), ([a, b], "stop"),
                                                                         ([a, b], "error")]
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    got = [_generate(engine, [[5, 6, 7]], [p])[0] for p in params]  # (alone: each row's drafts are its own)
    assert [(r["output_ids"], r["finish_reason"], r["error"]) for r in got] == \
        [(r["output_ids"], r["finish_reason"], r["error"]) for r in expected]
    assert engine.stats()["num_accepted_tokens"] >= 2  # ("b" after "a", where two tokens or more are left)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_constrained_sampled_outputs_stay_valid_with_speculation(tiny_checkpoint, k):
    """Sampling (three seeds each) with the draft layer's own drafts, drawn under the grammars' masks: every output
    is in its language, every draft is one its grammar takes, and some of the constrained rows' drafts are
    accepted."""
    prompts = _prompts([3, 40, 9, 70, 20], seed=9)
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    engine.executor.drafter = checking = GrammarCheckingDrafter(engine.executor.drafter)
    for seed in (0, 100, 200):
        params = _constrained_params(temperature=1.0, seed=seed)
        _assert_valid(_generate(engine, prompts, params), params)
    assert checking.invalid == []
    stats = engine.stats()
    assert checking.constrained_drafts > 0 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_verify_copies_the_masks_its_drafts_were_drawn_under(tiny_checkpoint, monkeypatch, temperature):
    """k = 2, constrained requests with the draft layer's own drafts (greedy, and sampled with seeds): a verify copies
    the masks its row's drafts were drawn under (filled by the drafter along the same drafts) and fills only the mask
    after the last draft, where it filled one at every position before; the outputs are the same either way, their
    log-probabilities within rounding (a request whose grammar compiles late joins another batch)."""
    from backend.structured.grammar import GrammarBatch

    prompts = _prompts([3, 40, 9, 70, 20], seed=9)
    params = _constrained_params(temperature=temperature, seed=5, logprobs=1)
    fill, drafted_mask = GrammarBatch.fill_or_unmask, speculative._drafted_mask
    verify_fills = []  # mask rows the verifier fills

    def counting_fill(batch, grammars, masks):
        if sys._getframe(1).f_code.co_name == "_mask_verify_rows":
            verify_fills.append(len(grammars))
        return fill(batch, grammars, masks)

    monkeypatch.setattr(GrammarBatch, "fill_or_unmask", counting_fill)
    runs = {}
    for copied in (False, True):
        monkeypatch.setattr(speculative, "_drafted_mask", drafted_mask if copied else lambda *args: None)
        verify_fills.clear()
        engine = _engine(tiny_checkpoint, num_speculative_tokens=2)
        results = _generate(engine, prompts, params)
        _assert_valid(results, params)
        runs[copied] = results, sum(verify_fills)
        assert engine.stats()["num_draft_tokens"] > 0
    for copied, filled in zip(runs[True][0], runs[False][0]):
        assert (copied["output_ids"], copied["finish_reason"]) == (filled["output_ids"], filled["finish_reason"])
        _same_logprobs(copied["logprobs"], filled["logprobs"])
    assert 0 < runs[True][1] < 0.6 * runs[False][1]  # (about one mask a verify row, against 1 + its drafts)


def test_constrained_sampled_tokens_are_distributed_as_without_speculation(tiny_checkpoint):
    """Under a grammar (the regex: digits first) 400 seeded samples of 3 tokens from one prompt, without speculation
    and with k = 2 drafts accepted or rejected often (`ModeDrafter`: the constrained samples' most frequent next
    token): the second and third tokens' distributions agree (chi-square homogeneity at p = 0.001), so the verify's
    masks after each draft and the rejection rule give each emitted token its constrained distribution."""
    prompt, count = _prompts([12], seed=6)[0], 400

    def sample(engine, first_seed):
        params = [SamplingParams.from_dict({"max_tokens": 3, "temperature": 1.0, "top_k": 6, "seed": first_seed + i,
                                            "guided_decoding": {"regex": REGEX}}) for i in range(count)]
        results = _generate(engine, [prompt] * count, params)
        assert all(re.fullmatch(r"(\d{3}-){0,4}\d{0,3}", r["text"]) for r in results), [r["text"] for r in results]
        return _ids(results)

    _distributed_as_without_drafts(tiny_checkpoint, sample)


def _same_logprobs(got: list, expected: list) -> None:
    """Per token: the same rank and top tokens, log-probabilities within 1e-4 (the verify's logits are computed in
    a wider batch)."""
    assert len(got) == len(expected)
    for position, (a, b) in enumerate(zip(got, expected)):
        assert a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-4, (position, a, b)
        finite = [(t, v) for t, v in b.top if v != float("-inf")]  # (tokens a mask cut have no order)
        assert [t for t, _ in a.top[:len(finite)]] == [t for t, _ in finite], (position, a, b)
        assert all(abs(v - w) < 1e-4 for (_, v), (_, w) in zip(a.top, finite)), (position, a, b)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_logprobs_with_speculation_equal_those_without(tiny_checkpoint, k):
    """logprobs=3, unconstrained and constrained: each emitted token's log-probabilities are those of the target row
    it was decided at (drafts accepted, so a verify emits several), masked as without drafts."""
    prompts = _prompts([3, 40, 9, 70, 20], seed=10)
    params = _constrained_params(logprobs=3)
    expected = _generate(_engine(tiny_checkpoint), prompts, params)
    engine = _engine(tiny_checkpoint, num_speculative_tokens=k)
    got = _generate(engine, prompts, params, dict(enumerate(_ids(expected))))
    assert _ids(got) == _ids(expected)
    assert engine.stats()["num_accepted_tokens"] > 0
    for a, b in zip(got, expected):
        _same_logprobs(a["logprobs"], b["logprobs"])


def _word_grammar(tmp_path, regex: str):
    """A grammar over the word vocabulary {a: 0, b: 1, </s>: 2}: token 0 is text, so a grammar may allow it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from backend.structured.grammar import GrammarService

    Tokenizer(WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="</s>")).save(str(tmp_path / "tokenizer.json"))
    service = GrammarService(tmp_path / "tokenizer.json", vocab_size=3, stop_token_ids=[2])
    params = SamplingParams.from_dict({"guided_decoding": {"regex": regex}, "allowed_token_ids": [1]})
    grammar = service.prepare(params.guided_decoding)
    grammar.future.result(timeout=30)
    service.close()
    return params, grammar


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_allows_none_of_allowed_token_ids_ends_the_request(tmp_path, temperature):
    """Where a constrained request's grammar allows none of its allowed_token_ids, every logit is -inf and the argmax
    (or the draw) is token 0: it must not be emitted. Sampled alone, the request fails; verified after drafts that
    fit both, its tokens stop at those drafts (the next step meets the dead end itself)."""
    from backend.sampler import NO_ALLOWED_TOKEN_FITS
    from backend.speculative import DraftRow, SpecJob

    logits = torch.tensor([[0.0, 5.0, 1.0]] * 2)
    params, grammar = _word_grammar(tmp_path, "a+")
    state = SamplerState(dataclasses.replace(params, temperature=temperature, seed=0), [2], grammar)
    output = Sampler().step(logits[:1].clone(), [state])
    assert output.ends == {0: NO_ALLOWED_TOKEN_FITS} and grammar.done

    params, grammar = _word_grammar(tmp_path, "a+")
    state = SamplerState(params, [2], grammar)
    job = SpecJob(torch.tensor([0, -1]), [DraftRow("r", None, (0,), 1, 10)], 1, propose=False)
    output = Verifier(Sampler()).verify(logits.clone(), [state], job)
    assert output.ends == {0: NO_ALLOWED_TOKEN_FITS}

    params, grammar = _word_grammar(tmp_path, "ba+")  # b fits both; then only a, outside allowed_token_ids
    state = SamplerState(params, [2], grammar)
    job = SpecJob(torch.tensor([1, -1]), [DraftRow("r", None, (1,), 1, 10)], 1, propose=False)
    output = Verifier(Sampler()).verify(logits.clone(), [state], job)
    assert output.tokens == [[1]] and not output.ends and 0 in output.drafts_alone and not grammar.done
    assert grammar.matcher.accept_token(0) and not grammar.matcher.accept_token(1)  # (it holds the draft b)
