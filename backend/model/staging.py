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

import numpy as np
import torch

ALIGN = 64  # bytes: every view starts aligned for any dtype (and for vectorised kernels)


class _Buffers:
    """`depth` growable byte buffers on `device`, handed out in turn (pinned on the host for a CUDA device)."""

    def __init__(self, device, depth: int, pin: bool = False):
        self.device, self.pin = torch.device(device), pin
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(depth)]
        self._arrays: dict[int, np.ndarray] = {}  # host buffers' numpy views (`host_array`)
        self._next = 0

    def next(self, num_bytes: int) -> torch.Tensor:
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._buffers[i].numel() < num_bytes:
            self._buffers[i] = torch.empty(max(num_bytes, 2 * self._buffers[i].numel()), dtype=torch.uint8,
                                           device=self.device, pin_memory=self.pin)
            self._arrays.pop(i, None)
        return self._buffers[i]

    def host_array(self, buffer: torch.Tensor) -> np.ndarray:
        """A host buffer handed out by `next` as a numpy array over the same memory (kept: made once per buffer)."""
        i = next(j for j, b in enumerate(self._buffers) if b is buffer)
        if i not in self._arrays:
            self._arrays[i] = buffer.numpy()
        return self._arrays[i]


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
    index: int  # its place among the batch's tensors (its segment of the packed buffer)
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class StagedBatch:
    """A batch packed into `host[:num_bytes]`: its i-th tensor's bytes are segment 2i (`sizes`), then padding to the
    next aligned offset; `skeleton` is the batch with a _Leaf where each tensor was."""

    host: torch.Tensor
    num_bytes: int
    skeleton: object
    sizes: list[int]
    layout: tuple  # (dtype, shape) of every leaf: equal layouts can share a device buffer's views

    def to_device(self, device_buffer: torch.Tensor):
        """Copy into `device_buffer` (at least num_bytes long) and return the batch as views into it."""
        self.copy_into(device_buffer)
        segments = device_buffer[:self.num_bytes].split(self.sizes)  # one op for every view
        return map_leaves(self.skeleton, lambda node: segments[2 * node.index].view(node.dtype).view(node.shape),
                          _Leaf)

    def copy_into(self, device_buffer: torch.Tensor) -> None:
        device_buffer[:self.num_bytes].copy_(self.host[:self.num_bytes], non_blocking=True)


def stage(batch, buffers: _Buffers) -> StagedBatch:
    """Pack every tensor of `batch` into the next host buffer: each one's bytes at the next aligned offset (the bytes
    between them left as they are), written through numpy (a step packs a few dozen small tensors: torch's per-call
    cost, not the bytes, is what this costs)."""
    arrays: list[np.ndarray] = []
    layout = []

    def leaf(t: torch.Tensor) -> _Leaf:
        node = _Leaf(len(layout), t.dtype, tuple(t.shape))
        layout.append((t.dtype, node.shape))
        arrays.append(_bytes_of(t))
        return node

    skeleton = map_leaves(batch, leaf)
    sizes = []
    for a in arrays:
        sizes += [a.size, -a.size % ALIGN]  # each segment's padding (possibly empty): aligned views
    num_bytes = sum(sizes)
    host = buffers.next(max(num_bytes, ALIGN))
    packed, offset = buffers.host_array(host), 0
    for a, size, padding in zip(arrays, sizes[::2], sizes[1::2]):
        packed[offset:offset + size] = a
        offset += size + padding
    return StagedBatch(host, num_bytes, skeleton, sizes, tuple(layout))


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a flat uint8 array (a view where it is contiguous)."""
    if t.dtype in _NUMPY_DTYPES and t.device.type == "cpu":
        return t.numpy().reshape(-1).view(np.uint8)
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()  # (bfloat16 and the like)


_NUMPY_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32,
                 torch.float64, torch.float16}


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
