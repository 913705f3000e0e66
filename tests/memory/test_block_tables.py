"""The block tables kept as pages are added (one row per state slot) gather exactly what rebuilding them from
the requests' page runs gives, through any sequence of extending, sliding, freeing and prefix restores; and a
step's batch reads only its rows (no per-row walk over a request's pages)."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.request import Sequence

from test_pools import _manager  # tests/memory is on sys.path


def _rebuilt(kv, pool: str, seqs, width: int) -> torch.Tensor:
    """The table as the old builder made it: each row's pages from its run, page 0 after them."""
    rows = []
    for seq in seqs:
        pages = list(seq.pages.runs[pool].pages)
        rows.append(pages + [0] * (width - len(pages)))
    return torch.tensor(rows, dtype=torch.int32)


def _gathered(kv, pool: str, seqs, width: int) -> torch.Tensor:
    runs = [seq.pages.runs[pool] for seq in seqs]
    return torch.from_numpy(kv.block_table(pool, np.array([s.pages.slot for s in seqs]),
                                           np.array([r.first for r in runs]), np.array([len(r.pages) for r in runs]),
                                           width, 0))


operations = st.lists(st.tuples(st.sampled_from(["arrive", "extend", "free", "evict"]), st.integers(0, 10 ** 6)),
                      min_size=1, max_size=50)


@settings(max_examples=60, deadline=None)
@given(operations=operations)
def test_kept_tables_equal_tables_rebuilt_from_the_runs(operations):
    kv = _manager(num_tokens=2048, ratio=0.5, page_size=16, max_running=4)
    kv.enable_prefix_caching(128, max_entries=6, max_end_entries=2)
    cache = kv.prefix_cache
    history = list(range(2, 900))
    live: list[Sequence] = []
    for step, (op, value) in enumerate(operations):
        if op == "arrive" and len(live) < 4 and kv.has_free_slot():
            seq = Sequence(f"r{step}", history[:1 + value % 700])
            seq.num_computed_tokens = cache.match(seq)  # a restore writes the whole rows (the scheduler counts)
            live.append(seq)
        elif op == "extend" and live:
            seq = live[value % len(live)]
            n = min(seq.num_tokens - seq.num_computed_tokens, 1 + value % 200)
            if n > 0 and kv.try_extend(seq, n):
                reserved = cache.reserve(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
                seq.num_computed_tokens += n
                cache.keep_reserved(seq, reserved)
                kv.release_slid_out(seq)  # the window slides: its row's start moves on
        elif op == "free" and live:
            seq = live.pop(value % len(live))
            if value % 2:
                cache.register_end(seq, seq.num_computed_tokens)
            kv.free(seq)
        elif op == "evict":
            cache.evict_one()
        holding = [s for s in live if s.pages is not None]
        for pool in ("window", "csa", "hca"):
            if holding:
                width = max(1, max(len(s.pages.runs[pool].pages) for s in holding))
                assert torch.equal(_gathered(kv, pool, holding, width), _rebuilt(kv, pool, holding, width)), pool
        kv.check()
    for seq in live:
        kv.free(seq)


def test_a_decode_step_writes_no_table_cell():
    """Tables are written where pages are added: a decode inside a page adds none."""
    kv = _manager(num_tokens=4096, ratio=0.5, page_size=16, max_running=2)
    seq = Sequence("a", list(range(2, 403)))
    kv.extend(seq, 401)
    seq.num_computed_tokens = 401
    kv.release_slid_out(seq)
    seq.append_output(7)
    before = {name: table.copy() for name, table in kv.tables.items()}
    assert kv.try_extend(seq, 1)  # position 401: inside the window's last page, no new CSA/HCA page
    assert all((before[name] == kv.tables[name]).all() for name in kv.tables)


def test_a_prompts_last_chunk_with_its_draft_chain_lookahead_fits_the_window_table():
    """k = 4: a prompt's last chunk holds max_num_batched_tokens positions and its draft chain's 3 more; a chat's next
    turn restored mid-page at its first turn's end spans one page more than a table sized by the chunk alone, whose
    newest page then overwrote the column of the oldest, which the same step reads."""
    from backend.config import EngineConfig
    from backend.memory.kv_manager import KVCacheManager
    from backend.model.forward_batch import BatchRow, build_forward_batch
    from backend.request import SamplingParams
    from backend.scheduler import Scheduler, StepOutput, StepTiming

    from test_pools import _model_config

    k, budget = 4, 256
    kv = KVCacheManager(_model_config(), num_tokens=8192, swa_full_tokens_ratio=1.0, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu", max_step_tokens=budget,
                        speculative_tokens=k, draft_layers=1)
    kv.enable_prefix_caching(128, 8, 4)
    scheduler = Scheduler(EngineConfig(policy="prefill_first", max_running_requests=4, max_num_batched_tokens=budget,
                                       num_speculative_tokens=k), kv, budget, prefix_cache=kv.prefix_cache)
    first = Sequence("turn 1", list(range(1, 143)), SamplingParams(max_tokens=1))  # its end kept at 142
    scheduler.add(first)
    while not first.is_finished:
        plan = scheduler.schedule(now=0.0)
        scheduler.update_from_output(plan, StepOutput([[7] for c in plan.chunks if c.samples], timing=StepTiming()))
    # (resending the first turn's answer, 7: the draft layer's entry at 141 read it)
    second = Sequence("turn 2", list(range(1, 143)) + [7] + [9] * (budget - 1), SamplingParams(max_tokens=4))
    scheduler.add(second)
    (chunk,) = scheduler.schedule(now=0.0).chunks
    assert chunk.start == 142 and chunk.allocated == budget + k - 1
    run = second.pages.runs["window"]
    batch = build_forward_batch([BatchRow(second.pages, second.token_ids[chunk.start:chunk.end], chunk.start, True)],
                                kv)
    row = batch.window_block_table[0].tolist()  # (the pages the step reads and writes: all but the chain's)
    assert len(row) >= len(run.pages) - 1 and row[:len(run.pages)] == list(run.pages)[:len(row)]
