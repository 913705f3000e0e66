"""The draft layer's static chain (DraftChain: what a CUDA graph replays after a static verify step) against the
pass-by-pass chain, eagerly on CPU.

Two engines with `cuda_graphs=True` (static verify steps) run the same requests: one drafts pass by pass (its runner
has no chains), the other through the static chain. Every proposal of the MTP layer must be the same, request by
request, and so must the generated tokens (those without speculation). Batches of 5 and 3 rows pad to 8 and 4; with
the oracle's drafts (30 % corrupted) rows accept different counts, so their chained positions differ; in lock-step
(the layer's own drafts, nearly all rejected, one max_tokens) every verify, the last ones included, carries k drafts
and every chain drafts k for each row (the scheduler allocates the chain's positions: rows of one width keep the
step's static shape). With `cut_chains`, every other static step's rows end their pages sooner
(`DraftRow.lookahead_end`), each row at its own place, so that within one chain some rows stop while others go on.
Off CUDA a recorded chain is a `ReplayedClosure` (graph_runner: recorded after the chain's first, eager, run; a
replay runs the closure on the static buffers), which checks what recording a chain assumes: every replay reads the
buffers the later steps copy in, and what the closure bound when recorded; under data-parallel lock-step a recorded
chain replays only where every pass's exchange pads to its own count.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest
import torch

from backend.model import graph_runner
from backend.model.graph_runner import DraftChain
from backend.model.static_batch import StaticKey
from backend.request import SamplingParams
from backend.runner import ModelRunner
from backend.sampler import HeldStops, SamplerState
from backend.speculative import Drafter, SpecJob, Verifier

from .test_speculative import OracleDrafter, _engine, _ids, _prompts, _record_chain_holds

SCENARIOS = {
    "oracle drafts, 5 rows": dict(lengths=[1, 7, 30, 12, 20], error_rate=0.3),
    "oracle drafts, chains cut": dict(lengths=[1, 7, 30, 12, 20], error_rate=0.3, cut_chains=True),
    "lock-step, 3 rows": dict(lengths=[20, 20, 20], error_rate=None),
}
MAX_TOKENS = 40


class RecordingDrafter(OracleDrafter):
    """Keeps the draft layer's proposals (per request, in order) and which chain made them, then hands on the oracle's
    drafts (error_rate None: the layer's own)."""

    def __init__(self, drafter: Drafter, reference: dict[int, list[int]], error_rate: float | None, vocab: int,
                 prompt_lengths: dict[int, int], cut_chains: bool = False, unchain_first_row: bool = False):
        super().__init__(drafter, reference, error_rate or 0.0, vocab, prompt_lengths)
        self.use_oracle, self.cut_chains, self.static_steps = error_rate is not None, cut_chains, 0
        self.unchain_first_row = unchain_first_row  # batch row 0's pages end after its first draft (static steps)
        self.proposals: dict[int, list[list[int]]] = defaultdict(list)  # by the request's place in the batch
        # (pass, the output it drafts, the token, the drafts its row accepted in the verify before)
        self.outputs: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
        self.chains: list[str] = []  # per step: "static", "eager" or "eager after a static step"
        self.short_static = 0  # static chains' rows given fewer than k drafts (their chain stopped early)

    def propose(self, batch, job, output, states, ready=None, held=None):
        if self.cut_chains and job.static_key is not None:
            self.static_steps += 1
            if self.static_steps % 2:  # row r's pages end 1 + r % k positions after its verify's first
                k = job.num_speculative_tokens
                job = replace(job, rows=[replace(row, lookahead_end=min(row.lookahead_end, row.position + 1 + r % k))
                                         for r, row in enumerate(job.rows)])
        if self.unchain_first_row and job.static_key is not None and job.rows:
            job = replace(job, rows=[replace(job.rows[0], lookahead_end=job.rows[0].position + 1), *job.rows[1:]])
        drafter = super() if self.use_oracle else super(OracleDrafter, self)
        return drafter.propose(batch, job, output, states, ready, held)

    def _propose_static(self, job, output, rows, picks, positions, ready, states, held):
        drafts = super()._propose_static(job, output, rows, picks, positions, ready, states, held)
        self.short_static += sum(len(d) < job.num_speculative_tokens for d in drafts.values())
        return self._record("static", job, drafts, rows, positions, states)

    def _propose_eager(self, batch, job, output, states, rows, picks, positions, held):
        chain = "eager" if job.static_key is None else "eager after a static step"
        drafts = super()._propose_eager(batch, job, output, states, rows, picks, positions, held)
        return self._record(chain, job, drafts, rows, positions, states)

    def _record(self, chain: str, job, drafts: dict[int, list[int]], rows, positions, states) -> dict[int, list[int]]:
        self.chains.append(chain)
        for r, position in zip(rows, positions):
            request = int(job.rows[r].request_id.split("-")[1])
            self.proposals[request].append(list(drafts[r]))
            # (a pass drafts the token two past its row's last emitted position: `_draft_holds`)
            self.outputs[request] += [(s, position + s + 2 - len(states[r].prompt_ids), token,
                                       position - job.rows[r].position) for s, token in enumerate(drafts[r])]
        return drafts


@pytest.fixture(scope="module")
def references(tiny_checkpoint):
    """Each scenario's prompts and their tokens without speculation."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for name, scenario in SCENARIOS.items():
        prompts = _prompts(scenario["lengths"], seed=11)
        out[name] = prompts, _ids(_engine(tiny_checkpoint, max_running_requests=8).generate(prompts, params))
    return out


def _run(checkpoint, k: int, scenario: dict, prompts, expected, static: bool, logprobs: int | None = None,
         params: SamplingParams | list[SamplingParams] | None = None, unchain_first_row: bool = False):
    """(each request's tokens, or with `logprobs` its (tokens, log-probabilities)), the drafter, the engine. Each step
    is taken in before the next is scheduled (no overlapped verify steps: every verify's drafts are the oracle's as
    the host saw them, the steps the same in every run)."""
    params = params or SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = _engine(checkpoint, num_speculative_tokens=k, cuda_graphs=True, max_running_requests=8,
                     overlap_scheduling=False)
    if not static:
        engine.core.runner.draft_chains = None  # pass by pass, after the same static verify steps
    drafter = RecordingDrafter(engine.executor.drafter, dict(enumerate(expected)), scenario["error_rate"],
                               engine.vocab_size, dict(enumerate(map(len, prompts))), scenario.get("cut_chains", False),
                               unchain_first_row)
    engine.executor.drafter = drafter
    params = [replace(p, logprobs=logprobs) for p in (params if isinstance(params, list) else [params] * len(prompts))]
    results = engine.generate(prompts, params)
    engine.kv.check()
    tokens = _ids(results) if logprobs is None else [(r["output_ids"], r["logprobs"]) for r in results]
    return tokens, drafter, engine


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_static_chain_drafts_what_the_eager_chain_drafts(tiny_checkpoint, references, scenario, k):
    prompts, expected = references[scenario]
    eager_tokens, eager, _ = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, static=False)
    static_tokens, static, engine = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, static=True)
    assert eager_tokens == expected and static_tokens == expected
    assert set(eager.chains) == {"eager", "eager after a static step"}
    assert set(static.chains) == {"eager", "static"}  # every static step's drafts from a static chain
    assert static.chains.count("static") == eager.chains.count("eager after a static step")
    assert {5: 8, 3: 4}[len(prompts)] in {key.rows for key, *_ in engine.core.runner.draft_chains.keys}  # padded
    assert static.proposals == eager.proposals
    if scenario == "oracle drafts, chains cut":
        assert static.short_static > 0 or k == 1  # chains stopped early
    else:  # every row drafts k for its next verify (the scheduler allocates the chain's positions)
        assert static.short_static == 0


@pytest.mark.parametrize("k", [2, 3])
def test_a_recorded_chain_replays_what_the_eager_chain_drafts(tiny_checkpoint, references, monkeypatch, k):
    scenario = "oracle drafts, 5 rows"  # (most static steps: many replays of each recorded chain)
    prompts, expected = references[scenario]
    replays = []
    replay = graph_runner.ReplayedClosure.replay
    monkeypatch.setattr(graph_runner.ReplayedClosure, "replay", lambda graph: replays.append(graph) or replay(graph))
    _, eager, _ = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, static=False)
    tokens, recorded, engine = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, static=True)
    assert tokens == expected and recorded.proposals == eager.proposals
    recorded_chains = engine.core.runner.draft_chains.recorded
    chain_replays = sum(graph in recorded_chains for graph in replays)
    # each chain's first run is eager and records it; every later run replays what it recorded
    assert len(recorded_chains) == len(engine.core.runner.draft_chains.keys)
    assert chain_replays == recorded.chains.count("static") - len(recorded_chains) > 0


@pytest.mark.parametrize("logprobs", [None, 2])
def test_one_greedy_draft_follows_its_verify_on_the_device(tiny_checkpoint, references, monkeypatch, logprobs):
    """k = 1, greedy rows: a static verify step's draft pass is launched before the host reads anything of the verify
    (`Drafter.chain_early`: the argmax, each row's accepted count and the first pass's inputs computed on the device),
    and the host reads the argmax and the drafts at once. The draft layer proposes what the host-planned chain
    proposes, after every step, and the tokens (and log-probabilities, where asked for) are the same either way; the
    tokens are the ones without speculation."""
    scenario = "oracle drafts, 5 rows"  # (drafts accepted and rejected: rows draft from different positions)
    prompts, expected = references[scenario]
    chain_early, draft_chain, verify = Drafter.chain_early, ModelRunner.draft_chain, Verifier.verify
    runs = {}
    for early in (False, True):
        monkeypatch.setattr(Drafter, "chain_early", chain_early if early else lambda *args: None)
        chains_run, verifies_read = [], []
        monkeypatch.setattr(ModelRunner, "draft_chain", lambda runner, chain, first_inputs=None: chains_run.append(
            first_inputs is not None) or draft_chain(runner, chain, first_inputs))
        monkeypatch.setattr(Verifier, "verify", lambda verifier, *args, argmax=None, **kwargs: verifies_read.append(
            argmax is not None) or verify(verifier, *args, argmax=argmax, **kwargs))
        tokens, drafter, _ = _run(tiny_checkpoint, 1, SCENARIOS[scenario], prompts, expected, static=True,
                                  logprobs=logprobs)
        runs[early] = tokens, dict(drafter.proposals), drafter.chains.count("static")
        assert (tokens if logprobs is None else [ids for ids, _ in tokens]) == expected
        # every static step's chain ran once: after a verify, early (its inputs from the device, the verify's argmax
        # read with the drafts); after a static step without drafts to verify, planned from its output
        assert len(chains_run) == runs[early][2]
        launched_early = chains_run.count(True)
        assert launched_early == verifies_read.count(True) and (launched_early > 10 if early else launched_early == 0)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rows_under_min_tokens_hold_their_stops_in_the_static_chain_as_pass_by_pass(tiny_checkpoint, references,
                                                                                   monkeypatch, k):
    """min_tokens: a row's stop tokens are held back from its drafts wherever a draft would be an output before its
    min_tokens-th, in the static chain (per pass, its holds on the device; at k = 1 in the chain that follows its
    verify, where the drafts accepted decide it) as pass by pass: the same proposals, none of them a stop there, the
    same tokens. Each request has its own min_tokens (an output its free run's first pass drafted after accepting a
    draft, where it has one: the hold's end then depends on the drafts accepted) and its own stops, the tokens its
    free run drafted right around its min_tokens-th output (nearest first), then those its chained passes drafted
    before it, none of them a token the target emits before it (so that the target's tokens, and with them the
    drafts there, are the free run's); batch row 0's pages end after its first draft, so every chained pass's rows
    are the first pass's shifted by one."""
    scenario = "oracle drafts, 5 rows"
    prompts, expected = references[scenario]
    free = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    _, recorded, _ = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, True, params=free,
                          unchain_first_row=True)
    params, after_accepting = [], 0
    for request, target in enumerate(expected):
        drafted, first = recorded.outputs[request], 8 + 3 * request
        # (where it can, min_tokens is an output its first pass drafted after its row accepted a draft)
        min_tokens = min((output for step, output, token, accepted in drafted if step == 0 and accepted
                          and output >= first and token not in target[:output]), default=first)
        after_accepting += min_tokens != first
        near = [token for _, output, token, _ in sorted(drafted, key=lambda d: abs(d[1] - min_tokens))
                if abs(output - min_tokens) <= 1]
        chained = Counter(token for step, output, token, _ in drafted if step > 0 and output < min_tokens)
        stops = [t for t in dict.fromkeys(near + [token for token, _ in chained.most_common()])
                 if t not in target[:min_tokens]]
        params.append(replace(free, min_tokens=min_tokens, stop_token_ids=stops[:graph_runner.HELD_STOP_SLOTS]))
    assert after_accepting >= 2
    holding = _record_chain_holds(monkeypatch)
    eager_tokens, eager, _ = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, False, params=params,
                                  unchain_first_row=True)
    static_tokens, static, _ = _run(tiny_checkpoint, k, SCENARIOS[scenario], prompts, expected, True, params=params,
                                    unchain_first_row=True)
    assert static_tokens == eager_tokens and all(len(t) >= p.min_tokens for t, p in zip(static_tokens, params))
    assert all(t[:p.min_tokens] == e[:p.min_tokens] for t, e, p in zip(static_tokens, expected, params))
    assert static.proposals == eager.proposals and static.chains.count("static") > 5 and sum(holding) > 2
    assert static.short_static > 5 or k == 1  # (row 0's chains stopped after its first draft)
    for request, p in enumerate(params):
        assert not any(token in p.stop_token_ids for _, output, token, _ in static.outputs[request]
                       if output < p.min_tokens), request


def test_the_chain_after_a_verify_holds_each_draft_as_the_host_planned_chain_would():
    """`Drafter.chain_early` decides on the device, from the drafts each row accepted, which rows hold their stop
    tokens back: exactly the rows whose draft the host-planned chain holds (`_draft_holds`, from the row's last
    emitted position), around the min_tokens-th output, accepted or not."""
    from types import SimpleNamespace

    from backend.speculative import _draft_holds, _holds_after_verify

    prompt, min_tokens, positions = [5] * 7, 10, list(range(12, 20))  # (outputs 7..15 drafted: both sides of 10)
    key = StaticKey(rows=len(positions), context=256, tokens_per_row=2)
    states = [SimpleNamespace(prompt_ids=prompt, params=SamplingParams(min_tokens=min_tokens))] * len(positions)
    held = {r: HeldStops(2, (1, 2)) for r in range(len(positions))}
    job = SimpleNamespace(static_key=key, rows=[SimpleNamespace(position=p) for p in positions])
    drafter = Drafter.__new__(Drafter)
    stop_ids, limits = drafter._early_holds(job, states, held, torch.device("cpu"))
    assert stop_ids.tolist() == [[1, 2, 1, 1]] * len(positions)
    for accepted in (0, 1):
        on_device = _holds_after_verify(torch.full((key.rows,), accepted), limits).tolist()
        planned = _draft_holds(list(range(key.rows)), [p + accepted for p in positions], 0, states, held)
        assert on_device == [r in planned for r in range(key.rows)] and 0 < sum(on_device) < key.rows


@pytest.mark.parametrize("scenario,k", [("oracle drafts, 5 rows", 1), ("oracle drafts, chains cut", 2)])
def test_biased_rows_draft_in_the_static_chain_what_they_draft_pass_by_pass(tiny_checkpoint, scenario, k):
    """logit_bias and allowed_token_ids apply to the static chain's drafts as to the eager chain's (two rows with the
    same allowed tokens share one of the chain's bias slots; with chains cut, a chained pass's rows are the earlier
    pass's reordered): the same proposals, each inside its allowed tokens."""
    scenario = SCENARIOS[scenario]
    prompts = _prompts(scenario["lengths"], seed=11)
    allowed = list(range(3, 300))
    plain = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [replace(plain, logit_bias={5: 8.0, 17: 6.5, 40: -100.0}), replace(plain, allowed_token_ids=allowed),
              replace(plain, allowed_token_ids=list(reversed(allowed))), plain, plain]
    expected = _ids(_engine(tiny_checkpoint, max_running_requests=8).generate(prompts, params))
    eager_tokens, eager, _ = _run(tiny_checkpoint, k, scenario, prompts, expected, static=False, params=params)
    static_tokens, static, engine = _run(tiny_checkpoint, k, scenario, prompts, expected, static=True, params=params)
    assert eager_tokens == static_tokens == expected
    assert "static" in static.chains and static.proposals == eager.proposals
    assert all(set(drafts) <= set(allowed) for request in (1, 2) for drafts in static.proposals[request])
    assert any(biased for _, _, biased in engine.core.runner.draft_chains.keys)
    states = [SamplerState(p, []) for p in params]
    table, slots = engine.executor.drafter._biases(states, 8)
    assert slots.tolist() == [1, 2, 2, 0, 0, 0, 0, 0] and table.shape[0] == 1 + graph_runner.BIAS_SLOTS
    assert table[0].eq(0).all() and table[3:].eq(0).all() and table[1, 5] == 8.0 and table[2, 2] == float("-inf")


def test_a_static_chain_leaves_a_row_its_stop_tokens_where_its_allowed_tokens_are_nothing_else():
    """min_tokens holds a row's stop tokens back; where allowed_token_ids leave it nothing but them, it keeps them (as
    the eager chain's hold_stops guards a narrowed row): its draft is one of them, not token 0 of an all -inf row."""
    logits = torch.full((2, 10), float("-inf"))
    logits[0, [2, 7]] = torch.tensor([0.5, 1.5])  # (only its stop tokens allowed)
    logits[1] = torch.arange(10.0)
    stop_ids, holds = torch.tensor([[2, 7, 2, 2], [9, 9, 9, 9]]), torch.tensor([True, True])
    held = graph_runner._held_back(logits.clone(), stop_ids, holds, narrowed=True)
    assert held.argmax(dim=-1).tolist() == [7, 8]
    assert graph_runner._held_back(logits.clone(), stop_ids, holds).argmax(dim=-1).tolist() == [0, 8]  # (unguarded)


def test_rows_that_draw_on_the_host_draft_pass_by_pass(tiny_checkpoint):
    """A constrained row's drafts are masked by its grammar, and under draft_sampling=sample a sampled row draws each
    draft from q with its own generator (both on the host, between passes): a step with one drafts pass by pass, as
    does a dynamic step. Under draft_sampling=argmax (auto's choice with cuda_graphs) a sampled row drafts in the
    static chain."""
    drafter = _engine(tiny_checkpoint, num_speculative_tokens=2, cuda_graphs=True).executor.drafter
    job = SpecJob(torch.empty(0, dtype=torch.long), [], 2, StaticKey(rows=4, context=256, tokens_per_row=3))
    greedy, sampled = SamplerState(SamplingParams(), []), SamplerState(SamplingParams(temperature=0.7), [])
    assert drafter._static(job, [greedy, greedy])
    assert drafter._static(job, [SamplerState(SamplingParams(repetition_penalty=1.2), [])])  # (drafts: no penalty)
    assert drafter._static(job, [greedy, sampled])
    assert not drafter._static(job, [greedy, SamplerState(SamplingParams(), [], grammar=object())])
    assert not drafter._static(replace(job, static_key=None), [greedy])
    # logit_bias / allowed_token_ids: a static chain adds up to BIAS_SLOTS distinct biases; a step with more drafts
    # eagerly
    biased = [SamplerState(SamplingParams(logit_bias={i: 1.0}), []) for i in range(graph_runner.BIAS_SLOTS + 1)]
    assert drafter._static(job, biased[:-1] + biased[:1]) and not drafter._static(job, biased)
    # min_tokens: a static chain holds back up to HELD_STOP_SLOTS stop tokens a row; a row with more drafts eagerly
    slots = graph_runner.HELD_STOP_SLOTS
    assert drafter._static(job, [greedy, greedy], [None, HeldStops(1, tuple(range(slots)))])
    assert not drafter._static(job, [greedy, greedy], [None, HeldStops(1, tuple(range(slots + 1)))])
    drafter.sample_drafts = True  # (draft_sampling=sample)
    assert not drafter._static(job, [greedy, sampled]) and drafter._static(job, [greedy, greedy])


def test_seeded_sampled_rows_draft_in_the_static_chain_what_they_draft_pass_by_pass(tiny_checkpoint):
    """Under draft_sampling=argmax sampled rows (seeded, with penalties and log-probabilities) draft in the static
    chain after static verify steps, and draw the same tokens as when they draft pass by pass after the same steps:
    both propose the draft layer's argmax, so the verify draws alike."""
    prompts = _prompts([5, 30, 12], seed=4)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7 + i, logprobs=1,
                             repetition_penalty=1.1, ignore_eos=True) for i in range(len(prompts))]
    outputs, static_steps = [], []
    for static in (False, True):
        engine = _engine(tiny_checkpoint, num_speculative_tokens=2, cuda_graphs=True, max_running_requests=8)
        if not static:
            engine.core.runner.draft_chains = None
        chains = []
        propose = engine.executor.drafter._propose_static
        engine.executor.drafter._propose_static = lambda *args: chains.append(1) or propose(*args)
        outputs.append([(r["output_ids"], r["logprobs"]) for r in engine.generate(prompts, params)])
        static_steps.append(len(chains))
        engine.kv.check()
    assert outputs[0] == outputs[1]
    assert static_steps[0] == 0 and static_steps[1] > 5


def test_a_recorded_chain_replays_only_where_every_pass_pads_to_its_own_count():
    """Data-parallel ranks in lock-step (as decode graphs): a chain's graph holds its passes' exchanges at its own
    counts, so it replays only where each pass's agreed largest count is this rank's; else the chain runs eagerly."""
    class Chains:  # (what the runner asks of its chains: replay or not)
        def run(self, chain, hidden, replay, first_inputs=None):
            return replay

    runner = ModelRunner.__new__(ModelRunner)
    runner.draft_chains, runner.hidden = Chains(), None
    chain = DraftChain(StaticKey(rows=4, context=256, tokens_per_row=3), None, None, None, {1: None, 2: None}, 256)
    assert chain.token_counts == (12, 4, 4)
    assert runner.draft_chain(chain)  # alone: no agreement
    assert runner.draft_chain(replace(chain, dp_token_counts=((12, 6), (4, 4), (4, 0))))  # the largest (or tied)
    assert not runner.draft_chain(replace(chain, dp_token_counts=((12, 6), (4, 8), (4, 0))))  # another's, pass 1
    assert not runner.draft_chain(replace(chain, dp_token_counts=((12, 24), (4, 4), (4, 4))))  # the first pass's
