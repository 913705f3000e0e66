"""A step's host metadata in one buffer, so that it reaches the device in one non-blocking copy.

    stager = BatchStager(device)
    staged = stager.stage(batch)                # pack every tensor of the host batch into one buffer
    device_batch = stager.to_device(staged)     # one copy into a device buffer, the batch as views into it

`stage` walks a ForwardBatch (its tensors, dicts and plans; a plan shared by two streams once) and
writes every tensor into one byte buffer at aligned offsets; `to_device` copies the used bytes into a
device buffer with one `copy_(non_blocking=True)` and rebuilds the batch as views into it. On CUDA the
host buffers are pinned, so the copy is asynchronous. A static-shape (CUDA-graph) step copies into the
same device buffer every time, whose views its graph captured (`StagedBatch.copy_into`).

The buffers rotate (`depth` of each): the ones step N was packed and copied into are not written again
until step N + depth is built, and the engine takes step N's output in before it schedules step N + 2,
so depth 2 never overwrites what a step in flight reads. The host thread may issue the copy itself: on
one stream it is ordered after the steps launched before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 64  # bytes: every view starts aligned for any dtype (and for vectorised kernels)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Buffers:
    """`depth` growable byte buffers on `device`, handed out in turn (pinned on the host for a CUDA device)."""

    def __init__(self, device, depth: int, pin: bool = False):
        self.device, self.pin = torch.device(device), pin
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(depth)]
        self._next = 0

    def next(self, num_bytes: int) -> torch.Tensor:
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._buffers[i].numel() < num_bytes:
            self._buffers[i] = torch.empty(max(num_bytes, 2 * self._buffers[i].numel()), dtype=torch.uint8,
                                           device=self.device, pin_memory=self.pin)
        return self._buffers[i]


class BatchStager:
    """Packs host batches into rotating host buffers and copies them into rotating device buffers."""

    def __init__(self, device, depth: int = 2):
        cuda = torch.device(device).type == "cuda"
        self._host = _Buffers("cpu", depth, pin=cuda)
        self._device = _Buffers(device, depth)

    def stage(self, batch) -> "StagedBatch":
        return stage(batch, self._host)

    def to_device(self, staged: "StagedBatch"):
        return staged.to_device(self._device.next(staged.num_bytes))


@dataclass
class _Leaf:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class StagedBatch:
    """A batch packed into `host[:num_bytes]`; `skeleton` is the batch with a _Leaf where each tensor was."""

    host: torch.Tensor
    num_bytes: int
    skeleton: object
    layout: tuple  # (offset, dtype, shape) of every leaf: equal layouts can share a device buffer's views

    def to_device(self, device_buffer: torch.Tensor):
        """Copy into `device_buffer` (at least num_bytes long) and return the batch as views into it."""
        self.copy_into(device_buffer)
        return map_leaves(self.skeleton, lambda node: device_buffer[node.offset:node.offset + node.num_bytes]
                          .view(node.dtype).view(node.shape), _Leaf)

    def copy_into(self, device_buffer: torch.Tensor) -> None:
        device_buffer[:self.num_bytes].copy_(self.host[:self.num_bytes], non_blocking=True)


def stage(batch, buffers: _Buffers) -> StagedBatch:
    """Pack every tensor of `batch` into the next host buffer."""
    leaves: list[tuple[_Leaf, torch.Tensor]] = []
    cursor = [0]

    def leaf(t: torch.Tensor) -> _Leaf:
        node = _Leaf(cursor[0], t.dtype, tuple(t.shape))
        cursor[0] = _aligned(cursor[0] + node.num_bytes)
        leaves.append((node, t))
        return node

    skeleton = map_leaves(batch, leaf)
    host = buffers.next(max(cursor[0], ALIGN))
    for node, t in leaves:
        if node.num_bytes:
            host[node.offset:node.offset + node.num_bytes].view(t.dtype).view(t.shape).copy_(t)
    layout = tuple((node.offset, node.dtype, node.shape) for node, _ in leaves)
    return StagedBatch(host, cursor[0], skeleton, layout)


def map_leaves(value, fn, leaf_type=torch.Tensor, memo: dict | None = None):
    """`value` (a batch, a plan, a dict of them) with every `leaf_type` object replaced by fn(leaf); an object reached
    twice (the CSA plan is also the indexer's) is mapped once and stays shared. Dataclasses are copied field by field
    through their __dict__ (no __init__: this runs for every step)."""
    memo = {} if memo is None else memo
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, leaf_type):
        out = fn(value)
    elif isinstance(value, dict):
        out = {k: map_leaves(v, fn, leaf_type, memo) for k, v in value.items()}
    elif hasattr(value, "__dataclass_fields__"):
        out = object.__new__(type(value))
        out.__dict__.update({k: map_leaves(v, fn, leaf_type, memo) for k, v in value.__dict__.items()})
    else:
        out = value
    memo[key] = out
    return out
