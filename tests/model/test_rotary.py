"""The rope tables a step computes together (backend/model/rotary.py's cos_sin_tables) against each table's own
product, cos, sin and scaling: the same values, row slices of one computation."""

from __future__ import annotations

import torch

from backend.model.config import load_model_config
from backend.model.rotary import Rotary, cos_sin_tables
from tests.conftest import REPO

FLASH = REPO / "docs" / "configs" / "deepseek-v4-flash.config.json"


def _own_table(rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions[:, None].float() * rotary.inv_freq
    return (freqs.cos() * rotary.scaling).to(dtype), (freqs.sin() * rotary.scaling).to(dtype)


def test_tables_computed_together_equal_each_tables_own():
    """A step's four tables (main and compress at the tokens' positions, compress at two plans' closing entries, one
    plan without any), V4-Flash's frequencies (YaRN for compress), a scaling other than 1 on one rotary."""
    config = load_model_config(FLASH)
    main, compress = Rotary(config, "main", "cpu"), Rotary(config, "compress", "cpu")
    compress.scaling = 1.2771  # (V4's attention factor is 1: the per-row scaling path is taken here only)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 1 << 20, (37,), generator=gen)
    entries = torch.randint(0, 1 << 18, (5,), generator=gen)
    requests = [(main, positions), (compress, positions), (compress, entries), (compress, entries[:0])]
    for dtype in (torch.bfloat16, torch.float32):
        tables = cos_sin_tables(requests, dtype)
        assert len(tables) == len(requests)
        for (rotary, p), (cos, sin) in zip(requests, tables):
            expected_cos, expected_sin = _own_table(rotary, p, dtype)
            assert cos.shape == (p.shape[0], rotary.inv_freq.shape[0]) and cos.is_contiguous() and sin.is_contiguous()
            assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
    assert not torch.equal(tables[0][0], tables[1][0])  # each row took its own rotary's frequencies
