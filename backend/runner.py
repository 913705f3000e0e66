"""Where a step's forward runs: the model over this process's pools, or every rank of a group.

    runner = ModelRunner(model, kv, graphs=None, keep_streams=False)     # this process's model and pools
    runner = GroupRunner(group, model, kv, ...)                          # rank 0 of a tensor/expert-parallel group
    logits, batch = runner.forward(Forward(batch, copies, static_key, staged, reads_previous_tokens))
    runner.keep_tokens(batch, tokens)                                    # what the next step's decodes read
    logits = runner.draft(Draft(batch, logits_index, hidden_rows))       # speculative decoding's draft passes

One interface for every layout, and the one owner of what surrounds a forward:
- the prefix cache's copies (`StepCopies`), made before and after the forward on every rank that holds pools;
- the previous step's tokens: each step keeps its sampled tokens in `last_tokens` (by state slot, on the device),
  and a decode row whose token the host has not seen yet (`token_source_slot`, overlap scheduling) reads it from
  there before the forward, without a host round trip;
- the forward itself: eager over the batch, or copied into a CUDA graph's static buffers and replayed
  (`DecodeGraphs`, a step at a static shape), with the residual streams kept for the draft passes when speculative
  decoding is on (`keep_streams`).

`Forward` and `Draft` are also the messages rank 0 of a group sends its workers (backend/parallel/group.py): a worker
runs each on its own `ModelRunner` exactly as rank 0 does; `Stop` ends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from backend.model.staging import BatchStager

if TYPE_CHECKING:
    from backend.model.forward_batch import ForwardBatch
    from backend.model.graph_runner import DecodeGraphs
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
    """One step's forward: its batch (host tensors where other ranks are sent it, else already on the device), the
    prefix cache's copies around it, its static shape (a CUDA graph's; `staged`: the batch packed for its buffers,
    packed by the runner when absent), and whether a decode's token is the previous step's (`token_source_slot`)."""

    batch: "ForwardBatch"
    copies: StepCopies = field(default_factory=StepCopies)
    static_key: "StaticKey | None" = None
    staged: "StagedBatch | None" = None
    reads_previous_tokens: bool = False


@dataclass(frozen=True, slots=True)
class Draft:
    """One pass of the MTP layer (backend/speculative.py) over `batch`, reading the streams the runner kept (all rows,
    or `hidden_rows` of them); logits at `logits_index`, whose streams the next pass reads."""

    batch: "ForwardBatch"
    logits_index: torch.Tensor
    hidden_rows: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Stop:
    """A worker's last message."""


class ModelRunner:
    """The model over this process's pools (see the module docstring)."""

    def __init__(self, model, kv, graphs: "DecodeGraphs | None" = None, keep_streams: bool = False):
        self.model, self.kv, self.graphs, self.keep_streams = model, kv, graphs, keep_streams
        self.device = torch.device(model.device)
        self.last_tokens = torch.zeros(kv.state_pool.scratch_slot + 1, dtype=torch.long, device=self.device)
        self.hidden: torch.Tensor | None = None  # the streams the next draft pass reads (keep_streams)
        self._stager: BatchStager | None = None  # packs a static step's batch that came as host tensors

    def forward(self, step: Forward) -> tuple[torch.Tensor, "ForwardBatch"]:
        """The step's logits, and its batch on the device (a static step's: its graph's buffers); the prefix cache's
        copies around it."""
        self._copy(step.copies.before)
        prepare = self._take_previous_tokens if step.reads_previous_tokens else _nothing
        if step.static_key is not None:
            out, batch = self.graphs.forward(step.static_key, step.staged or self._stage(step.batch), prepare)
        else:
            batch = _on(step.batch, self.device)
            prepare(batch)
            out = (self.model.forward(batch, self.kv, return_streams=True) if self.keep_streams
                   else self.model.forward(batch, self.kv))
        self._copy(step.copies.after)
        if self.keep_streams:
            out, self.hidden = out
        return out, batch

    def draft(self, step: Draft) -> torch.Tensor:
        """The pass's logits; its streams at the logits rows are what the next pass reads."""
        hidden = self.hidden if step.hidden_rows is None else self.hidden[step.hidden_rows.to(self.device)]
        index = step.logits_index.to(self.device)
        logits, streams = self.model.draft(_on(step.batch, self.device), self.kv, hidden, index)
        self.hidden = streams[index]
        return logits

    def keep_tokens(self, batch: "ForwardBatch", tokens: torch.Tensor) -> None:
        """A step's sampled tokens (one per logits row, in order), where the next step's decodes read them."""
        self.last_tokens[batch.logits_slot[:len(tokens)].to(self.device)] = tokens

    def _take_previous_tokens(self, batch: "ForwardBatch") -> None:
        """Tokens whose id the previous step sampled: read from `last_tokens` by state slot (in place; a batch on
        the host reads them back once)."""
        source = batch.token_source_slot
        last = self.last_tokens.to(source.device)
        batch.input_ids.copy_(torch.where(source >= 0, last[source.clamp(min=0)], batch.input_ids))

    def _stage(self, batch: "ForwardBatch") -> "StagedBatch":
        if self._stager is None:
            self._stager = BatchStager(self.device, depth=1)
        return self._stager.stage(batch)

    def _copy(self, copies: list[tuple]) -> None:
        if copies:
            self.kv.prefix_cache.apply(copies)


class GroupRunner(ModelRunner):
    """Rank 0 of a tensor/expert-parallel group: every rank runs each step, rank 0 sends it first (its batch as host
    tensors, the previous step's tokens already in: only rank 0 samples, so only its `last_tokens` holds them)."""

    def __init__(self, group: "RankGroup", model, kv, graphs: "DecodeGraphs | None" = None,
                 keep_streams: bool = False):
        super().__init__(model, kv, graphs, keep_streams)
        self.group = group

    def forward(self, step: Forward) -> tuple[torch.Tensor, "ForwardBatch"]:
        if step.reads_previous_tokens:
            self._take_previous_tokens(step.batch)
            step = replace(step, reads_previous_tokens=False)
        message = replace(step, staged=None)  # (the packed host buffer stays here: each rank packs its own)
        return self.group.run(message, lambda: ModelRunner.forward(self, step))

    def draft(self, step: Draft) -> torch.Tensor:
        cpu = torch.device("cpu")  # (what the workers are sent: host tensors, each moves them to its own device)
        message = Draft(_on(step.batch, cpu), step.logits_index.cpu(),
                        None if step.hidden_rows is None else step.hidden_rows.cpu())
        return self.group.run(message, lambda: ModelRunner.draft(self, step))


def _nothing(batch) -> None:
    pass


def _on(batch: "ForwardBatch", device: torch.device) -> "ForwardBatch":
    """`batch` on `device` (itself when it is there already)."""
    return batch if batch.input_ids.device.type == device.type else batch.to(device)
