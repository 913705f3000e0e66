"""Speculative decoding with the checkpoint's own MTP layer: draft k tokens, verify them in one forward.

With `num_speculative_tokens` k > 0 a decoding request's step is a *verify*: the forward computes its last token and
the k draft tokens proposed for it (1 + k positions, logits at each), and the step emits the drafts the target model
agrees with plus one token of its own after them (1 to k + 1 tokens):
- greedy rows accept the longest prefix of drafts equal to the target's argmax, then emit the argmax after it;
- sampled rows use rejection sampling (Leviathan et al. 2023): draft d_i, from the draft distribution q_i, is
  accepted with probability min(1, p_i(d_i) / q_i(d_i)); the first rejection draws from max(0, p_i - q_i), and if all
  are accepted one more token is drawn from p_k. Under draft_sampling=argmax (auto's choice with static steps) a
  sampled row drafts the draft layer's argmax, as vLLM's and SGLang's MTP drafts do: q_i is all on d_i, so d_i is
  accepted with probability p_i(d_i) and a rejection draws from p_i without d_i; with draft_sampling=sample it draws
  d_i from q_i (where the logits are, pass by pass).
  Each emitted token is then distributed exactly as p, the target's distribution after temperature,
  top-k/top-p/min-p and penalties (which count the drafts accepted before it), so the outputs are distributed as
  without speculation; the request's own generator draws everything (seeds hold).

Constrained requests (structured outputs, backend/structured/grammar.py) draft and verify too, every distribution
masked by the grammar as it would be at that position: the verify masks its i-th logits row with the grammar's mask
after the drafts before it, and the drafter draws each draft under the mask after the drafts before it. The matcher
takes the drafts tentatively to fill those masks (`GrammarLookahead`; each position's masks over the rows in one
fill, all of a verify's in one copy and one kernel; a verify copies the masks its row's drafts were drawn under,
which the drafter kept, and fills only the one after the last draft), then rolls back to the emitted tokens and
takes the last one: greedy acceptance, rejection sampling and log-probabilities see the constrained distributions,
so a row emits what it would emit without speculation. A draft the grammar cannot take ends the row's chain (the
verify rejects it: its mask gives it probability 0); where no token can follow (the grammar ended at a draft), the
row's tokens stop there and its end is reported as the sampler reports it.

Then the MTP layer (DeepSeek's MTPBlock, `DeepseekV4Model.draft`) proposes the next step's drafts. Its first pass runs
over every position of the step's batch, each with the main model's residual streams there and the *next* token's
embedding (a prompt's next token, or the token the step emitted), which also fills its own sliding window (one layer
more in the window pool); the first draft comes from the row's last emitted position. The next k - 1 drafts chain
through the draft layer's own streams, one position further each (vLLM's and SGLang's scheme for DeepSeek).
After a verify step at a static shape (`SpecJob.static_key`) whose drafting rows all draft the argmax, the k passes
run as one static chain (`DraftChain`, backend/model/graph_runner.py: a CUDA graph on CUDA): the chained passes'
positions and pages are known on the host before it (a row drafts while its pages last, `DraftRow.lookahead_end`),
each pass's argmax feeds the next on the device, and the host reads every draft once at the end. Rows whose drafts
the host takes between passes (constrained rows, drafted under their grammar's masks; sampled rows under
draft_sampling=sample, drawn from q off the request's generator) draft pass by pass (eagerly), and so does a step
with one.
Data-parallel ranks in lock-step (their MoE exchanges pad to the largest rank's tokens) agree once, before a step's
first draft pass, on every rank's tokens in each of its k passes: a static chain's padded counts, an eager rank's
rows whose pages reach each pass (a grammar may end some after the agreement: fewer), an idle rank's none; each rank
then runs its k passes (its static chain, its eager passes, or its part of the others' exchanges) at those counts.

Rolling back a rejected draft is moving the request's position back (`Scheduler._settle_verify`), never a copy:
- window and compressed entries, indexer keys, and the draft layer's window entries at rejected positions lie past
  the causal reach of every later query until the position is computed again, which rewrites them first;
- a compressor ring keeps k positions more than its windows read (KVCacheManager: ring = span + k), so the rejected
  positions' ring writes only overwrite positions older than any continuation reads;
- the prefix-cache snapshots a verify writes at block boundaries inside it become entries only up to its accepted
  positions (`Scheduler._keep_verified_snapshots`; at static shapes too: backend/model/static_batch.py), and a
  request's end is kept where its emitted tokens end.

The host learns the accepted count with the step's output, so steps with speculation run one at a time (overlap
scheduling waits for each step's output; docs/speculative.md). Under tensor/expert parallelism every rank
runs the forward and each draft pass on the batch rank 0 broadcasts, each keeping its own copy of the streams the
next pass reads; rank 0 alone verifies and draws.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend.model.forward_batch import BatchRow, ForwardBatch, build_forward_batch
from backend.model.graph_runner import BIAS_SLOTS, HELD_STOP_SLOTS, DraftChain, FirstInputs
from backend.model.static_batch import StaticKey, context_bucket
from backend.runner import Draft
from backend.sampler import (NO_ALLOWED_TOKEN_FITS, NO_TOKEN_FITS, HeldStops, HostMasks, Sampler, SamplerState,
                             draw_rows, draws, filtered_probs, held_on_copies, hold_stops, logit_bias, long_on,
                             row_index, row_shares)
from backend.request import TokenLogprobs
from backend.scheduler.plan import StepOutput, StepTiming
from backend.structured.grammar import NO_TOKEN_CAN_FOLLOW, GrammarLookahead


@dataclass
class DraftRow:
    """A sampling row of a step with speculation, as the host planned it."""

    request_id: str
    pages: object  # the request's RequestPages (the draft chain writes the draft layer's window through them)
    drafts: tuple[int, ...]  # the drafts this row verifies (none: an ordinary sampling row)
    position: int  # the position of its first logits token (a verify row's first of 1 + k)
    lookahead_end: int  # positions below this have pages: the draft chain stops before it


@dataclass
class SpecJob:
    """What a step with speculation needs beyond its batch: each position's next token (-1: emitted by this step)
    and the sampling rows, in batch order."""

    next_ids: torch.Tensor  # [T] long
    rows: list[DraftRow]
    num_speculative_tokens: int
    static_key: StaticKey | None = None  # the step's static shape (a verify step whose rows all carry k drafts)
    propose: bool = True  # the draft layer proposes the next step's drafts (False: the rows decode plainly next)

    @classmethod
    def idle(cls, num_speculative_tokens: int) -> "SpecJob | None":
        """A data-parallel rank's step without a batch: its draft passes are the other ranks' exchanges alone."""
        return cls(torch.empty(0, dtype=torch.long), [], num_speculative_tokens) if num_speculative_tokens else None

    def with_verified_drafts(self, verified: list[int]) -> "SpecJob":
        """The job with each row's drafts as its batch held them (`verified`: k a batch row, row after row): a verify
        scheduled before the one ahead of it was taken in (overlapped verify steps) read its drafts on the device,
        and the host only has stand-ins."""
        k = self.num_speculative_tokens
        if all(len(row.drafts) == k for row in self.rows) and verified == [d for row in self.rows for d in row.drafts]:
            return self  # (a verify taken in before the next was scheduled: the host had them; every step, per row)
        rows = [row if row.drafts == (drafts := tuple(verified[r * k:r * k + len(row.drafts)]))
                else DraftRow(row.request_id, row.pages, drafts, row.position, row.lookahead_end)
                for r, row in enumerate(self.rows)]
        return dataclasses.replace(self, rows=rows)

    def first_logits_rows(self) -> list[int]:
        """Each sampling row's first row of the step's logits (a verify row has 1 + drafts of them)."""
        return [0, *itertools.accumulate(1 + len(row.drafts) for row in self.rows)][:-1]


class Verifier:
    """Turns a step's logits (1 row per ordinary sampling row, 1 + k per verify row) into emitted tokens."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.masks = HostMasks(sampler.kernels)

    @torch.inference_mode()  # (the logits are the forward's inference tensors, and so are the penalty states)
    def verify(self, logits: torch.Tensor, states: list[SamplerState], job: SpecJob,
               timing: StepTiming | None = None, argmax: list[int] | None = None,
               held: dict[int, HeldStops] | None = None) -> StepOutput:
        """The tokens each sampling row emits (the step's StepOutput, its host times in `timing`), their
        log-probabilities, the rows a grammar ended. `argmax`: every logits row's argmax, where the host has read it
        already (`Drafter.chain_early`); `held`: the stop tokens rows hold back (min_tokens), by sampling row (those
        held in place are already)."""
        rows, firsts, held = job.rows, job.first_logits_rows(), held_on_copies(held)
        output = StepOutput([[] for _ in rows], timing=timing or StepTiming())
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(rows)
        # Ordinary rows (prefill ends, decodes without drafts): the sampler, in one call.
        single = [r for r, row in enumerate(rows) if not row.drafts]
        if single:
            index = torch.tensor([firsts[r] for r in single], device=logits.device)
            states_single = [states[r] for r in single]
            held_single = {i: held[r] for i, r in enumerate(single) if r in held}
            sampled = self.sampler.step(logits[index], states_single,
                                        all(s.plain for s in states_single) and not held_single, output.timing,
                                        held_single)
            for i, (r, token) in enumerate(zip(single, sampled.sampled.tolist())):
                output.tokens[r] = [token]
                logprobs[r] = sampled.row_logprobs(i)
            output.ends = {single[i]: end for i, end in sampled.ends.items()}
        constrained = [r for r, row in enumerate(rows) if row.drafts and _constrained(states[r])]
        walk = self._mask_verify_rows(logits, states, job, constrained, output) if constrained else None
        # (`argmax`: every logits row's, read once for the greedy rows without penalties)
        targets = {}  # verify row -> its target logits [1 + k, V]
        sampled = []  # verify rows of sampled requests: rejection sampling, all of them at once
        for r, row in enumerate(rows):
            if not row.drafts:
                continue
            state, span = states[r], slice(firsts[r], firsts[r] + 1 + len(row.drafts))
            if state.params.temperature > 0.0 or state.has_penalties or state.params.logprobs is not None or r in held:
                targets[r] = _targets(logits[span], state, list(row.drafts), held.get(r))  # (else nothing reads them)
            if state.params.temperature > 0.0:
                sampled.append(r)
            elif state.has_penalties or r in held:
                output.tokens[r] = _accepted_prefix(row.drafts, targets[r].argmax(dim=-1).tolist())
            else:  # (its targets are the raw logits')
                argmax = logits.argmax(dim=-1).tolist() if argmax is None else argmax
                output.tokens[r] = _accepted_prefix(row.drafts, argmax[span])
        if sampled:
            emitted = self._rejection_sample([targets[r] for r in sampled], [states[r] for r in sampled],
                                             [list(rows[r].drafts) for r in sampled])
            for r, tokens in zip(sampled, emitted):
                output.tokens[r] = tokens
        if constrained:
            self._settle_grammars(walk, states, constrained, output)
        for r, row_targets in targets.items():  # (raw log-probabilities: the logits before the penalties)
            raw = logits[firsts[r]:firsts[r] + len(row_targets)]
            logprobs[r] = self._observe(raw if self.sampler.raw_logprobs else row_targets, states[r], output.tokens[r])
        if any(lp is not None for lp in logprobs):
            output.logprobs = logprobs
        return output

    def _mask_verify_rows(self, logits: torch.Tensor, states: list[SamplerState], job: SpecJob, rows: list[int],
                          output: StepOutput) -> GrammarLookahead:
        """Mask the constrained verify rows' 1 + k logits rows, each with the grammar's mask after the row's drafts
        before it: position by position, the grammars still walking fill their masks (one call) and take their
        drafts there; one copy and one kernel then apply every mask. The masks a row's drafts were drawn under are
        these same masks (the drafter filled them along the same drafts, from where the matcher still stands): they
        are copied, not filled again, so a verify fills one mask a row, after its last draft. A row whose first
        position no token fits ends, as the sampler ends it. Returns the walk: the matchers hold the drafts they took
        (`_settle_grammars`)."""
        started = time.perf_counter()
        firsts, walk, filled = job.first_logits_rows(), GrammarLookahead(), 0
        masks, targets = self.masks.buffers(sum(1 + len(job.rows[r].drafts) for r in rows), logits)
        for position in range(1 + max(len(job.rows[r].drafts) for r in rows)):
            at = [r for r in rows if position <= len(job.rows[r].drafts) and walk.open(states[r].grammar)]
            if not at:
                break
            kept = {r: _drafted_mask(states[r], job.rows[r].drafts, position) for r in at}
            fill = [r for r in at if kept[r] is None]
            at = fill + [r for r in at if kept[r] is not None]  # (the masks filled, then those copied)
            grammars = [states[r].grammar for r in at]
            block = masks[filled:filled + len(at)]
            unfit = self.sampler.grammars.fill_or_unmask(grammars[:len(fill)], block[:len(fill)]) if fill else []
            for i in range(len(fill), len(at)):
                mask, no_token_fits = kept[at[i]]
                block[i].copy_(mask)
                if no_token_fits:
                    unfit.append(i)
            for i in unfit:  # the row's tokens stop before it
                walk.block(grammars[i])
                if position == 0:
                    output.ends[at[i]] = NO_TOKEN_CAN_FOLLOW
            targets[filled:filled + len(at)] = torch.tensor([firsts[r] + position for r in at])
            filled += len(at)
            drafting = [r for r in at if position < len(job.rows[r].drafts) and walk.open(states[r].grammar)]
            if drafting:
                walk.take([states[r].grammar for r in drafting], [job.rows[r].drafts[position] for r in drafting])
        for r in rows:  # (each kept mask serves the one verify of the drafts drawn under it)
            states[r].draft_masks = []
        output.timing.mask_fill_s += time.perf_counter() - started
        self.masks.apply(logits, filled)
        return walk

    def _settle_grammars(self, walk: GrammarLookahead, states: list[SamplerState], rows: list[int],
                         output: StepOutput) -> None:
        """The constrained verify rows' matchers end holding exactly the emitted tokens: back to the accepted drafts
        among those they took, then on by the token after them (one call). Where no token could follow the drafts
        a matcher took (its grammar ended there: reported), or the token after them does not fit, the row's tokens
        stop at its accepted drafts; a row that accepted none fails, as it would without drafts."""
        started = time.perf_counter()
        keep, cut, final = {}, [], []
        for r in rows:
            grammar, emitted = states[r].grammar, output.tokens[r]
            if r in output.ends:  # no token could follow its emitted ones: the request fails
                grammar.done = True
                continue
            taken = walk.taken.get(grammar, 0)
            outside = states[r].first_disallowed(emitted)
            if outside is not None:  # where its grammar allows none of allowed_token_ids: the tokens stop before it
                keep[grammar] = held = min(outside, taken)
                if held:
                    output.tokens[r] = emitted[:held]
                    output.drafts_alone.add(r)
                    cut.append(r)
                else:
                    output.ends[r] = NO_ALLOWED_TOKEN_FITS
                    grammar.done = True
                continue
            keep[grammar] = held = min(len(emitted) - 1, taken)
            if held == taken and walk.blocked(grammar):
                output.tokens[r] = emitted[:held]
                output.drafts_alone.add(r)
                cut.append(r)
            else:
                final.append(r)
        walk.rollback(keep)
        for r in cut:
            if states[r].grammar.matcher.is_terminated():
                states[r].grammar.done = True
                output.ends[r] = None
        rejected, ended = self.sampler.grammars.accept([states[r].grammar for r in final],
                                                       [output.tokens[r][keep[states[r].grammar]] for r in final])
        for i in rejected:  # (drawn under the grammar's mask: only a mask that left nothing to draw gets here)
            r = final[i]
            held = keep[states[r].grammar]
            if held:  # the accepted drafts stand, as they would one by one; the next step meets the dead end itself
                output.tokens[r] = output.tokens[r][:held]
                output.drafts_alone.add(r)
                states[r].grammar.done = False  # (a refused token leaves XGrammar's matcher where it was)
            else:
                output.ends[r] = NO_TOKEN_FITS
        for i in ended:
            output.ends[final[i]] = None
        output.timing.grammar_accept_s += time.perf_counter() - started

    def _observe(self, reported: torch.Tensor, state: SamplerState, emitted: list[int]) -> list[TokenLogprobs] | None:
        """A verify row's emitted tokens seen by its penalties; their log-probabilities, each token's from its row of
        `reported` (the raw logits, or the targets it was drawn from), when the request asks for them."""
        if state.has_penalties:
            state.observe(torch.tensor(emitted, device=reported.device))
        if state.params.logprobs is None:
            return None
        return self.sampler.logprobs(reported[:len(emitted)], [state] * len(emitted), emitted)

    @staticmethod
    def _rejection_sample(targets: list[torch.Tensor], states: list[SamplerState],
                          drafts: list[list[int]]) -> list[list[int]]:
        """Each sampled verify row's emitted tokens by Leviathan et al.'s rule over its target distributions p_i (the
        rows of its `targets` [1 + k, V], filtered as the request samples) and the draft distributions q_i kept when
        its drafts were drawn; none kept: argmax drafts, each q_i all on its draft (accepted with probability
        p_i(d_i); a rejection draws from p_i without d_i). All rows at once, where the logits are (and the q_i,
        `Drafter._draw`): the host reads every p_i(d_i) and q_i(d_i) in one read, tests them off each request's host
        generator, and reads the tokens drawn (off each request's generator there) in another."""
        params = [state.params for state, rows in zip(states, targets) for _ in range(len(rows))]
        probs = filtered_probs(torch.cat(targets), params)
        starts = list(itertools.accumulate([len(rows) for rows in targets[:-1]], initial=0))
        positions = long_on([start + i for start, row in zip(starts, drafts) for i in range(len(row))], probs.device)
        tokens = long_on([token for row in drafts for token in row], probs.device)
        read = [probs[positions].gather(1, tokens[:, None]).flatten()]  # every p_i(d_i), then the kept q_i(d_i)
        kept = [j for j, state in enumerate(states) if state.draft_probs]
        if kept:
            q_tokens = long_on([token for j in kept for token in drafts[j]], probs.device)
            # (a row's q for each draft it verifies: a decode near its end verifies fewer than it drafted)
            q_rows = torch.stack([q for j in kept for q in states[j].draft_probs[:len(drafts[j])]])
            read.append(q_rows.gather(1, q_tokens[:, None]).flatten())
        values = torch.cat(read).tolist()
        p_values, q_values = values[:len(tokens)], iter(values[len(tokens):])
        emitted, weights, at = [], [], 0
        for j, (state, row, start) in enumerate(zip(states, drafts, starts)):
            p_row, at = p_values[at:at + len(row)], at + len(row)
            q_row = [next(q_values) for _ in row] if state.draft_probs else [1.0] * len(row)
            # (rejected unless u q < p: a row without any finite logit, p NaN, accepts nothing)
            accepted = next((i for i, (p, q) in enumerate(zip(p_row, q_row)) if not float(state.uniform()) * q < p),
                            len(row))
            emitted.append(row[:accepted])
            p = probs[start + accepted]
            if accepted < len(row):  # the first rejection: a draw from max(0, p - q), q all on the draft without one
                residual = (p - state.draft_probs[accepted]).clamp(min=0.0) if state.draft_probs else p.clone()
                if not state.draft_probs:
                    residual[row[accepted]] = 0.0
                p = torch.where(residual.sum() > 0, residual, p)  # (a residual of nothing, q at least p: p itself)
            weights.append(p)  # (a draw needs no normalizing)
        for tokens_of_row, token in zip(emitted, draws(torch.stack(weights), states).tolist()):
            tokens_of_row.append(token)
        return emitted


def _targets(logits: torch.Tensor, state: SamplerState, drafts: list[int], held: HeldStops | None) -> torch.Tensor:
    """A verify row's target logits [1 + k, V]: `logits` itself, or a copy whose position i sees the penalties of
    the outputs so far and the drafts before it, and the stop tokens the row holds back there."""
    if not state.has_penalties and held is None:
        return logits
    targets = logits.clone()
    if state.has_penalties:
        for i in range(len(targets)):
            state.penalize(targets[i], pending=drafts[:i])
    if held is not None:
        hold_stops(targets, [0], [held], [state.narrowed])
    return targets


def _emitted_after(job: SpecJob, output: StepOutput) -> list[int]:
    """The token after each logits token of the step's rows, in order (what the draft layer's first pass embeds)."""
    after = []
    for row, tokens in zip(job.rows, output.tokens):
        count = 1 + len(row.drafts)
        after += (tokens + tokens[-1:] * count)[:count] if tokens else [0] * count
    return after


def _long(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _accepted_prefix(drafts: Sequence[int], best: list[int]) -> list[int]:
    """Greedy verification: the target's tokens up to and including its first disagreement with the drafts (all
    of them, and one more, when none disagrees)."""
    accepted = next((i for i, (d, t) in enumerate(zip(drafts, best)) if d != t), len(drafts))
    return best[:accepted + 1]


class Drafter:
    """Proposes each row's drafts with the MTP layer (see the module docstring); each pass runs on the step's runner
    (backend/runner.py: with a rank group, every rank runs it), which keeps the streams the next pass reads. A
    constrained row's drafts are drawn under its grammar's masks (`sampler`'s mask pool, masks of its own)."""

    def __init__(self, runner, sampler: Sampler, sample_drafts: bool = False):
        """`sample_drafts` (draft_sampling=sample): sampled rows draw their drafts from the draft distribution,
        pass by pass (the host reads each pass's); else every row drafts the argmax."""
        self.runner = runner
        self.sampler = sampler
        self.sample_drafts = sample_drafts
        self.masks = HostMasks(sampler.kernels)
        self._first_passes: dict[StaticKey, tuple[DraftChain, torch.Tensor]] = {}  # (`chain_early`'s, per key)
        self._no_holds: dict[StaticKey, tuple[torch.Tensor, torch.Tensor]] = {}  # (`_early_holds`' zeros, per key)
        self._bias_table: tuple[tuple, torch.Tensor | None] = ((), None)  # (`_biases`': the last step's, by its keys)

    @torch.inference_mode()
    def propose(self, batch: ForwardBatch, job: SpecJob, output: StepOutput, states: list[SamplerState],
                ready: list[int] | None = None, held: dict[int, HeldStops] | None = None) -> dict[int, list[int]]:
        """Sampling row -> its drafts for the next step (rows that draft only), after the tokens `output` emits; the
        first pass reads the step's own streams (the runner kept them). In lock-step every rank runs the first pass
        and k - 1 chained ones at the counts agreed before the first (a rank whose rows ran out of pages, or that
        has none, takes part in the others' exchanges alone). `ready`: the drafts the step's chain proposed before
        the verify was read (`chain_early`), one per batch row. `held`: the step's holds (min_tokens), by sampling
        row: a row drafts none of its stop tokens before its min_tokens-th output, where the verify would reject
        it."""
        rows = [r for r in range(len(job.rows)) if r not in output.ends]
        firsts = job.first_logits_rows()
        # The row's last emitted position: its logits row (emitted - 1) and its position. (No row: the draft
        # layer's window still takes in this step's positions.)
        picks = [firsts[r] + len(output.tokens[r]) - 1 for r in rows]
        positions = [job.rows[r].position + len(output.tokens[r]) - 1 for r in rows]
        for r in rows:
            states[r].draft_probs, states[r].draft_masks = [], []
        held = held or {}
        if ready is not None or self._static(job, [states[r] for r in rows], [held.get(r) for r in rows]):
            return self._propose_static(job, output, rows, picks, positions, ready, states, held)
        return self._propose_eager(batch, job, output, states, rows, picks, positions, held)

    @torch.inference_mode()
    def keep_window(self, batch: ForwardBatch, job: SpecJob, output: StepOutput) -> None:
        """The draft layer's first pass over the step's positions with no row drafting: its sliding window takes them in
        (a step that prefills while its rows decode plainly next, `SpecJob.propose` False: the prompt's last positions
        are what a request's first drafts read, whenever it drafts)."""
        first = dataclasses.replace(batch, input_ids=self._next_ids(batch, job, output))
        self.runner.draft(Draft(first, batch.logits_token_index[:0]))

    def _static(self, job: SpecJob, states: list[SamplerState], holds: Sequence[HeldStops | None] = ()) -> bool:
        """Whether the step's drafts come from one static chain: a static verify step, on a runner that has chains,
        whose drafting rows all draft the argmax (no grammar masks a draft, no row draws one on the host) and hold
        back no more stop tokens (min_tokens), and add no more distinct biases, than a chain has slots for."""
        return (job.static_key is not None and self.runner.draft_chains is not None
                and all(s.grammar is None and not self._draws(s) for s in states) and _slots_hold(holds)
                and len({s.bias_key for s in states if s.biased}) <= BIAS_SLOTS)

    def _draws(self, state: SamplerState) -> bool:
        """Whether the row draws its drafts from the draft distribution (else it drafts the argmax)."""
        return self.sample_drafts and state.params.temperature > 0.0

    def _propose_eager(self, batch: ForwardBatch, job: SpecJob, output: StepOutput, states: list[SamplerState],
                       rows: list[int], picks: list[int], positions: list[int],
                       held: dict[int, HeldStops]) -> dict[int, list[int]]:
        """Pass by pass: each pass's drafts drawn on the host before the next pass is built (`held`: `propose`'s)."""
        first = dataclasses.replace(batch, input_ids=self._next_ids(batch, job, output))
        index = batch.logits_token_index[torch.tensor(picks, dtype=torch.long, device=batch.input_ids.device)]
        counts = self.runner.agree_drafts(self._eager_counts(batch, job, rows, positions))
        logits = self.runner.draft(Draft(first, index, dp_token_counts=counts[0]))
        drafts = {r: [] for r in rows}
        walk = GrammarLookahead()  # constrained rows: their matchers take the drafts, rolled back at the end
        tokens = self._draw(logits, [states[r] for r in rows], walk, output.timing,
                            _draft_holds(rows, positions, 0, states, held))
        for step in range(1, job.num_speculative_tokens + 1):
            for r, token in zip(rows, tokens):
                if token is not None:  # (None: its grammar can take no draft there)
                    drafts[r].append(token)
            # Chained drafts: one position further, from the draft layer's own streams, while the row has pages (and
            # its grammar, if any, takes more drafts).
            live = [i for i, r in enumerate(rows)
                    if positions[i] + step < job.rows[r].lookahead_end and walk.open(states[r].grammar)]
            if step == job.num_speculative_tokens or not (live or self.runner.sync.lock_step):
                break
            rows, positions, tokens = [rows[i] for i in live], [positions[i] for i in live], [tokens[i] for i in live]
            chain = [BatchRow(job.rows[r].pages, [token], position + step, True)
                     for r, token, position in zip(rows, tokens, positions)]
            if not live:
                self.runner.idle_draft(counts[step])
                continue
            logits = self.runner.draft(self._chain(chain, live, batch.input_ids.device, counts[step]))
            tokens = self._draw(logits, [states[r] for r in rows], walk, output.timing,
                                _draft_holds(rows, positions, step, states, held))
        rolling_back = time.perf_counter()
        walk.rollback()
        output.timing.grammar_accept_s += time.perf_counter() - rolling_back
        for r, proposed in drafts.items():  # (what the masks kept by `_mask` were filled along)
            states[r].masked_drafts = list(proposed)
        return drafts

    @staticmethod
    def _eager_counts(batch: ForwardBatch, job: SpecJob, rows: list[int], positions: list[int]) -> tuple[int, ...]:
        """This rank's tokens in each pass of its eager chain, known before the first: the step's batch, then the rows
        whose pages reach the chained pass's position (their grammars may end some before it: at most these)."""
        return (batch.num_tokens, *[sum(positions[i] + step < job.rows[r].lookahead_end for i, r in enumerate(rows))
                                    for step in range(1, job.num_speculative_tokens)])

    def _propose_static(self, job: SpecJob, output: StepOutput, rows: list[int], picks: list[int],
                        positions: list[int], ready: list[int] | None, states: list[SamplerState],
                        held: dict[int, HeldStops]) -> dict[int, list[int]]:
        """One static chain (DraftChain): planned on the host, its passes agreed on at once (in lock-step), its
        drafts read once; or the drafts `ready` (`chain_early`: the chain ran before the verify was read)."""
        output.timing.static_drafts = True
        if ready is not None:
            return {r: [ready[r]] for r in rows}
        next_ids = self._next_ids_static(job, output, job.static_key)
        chain, order = self._static_chain(job, next_ids, rows, picks, positions, states, held)
        chain = dataclasses.replace(chain, dp_token_counts=self.runner.agree_drafts(chain.token_counts))
        tokens = self.runner.draft_chain(chain).tolist()  # (the chain's one host sync)
        drafts = {r: [] for r in rows}
        for line, live in zip(tokens, order):  # pass s gives the rows it ran their draft s + 1
            for i, token in zip(live, line):
                drafts[rows[i]].append(token)
        return drafts

    def chains_on_device(self, job: SpecJob, states: list[SamplerState], held: dict | None = None) -> bool:
        """Whether the step's drafts follow its verify on the device (`chain_early`): a static verify step of one draft
        a row whose rows all accept by the logits' argmax (greedy, without penalties, a grammar or stop tokens `held`
        back on a copy; log-probabilities the verify computes after), on this process's runner, with static chains
        (more drafts: a chained pass's positions depend on what the verify accepted, which the host plans)."""
        return (job.propose and job.static_key is not None and job.num_speculative_tokens == 1
                and self.runner.draft_chains is not None and not held_on_copies(held)
                and _slots_hold(list((held or {}).values()))
                and not self.runner.sends_host_batches and all(row.drafts for row in job.rows)
                and all(_accepts_by_argmax(state) for state in states))

    @torch.inference_mode()  # (as `propose`: the chains' buffers are inference tensors)
    def chain_early(self, logits: torch.Tensor, batch: ForwardBatch, job: SpecJob, states: list[SamplerState],
                    held: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the step's drafts need nothing the host reads from its verify (`chains_on_device`): (the target's
        argmax at every logits row, each batch row's draft, each batch row's drafts as verified), on the device, the
        static chain launched; else None (`propose` plans the chain from the verify's output). The argmax is what the
        verify accepts by, and every position's next token for the first pass: a greedy row emits the argmax up to
        its first disagreement with its draft, and past it (a rejected position) the first pass may embed any token
        (`_next_ids`). Each row drafts from its last emitted position: its first logits row plus the drafts its
        argmax accepts, counted on the device from the batch's own input ids (each row's last token, then its
        draft). A row under min_tokens holds its stop tokens back from its draft where that draft would be an output
        before its min_tokens-th, which depends on the drafts accepted: decided on the device too (`_early_holds`).
        The token after that position and the draft are kept where the next verify, scheduled before this one is
        taken in, reads them (`ModelRunner.keep_verify_inputs`)."""
        if not self.chains_on_device(job, states, held):
            return None
        key = job.static_key
        argmax = logits.argmax(dim=-1)
        chain, row_starts = self._first_pass(key, argmax.device)
        rows = (key.rows, key.tokens_per_row)  # (one draft a row: its last token, then its draft)
        proposed = batch.input_ids.view(rows)[:, 1]
        picks = row_starts + (proposed == argmax.view(rows)[:, 0])  # (+ 1 where the draft is accepted)
        counts = self.runner.agree_drafts(chain.token_counts)
        if counts != chain.dp_token_counts:  # (kept: alone, or with the same counts again, it is not rebuilt)
            chain = dataclasses.replace(chain, dp_token_counts=counts)
            self._first_passes[key] = chain, row_starts
        stop_ids, limits = self._early_holds(job, states, held or {}, argmax.device)
        first = FirstInputs(argmax, picks, stop_ids, _holds_after_verify(picks - row_starts, limits))
        drafts = self.runner.draft_chain(chain, first_inputs=first)  # [1, rows]
        self.runner.keep_verify_inputs(batch.logits_slot.view(rows)[:, 0], argmax[picks], drafts)
        return argmax, drafts[0], proposed

    def _first_pass(self, key: StaticKey, device) -> tuple[DraftChain, torch.Tensor]:
        """`chain_early`'s chain for a verify step of `key` (one pass, its inputs the device's: nothing in it depends
        on the step's rows), and each row's first logits row; built once per key."""
        if key not in self._first_passes:
            placeholder = torch.zeros(key.rows * key.tokens_per_row, dtype=torch.long)
            chain = DraftChain(key, placeholder, torch.zeros(key.rows, dtype=torch.long),
                               torch.empty(0, key.rows, dtype=torch.long), {}, key.context,
                               stop_ids=_stop_slots([], key.rows), holds=torch.zeros(1, key.rows, dtype=torch.bool))
            starts = torch.arange(key.rows, device=device) * key.tokens_per_row
            self._first_passes[key] = chain, starts
        return self._first_passes[key]

    def _early_holds(self, job: SpecJob, states: list[SamplerState], held: dict[int, HeldStops],
                     device) -> tuple[torch.Tensor, torch.Tensor]:
        """`chain_early`'s holds: each batch row's stop tokens, and the number of drafts it must accept for its next
        draft to be its min_tokens-th output or later (it drafts output position + accepted + 2 - prompt length;
        0 for a row that holds nothing). Without holds the key's zeros, made once."""
        key = job.static_key
        if not held:
            if key not in self._no_holds:
                self._no_holds[key] = (_stop_slots([], key.rows).to(device),
                                       torch.zeros(key.rows, dtype=torch.long, device=device))
            return self._no_holds[key]
        limits = [0] * key.rows
        for r in held:
            limits[r] = states[r].params.min_tokens + len(states[r].prompt_ids) - 2 - job.rows[r].position
        stop_ids = _stop_slots([held.get(r) for r in range(key.rows)], key.rows).to(device, non_blocking=True)
        return stop_ids, long_on(limits, device)  # (neither copy waits for the verify in flight)

    def _static_chain(self, job: SpecJob, next_ids: torch.Tensor, rows: list[int], picks: list[int],
                      positions: list[int], states: list[SamplerState],
                      held: dict[int, HeldStops]) -> tuple[DraftChain, list[list[int]]]:
        """The chain of the step's drafting rows, and each pass's rows (indices into `rows`, in its row order): the
        first pass has them all, chained pass s those whose pages reach position + s (as the eager chain); each pass's
        holds (min_tokens) as the eager chain's (`_draft_holds`)."""
        key, k = job.static_key, job.num_speculative_tokens
        order = [list(range(len(rows)))]
        for step in range(1, k):
            order.append([i for i in order[-1] if positions[i] + step < job.rows[rows[i]].lookahead_end])
        # (the verify's context bucket at least: a chain key per verify key, or two where the chain crosses a bucket)
        ends = [positions[i] + step + 1 for step, live in enumerate(order[1:], 1) for i in live]
        context = max(key.context, context_bucket(max(ends, default=1)))
        # (the draft layer is a sliding-window block: its passes need no compressed tables or plans)
        passes = {step: build_forward_batch([BatchRow(job.rows[rows[i]].pages, [0], positions[i] + step, True)
                                             for i in live], self.runner.kv, pad_to=StaticKey(key.rows, context),
                                            compressed=False)
                  for step, live in enumerate(order[1:], 1)}
        # A chained row continues its own row of the pass before; a padding row any row (its writes go to scratch).
        sources = []
        for before, live in zip(order, order[1:]):
            place = {i: j for j, i in enumerate(before)}
            sources.append([place[i] for i in live] + list(range(len(live), key.rows)))
        padded_picks = picks + [0] * (key.rows - len(picks))
        holds = torch.zeros(k, key.rows, dtype=torch.bool)
        for step, live in enumerate(order):
            at = _draft_holds(rows, positions, step, states, held)
            holds[step, :len(live)] = torch.tensor([i in at for i in live], dtype=torch.bool)
        biases, bias_slots = self._biases([states[r] for r in rows], key.rows)
        chain = DraftChain(key, next_ids, _long(padded_picks), _long(sources).view(k - 1, key.rows), passes, context,
                           stop_ids=_stop_slots([held.get(r) for r in rows], key.rows), holds=holds,
                           biases=biases, bias_slots=bias_slots)
        return chain, order

    def _biases(self, states: list[SamplerState], num_rows: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A static chain's biases [1 + BIAS_SLOTS, V] (row 0 none, then each distinct one of the rows', built on the
        host from the requests' parameters, again only when the step's distinct biases change) and each row's slot
        among them [num_rows]; (None, None) where no row has one."""
        slots, distinct = [0] * num_rows, {}
        for i, state in enumerate(states):
            if state.biased:
                slots[i] = distinct.setdefault(state.bias_key, (len(distinct) + 1, state.params))[0]
        if not distinct:
            return None, None
        keys = tuple(distinct)
        if self._bias_table[0] != keys:
            table = torch.zeros(1 + BIAS_SLOTS, self.runner.model.config.vocab_size)
            for slot, params in distinct.values():
                table[slot] = logit_bias(params, table[0])
            self._bias_table = keys, table
        return self._bias_table[1], _long(slots)

    def idle(self, job: SpecJob) -> None:
        """A data-parallel rank without a batch in lock-step: its part of the other ranks' draft passes (agreed on
        at once, as theirs are)."""
        for counts in self.runner.agree_drafts((0,) * job.num_speculative_tokens):
            self.runner.idle_draft(counts)

    def _chain(self, rows: list[BatchRow], live: list[int], device, counts: tuple[int, ...]) -> Draft:
        """A chained pass over `rows`, reading the streams the last pass kept at rows `live` (`counts`: the pass's
        agreed tokens of every rank, in lock-step)."""
        batch = build_forward_batch(rows, self.runner.kv, device=device, compressed=False)  # (a sliding-window block)
        return Draft(batch, batch.logits_token_index, torch.tensor(live, device=device), counts)

    @staticmethod
    def _next_ids(batch: ForwardBatch, job: SpecJob, output: StepOutput) -> torch.Tensor:
        """Each position's next token: the host's (prompt tokens), or the token the step emitted after it (every
        logits token: a verify's i-th emits its i-th token; past the emitted ones, any token: those positions are
        rejected and rewritten later)."""
        after = _emitted_after(job, output)
        after += [0] * (len(batch.logits_token_index) - len(after))  # (a static batch's padding rows)
        next_ids = torch.zeros(batch.num_tokens, dtype=torch.long)  # (padding rows' tokens follow the real ones)
        next_ids[:len(job.next_ids)] = job.next_ids
        next_ids = next_ids.to(batch.input_ids.device)
        next_ids[batch.logits_token_index] = torch.tensor(after, dtype=torch.long, device=next_ids.device)
        return next_ids

    @staticmethod
    def _next_ids_static(job: SpecJob, output: StepOutput, key: StaticKey) -> torch.Tensor:
        """_next_ids of a static verify step, on the host: every token of its batch is a logits token."""
        after = _emitted_after(job, output)
        return _long(after + [0] * (key.rows * key.tokens_per_row - len(after)))

    def _draw(self, logits: torch.Tensor, states: list[SamplerState], walk: GrammarLookahead,
              timing: StepTiming, held: dict[int, HeldStops]) -> list[int | None]:
        """One draft per row: the argmax, or for sampled requests under draft_sampling=sample a draw from the draft
        distribution q (filtered as the request samples), which the state keeps for the verify's rejection rule (an
        argmax draft keeps none: its q is all on the draft). A constrained row drafts under
        its grammar's mask after its drafts so far, and its matcher takes the draft (`walk`); None where no token
        fits. `held`: the rows whose stop tokens are held back at this draft (min_tokens), as the verify holds
        them (after the grammar's mask: a stop token that is all it allows stays)."""
        unfit = self._mask(logits, states, walk, timing)
        self._bias(logits, states, unfit)
        if held:
            rows = sorted(held)
            hold_stops(logits, rows, [held[i] for i in rows], [states[i].narrowed for i in rows])
        tokens = logits.argmax(dim=-1).tolist()
        for i in unfit:
            tokens[i] = None
        drawing = [i for i, state in enumerate(states) if i not in unfit and self._draws(state)]
        for part in row_shares(drawing, logits.device):
            drawn, q = draw_rows(logits[row_index(part, logits.device)], [states[i] for i in part])
            for i, token, line in zip(part, drawn.tolist(), q):
                tokens[i] = token
                states[i].draft_probs.append(line)
        drafted = [i for i, state in enumerate(states) if _constrained(state) and tokens[i] is not None]
        if drafted:
            started = time.perf_counter()
            walk.take([states[i].grammar for i in drafted], [tokens[i] for i in drafted])
            timing.mask_fill_s += time.perf_counter() - started
        return tokens

    @staticmethod
    def _bias(logits: torch.Tensor, states: list[SamplerState], unfit: set[int]) -> None:
        """The rows' logit_bias and allowed_token_ids on their draft logits (in place), as the verify applies them to
        its own: a draft the verify is bound to reject (outside allowed_token_ids, say) is a draft wasted. A row
        the bias leaves no finite logit (its grammar and allowed tokens share none) keeps its logits: the verify
        rejects its draft, as it would any."""
        rows = [i for i, state in enumerate(states) if state.biased and i not in unfit]
        if not rows:
            return
        index = row_index(rows, logits.device)
        biased = logits[index] + torch.stack([states[i].bias_of(logits[i]) for i in rows])
        kept = torch.isfinite(biased).any(dim=-1, keepdim=True)  # (on the device: no host sync)
        logits[index] = torch.where(kept, biased, logits[index])

    def _mask(self, logits: torch.Tensor, states: list[SamplerState], walk: GrammarLookahead,
              timing: StepTiming) -> set[int]:
        """Mask the constrained rows' draft logits (in place) with their grammars' masks after their drafts so far:
        one fill, one copy, one kernel. Returns the rows no token fits (their walk blocked)."""
        rows = [i for i, state in enumerate(states) if _constrained(state)]
        if not rows:
            return set()
        started = time.perf_counter()
        masks, targets = self.masks.buffers(len(rows), logits)
        targets.copy_(torch.tensor(rows))
        unfit = {rows[i] for i in self.sampler.grammars.fill_or_unmask([states[i].grammar for i in rows], masks)}
        for i in unfit:
            walk.block(states[i].grammar)
        for mask, i in zip(masks, rows):  # (kept for the verify of these drafts: `Verifier._mask_verify_rows`)
            states[i].draft_masks.append((mask.clone(), i in unfit))
        timing.mask_fill_s += time.perf_counter() - started
        self.masks.apply(logits, len(rows))
        return unfit


def _draft_holds(rows: list[int], positions: list[int], step: int, states: list[SamplerState],
                 held: dict[int, HeldStops]) -> dict[int, HeldStops]:
    """Of a pass's rows (sampling rows `rows`, drafting from `positions` + `step`), those whose draft there is an
    output before their min_tokens-th, by index in the pass: their stop tokens held at that one logits row. (A row's
    position is its last emitted token's logits row, so that token sits one further and the pass drafts the token two
    further: the output at position + step + 2 - the prompt's length.)"""
    holds = {}
    for i, (r, position) in enumerate(zip(rows, positions)):
        if r in held and position + step + 2 - len(states[r].prompt_ids) < states[r].params.min_tokens:
            holds[i] = HeldStops(1, held[r].token_ids)
    return holds


def _holds_after_verify(accepted: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """Which rows' draft after a verify holds their stop tokens back (`Drafter.chain_early`, on the device): those that
    accepted fewer drafts than their limit (`Drafter._early_holds`)."""
    return accepted < limits


def _slots_hold(holds: Sequence[HeldStops | None]) -> bool:
    """Whether a static chain has the slots for these holds' stop tokens."""
    return all(hold is None or len(hold.token_ids) <= HELD_STOP_SLOTS for hold in holds)


def _stop_slots(holds: list[HeldStops | None], num_rows: int) -> torch.Tensor:
    """[num_rows, HELD_STOP_SLOTS] long: row i's held stop tokens (holds[i]; none past the list), its first repeated
    in the spare slots (holding writes the same -inf twice), zeros for a row that holds nothing."""
    slots = torch.zeros(num_rows, HELD_STOP_SLOTS, dtype=torch.long)
    for i, hold in enumerate(holds):
        if hold is not None:
            ids = list(hold.token_ids)
            slots[i] = torch.tensor(ids + ids[:1] * (HELD_STOP_SLOTS - len(ids)))
    return slots


def _drafted_mask(state: SamplerState, drafts: tuple[int, ...], position: int) -> tuple[torch.Tensor, bool] | None:
    """The mask a constrained row's draft at `position` was drawn under (the grammar's after the drafts before it),
    where its verify has the same drafts before it; else None (to fill)."""
    if position < len(state.draft_masks) and list(drafts[:position]) == state.masked_drafts[:position]:
        return state.draft_masks[position]
    return None


def _accepts_by_argmax(state: SamplerState) -> bool:
    """A greedy row whose drafts are accepted by the raw logits' argmax: no penalties, no grammar."""
    return state.params.temperature == 0.0 and not state.has_penalties and state.grammar is None


def _constrained(state: SamplerState) -> bool:
    """A row whose grammar still constrains its tokens."""
    return state.grammar is not None and not state.grammar.done
