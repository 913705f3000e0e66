"""Fixtures for engine tests: the built-in tiny checkpoint and a second random DeepSeek-V4 config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from make_checkpoint import write_checkpoint  # noqa: E402,F401 (re-exported for tests)

# Different widths, head counts, layer mix and routing from the tiny model, plain (non-YaRN) rope,
# and a small index_topk so that CSA selection is exercised early.
ALT_CONFIG = dict(
    vocab_size=512,
    hidden_size=96,
    moe_intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=2,
    head_dim=32,
    q_lora_rank=40,
    num_experts_per_tok=3,
    n_routed_experts=6,
    o_groups=1,
    o_lora_rank=24,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=5,
    partial_rotary_factor=0.5,
    max_position_embeddings=8192,
    layer_types=[
        "compressed_sparse_attention",
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe"],
    rope_parameters={"rope_type": "default"},
)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    built_in = REPO / "checkpoints" / "dsv4-tiny"
    if (built_in / "config.json").is_file():
        return built_in
    out = tmp_path_factory.mktemp("dsv4-tiny")
    write_checkpoint(out)
    return out


@pytest.fixture(scope="session")
def alt_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsv4-alt")
    write_checkpoint(out, seed=7, **ALT_CONFIG)
    return out


@pytest.fixture(scope="session", params=["tiny", "alt"])
def checkpoint(request, tiny_checkpoint, alt_checkpoint) -> Path:
    return tiny_checkpoint if request.param == "tiny" else alt_checkpoint
