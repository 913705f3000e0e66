"""Per-request compressor state: ring buffers of the last few tokens' projections.

A compressed entry w is a gated sum over the projections of the tokens of window w (HCA) or of
windows w-1 and w (CSA and its indexer, "overlapping windows"). Tokens of a window that has not
closed yet, and the previous window's tokens that CSA still needs, are kept here in a ring of
`ring` positions (m for HCA, 2m for CSA): position p lives at ring slot p % ring. One slot per
running request; each ring is `[layer, slot, ring, width]` for the projected kv and gate.

Slots [0, num_slots) are handed to requests; slot num_slots is the scratch slot of padding rows; the
`num_spare` slots after it are never allocated either: the prefix cache keeps its ring snapshots there
(backend/memory/prefix_cache.py), so a step's compression plan can write a snapshot like any ring
update, and saving or restoring one is a copy between slots of the same tensors.
"""

from __future__ import annotations

import torch

from backend.memory.page_allocator import PageAllocator


class CompressorStatePool:
    name = "compressor_state"

    def __init__(self, num_slots: int, rings: dict[str, tuple[int, int, int]], dtype: torch.dtype,
                 device: str | torch.device, num_spare: int = 0):
        """rings: stream name -> (num_layers, ring length, width)."""
        self.allocator = PageAllocator(self.name, num_slots)
        self.scratch_slot = num_slots  # never allocated: the padding rows of static-shape steps use it
        self.num_spare, self.dtype, self.device = num_spare, dtype, device
        total = num_slots + 1 + num_spare
        self.kv = {name: torch.zeros(n, total, ring, w, dtype=dtype, device=device)
                   for name, (n, ring, w) in rings.items() if n}
        self.gate = {name: torch.zeros(n, total, ring, w, dtype=dtype, device=device)
                     for name, (n, ring, w) in rings.items() if n}

    def spare_slot(self, index: int) -> int:
        """The slot of spare `index` in [0, num_spare)."""
        assert 0 <= index < self.num_spare, f"spare slot {index} of {self.num_spare}"
        return self.scratch_slot + 1 + index

    def copy_slot(self, src: int, dst: int) -> None:
        """Every stream's rings of slot `src` into slot `dst`."""
        for rings in (*self.kv.values(), *self.gate.values()):
            rings[:, dst].copy_(rings[:, src])

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def bytes_per_slot(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for d in (self.kv, self.gate) for t in d.values())

    def acquire(self) -> int:
        return self.allocator.allocate(1)[0]

    def release(self, slot: int) -> None:
        self.allocator.free([slot])

    def check(self, num_held: int) -> None:
        self.allocator.check()
        assert num_held == self.allocator.num_used, f"{num_held} requests hold a compressor-state slot, " \
                                                    f"allocator says {self.allocator.num_used}"
