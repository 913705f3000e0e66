"""Suite-wide settings, applied before any test module is imported.

- TRITON_INTERPRET=1: the Triton kernels under test run on CPU tensors through Triton's
  interpreter. It must be set before any @triton.jit decorator runs, and the engine tests import
  the kernel modules too (through kernels.dispatch), so it is set here. On CPU the engine itself
  always calls the torch references, so nothing else changes. The end-to-end fixtures remove it
  from tritonserver's environment.
- One intra-op thread: the models under test are tiny, their forwards are thousands of small tensor
  ops, which run faster on one thread than on two (and CI has two cores, shared with tritonserver
  in the end-to-end tests).
- Checkpoint fixtures shared by the engine, model and memory tests: the built-in tiny checkpoint
  and a second random DeepSeek-V4 config with other widths, heads, layer mix and routing.
"""

import os
import sys
from pathlib import Path

# DSV4_TEST_DEVICE=cuda (scripts/gpu_check.sh, on a GPU machine): the kernels compile for the GPU and
# tensors are created on it by default; everything else below is the same.
ON_CUDA = os.environ.get("DSV4_TEST_DEVICE") == "cuda"
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

if ON_CUDA:
    torch.set_default_device("cuda")

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import pytest  # noqa: E402

from make_checkpoint import write_checkpoint  # noqa: E402

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


# The tiny checkpoint with enough heads, output groups, experts and intermediate columns to split 4 ways
# (backend/model/parallel_layout.py): tensor and expert parallelism tests.
PARALLEL_CONFIG = dict(num_attention_heads=8, o_groups=4, n_routed_experts=8, moe_intermediate_size=32)


@pytest.fixture(scope="session")
def parallel_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsv4-parallel")
    write_checkpoint(out, seed=11, **PARALLEL_CONFIG)
    return out


@pytest.fixture(scope="session")
def parallel_checkpoint_published(tmp_path_factory) -> Path:
    """The same model as DeepSeek publishes its checkpoints: original names, FP8 linears, MXFP4 experts."""
    out = tmp_path_factory.mktemp("dsv4-parallel-fp8")
    write_checkpoint(out, seed=11, layout="deepseek", quantize="fp8-mxfp4", **PARALLEL_CONFIG)
    return out


# The tiny model at widths DeepSeek's roundings apply to (numerics=deepseek): head_dim - rope dims a multiple of 64
# (128 - 64), the indexer's 64 a power of two (and wide enough for the 64 rope dims).
DEEPSEEK_SHAPED_CONFIG = dict(head_dim=128, partial_rotary_factor=0.5, index_head_dim=64)


@pytest.fixture(scope="session")
def deepseek_shaped_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsv4-deepseek-shaped")
    write_checkpoint(out, seed=5, **DEEPSEEK_SHAPED_CONFIG)
    return out


# The same widths as DeepSeek publishes its checkpoints (original names, FP8 linears, MXFP4 experts), with every input
# of an FP8/FP4 linear a multiple of the 128 values DeepSeek's act_quant groups (numerics=deepseek quantizes them).
DEEPSEEK_PUBLISHED_CONFIG = dict(DEEPSEEK_SHAPED_CONFIG, hidden_size=128, q_lora_rank=128, o_lora_rank=64,
                                 moe_intermediate_size=128)


@pytest.fixture(scope="session")
def deepseek_published_checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsv4-deepseek-published")
    write_checkpoint(out, seed=5, layout="deepseek", quantize="fp8-mxfp4", **DEEPSEEK_PUBLISHED_CONFIG)
    return out


# hf_overrides shrinking docs/configs/deepseek-v4-flash.config.json to widths a CPU serves in a second (load_format=dummy),
# every FP8 linear's input a multiple of 128 (so DeepSeek's numerics and the fp8 KV layout apply, as on V4-Flash
# itself), and a vocabulary larger than the built-in tokenizer's 512.
TINY_FLASH_OVERRIDES = {"hidden_size": 128, "moe_intermediate_size": 128, "num_attention_heads": 2, "head_dim": 128,
                        "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 64, "n_routed_experts": 8,
                        "num_experts_per_tok": 2, "index_n_heads": 2, "index_head_dim": 64, "index_topk": 8,
                        "vocab_size": 1024}


@pytest.fixture(scope="session", params=["tiny", "alt"])
def checkpoint(request, tiny_checkpoint, alt_checkpoint) -> Path:
    return tiny_checkpoint if request.param == "tiny" else alt_checkpoint
