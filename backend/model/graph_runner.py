"""Decode steps replayed from CUDA graphs: one launch of the whole step instead of one per kernel.

    graphs = DecodeGraphs(model, kv, max_rows=64, capture=True)   # capture=False: eager, same buffers
    if graphs.accepts(rows):
        key = static_key(rows); staged = stager.stage(build_forward_batch(rows, kv, pad_to=key))
        logits, batch = graphs.forward(key, staged, prepare)        # [key.rows, vocab], its static batch

Per `StaticKey` (row bucket x context bucket, backend/model/static_batch.py) it keeps one device
buffer holding the batch's metadata (the views the graph reads) and, when capturing, a graph
recorded on the first step of that key: the forward runs once on a batch made only of padding rows
(every write goes to the pools' scratch page and slot, so no request's memory changes; it compiles
every Triton kernel for these shapes), then is captured on the same buffer. Every step copies its
packed batch into the buffer (one copy), lets `prepare` fill in what only the device knows (the
tokens the step before sampled), and replays. Graphs share one memory pool. Prefill and mixed steps
run eagerly (their shapes are not bucketed). With several ranks every rank replays its own graphs: a tensor/expert-
parallel group's ranks all take the same key (the same batch), and data-parallel ranks in lock-step replay only when
their own padded count is the largest of the step's (the one their MoE exchange pads to, as when captured), else run
the static step eagerly (backend/runner.py). Speculative decoding's verify steps (rows of 1 + k tokens alike) have
their own keys, and the draft layer's k passes after one (`DraftChains`) are one more static chain per verify key:
the first pass over the verify's own static batch, the chained ones over decode batches padded to the same row
bucket, each pass's argmax feeding the next on the device; one graph of the k passes, one read of the drafts. Data-
parallel ranks in lock-step agree on a chain's passes at once (each pass's token count on every rank), and replay
its graph by the decode graphs' rule: only where every pass's exchange pads to the rank's own count, else they run
the same chain eagerly at the agreed counts.

With capture=False (any device; the engine's `cuda_graphs` parameter on CPU) the same padded,
static-shape step runs eagerly: this is how the logic of the graph path is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from backend.model.forward_batch import ForwardBatch, build_forward_batch
from backend.model.staging import BatchStager, StagedBatch
from backend.model.static_batch import StaticKey, is_decode_batch, row_bucket

if TYPE_CHECKING:  # the pools are handed in, never made here
    from backend.memory.kv_manager import KVCacheManager


@dataclass
class _StaticStep:
    buffer: torch.Tensor  # the packed metadata, on the device
    batch: ForwardBatch  # views into `buffer`
    layout: tuple
    graph: "torch.cuda.CUDAGraph | None" = None
    output: object = None  # the graph's output buffers (logits, or logits and streams)


class DecodeGraphs:
    def __init__(self, model, kv: KVCacheManager, max_rows: int, capture: bool, return_streams: bool = False):
        """`return_streams`: every step returns (logits, residual streams), what speculative decoding's draft layer
        reads (DeepseekV4Model.forward)."""
        self.model, self.kv, self.capture, self.return_streams = model, kv, capture, return_streams
        self.max_rows = row_bucket(max_rows)
        self._steps: dict[StaticKey, _StaticStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # (the draft chains record into it too)
        self._warm_up = BatchStager(model.device, depth=1)

    @property
    def keys(self) -> list[StaticKey]:
        return list(self._steps)

    def accepts(self, rows) -> bool:
        return is_decode_batch(rows) and len(rows) <= self.max_rows

    def forward(self, key: StaticKey, staged: StagedBatch, prepare: Callable[[ForwardBatch], None],
                replay: bool = True) -> tuple:
        """Logits [key.rows * key.tokens_per_row, vocab] of the packed static batch `staged` (padded to `key`; with
        return_streams, (logits, streams)), and the static batch they came from; `prepare(batch)` runs on the static
        buffers after the copy, before the forward. `replay` False: eagerly on the same buffers (a data-parallel
        step whose MoE exchange pads to another rank's larger count than the graph's own)."""
        step = self._steps.get(key)
        if step is None:
            buffer = torch.empty(staged.num_bytes, dtype=torch.uint8, device=self.model.device)
            step = self._steps[key] = _StaticStep(buffer, staged.to_device(buffer), staged.layout)
        assert staged.layout == step.layout, f"a batch of key {key} with another layout"
        if replay and self.capture and step.graph is None:
            self._capture(step, key, prepare)
        staged.copy_into(step.buffer)
        prepare(step.batch)
        if step.graph is None or not replay:
            return self._forward(step.batch), step.batch
        step.graph.replay()
        return step.output, step.batch

    def _forward(self, batch: ForwardBatch):
        return self.model.forward(batch, self.kv, return_streams=self.return_streams)

    def static_batch(self, key: StaticKey) -> ForwardBatch:
        """The static batch of `key` (views into its buffer): what its last step ran on."""
        return self._steps[key].batch

    def _capture(self, step: _StaticStep, key: StaticKey, prepare: Callable[[ForwardBatch], None]) -> None:
        """Record the graph of `key` on a batch of padding rows only (every write goes to the scratch page and slot)."""
        padding = self._warm_up.stage(build_forward_batch([], self.kv, pad_to=key))
        assert padding.layout == step.layout
        padding.copy_into(step.buffer)
        prepare(step.batch)  # (what only the step knows: a data-parallel step's token counts)
        step.graph, step.output = _record(lambda: self._forward(step.batch), self.pool)


@dataclass
class DraftChain:
    """The draft layer's k passes after a static verify step (backend/speculative.py builds it on the host, from the
    rows' positions and pages), for rows that draft greedily. Row i of every pass is a drafting row (or padding):
    the first pass picks its logits and streams at `picks[i]` of the verify's batch; chained pass s (1..k-1) is a
    decode batch of the rows still drafting, at one position further each, whose row j continues row sources[s-1][j]
    of the pass before (its streams, its argmax as the input token). It is also what rank 0 of a group sends its
    workers. `dp_token_counts`: data-parallel ranks in lock-step, every rank's tokens in each pass (agreed; what each
    pass's MoE exchange pads to the largest of)."""

    key: StaticKey  # the verify step's: the first pass runs over its static batch
    next_ids: torch.Tensor  # [key.rows * key.tokens_per_row] long: each position's next token (the first pass's ids)
    picks: torch.Tensor  # [key.rows] long: the logits row each drafting row drafts from (padding: any)
    sources: torch.Tensor  # [k - 1, key.rows] long
    passes: dict[int, ForwardBatch]  # 1..k-1 -> chained pass s, padded to StaticKey(key.rows, context)
    context: int  # the chained passes' context bucket
    dp_token_counts: tuple[tuple[int, ...], ...] = ()  # per pass, every rank's tokens (in lock-step)

    @property
    def chain_key(self) -> tuple[StaticKey, int]:
        return self.key, self.context

    @property
    def token_counts(self) -> tuple[int, ...]:
        """This rank's tokens in each pass: the verify's static batch, then key.rows a chained pass."""
        return (self.key.rows * self.key.tokens_per_row, *[self.key.rows] * len(self.passes))


@dataclass
class _StaticChain:
    buffer: torch.Tensor  # the packed DraftChain, on the device
    chain: DraftChain  # views into `buffer`
    layout: tuple
    hidden: torch.Tensor  # the verify step's residual streams, copied in before each run
    first: ForwardBatch  # the verify key's static batch, reading the chain's next ids
    graph: "torch.cuda.CUDAGraph | None" = None
    output: torch.Tensor | None = None


class DraftChains:
    """Static draft chains (DraftChain) per verify key and chained context: buffers kept, and on CUDA one graph each,
    recorded on its first run (the verify graph's pool). capture=False runs the same chain eagerly."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs, self.model, self.kv, self.capture = graphs, graphs.model, graphs.kv, graphs.capture
        self._chains: dict[tuple[StaticKey, int], _StaticChain] = {}
        self._stager = BatchStager(self.model.device, depth=1)  # (the drafts are read before the next chain)

    @property
    def keys(self) -> list[tuple[StaticKey, int]]:
        return list(self._chains)

    def run(self, chain: DraftChain, hidden: torch.Tensor, replay: bool = True) -> torch.Tensor:
        """The drafts [k, key.rows] on the device, line s pass s's argmax at each of its rows (line 0: the first
        pass's); `hidden` the verify step's streams [T, N, D]. `replay` False: eagerly on the same buffers at the
        chain's agreed counts (a data-parallel step where some pass's MoE exchange pads to another rank's larger count
        than the graph's own; a graph is only recorded on a step it could replay, so its counts are its own)."""
        staged = self._stager.stage(chain)
        step = self._chains.get(chain.chain_key)
        if step is None:
            buffer = torch.empty(staged.num_bytes, dtype=torch.uint8, device=self.model.device)
            views = staged.to_device(buffer)
            first = replace(self.graphs.static_batch(chain.key), input_ids=views.next_ids)
            step = self._chains[chain.chain_key] = _StaticChain(buffer, views, staged.layout, torch.empty_like(hidden),
                                                                first)
        assert staged.layout == step.layout, f"a draft chain of key {chain.chain_key} with another layout"
        staged.copy_into(step.buffer)
        step.hidden.copy_(hidden)
        counts = chain.dp_token_counts or tuple(() for _ in chain.token_counts)
        if replay and self.capture and step.graph is None:
            # (the warm-up runs on this chain's own inputs: it writes the draft layer's window entries the replay
            # then writes again, the same values)
            step.graph, step.output = _record(lambda: self._passes(step, counts), self.graphs.pool)
        if step.graph is None or not replay:
            return self._passes(step, counts)
        step.graph.replay()
        return step.output

    def _passes(self, step: _StaticChain, counts: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """The k passes, each row's draft the argmax of its logits (greedy drafts need nothing else); pass s's MoE
        exchange at `counts[s]` (the buffers' views hold the first chain's, not this one's)."""
        chain = step.chain
        first = replace(step.first, dp_token_counts=counts[0])
        index = first.logits_token_index[chain.picks]
        logits, streams = self.model.draft(first, self.kv, step.hidden, index)
        hidden, tokens = streams[index], logits.argmax(dim=-1)
        drafts = [tokens]
        for s, batch in chain.passes.items():
            source = chain.sources[s - 1]
            batch = replace(batch, input_ids=tokens[source], dp_token_counts=counts[s])
            logits, streams = self.model.draft(batch, self.kv, hidden[source], batch.logits_token_index)
            hidden, tokens = streams[batch.logits_token_index], logits.argmax(dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts)


def _record(run: Callable[[], object], pool) -> tuple["torch.cuda.CUDAGraph", object]:
    """(graph, its output buffers) of `run`, after one warm-up run on a side stream (it compiles every Triton kernel
    for these shapes)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output
