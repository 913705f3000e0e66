"""Decode steps replayed from CUDA graphs: one launch of the whole step instead of one per kernel.

    graphs = DecodeGraphs(model, kv, max_rows=64, capture=True)   # capture=False: eager, same buffers
    if graphs.accepts(rows):
        key = static_key(rows); staged = stager.stage(build_forward_batch(rows, kv, pad_to=key))
        logits, batch = graphs.forward(key, staged, prepare)        # [key.rows, vocab], its static batch

Per `StaticKey` (row bucket x context bucket, backend/model/static_batch.py) it keeps one device
buffer holding the batch's metadata (the views the graph reads) and, when capturing, a graph
recorded on the first step of that key: that step runs eagerly on the buffer (it compiles every
Triton kernel for these shapes), then its forward is captured on the same buffer, which runs
nothing. So every step, the first included, runs its forward exactly once: a rank recording a graph
makes its collectives as often as the ranks replaying theirs (a warm-up run before the capture made
a data-parallel rank's MoE exchanges once more than the other ranks'). Every later step copies its
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

Off CUDA a recorded "graph" is `ReplayedClosure`: recording keeps the forward's closure and runs nothing, a replay
runs it on the static buffers. With the engine's `cuda_graphs` parameter on CPU this is how the graph path's logic
(padded static steps, which step records, which replays, what a replay reads) is tested without a GPU;
capture=False runs every static step eagerly on the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from backend.model.forward_batch import ForwardBatch
from backend.model.staging import BatchStager, StagedBatch
from backend.model.static_batch import StaticKey, is_decode_batch, row_bucket
from kernels.common import split_counters

if TYPE_CHECKING:  # the pools are handed in, never made here
    from backend.memory.kv_manager import KVCacheManager


@dataclass
class _StaticStep:
    buffer: torch.Tensor  # the packed metadata, on the device
    batch: ForwardBatch  # views into `buffer`
    layout: tuple
    graph: "CapturedGraph | ReplayedClosure | None" = None


class DecodeGraphs:
    def __init__(self, model, kv: KVCacheManager, max_rows: int, capture: bool, return_streams: bool = False):
        """`return_streams`: every step returns (logits, residual streams), what speculative decoding's draft layer
        reads (DeepseekV4Model.forward)."""
        self.model, self.kv, self.capture, self.return_streams = model, kv, capture, return_streams
        self.max_rows = row_bucket(max_rows)
        self._steps: dict[StaticKey, _StaticStep] = {}
        on_cuda = capture and torch.device(model.device).type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if on_cuda else None  # (the draft chains record into it too)
        self.record = CapturedGraph if on_cuda else ReplayedClosure

    @property
    def keys(self) -> list[StaticKey]:
        return list(self._steps)

    @property
    def recorded(self) -> list["CapturedGraph | ReplayedClosure"]:
        """The graphs recorded so far (closures off CUDA), one per key that has one."""
        return [step.graph for step in self._steps.values() if step.graph is not None]

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
        staged.copy_into(step.buffer)
        prepare(step.batch)
        return self.run_or_replay(step, lambda: self._forward(step.batch), replay), step.batch

    def run_or_replay(self, step: "_StaticStep | _StaticChain", run: Callable[[], object], replay: bool):
        """`run`'s output on a static step's buffers: its graph replayed where it has one and `replay` allows; else
        `run` eagerly, then, where `replay` allows and graphs are captured, its graph recorded (after the eager run,
        which compiled every kernel: the capture runs nothing)."""
        if step.graph is not None and replay:
            return step.graph.replay()
        out = run()
        if replay and self.capture:
            step.graph = self.record(run, self.pool)
        return out

    def _forward(self, batch: ForwardBatch):
        return self.model.forward(batch, self.kv, return_streams=self.return_streams)

    def static_batch(self, key: StaticKey) -> ForwardBatch:
        """The static batch of `key` (views into its buffer): what its last step ran on."""
        return self._steps[key].batch


@dataclass
class DraftChain:
    """The draft layer's k passes after a static verify step (backend/speculative.py builds it on the host, from the
    rows' positions and pages), for rows that draft greedily. Row i of every pass is a drafting row (or padding):
    the first pass picks its logits and streams at `picks[i]` of the verify's batch; chained pass s (1..k-1) is a
    decode batch of the rows still drafting, at one position further each, whose row j continues row sources[s-1][j]
    of the pass before (its streams, its stop tokens, its argmax as the input token). A row whose draft would be an
    output before its min_tokens-th drafts the argmax of the rest (`holds`: the verify would reject a stop token
    there). It is also what rank 0 of a group sends its workers. `dp_token_counts`: data-parallel ranks in lock-step,
    every rank's tokens in each pass (agreed; what each pass's MoE exchange pads to the largest of)."""

    key: StaticKey  # the verify step's: the first pass runs over its static batch
    next_ids: torch.Tensor  # [key.rows * key.tokens_per_row] long: each position's next token (the first pass's ids)
    picks: torch.Tensor  # [key.rows] long: the logits row each drafting row drafts from (padding: any)
    sources: torch.Tensor  # [k - 1, key.rows] long
    passes: dict[int, ForwardBatch]  # 1..k-1 -> chained pass s, padded to StaticKey(key.rows, context)
    context: int  # the chained passes' context bucket
    dp_token_counts: tuple[tuple[int, ...], ...] = ()  # per pass, every rank's tokens (in lock-step)
    # min_tokens: each first-pass row's stop tokens [key.rows, HELD_STOP_SLOTS] (its first repeated in the spare
    # slots), and where pass s's row j (the pass's own row order) holds them back from its draft [k, key.rows] bool
    stop_ids: torch.Tensor | None = None
    holds: torch.Tensor | None = None
    # logit_bias / allowed_token_ids: the biases the step's rows add to their draft logits as their verify does
    # [1 + BIAS_SLOTS, V] (row 0 adds nothing), and each first-pass row's [key.rows]; None where no row has one
    biases: torch.Tensor | None = None
    bias_slots: torch.Tensor | None = None

    @property
    def chain_key(self) -> tuple[StaticKey, int, bool]:
        """Its buffers' key: the verify key, the chained context, and whether it carries biases."""
        return self.key, self.context, self.biases is not None

    @property
    def token_counts(self) -> tuple[int, ...]:
        """This rank's tokens in each pass: the verify's static batch, then key.rows a chained pass."""
        return (self.key.rows * self.key.tokens_per_row, *[self.key.rows] * len(self.passes))


HELD_STOP_SLOTS = 4  # a static chain's stop tokens a row (min_tokens): a row with more drafts eagerly
BIAS_SLOTS = 4  # a static chain's distinct biases (logit_bias, allowed_token_ids): a step with more drafts eagerly


class FirstInputs(NamedTuple):
    """What `Drafter.chain_early` computes on the device for a chain's first pass: each position's next token, each
    row's logits row, and where each row's draft holds back its stop tokens; with the stop tokens themselves."""

    next_ids: torch.Tensor
    picks: torch.Tensor
    stop_ids: torch.Tensor
    holds: torch.Tensor  # [key.rows] bool


@dataclass
class _StaticChain:
    buffer: torch.Tensor  # the packed DraftChain, on the device
    chain: DraftChain  # views into `buffer`
    layout: tuple
    hidden: torch.Tensor  # the verify step's residual streams, copied in before each run
    first: ForwardBatch  # the verify key's static batch, reading the chain's next ids
    graph: "CapturedGraph | ReplayedClosure | None" = None


class DraftChains:
    """Static draft chains (DraftChain) per verify key, chained context and whether they carry biases: buffers kept,
    and on CUDA one graph each, recorded after its first, eager, run (in the verify graphs' pool). capture=False runs
    the same chain eagerly."""

    def __init__(self, graphs: DecodeGraphs):
        self.graphs, self.model, self.kv = graphs, graphs.model, graphs.kv
        self._chains: dict[tuple[StaticKey, int, bool], _StaticChain] = {}
        self._stager = BatchStager(self.model.device, depth=1)  # (the drafts are read before the next chain)

    @property
    def keys(self) -> list[tuple[StaticKey, int, bool]]:
        return list(self._chains)

    @property
    def recorded(self) -> list["CapturedGraph | ReplayedClosure"]:
        """The chains' graphs recorded so far (closures off CUDA)."""
        return [step.graph for step in self._chains.values() if step.graph is not None]

    def run(self, chain: DraftChain, hidden: torch.Tensor, replay: bool = True,
            first_inputs: FirstInputs | None = None) -> torch.Tensor:
        """The drafts [k, key.rows] on the device, line s pass s's argmax at each of its rows (line 0: the first
        pass's); `hidden` the verify step's streams [T, N, D]. `replay` False: eagerly on the same buffers at the
        chain's agreed counts (a data-parallel step where some pass's MoE exchange pads to another rank's larger count
        than the graph's own; a graph is only recorded on a step it could replay, so its counts are its own).
        `first_inputs`: the first pass's inputs as device tensors, in place of the chain's own (computed on the
        device from the verify's logits: the host has not read them); a chain of one pass then has nothing else to
        copy in, once its buffers exist."""
        step = self._chains.get(chain.chain_key)
        if step is None or first_inputs is None or chain.passes:
            staged = self._stager.stage(chain)
            if step is None:
                buffer = torch.empty(staged.num_bytes, dtype=torch.uint8, device=self.model.device)
                views = staged.to_device(buffer)
                first = replace(self.graphs.static_batch(chain.key), input_ids=views.next_ids)
                step = self._chains[chain.chain_key] = _StaticChain(buffer, views, staged.layout,
                                                                    torch.empty_like(hidden), first)
            assert staged.layout == step.layout, f"a draft chain of key {chain.chain_key} with another layout"
            staged.copy_into(step.buffer)
        if first_inputs is not None:
            step.chain.next_ids.copy_(first_inputs.next_ids)
            step.chain.picks.copy_(first_inputs.picks)
            step.chain.stop_ids.copy_(first_inputs.stop_ids)
            step.chain.holds[0].copy_(first_inputs.holds)
        step.hidden.copy_(hidden)
        counts = chain.dp_token_counts or tuple(() for _ in chain.token_counts)
        return self.graphs.run_or_replay(step, lambda: self._passes(step, counts), replay)

    @torch.inference_mode()  # (the holds write into the passes' logits, inference tensors, also on a group's workers)
    def _passes(self, step: _StaticChain, counts: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """The k passes, each row's draft the argmax of its logits, its stop tokens held where it holds them (greedy
        drafts need nothing else); pass s's MoE exchange at `counts[s]` (the buffers' views hold the first chain's,
        not this one's)."""
        chain = step.chain
        first = replace(step.first, dp_token_counts=counts[0])
        index = first.logits_token_index[chain.picks]
        logits, streams = self.model.draft(first, self.kv, step.hidden, index)
        stop_ids, slots, narrowed = chain.stop_ids, chain.bias_slots, chain.biases is not None
        hidden = streams[index]
        tokens = _held_back(_biased(logits, chain.biases, slots), stop_ids, chain.holds[0], narrowed).argmax(dim=-1)
        drafts = [tokens]
        for s, batch in chain.passes.items():
            source = chain.sources[s - 1]
            batch = replace(batch, input_ids=tokens[source], dp_token_counts=counts[s])
            logits, streams = self.model.draft(batch, self.kv, hidden[source], batch.logits_token_index)
            stop_ids, slots = stop_ids[source], None if slots is None else slots[source]
            hidden = streams[batch.logits_token_index]
            tokens = _held_back(_biased(logits, chain.biases, slots), stop_ids, chain.holds[s], narrowed).argmax(dim=-1)
            drafts.append(tokens)
        return torch.stack(drafts)


def _biased(logits: torch.Tensor, biases: torch.Tensor | None, slots: torch.Tensor | None) -> torch.Tensor:
    """The draft pass's logits with each row's bias added, in place, as the eager chain's `Drafter._bias` adds it
    (static shapes: every row, a row without one adding row 0's zeros). Its rule for a row the bias leaves no finite
    logit never applies here: such a row has a grammar, and a row with a grammar drafts eagerly."""
    return logits if biases is None else logits.add_(biases[slots])


def _held_back(logits: torch.Tensor, stop_ids: torch.Tensor, holds: torch.Tensor,
               narrowed: bool = False) -> torch.Tensor:
    """The draft pass's logits (its own: nothing else reads them) with -inf, in place, at each holding row's stop
    tokens (every row, every slot: static shapes, no host sync; a row that holds nothing writes its own values
    back). In place: a copy would move the whole [rows, vocab] block once more a pass. `narrowed` (the chain adds
    biases: allowed_token_ids may leave a row its stop tokens only): a row left nothing gets them back, as the eager
    chain's `hold_stops` guards a narrowed row."""
    values = logits.gather(1, stop_ids)
    logits.scatter_(1, stop_ids, values.masked_fill(holds[:, None], float("-inf")))
    if narrowed:
        nothing_left = torch.isinf(logits).all(dim=-1, keepdim=True)
        logits.scatter_(1, stop_ids, torch.where(nothing_left, values, logits.gather(1, stop_ids)))
    return logits


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> "torch.cuda.Stream":
    """The stream the current device's graphs are captured on (torch's own choice made explicit, so that what keys
    on a stream, the split kernels' counters, can be made for it before a capture)."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class CapturedGraph:
    """The CUDA graph of `run` and its output buffers. Capturing runs nothing: it is recorded after an eager run of
    the same step on the same buffers, which compiled every Triton kernel for these shapes (a kernel compiled during a
    capture would load a module mid-capture)."""

    def __init__(self, run: Callable[[], object], pool):
        self.graph = torch.cuda.CUDAGraph()
        stream = capture_stream()
        with torch.cuda.stream(stream):  # (the split kernels' counters of the stream it is captured on, zeroed now:
            split_counters(torch.device("cuda", torch.cuda.current_device()))  # made in a capture, never zeroed)
        # thread_local: graphs are recorded while serving, on the executor's thread, while the engine's thread may
        # stage the next step or read the last one's tokens; under the default (global) mode such a call from any
        # thread during the capture fails the capture
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.output = run()

    def replay(self):
        """The output buffers, after the graph ran again on what its input buffers hold now."""
        self.graph.replay()
        return self.output


class ReplayedClosure:
    """What stands for a CUDA graph off CUDA: recording keeps `run` and runs nothing, as a capture; a replay runs it
    on what the static buffers hold now. It binds what the closure bound when recorded (a draft chain's agreed
    counts), as a graph does."""

    def __init__(self, run: Callable[[], object], pool=None):
        self.run = run

    def replay(self):
        return self.run()
