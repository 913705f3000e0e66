"""Decode steps replayed from CUDA graphs: one launch of the whole step instead of one per kernel.

    graphs = DecodeGraphs(model, kv, max_rows=64, capture=True)   # capture=False: eager, same buffers
    if graphs.accepts(rows):
        logits = graphs.forward(rows)                               # [len(rows), vocab]

Per `StaticKey` (row bucket x context bucket, backend/model/static_batch.py) it keeps static device
buffers for the batch and, when capturing, a graph recorded on the first step of that key: the
forward runs once on a batch made only of padding rows (every write goes to the pools' scratch page
and slot, so no request's memory changes; it compiles every Triton kernel for these shapes), then
is captured on the same buffers. Every step copies its padded batch into the buffers and replays.
Graphs share one memory pool. Prefill and mixed steps run eagerly (their shapes are not bucketed).

With capture=False (any device; the engine's `cuda_graphs` parameter on CPU) the same padded,
static-shape step runs eagerly: this is how the logic of the graph path is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.memory.kv_manager import KVCacheManager
from backend.model.forward_batch import BatchRow, ForwardBatch
from backend.model.static_batch import StaticKey, copy_batch, is_decode_batch, row_bucket, static_decode_batch, \
    static_key


@dataclass
class _StaticStep:
    batch: ForwardBatch  # device buffers of this key's shapes
    graph: "torch.cuda.CUDAGraph | None" = None
    logits: torch.Tensor | None = None  # the graph's output buffer


class DecodeGraphs:
    def __init__(self, model, kv: KVCacheManager, max_rows: int, capture: bool):
        self.model, self.kv, self.capture = model, kv, capture
        self.max_rows = row_bucket(max_rows)
        self._steps: dict[StaticKey, _StaticStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def keys(self) -> list[StaticKey]:
        return list(self._steps)

    def accepts(self, rows: list[BatchRow]) -> bool:
        return is_decode_batch(rows) and len(rows) <= self.max_rows

    def forward(self, rows: list[BatchRow]) -> torch.Tensor:
        key = static_key(rows)
        host = static_decode_batch(rows, self.kv, key, "cpu")
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._new_step(key, host)
        copy_batch(step.batch, host)
        if step.graph is None:
            logits = self.model.forward(step.batch, self.kv)
        else:
            step.graph.replay()
            logits = step.logits
        return logits[: len(rows)]

    def _new_step(self, key: StaticKey, host: ForwardBatch) -> _StaticStep:
        step = _StaticStep(host.to(self.model.device))
        if self.capture:
            copy_batch(step.batch, static_decode_batch([], self.kv, key, "cpu"))  # padding only: writes scratch
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.model.forward(step.batch, self.kv)  # compiles the kernels, warms the allocator
            torch.cuda.current_stream().wait_stream(side)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self._pool):
                step.logits = self.model.forward(step.batch, self.kv)
        return step
