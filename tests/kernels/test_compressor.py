"""compress_into_pool_triton against compress_into_pool_reference, step after step on the same rings and pools.

Requests of different lengths advance through chunked prefills (chunk boundaries off the window grid) and
then decode steps, so entries close from ring and batch tokens alike, rings wrap, and the one-launch (decode)
and two-launch (prefill) forms both run. Padding entries (entry_row -1, as static decode steps have) must
land on the scratch page only.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from backend.model.compressor import build_plan
from kernels.compressor import compress_into_pool_reference, compress_into_pool_triton, plan_compress_into_pool

PAGE_SIZE = 4
DEVICE = torch.get_default_device()  # cuda with DSV4_TEST_DEVICE=cuda: plans live beside the tensors


class _Memory:
    """Rings [slots + 1, ring, width] and a pool [pages + 1, PAGE_SIZE, head_dim] (last page: scratch)."""

    def __init__(self, rate, overlap, head_dim, num_requests, max_entries, dtype, gen):
        width = 2 * head_dim if overlap else head_dim
        ring = 2 * rate if overlap else rate
        self.kv = torch.randn(num_requests + 1, ring, width, generator=gen).to(dtype)
        self.gate = torch.randn(num_requests + 1, ring, width, generator=gen).to(dtype)
        pages_per_request = -(-max_entries // PAGE_SIZE)
        self.pool = torch.zeros(num_requests * pages_per_request + 1, PAGE_SIZE, head_dim, dtype=dtype)
        perm = torch.randperm(num_requests * pages_per_request, generator=gen)  # scattered pages
        self.table = perm.view(num_requests, pages_per_request).int()

    def clone(self):
        other = object.__new__(_Memory)
        other.kv, other.gate, other.pool, other.table = self.kv.clone(), self.gate.clone(), self.pool.clone(), self.table
        return other


def _run(rate, overlap, head_dim, rope_dim, schedule, lengths, dtype, *, pad_entries=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * head_dim if overlap else head_dim
    memory = _Memory(rate, overlap, head_dim, len(lengths), max(lengths) // rate + 1, dtype, gen)
    expected, actual = memory, memory.clone()
    bias = torch.randn(rate, width, generator=gen).float()
    norm_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype)
    done = [0] * len(lengths)
    launches_seen = set()
    for step in schedule:  # step: [(request, tokens)]
        rows = [r for r, _ in step]
        lens = [n for _, n in step]
        starts = [done[r] for r in rows]
        offsets = [sum(lens[:i]) for i in range(len(lens))]
        plan = build_plan(rate, overlap, starts, lens, offsets, rows, DEVICE)
        if pad_entries:
            pad = lambda t, v: torch.cat([t, torch.full((pad_entries, *t.shape[1:]), v, dtype=t.dtype)])  # noqa
            plan = replace(plan, entry_src=pad(plan.entry_src, 0), entry_valid=pad(plan.entry_valid, True),
                           entry_pos=pad(plan.entry_pos, 0), entry_row=pad(plan.entry_row, -1),
                           entry_index=pad(plan.entry_index, 0))
        num_tokens = sum(lens)
        wide = torch.randn(num_tokens, 2 * width + 3, generator=gen).to(dtype)
        kv, gate = wide[:, :width], wide[:, width:2 * width]  # column views of one projection, as the model has
        angles = plan.entry_pos[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        table = expected.table[rows]
        for memory, fn in ((expected, compress_into_pool_reference), (actual, compress_into_pool_triton)):
            fn(kv, gate, memory.kv, memory.gate, plan, bias, norm_weight, 1e-6, cos, sin, memory.pool, table)
        launches_seen.add(len(plan_compress_into_pool(kv, gate, actual.kv, actual.gate, plan, bias, norm_weight,
                                                      1e-6, cos, sin, actual.pool, table)))
        for r, n in step:
            done[r] += n
    return expected, actual, launches_seen


def _schedule(lengths, chunk):
    """Prefill every request in chunks of `chunk` (two requests per step), then decode all together 6 times."""
    steps, done = [], [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        step = []
        for r, n in enumerate(lengths):
            if done[r] < n and len(step) < 2:
                take = min(chunk, n - done[r])
                step.append((r, take))
                done[r] += take
        steps.append(step)
    steps += [[(r, 1) for r in range(len(lengths))] for _ in range(6)]
    return steps, [n + 6 for n in lengths]


# bf16: the interpreter truncates fp32 -> bf16 where the GPU rounds, and each of the reference's roundings (gate +
# bias, weights, products, sum, norm, rope) may then differ by an ulp of values of size ~1 (2^-8).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=4e-2)}


@pytest.mark.parametrize("rate,overlap,head_dim,rope_dim", [(4, True, 24, 8), (16, False, 20, 8), (4, True, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_through_prefill_and_decode(rate, overlap, head_dim, rope_dim, dtype):
    prompt_lengths = [3, 37, 50, 9]
    schedule, lengths = _schedule(prompt_lengths, chunk=7 if overlap else 13)
    expected, actual, launches = _run(rate, overlap, head_dim, rope_dim, schedule, lengths, dtype)
    assert launches == {1, 2}  # decode steps in one launch, prefill chunks in two
    torch.testing.assert_close(actual.pool.float(), expected.pool.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(actual.kv, expected.kv, rtol=0, atol=0)  # rings are copies: exact
    torch.testing.assert_close(actual.gate, expected.gate, rtol=0, atol=0)
    assert expected.pool[:-1].abs().sum() > 0  # entries were written


def test_hca_rate_128_spans_several_chunks():
    """A real HCA window (128 positions, chunked by BLOCK_S inside the program) with a wide head."""
    schedule = [[(0, 100)], [(0, 60)], [(0, 1)]]
    expected, actual, _ = _run(128, False, 96, 64, schedule, [161], torch.float32, seed=3)
    torch.testing.assert_close(actual.pool, expected.pool, rtol=1e-5, atol=1e-5)
    assert expected.pool[:-1].abs().sum() > 0


def test_padding_entries_write_only_the_scratch_page():
    schedule = [[(0, 5), (1, 2)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]
    expected, actual, _ = _run(4, True, 16, 8, schedule, [7, 4], torch.float32, pad_entries=2)
    torch.testing.assert_close(actual.pool[:-1], expected.pool[:-1], rtol=1e-5, atol=1e-5)
    assert actual.pool[-1].abs().sum() > 0  # the padding went somewhere: the scratch page


def test_nothing_to_do_launches_nothing():
    plan = build_plan(4, True, [0], [1], [0], [0], DEVICE)  # one token: nothing closes
    assert plan.num_entries == 0
    plan = replace(plan, keep_src=plan.keep_src[:0], keep_slot=plan.keep_slot[:0], keep_pos=plan.keep_pos[:0])
    z = torch.zeros(1, 32)
    state = torch.zeros(1, 8, 32)
    assert plan_compress_into_pool(z, z, state, state.clone(), plan, torch.zeros(4, 32), torch.ones(16), 1e-6,
                                   torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(2, 4, 16),
                                   torch.zeros(1, 1, dtype=torch.int32)) == []


@pytest.mark.parametrize("rate,overlap,split,snapshots", [
    (4, True, 3, (16, 22)), (16, False, 3, (20, 40)),
    (4, True, 14, (16, 22)), (16, False, 18, (20, 40)),  # the first snapshot reads ring positions before the chunk
])
@pytest.mark.parametrize("fn", [compress_into_pool_reference, compress_into_pool_triton])
def test_a_snapshot_inside_a_chunk_keeps_the_ring_as_it_stands_there(rate, overlap, split, snapshots, fn):
    """Chunk [split, 45) of slot 0 snapshots its ring at two positions into slots 1 and 2: they hold, of the ring,
    exactly what a continuation from there reads, as slot 0 holds them after chunks that end there (also when
    some of them are ring positions before the chunk, which the chunk's own ring updates overwrite)."""
    head_dim = 8
    width, ring = (2 * head_dim if overlap else head_dim), (2 * rate if overlap else rate)
    gen = torch.Generator().manual_seed(5)
    kv_all, gate_all = torch.randn(45, width, generator=gen), torch.randn(45, width, generator=gen)
    bias, norm_weight = torch.randn(rate, width, generator=gen), torch.ones(head_dim)
    table = torch.zeros(1, 8, dtype=torch.int32)

    def run(rings, start, end, snaps=()):
        plan = build_plan(rate, overlap, [start], [end - start], [0], [0], DEVICE,
                          [(0, p, slot) for slot, p in enumerate(snaps, 1)])
        trig = torch.zeros(plan.num_entries, 2)
        fn(kv_all[start:end], gate_all[start:end], *rings, plan, bias, norm_weight, 1e-6, trig.cos(), trig.sin(),
           torch.zeros(9, 4, head_dim), table)

    first_read = snapshots[0] - (snapshots[0] % rate + (rate if overlap else 0))
    assert (first_read < split) == (split > 3)  # the cases that read the ring are the ones meant to
    one_chunk = (torch.randn(3, ring, width, generator=gen), torch.randn(3, ring, width, generator=gen))
    stepped = tuple(t.clone() for t in one_chunk)
    run(one_chunk, 0, split)
    run(one_chunk, split, 45, snapshots)
    run(stepped, 0, split)
    for slot, (previous, position) in enumerate(zip((split, *snapshots), snapshots), 1):
        run(stepped, previous, position)
        lookback = position % rate + (rate if overlap else 0)
        kept = [p % ring for p in range(position - lookback, position)]
        for snapshot, reference in zip(one_chunk, stepped):
            torch.testing.assert_close(snapshot[slot, kept], reference[0, kept], rtol=0, atol=0)


def test_snapshot_rows_run_with_the_entries_before_the_ring_updates():
    """On a GPU the programs of a launch run at once: a snapshot reading ring positions that the chunk's ring
    updates overwrite must be written in the first launch (the interpreter runs programs in order and cannot
    show the race, so the launch split itself is checked)."""
    plan = build_plan(4, True, [14], [31], [0], [0], DEVICE, [(0, 16, 1), (0, 32, 2)])
    assert plan.num_snapshot_keep == 8 and plan.keep_src.shape[0] == 8 + 8
    z = torch.zeros(31, 32)
    launches = plan_compress_into_pool(z, z, torch.zeros(3, 8, 32), torch.zeros(3, 8, 32), plan, torch.zeros(4, 32),
                                       torch.ones(16), 1e-6, torch.zeros(plan.num_entries, 4),
                                       torch.zeros(plan.num_entries, 4), torch.zeros(9, 4, 16),
                                       torch.zeros(1, 16, dtype=torch.int32))
    counts = [args[20:23] for _, _, args, _ in launches]  # (entry programs, keep_begin, keep_end)
    assert counts == [(plan.num_entries, 0, 8), (0, 8, 16)]


@pytest.mark.parametrize("rate,overlap", [(4, True), (128, False), (2, True), (8, False)])
def test_the_uniform_plan_is_the_general_plan_of_rows_of_one_length(rate, overlap):
    """build_uniform_plan (the fast path of decode and verify steps) gives exactly build_plan's tensors for rows of
    one to `rate` tokens each at any positions: windows closing or not (at a row's first, middle or last token),
    before the first window is whole, rings wrapping, with a prefix-cache snapshot inside a row; padded like a
    static step's, or not."""
    from dataclasses import fields

    from backend.model.compressor import build_uniform_plan

    gen = torch.Generator().manual_seed(rate)
    snapshot_rows_seen = False
    for num_rows in (1, 3, 17, 40):
        for length in sorted({1, 2, rate}):
            starts = torch.randint(0, 700, (num_rows,), generator=gen)
            starts[0] = rate - 1  # the first window closes at the row's first possible position
            slots = torch.randperm(64, generator=gen)[:num_rows]
            ring = 2 * rate + 2 * length + (0 if overlap else rate)
            snapshots = [(num_rows - 1, int(starts[-1]) + length - 1, 62)] if length > 1 else []
            for padding in ({}, dict(num_entries=num_rows + 3, num_snapshot_keep=3 * rate, scratch_slot=63)):
                lens, offsets = torch.full((num_rows,), length), torch.arange(num_rows) * length
                general = build_plan(rate, overlap, starts, lens, offsets, slots, DEVICE, snapshots, ring,
                                     padding.get("num_entries"), padding.get("num_snapshot_keep"),
                                     padding.get("scratch_slot", 0))
                fast = build_uniform_plan(rate, overlap, starts, length, slots, DEVICE, snapshots, ring, **padding)
                assert general.num_entries >= 1
                snapshot_rows_seen |= bool(snapshots) and not padding and general.num_snapshot_keep > 0
                for f in fields(general):
                    a, b = getattr(general, f.name), getattr(fast, f.name)
                    assert (a.dtype == b.dtype and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b, \
                        (f.name, length, padding)
    assert snapshot_rows_seen


def test_closed_entries_returned_for_the_caller_to_store():
    """compress_entries_reference (the values the encoded-store tests below compare bytes of) computes exactly the
    entries compress_into_pool_reference stores, and updates the rings the same way."""
    import kernels.compressor as compressor

    gen = torch.Generator().manual_seed(3)
    rate, head_dim, rope_dim = 4, 24, 8
    stored, returned = _Memory(rate, True, head_dim, 2, 12, torch.float32, gen), None
    returned = stored.clone()
    bias = torch.randn(rate, 2 * head_dim, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    for starts, lens in (([0, 0], [15, 7]), ([15, 7], [1, 1])):  # a prefill step, then a decode step closing both
        plan = build_plan(rate, True, starts, lens, [0, lens[0]], [0, 1], DEVICE)
        wide = torch.randn(sum(lens), 4 * head_dim, generator=gen)
        kv, gate = wide[:, :2 * head_dim], wide[:, 2 * head_dim:]
        angles = plan.entry_pos[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
        inputs = (kv, gate, None, None, plan, bias, norm_weight, 1e-6, angles.cos(), angles.sin())
        compressor.compress_into_pool_reference(*inputs[:2], stored.kv, stored.gate, *inputs[4:], stored.pool,
                                                stored.table)
        entries = compressor.compress_entries_reference(*inputs[:2], returned.kv, returned.gate, *inputs[4:])
        assert entries.shape == (plan.num_entries, head_dim) and plan.num_entries > 0
        rows = stored.pool.view(-1, head_dim)[compressor.entry_destinations(plan, stored.pool, stored.table)]
        assert torch.equal(entries, rows)
        assert torch.equal(returned.kv, stored.kv) and torch.equal(returned.gate, stored.gate)


@pytest.mark.parametrize("overlap,rate", [(True, 4), (False, 16)])
def test_fp32_pooling_with_entries_in_the_model_dtype(overlap, rate):
    """DeepSeek's compressor on a bf16 deployment: fp32 projections, rings and pooling, the pooled entry rounded to
    bf16 before its norm and rope (entry_dtype). The kernel and the reference agree as in bf16 above."""
    import kernels.compressor as compressor

    gen = torch.Generator().manual_seed(rate)
    head_dim, rope_dim = 32, 8
    width = 2 * head_dim if overlap else head_dim
    rings = {name: _Memory(rate, overlap, head_dim, 2, 12, torch.float32, gen) for name in ("reference", "triton")}
    rings["reference"].pool = rings["reference"].pool.to(torch.bfloat16)  # the pools of a bf16 deployment
    rings["triton"] = rings["reference"].clone()
    bias = torch.randn(rate, width, generator=gen)
    norm_weight = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    for starts, lens in (([0, 0], [2 * rate + 3, rate - 1]), ([2 * rate + 3, rate - 1], [rate - 3, 1])):
        plan = build_plan(rate, overlap, starts, lens, [0, lens[0]], [0, 1], DEVICE)
        wide = torch.randn(sum(lens), 2 * width, generator=gen)  # the fp32 projection
        angles = plan.entry_pos[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        entries = {}
        for name, memory in rings.items():
            getattr(compressor, f"compress_into_pool_{name}")(
                wide[:, :width], wide[:, width:], memory.kv, memory.gate, plan, bias, norm_weight, 1e-6, cos, sin,
                memory.pool, memory.table, entry_dtype=torch.bfloat16)
            entries[name] = memory.pool.view(-1, head_dim)[compressor.entry_destinations(plan, memory.pool,
                                                                                         memory.table)]
        assert plan.num_entries > 0 and entries["triton"].dtype == entries["reference"].dtype == torch.bfloat16
        torch.testing.assert_close(entries["triton"].float(), entries["reference"].float(),
                                   **TOLERANCE[torch.bfloat16])  # (the interpreter truncates to bf16)
        assert torch.equal(rings["triton"].kv, rings["reference"].kv)  # fp32 rings, copies


def _encoded_as_stored(implementation, seed, head_dim, rope_dim, width, keys, store_reference):
    """A prefill step, then a decode step closing entries, of a CSA compressor into a uint8 pool of `width` bytes an
    entry: (the pool the implementation wrote, the pool `store_reference(entries, pool, rows)` writes from the
    reference's entries)."""
    import kernels.compressor as compressor

    gen = torch.Generator().manual_seed(seed)
    rate = 4
    rings = _Memory(rate, True, head_dim, 2, 12, torch.float32, gen)
    staged = rings.clone()
    pools = [torch.zeros(rings.pool.shape[0], PAGE_SIZE, width, dtype=torch.uint8) for _ in range(2)]
    bias = torch.randn(rate, 2 * head_dim, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(head_dim, generator=gen)
    for starts, lens in (([0, 0], [15, 7]), ([15, 7], [1, 1])):
        plan = build_plan(rate, True, starts, lens, [0, lens[0]], [0, 1], DEVICE)
        wide = torch.randn(sum(lens), 4 * head_dim, generator=gen)
        angles = plan.entry_pos[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
        inputs = (wide[:, :2 * head_dim], wide[:, 2 * head_dim:])
        rest = (plan, bias, norm_weight, 1e-6, angles.cos(), angles.sin())
        getattr(compressor, f"compress_into_pool_{implementation}")(*inputs, rings.kv, rings.gate, *rest, pools[0],
                                                                     rings.table, keys=keys)
        entries = compressor.compress_entries_reference(*inputs, staged.kv, staged.gate, *rest)
        store_reference(entries, pools[1], compressor.entry_destinations(plan, pools[1], staged.table))
    assert torch.equal(rings.kv, staged.kv)
    return pools


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_entries_quantized_as_they_are_stored_in_the_fp8_layout(implementation):
    """A uint8 pool (kv_cache_dtype fp8): the kernel encodes each closed entry where it stores it, the bytes
    store_kv_fp8 writes for the same entries (the scratch page aside, where padding entries go)."""
    from kernels.kv_store import store_kv_fp8_reference
    from kernels.quant_formats import kv_fp8_entry_bytes

    head_dim, rope_dim = 128, 64
    stored, expected = _encoded_as_stored(implementation, 9, head_dim, rope_dim, kv_fp8_entry_bytes(head_dim, rope_dim),
                                          False, lambda e, pool, rows: store_kv_fp8_reference(e, pool, rows, rope_dim))
    assert torch.equal(stored[:-1], expected[:-1]) and stored[:-1].any()


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_indexer_keys_rotated_and_quantized_as_they_are_stored(implementation):
    """The indexer's compressor over a uint8 pool (kv_cache_dtype fp8): each closed key rotated and encoded as FP4
    where it is stored, the bytes store_indexer_fp4 writes for the same keys after hadamard_rotate (the scratch page
    aside, where padding entries go)."""
    from kernels.kv_store import store_indexer_fp4_reference
    from kernels.quant_formats import hadamard_rotate, indexer_fp4_entry_bytes

    stored, expected = _encoded_as_stored(
        implementation, 11, 64, 16, indexer_fp4_entry_bytes(64), True,
        lambda e, pool, rows: store_indexer_fp4_reference(hadamard_rotate(e), pool, rows))
    assert torch.equal(stored[:-1], expected[:-1]) and stored[:-1].any()


def test_a_csa_layer_and_its_indexer_compress_in_one_launch():
    """A CSA layer's compressor (the fp8 layout's pool) and its indexer's (FP4 keys), over one plan: through a prefill
    step (entries and snapshots, then the rings: two launches) and decode steps (one), the paired launches write the
    same pools and rings, bit for bit, as each compressor's own launches."""
    from kernels.compressor import CompressorRun, pair_compress_launches
    from kernels.quant_formats import indexer_fp4_entry_bytes, kv_fp8_entry_bytes

    gen = torch.Generator().manual_seed(21)
    rate, rope_dim = 4, 64
    shapes = {"csa": (128, kv_fp8_entry_bytes(128, rope_dim), False), "indexer": (64, indexer_fp4_entry_bytes(64), True)}
    memories, bias, norm = {}, {}, {}
    for name, (head_dim, entry_bytes, _) in shapes.items():
        memory = _Memory(rate, True, head_dim, 2, 12, torch.bfloat16, gen)
        memory.pool = torch.zeros(memory.pool.shape[0], PAGE_SIZE, entry_bytes, dtype=torch.uint8)
        memories[name] = {"own": memory, "paired": memory.clone()}
        memories[name]["paired"].table = memory.table
        bias[name] = torch.randn(rate, 2 * head_dim, generator=gen)
        norm[name] = (1 + 0.1 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    counts = []
    for starts, lens in (([0, 0], [15, 7]), ([15, 7], [1, 1]), ([16, 8], [1, 1])):
        plan = build_plan(rate, True, starts, lens, [0, lens[0]], [0, 1], DEVICE)
        angles = plan.entry_pos[:, None].float() * torch.linspace(0.1, 1.0, rope_dim // 2)[None, :]
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        wide = (torch.randn(sum(lens), 4 * (128 + 64), generator=gen) * 2).to(torch.bfloat16)
        runs = {"own": [], "paired": []}
        offset = 0
        for name, (head_dim, _, keys) in shapes.items():
            kv, gate = wide[:, offset:offset + 2 * head_dim], wide[:, offset + 2 * head_dim:offset + 4 * head_dim]
            offset += 4 * head_dim
            for way in runs:
                memory = memories[name][way]
                runs[way].append(CompressorRun(kv, gate, memory.kv, memory.gate, plan, bias[name], norm[name], 1e-6,
                                               cos, sin, memory.pool, memory.table, keys=keys))
        for run in runs["own"]:
            run.run(compress_into_pool_triton)
        paired = pair_compress_launches(*(run.run(plan_compress_into_pool) for run in runs["paired"]))
        counts.append(len(paired))
        for kernel, grid, args, kwargs in paired:
            kernel[grid](*args, **kwargs)
    assert counts == [2, 1, 1]
    for name in shapes:
        own, paired = memories[name]["own"], memories[name]["paired"]
        assert own.pool[:-1].any()  # entries were stored
        assert torch.equal(paired.pool, own.pool) and torch.equal(paired.kv, own.kv)
        assert torch.equal(paired.gate, own.gate)
