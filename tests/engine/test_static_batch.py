"""The static-shape decode step (what CUDA graphs replay) against the dynamic one, eagerly on CPU.

Two copies of the same memory: one decodes with batches built by `build_forward_batch`, the other
through `DecodeGraphs(capture=False)` with batches padded to their `StaticKey`. Prompts end just before
CSA and HCA boundaries, so the decode steps close compressor windows (real and padding entries in one
plan), and the batch sizes (3 and 5 rows: padded to 4 and 8) leave padding rows. Logits must match and
the padding must leave every request's memory alone (the greedy continuations agree step after step).
"""

from __future__ import annotations

import pytest
import torch

from backend.memory.kv_manager import KVCacheManager, model_kv_layout
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.model.graph_runner import DecodeGraphs
from backend.model.staging import BatchStager
from backend.model.static_batch import StaticKey, row_bucket, static_key
from backend.request import Sequence

from .harness import EngineHarness

PROMPT_LENGTHS = [3, 126, 127, 254, 60]  # next positions cross 4-, 128- and 256-boundaries while decoding


def _kv(harness: EngineHarness, kv_cache_dtype=None) -> KVCacheManager:
    return KVCacheManager(harness.config, num_tokens=16384, swa_full_tokens_ratio=0.5, page_size=16,
                          max_running_requests=8, dtype=torch.float32, device="cpu",
                          kv_layout=model_kv_layout(harness.config, torch.float32, fp8=kv_cache_dtype == "fp8"))


class _Decoder:
    """Requests on one memory, prefilled on the reference path, then decoded by `forward(rows)`."""

    def __init__(self, harness: EngineHarness, kv: KVCacheManager, prompts: list[list[int]]):
        self.model, self.kv = harness.model, kv
        self.stager = BatchStager("cpu")
        self.seqs = [Sequence(f"r{i}", p) for i, p in enumerate(prompts)]
        for seq in self.seqs:
            seq.append_output(int(self._run([(seq, len(seq.prompt_ids))], None)[0].argmax()))

    def _run(self, work, graphs, snapshots: dict | None = None):
        """`snapshots`: request index -> ((position, spare slot), ...) to keep inside its row."""
        rows = []
        for seq, n in work:
            self.kv.extend(seq, n)
            start = seq.num_computed_tokens
            kept = (snapshots or {}).get(self.seqs.index(seq), ())
            rows.append(BatchRow(seq.pages, seq.token_ids[start:start + n], start, True, kept, num_logits=n))
        if graphs is None:
            logits = self.model.forward(build_forward_batch(rows, self.kv, "cpu"), self.kv)
        else:  # what the executor does: pad to the key, pack, one copy into the key's buffers
            key = static_key(rows)
            staged = self.stager.stage(build_forward_batch(rows, self.kv, pad_to=key))
            logits = graphs.forward(key, staged, lambda batch: None)[0][:sum(n for _, n in work)]  # the real rows
        for seq, n in work:
            seq.num_computed_tokens += n
            self.kv.release_slid_out(seq)
        return logits

    def decode(self, seqs, graphs=None) -> torch.Tensor:
        logits = self._run([(seq, 1) for seq in seqs], graphs)
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.append_output(token)
        return logits


@pytest.mark.parametrize("kernel_mode", ["reference", "triton"])
def test_padded_static_decode_equals_dynamic(tiny_checkpoint, kernel_mode):
    _static_equals_dynamic(EngineHarness(tiny_checkpoint, kernel_mode=kernel_mode), kernel_mode)


def test_padded_static_decode_with_the_fp8_kv_cache(deepseek_shaped_checkpoint):
    """kv_cache_dtype fp8: the padding rows' entries are quantized into the scratch page like any others. The two
    paths' fp32 entries differ by an ulp here and there (padded GEMMs), and the layout keeps the rope values in bf16:
    an ulp on a bf16 rounding boundary flips that value by one bf16 ulp (seen: one value of one CSA entry), which
    moves the logits by up to ~1e-4. So the requests' memory must hold the same bytes up to such flips, and the
    logits agree to 2e-4."""
    harness = EngineHarness(deepseek_shaped_checkpoint, numerics="deepseek")
    _static_equals_dynamic(harness, "reference", kv_cache_dtype="fp8", atol=2e-4)


def _same_fp8_memory_up_to_rope_flips(dynamic: KVCacheManager, static: KVCacheManager, head_dim: int,
                                      rope_dim: int) -> None:
    """Every byte of the requests' pages equal, except bf16 rope values one ulp apart (in a handful of entries)."""
    nope = head_dim - rope_dim
    pools = [(dynamic.window_pool, static.window_pool)] + [
        (pool, static.compressed_pools[name]) for name, pool in dynamic.compressed_pools.items()]
    flipped = 0
    for mine, theirs in pools:
        for stream, tensor in mine.tensors.items():
            differs = (tensor[:, :-1] != theirs.tensors[stream][:, :-1])  # the scratch page is the padding's
            if stream == "index_k" or not differs.any():
                assert not differs.any(), f"{mine.name} {stream}"
                continue
            assert not differs[..., :nope].any() and not differs[..., nope + 2 * rope_dim:].any(), mine.name
            rope = lambda t: t[:, :-1][..., nope:nope + 2 * rope_dim].contiguous().view(torch.int16)  # noqa: E731
            steps = (rope(tensor).int() - rope(theirs.tensors[stream]).int()).abs()
            assert steps.max() <= 1, f"{mine.name}: bf16 rope values more than one ulp apart"
            flipped += int((steps > 0).sum())
    assert flipped <= 8, flipped


def _static_equals_dynamic(harness: EngineHarness, kernel_mode: str, kv_cache_dtype=None, atol=1e-5) -> None:
    harness.model.indexer_observer = None  # the harness's observer tracks its own rows only
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, harness.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    harness.model.kernels.mode = "reference"  # prefill fast; the decode steps run the mode under test
    dynamic, static = (_Decoder(harness, _kv(harness, kv_cache_dtype), prompts),
                       _Decoder(harness, _kv(harness, kv_cache_dtype), prompts))
    harness.model.kernels.mode = kernel_mode
    graphs = DecodeGraphs(harness.model, static.kv, max_rows=8, capture=False)
    steps = 3 if kernel_mode == "triton" else 6
    for step in range(steps):
        subset = slice(0, 3) if step % 2 else slice(None)  # 3 rows (bucket 4), then 5 (bucket 8)
        expected = dynamic.decode(dynamic.seqs[subset])
        actual = static.decode(static.seqs[subset], graphs)
        torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-5)
    assert [s.output_ids for s in static.seqs] == [s.output_ids for s in dynamic.seqs]
    if kv_cache_dtype == "fp8":
        _same_fp8_memory_up_to_rope_flips(dynamic.kv, static.kv, harness.config.head_dim,
                                          harness.config.qk_rope_head_dim)
    assert {k.rows for k in graphs.keys} == {4, 8}
    for decoder in (dynamic, static):
        for seq in decoder.seqs:
            decoder.kv.free(seq)
        decoder.kv.check()


def test_static_keys_bucket_rows_and_context(tiny_checkpoint):
    harness = EngineHarness(tiny_checkpoint)
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    seq = Sequence("a", list(range(2, 300)))
    harness.kv.extend(seq, 300 - 2)
    seq.num_computed_tokens = 298
    harness.kv.release_slid_out(seq)
    harness.kv.extend(seq, 1)
    rows = [BatchRow(seq.pages, [5], 298, True)]
    key = static_key(rows)
    assert key == StaticKey(rows=1, context=512)
    batch = build_forward_batch(rows, harness.kv, pad_to=StaticKey(rows=4, context=512))
    assert batch.num_tokens == 4 and batch.max_entries == {"csa": 128, "hca": 4}
    assert batch.comp_block_tables["csa"].shape == (4, 8)  # 128 entries in pages of 16
    scratch = harness.kv.window_pool.scratch_page
    assert batch.window_write_index[1:].tolist() == [scratch * harness.kv.page_size] * 3
    for plan in batch.plans.values():
        assert plan.num_entries == 4 and (plan.entry_row[1:] == -1).all()  # position 298 closes no window
        assert plan.keep_slot[1:].tolist() == [harness.kv.state_pool.scratch_slot] * 3


@pytest.mark.parametrize("width", [3, 5])
def test_padded_static_verify_rows_equal_dynamic(tiny_checkpoint, width):
    """Speculative decoding's verify rows (1 + k tokens each, logits at each) at static shapes: with 5 tokens a row
    may close two CSA windows, and padding rows of `width` tokens close entries of their own into the scratch page.
    The real rows' logits and their greedy continuations agree with the dynamic batches'."""
    harness = EngineHarness(tiny_checkpoint)
    harness.model.indexer_observer = None
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, harness.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    dynamic, static = _Decoder(harness, _kv(harness), prompts), _Decoder(harness, _kv(harness), prompts)
    graphs = DecodeGraphs(harness.model, static.kv, max_rows=8, capture=False)
    for step in range(4):
        subset = slice(0, 3) if step % 2 else slice(None)
        drafts = torch.randint(2, harness.config.vocab_size, (5, width - 1), generator=gen).tolist()
        for decoder in (dynamic, static):
            for seq, tokens in zip(decoder.seqs[subset], drafts):
                for token in tokens:  # the drafts a verify row computes after the last token
                    seq.append_output(token)
        work = lambda decoder: [(seq, width) for seq in decoder.seqs[subset]]  # noqa: E731
        expected, actual = dynamic._run(work(dynamic), None), static._run(work(static), graphs)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        for decoder, logits in ((dynamic, expected), (static, actual)):
            for seq, token in zip(decoder.seqs[subset], logits[width - 1::width].argmax(-1).tolist()):
                seq.append_output(token)
    assert {(k.rows, k.tokens_per_row) for k in graphs.keys} == {(4, width), (8, width)}
    for decoder in (dynamic, static):
        for seq in decoder.seqs:
            decoder.kv.free(seq)
        decoder.kv.check()


def test_static_verify_rows_keep_the_prefix_snapshots_inside_them(tiny_checkpoint):
    """A verify row that crosses a prefix-cache block boundary keeps the rings as they stand there in a spare slot
    (its plan's snapshot keep rows). At static shapes every verify plan holds the most snapshot rows its rows can
    need, so such a step replays its key's graph like any other (before, it ran eagerly): the same logits as the
    dynamic step, the same snapshot in every spare slot, and steps with and without snapshots on one key."""
    harness = EngineHarness(tiny_checkpoint)
    harness.model.indexer_observer = None
    gen = torch.Generator().manual_seed(7)
    width, block = 3, 128
    prompts = [torch.randint(2, harness.config.vocab_size, (n,), generator=gen).tolist()
               for n in (124, 126, 250, 60, 255)]
    decoders = []
    for _ in range(2):
        kv = _kv(harness)
        kv.enable_prefix_caching(block, max_entries=8, max_end_entries=4)
        decoders.append(_Decoder(harness, kv, prompts))
    dynamic, static = decoders
    graphs = DecodeGraphs(harness.model, static.kv, max_rows=8, capture=False)
    spare = static.kv.state_pool.spare_slot
    kept_somewhere = 0
    for step in range(3):
        drafts = torch.randint(2, harness.config.vocab_size, (5, width - 1), generator=gen).tolist()
        for decoder in decoders:
            for seq, tokens in zip(decoder.seqs, drafts):
                for token in tokens:
                    seq.append_output(token)
        starts = [seq.num_computed_tokens for seq in static.seqs]
        # each boundary strictly inside a row (its end's state is copied after the forward, not planned)
        snapshots = {i: tuple((p, spare(i + 4 * (step % 2))) for p in range(start + 1, start + width)
                              if p % block == 0) for i, start in enumerate(starts)}
        kept_somewhere += sum(map(len, snapshots.values()))
        work = lambda decoder: [(seq, width) for seq in decoder.seqs]  # noqa: E731
        expected = dynamic._run(work(dynamic), None, snapshots)
        actual = static._run(work(static), graphs, snapshots)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        for decoder, logits in ((dynamic, expected), (static, actual)):
            for seq, token in zip(decoder.seqs, logits[width - 1::width].argmax(-1).tolist()):
                seq.append_output(token)
    assert kept_somewhere >= 3  # the prompts' ends put boundaries inside rows of both steps
    assert [k.tokens_per_row for k in graphs.keys] == [width]
    pools = dynamic.kv.state_pool, static.kv.state_pool
    for streams in ("kv", "gate"):
        for name, rings in getattr(pools[0], streams).items():
            for index in range(8):
                slot = spare(index)
                if slot < rings.shape[1]:  # (light spares hold the streams a block boundary needs only)
                    torch.testing.assert_close(getattr(pools[1], streams)[name][:, slot], rings[:, slot],
                                               atol=1e-5, rtol=1e-5, msg=f"{streams} {name} spare {index}")
