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
their own keys; the draft layer's passes after them run eagerly.

With capture=False (any device; the engine's `cuda_graphs` parameter on CPU) the same padded,
static-shape step runs eagerly: this is how the logic of the graph path is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        self._pool = torch.cuda.graph_pool_handle() if capture else None
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

    def _capture(self, step: _StaticStep, key: StaticKey, prepare: Callable[[ForwardBatch], None]) -> None:
        """Record the graph of `key` on a batch of padding rows only (every write goes to the scratch page and slot),
        after one warm-up forward (it compiles every Triton kernel for these shapes)."""
        padding = self._warm_up.stage(build_forward_batch([], self.kv, pad_to=key))
        assert padding.layout == step.layout
        padding.copy_into(step.buffer)
        prepare(step.batch)  # (what only the step knows: a data-parallel step's token counts)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(step.batch)
        torch.cuda.current_stream().wait_stream(side)
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, pool=self._pool):
            step.output = self._forward(step.batch)
