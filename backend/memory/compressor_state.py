"""Per-request compressor state: ring buffers of the last few tokens' projections.

A compressed entry w is a gated sum over the projections of the tokens of window w (HCA) or of
windows w-1 and w (CSA and its indexer, "overlapping windows"). Tokens of a window that has not
closed yet, and the previous window's tokens that CSA still needs, are kept here in a ring of
`ring` positions (m for HCA, 2m for CSA): position p lives at ring slot p % ring. One slot per
running request; each ring is `[layer, slot, ring, width]` for the projected kv and gate.

Slots [0, num_slots) are handed to requests; slot num_slots is the scratch slot of padding rows; the
spare slots after it are never allocated either: the prefix cache keeps its ring snapshots there
(backend/memory/prefix_cache.py), so a step's compression plan can write a snapshot like any ring
update, and saving or restoring one is a copy between slots of the same tensors. The first `num_spare`
spare slots exist in every stream (full snapshots: a request's end, anywhere); the `num_light_spare`
after them only in the `light_streams` (a block boundary's snapshot: at a multiple of 128 positions the
HCA window is closed, so a continuation reads nothing of the HCA ring, and V4-Flash's HCA ring is 85 % of
a slot).
"""

from __future__ import annotations

import torch

from backend.memory.page_allocator import PageAllocator


class CompressorStatePool:
    name = "compressor_state"

    def __init__(self, num_slots: int, rings: dict[str, tuple[int, int, int]], dtype: torch.dtype,
                 device: str | torch.device, num_spare: int = 0, num_light_spare: int = 0,
                 light_streams: frozenset[str] = frozenset()):
        """rings: stream name -> (num_layers, ring length, width)."""
        self.allocator = PageAllocator(self.name, num_slots)
        self.scratch_slot = num_slots  # never allocated: the padding rows of static-shape steps use it
        self.num_spare, self.num_light_spare, self.dtype, self.device = num_spare, num_light_spare, dtype, device
        self.light_streams = light_streams
        full = num_slots + 1 + num_spare

        def slots(name: str) -> int:
            return full + (num_light_spare if name in light_streams else 0)

        self.kv = {name: torch.zeros(n, slots(name), ring, w, dtype=dtype, device=device)
                   for name, (n, ring, w) in rings.items() if n}
        self.gate = {name: torch.zeros(n, slots(name), ring, w, dtype=dtype, device=device)
                     for name, (n, ring, w) in rings.items() if n}

    def spare_slot(self, index: int) -> int:
        """The slot of spare `index`: full in [0, num_spare), light in [num_spare, num_spare + num_light_spare)."""
        assert 0 <= index < self.num_spare + self.num_light_spare, \
            f"spare slot {index} of {self.num_spare} + {self.num_light_spare}"
        return self.scratch_slot + 1 + index

    def is_light(self, index: int) -> bool:
        return index >= self.num_spare

    def copy_slot(self, src: int, dst: int) -> None:
        """Every stream's rings of slot `src` into slot `dst`; a light spare's only (it has no others: restoring
        it leaves the request's other rings as they were, which a continuation from a block boundary never reads)."""
        for rings in (*self.kv.values(), *self.gate.values()):
            if max(src, dst) < rings.shape[1]:
                rings[:, dst].copy_(rings[:, src])

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def bytes_per_slot(self, streams: frozenset[str] | None = None) -> int:
        """A slot's bytes in `streams` (None: all, a request's or a full snapshot's)."""
        return sum(t[:, 0].numel() * t.element_size() for d in (self.kv, self.gate) for name, t in d.items()
                   if streams is None or name in streams)

    def spare_bytes(self) -> int:
        """What the prefix cache's snapshot slots take."""
        return self.num_spare * self.bytes_per_slot() + self.num_light_spare * self.bytes_per_slot(self.light_streams)

    def acquire(self) -> int:
        return self.allocator.allocate(1)[0]

    def release(self, slot: int) -> None:
        self.allocator.free([slot])

    def check(self, num_held: int) -> None:
        self.allocator.check()
        assert num_held == self.allocator.num_used, f"{num_held} requests hold a compressor-state slot, " \
                                                    f"allocator says {self.allocator.num_used}"
