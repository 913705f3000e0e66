"""A step's metadata packed into one host buffer reaches the device in one copy and unpacks to the same batch."""

from __future__ import annotations

from dataclasses import fields

import torch

from backend.memory.kv_manager import KVCacheManager
from backend.model.config import load_model_config
from backend.model.forward_batch import BatchRow, ForwardBatch, build_forward_batch
from backend.model.staging import BatchStager
from backend.model.static_batch import StaticKey
from backend.request import Sequence


def _batch(checkpoint, pad_to=None) -> ForwardBatch:
    kv = KVCacheManager(load_model_config(checkpoint), num_tokens=4096, swa_full_tokens_ratio=0.5, page_size=16,
                        max_running_requests=4, dtype=torch.float32, device="cpu")
    rows = []
    for i, (computed, n) in enumerate([(0, 40), (300, 1), (131, 1)] if pad_to is None else [(300, 1), (131, 1)]):
        seq = Sequence(f"r{i}", list(range(2, 2 + computed + n)))
        kv.extend(seq, computed)
        seq.num_computed_tokens = computed
        kv.release_slid_out(seq)
        kv.extend(seq, n)
        rows.append(BatchRow(seq.pages, seq.token_ids[computed:computed + n], computed, True,
                             from_previous_step=n == 1))
    return build_forward_batch(rows, kv, pad_to=pad_to)


def _tensors(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    out = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            out[f.name] = value
        elif f.name == "comp_block_tables":
            out.update({f"{f.name}.{k}": v for k, v in value.items()})
        elif f.name == "plans":
            for stream, plan in value.items():
                out.update({f"plans.{stream}.{pf.name}": getattr(plan, pf.name) for pf in fields(plan)
                            if isinstance(getattr(plan, pf.name), torch.Tensor)})
    return out


def test_a_staged_batch_unpacks_to_the_same_batch_in_one_buffer(tiny_checkpoint):
    for pad_to in (None, StaticKey(rows=4, context=512)):
        batch = _batch(tiny_checkpoint, pad_to)
        stager = BatchStager("cpu", depth=1)
        staged = stager.stage(batch)
        unpacked = stager.to_device(staged)
        device_buffer = stager._device._buffers[0]
        expected, got = _tensors(batch), _tensors(unpacked)
        assert expected.keys() == got.keys()
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
            start = got[name].untyped_storage().data_ptr()
            assert start == device_buffer.untyped_storage().data_ptr(), f"{name} is not a view of the one buffer"
        assert unpacked.plans["csa"] is unpacked.plans["indexer"]  # shared plans stay shared
        assert unpacked.max_entries == batch.max_entries and unpacked.num_tokens == batch.num_tokens
        assert (unpacked.token_source >= 0).sum() == 2  # the decodes read their token on the device


def test_buffers_rotate_so_a_step_in_flight_keeps_its_own(tiny_checkpoint):
    stager = BatchStager("cpu", depth=2)
    batch = _batch(tiny_checkpoint)
    first, second, third = (stager.stage(batch) for _ in range(3))
    assert first.host.data_ptr() != second.host.data_ptr()
    assert third.host.data_ptr() == first.host.data_ptr()
    assert first.layout == second.layout == third.layout
    on_device = [stager.to_device(staged).input_ids.data_ptr() for staged in (first, second, third)]
    assert on_device[0] != on_device[1] and on_device[2] == on_device[0]
