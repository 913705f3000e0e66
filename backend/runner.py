"""Where a step's forward runs: the model over this process's pools, or every rank of a group.

    runner = make_runner(config, model, kv, group=None, sync=ALONE)      # ModelRunner: this process's model and
                                                                         # pools; GroupRunner: rank 0 of a group
    logits, batch = runner.forward(Forward(batch, copies, static_key, staged, reads_previous_tokens))
    runner.keep_tokens(batch, tokens)                                    # what the next step's decodes read
    counts = runner.agree_drafts(own_counts)                             # speculative decoding's k draft passes,
    logits = runner.draft(Draft(batch, logits_index, hidden_rows, counts[s]))  # pass by pass (`idle_draft`: none
    drafts = runner.draft_chain(replace(chain, dp_token_counts=counts))  # of its own), or one static chain

One interface for every layout, and the one owner of what surrounds a forward:
- the prefix cache's copies (`StepCopies`), made before and after the forward on every rank that holds pools;
- the previous step's tokens: each step keeps its sampled tokens in `last_tokens` (1 + k entries a state slot, on
  the device: a decode's token, or after a verify step whose drafts the device chained, the token after the
  request's last accepted one and the drafts from there), and a row whose tokens the host has not seen yet
  (`token_source`: overlap scheduling, overlapped verify steps) reads them from there before the forward, without a
  host round trip;
- the forward itself: eager over the batch, or copied into a CUDA graph's static buffers and replayed
  (`DecodeGraphs`, a step at a static shape), with the residual streams kept for the draft passes when speculative
  decoding is on (`keep_streams`);
- data-parallel ranks in lock-step (backend/parallel/sync.py): every rank's token counts on the batch (what the MoE
  exchange pads to), and a rank without a batch (`Forward(None)`, `idle_draft`) takes part in the other ranks'
  exchanges alone; a step's k draft passes are agreed on once, before the first (`agree_drafts`: every rank's tokens
  in each pass);
- the draft passes after a static verify step, for rows that draft greedily: one static chain (`DraftChain`,
  backend/model/graph_runner.py), replayed from a CUDA graph on CUDA, that returns every pass's drafts at once. In
  lock-step its graph replays only where each pass's exchange pads to this rank's own count (as a decode graph's);
  else the same chain runs eagerly at the agreed counts.

`Forward`, `Draft` and `DraftChain` are also the messages rank 0 of a group sends its workers (backend/rank_main.py):
a worker runs each on its own `ModelRunner` exactly as rank 0 does; `Stop` (backend/parallel/messages.py) ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from backend.model.graph_runner import DecodeGraphs, DraftChain, DraftChains, FirstInputs
from backend.model.staging import BatchStager
from backend.parallel.sync import ALONE, StepSync

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.model.forward_batch import ForwardBatch
    from backend.model.staging import StagedBatch
    from backend.model.static_batch import StaticKey
    from backend.parallel.group import RankGroup


@dataclass
class StepCopies:
    """The prefix cache's copies (backend/memory/prefix_cache.py `apply`) around a step's forward."""

    before: list[tuple] = field(default_factory=list)
    after: list[tuple] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Forward:
    """One step's forward: its batch (host tensors where other ranks are sent it, else already on the device; None:
    this data-parallel rank has none, it takes part in the others'), the prefix cache's copies around it, its static
    shape (a CUDA graph's; `staged`: the batch packed for its buffers, packed by the runner when absent), whether a
    decode's token is the previous step's (`token_source`), and every data-parallel rank's token count."""

    batch: "ForwardBatch | None"
    copies: StepCopies = field(default_factory=StepCopies)
    static_key: "StaticKey | None" = None
    staged: "StagedBatch | None" = None
    reads_previous_tokens: bool = False
    dp_token_counts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Draft:
    """One pass of the MTP layer (backend/speculative.py) over `batch`, reading the streams the runner kept (all rows,
    or `hidden_rows` of them); logits at `logits_index`, whose streams the next pass reads. In lock-step, every rank's
    tokens in this pass, agreed before the step's first pass (this rank's may be more than its batch holds, where a
    grammar ended rows since: the exchange pads to the largest all the same)."""

    batch: "ForwardBatch"
    logits_index: torch.Tensor
    hidden_rows: torch.Tensor | None = None
    dp_token_counts: tuple[int, ...] = ()


class ModelRunner:
    """The model over this process's pools (see the module docstring)."""

    sends_host_batches = False  # a step's batch goes to the device from the host thread (not out to other ranks)

    def __init__(self, model, kv, graphs: DecodeGraphs | None = None, keep_streams: bool = False,
                 sync: StepSync = ALONE):
        self.model, self.kv, self.graphs, self.keep_streams, self.sync = model, kv, graphs, keep_streams, sync
        # The static draft chains after static verify steps (speculative decoding with static steps: one rank, a
        # group, or data-parallel ranks in lock-step, which agree on every pass of a chain at once).
        self.draft_chains = DraftChains(graphs) if graphs is not None and keep_streams else None
        self.device = torch.device(model.device)
        # [slots, 1 + k] flattened: a decode's token at entry 0; the next verify's tokens after a chained verify
        self.tokens_per_slot = kv.speculative_tokens + 1
        self.last_tokens = torch.zeros((kv.state_pool.scratch_slot + 1) * self.tokens_per_slot, dtype=torch.long,
                                       device=self.device)
        self.hidden: torch.Tensor | None = None  # the streams the next draft pass reads (keep_streams)
        self._stager: BatchStager | None = None  # packs a static step's batch that came as host tensors

    def forward(self, step: Forward) -> tuple[torch.Tensor | None, "ForwardBatch | None"]:
        """The step's logits, and its batch on the device (a static step's: its graph's buffers); the prefix cache's
        copies around it. (None, None) for a rank without a batch."""
        if step.batch is None:
            self.model.idle_forward(step.dp_token_counts)
            return None, None
        self._copy(step.copies.before)

        def prepare(batch: "ForwardBatch") -> None:
            if step.reads_previous_tokens:
                self._take_previous_tokens(batch)
            batch.dp_token_counts = step.dp_token_counts

        if step.static_key is not None:  # (in lock-step, a graph replays only at its own count's exchange)
            replay = not step.dp_token_counts or step.batch.num_tokens == max(step.dp_token_counts)
            out, batch = self.graphs.forward(step.static_key, step.staged or self._stage(step.batch), prepare, replay)
        else:
            batch = _on(step.batch, self.device)
            prepare(batch)
            out = (self.model.forward(batch, self.kv, return_streams=True) if self.keep_streams
                   else self.model.forward(batch, self.kv))
        self._copy(step.copies.after)
        if self.keep_streams:
            out, self.hidden = out
        return out, batch

    def agree_drafts(self, counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """Per draft pass of the step, every rank's tokens in it (`counts`: this rank's, one per pass, at most what
        its batch will hold), agreed once before the first pass; () per pass where no rank meets another."""
        return self.sync.agree_passes(counts) if self.sync.lock_step else tuple(() for _ in counts)

    def idle_draft(self, counts: tuple[int, ...]) -> None:
        """A draft pass without rows of this rank's: in lock-step, its part of the other ranks' exchanges."""
        if any(counts):
            self.model.idle_forward(counts, draft=True)

    def draft(self, step: Draft) -> torch.Tensor:
        """The pass's logits; its streams at the logits rows are what the next pass reads."""
        batch = _on(step.batch, self.device)
        batch.dp_token_counts = step.dp_token_counts
        hidden = self.hidden if step.hidden_rows is None else self.hidden[step.hidden_rows.to(self.device)]
        index = step.logits_index.to(self.device)
        logits, streams = self.model.draft(batch, self.kv, hidden, index)
        self.hidden = streams[index]
        return logits

    def draft_chain(self, chain: DraftChain, first_inputs: FirstInputs | None = None) -> torch.Tensor:
        """The drafts [k, rows] of a static chain (on the device), from the streams the verify step kept. In
        lock-step, as a decode graph (`forward`), its graph replays only where every pass's MoE exchange pads to this
        rank's own count, the count it was captured at (a captured exchange's size is fixed); where another rank
        brings more to some pass, the same chain runs eagerly at the agreed counts. `first_inputs`: the first pass's
        inputs, on the device (DraftChains.run; this process's runner only: a group's workers are sent
        the chain as the host built it)."""
        replay = all(not counts or own == max(counts)
                     for own, counts in zip(chain.token_counts, chain.dp_token_counts))
        return self.draft_chains.run(chain, self.hidden, replay, first_inputs)

    def keep_tokens(self, batch: "ForwardBatch", tokens: torch.Tensor) -> None:
        """A step's sampled tokens (one per logits row, in order), where the next step's decodes read them."""
        self.last_tokens[batch.logits_slot[:len(tokens)].to(self.device) * self.tokens_per_slot] = tokens

    def keep_verify_inputs(self, slots: torch.Tensor, tokens: torch.Tensor, drafts: torch.Tensor) -> None:
        """After a verify step whose drafts the device chained: each row's next verify tokens, the token after its last
        accepted one and the drafts proposed from there (tokens [rows], drafts [k, rows], by state slot [rows]), where
        a verify scheduled before this one is taken in reads them (`token_source`)."""
        kept = self.last_tokens.view(-1, self.tokens_per_slot)
        kept[slots, 0] = tokens
        kept[slots, 1:] = drafts.T

    def _take_previous_tokens(self, batch: "ForwardBatch") -> None:
        """Tokens whose id the previous step sampled: read from `last_tokens` by state slot (in place; a batch on
        the host reads them back once)."""
        source = batch.token_source
        last = self.last_tokens.to(source.device)
        batch.input_ids.copy_(torch.where(source >= 0, last[source.clamp(min=0)], batch.input_ids))

    def _stage(self, batch: "ForwardBatch") -> "StagedBatch":
        if self._stager is None:
            self._stager = BatchStager(self.device, depth=2)  # (a worker never waits for a step's copy: one in flight)
        return self._stager.stage(batch)

    def _copy(self, copies: list[tuple]) -> None:
        if copies:
            self.kv.prefix_cache.apply(copies)


class GroupRunner(ModelRunner):
    """Rank 0 of a tensor/expert-parallel group: every rank runs each step, rank 0 sends it first (its batch as host
    tensors, the previous step's tokens already in: only rank 0 samples, so only its `last_tokens` holds them)."""

    sends_host_batches = True

    def __init__(self, group: "RankGroup", model, kv, graphs: DecodeGraphs | None = None,
                 keep_streams: bool = False):
        super().__init__(model, kv, graphs, keep_streams)
        self.group = group

    def forward(self, step: Forward) -> tuple[torch.Tensor, "ForwardBatch"]:
        # The workers get the host batch with the previous step's tokens in (and pack it themselves); rank 0 runs the
        # step as it is (its packed copy still reads them on the device).
        message = replace(step, staged=None, reads_previous_tokens=False)
        if step.reads_previous_tokens:
            self._take_previous_tokens(message.batch)
        return self.group.run(message, lambda: ModelRunner.forward(self, step))

    def draft(self, step: Draft) -> torch.Tensor:
        cpu = torch.device("cpu")  # (what the workers are sent: host tensors, each moves them to its own device)
        message = Draft(_on(step.batch, cpu), step.logits_index.cpu(),
                        None if step.hidden_rows is None else step.hidden_rows.cpu(), step.dp_token_counts)
        return self.group.run(message, lambda: ModelRunner.draft(self, step))

    def draft_chain(self, chain: DraftChain) -> torch.Tensor:
        # (built on the host: the workers get it as it is, each runs the chain over its own buffers; every rank's
        # logits are the same, gathered or reduced alike, so each rank's argmax feeds its next pass the same ids)
        return self.group.run(chain, lambda: ModelRunner.draft_chain(self, chain))


def make_runner(config: "EngineConfig", model, kv, group: "RankGroup | None" = None,
                sync: StepSync = ALONE) -> ModelRunner:
    """The runner of a rank's steps: with `group` (tensor/expert parallelism), rank 0's, which runs every step on
    every rank; else this process's own (one rank, a worker of a group, a data-parallel rank)."""
    keep_streams = bool(config.num_speculative_tokens)  # the draft layer reads the verify's residual streams
    graphs = (DecodeGraphs(model, kv, config.max_running_requests, capture=True, return_streams=keep_streams)
              if config.resolved_cuda_graphs() else None)  # (off CUDA, closures recorded and replayed as graphs)
    if group is not None:
        return GroupRunner(group, model, kv, graphs, keep_streams)
    return ModelRunner(model, kv, graphs, keep_streams, sync)


def _on(batch: "ForwardBatch", device: torch.device) -> "ForwardBatch":
    """`batch` on `device` (itself when it is there already)."""
    return batch if batch.input_ids.device.type == device.type else batch.to(device)
