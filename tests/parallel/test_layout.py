"""ParallelLayout: who holds which part of each tensor, and the clear errors for splits that cannot work."""

from __future__ import annotations

import pytest
import torch

from backend.config import ConfigError, EngineConfig
from backend.model.checkpoint import expected_shapes, load_weights
from backend.model.config import load_model_config
from backend.model.parallel_layout import ParallelLayout, Shard


def test_shards_of_each_kind_of_tensor():
    tp2 = ParallelLayout(tensor_parallel_size=2, rank=1)
    assert tp2.shard("model.layers.0.self_attn.q_b_proj.weight", (512, 48)) == Shard(0, ((256, 512),))
    assert tp2.shard("model.layers.0.self_attn.o_b_proj.weight", (64, 128)) == Shard(1, ((64, 128),))
    assert tp2.shard("model.layers.0.mlp.shared_experts.down_proj.weight", (64, 32)) == Shard(1, ((16, 32),))
    assert tp2.shard("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 64)) == Shard(1, ((16, 32), (48, 64)))
    assert tp2.shard("model.layers.0.mlp.experts.down_proj", (8, 64, 32)) == Shard(2, ((16, 32),))
    assert tp2.shard("model.layers.0.self_attn.kv_proj.weight", (64, 64)) is None  # replicated
    assert tp2.shard("lm_head.weight", (512, 64)) == Shard(0, ((256, 512),))
    ep2 = ParallelLayout(expert_parallel_size=2, rank=1)
    assert ep2.shard("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 64)) == Shard(0, ((4, 8),))
    assert ep2.shard("model.layers.0.self_attn.q_b_proj.weight", (512, 48)) is None  # attention replicated
    assert ep2.shard("model.layers.0.mlp.shared_experts.gate_proj.weight", (32, 64)) is None
    assert ep2.expert_range(8) == (4, 4)
    assert ParallelLayout().shard("lm_head.weight", (512, 64)) is None


@pytest.mark.parametrize("settings,parameter", [
    (dict(tensor_parallel_size=8), "tensor_parallel_size"),  # 4 heads of the tiny model
    (dict(expert_parallel_size=16), "expert_parallel_size"),  # 8 experts
    (dict(tensor_parallel_size=2, expert_parallel_size=4), "tensor_parallel_size"),  # 1 or the world
])
def test_a_split_that_cannot_work_is_refused_before_any_weight_loads(tiny_checkpoint, settings, parameter):
    with pytest.raises(ConfigError, match=f"'{parameter}'"):
        config = EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", **settings)
        ParallelLayout(config.tensor_parallel_size, config.expert_parallel_size).check(
            load_model_config(tiny_checkpoint))


def test_graphs_with_several_ranks_only_when_asked_for():
    assert EngineConfig(device="cpu", tensor_parallel_size=2, cuda_graphs=True).resolved_cuda_graphs()
    assert not EngineConfig(device="cuda", tensor_parallel_size=2).resolved_cuda_graphs()


@pytest.fixture(scope="module")
def save_pretrained_checkpoint(tmp_path_factory):
    """The split-friendly model as a transformers user has it: DeepseekV4ForCausalLM.save_pretrained."""
    from make_checkpoint import make_config
    from transformers import DeepseekV4ForCausalLM

    from tests.conftest import PARALLEL_CONFIG

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dsv4-parallel-save-pretrained")
    DeepseekV4ForCausalLM(make_config(**PARALLEL_CONFIG)).save_pretrained(out)
    return out


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("which", ["dense", "published", "save_pretrained"])
def test_every_rank_loads_exactly_its_part(parallel_checkpoint, parallel_checkpoint_published,
                                           save_pretrained_checkpoint, tp, ep, which, monkeypatch):
    """The ranks' parts put back together are the single-rank tensors, bit for bit (our writer's layouts, and
    what transformers' save_pretrained writes), and a rank never reads another rank's experts from the files."""
    import backend.model.checkpoint as checkpoint_module

    path = {"dense": parallel_checkpoint, "published": parallel_checkpoint_published,
            "save_pretrained": save_pretrained_checkpoint}[which]
    config = load_model_config(path)
    whole = load_weights(path, config, torch.float32, "cpu")
    world = max(tp, ep)
    parts = []
    for rank in range(world):
        read: list[str] = []
        monkeypatch.setattr(checkpoint_module, "safe_open", _recording_safe_open(read))
        layout = ParallelLayout(tp, ep, rank)
        local = load_weights(path, config, torch.float32, "cpu", layout=layout)
        assert {n: tuple(t.shape) for n, t in local.items()} == layout.local_shapes(expected_shapes(config))
        if ep > 1 and which == "published":  # one tensor per expert in the files: only this rank's are read
            first, count = layout.expert_range(config.n_routed_experts)
            experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
            assert experts and experts <= set(range(first, first + count)), (rank, sorted(experts))
        parts.append(local)
    for name, tensor in whole.items():
        shard = ParallelLayout(tp, ep, 0).shard(name, tuple(tensor.shape))
        if shard is None:
            assert all(torch.equal(p[name], tensor) for p in parts), name
            continue
        pieces = [[p[name].narrow(shard.dim, offset, stop - start) for offset, (start, stop) in
                   zip(_offsets(shard), shard.ranges)] for p in parts]
        rebuilt = torch.cat([piece for group in zip(*pieces) for piece in group], dim=shard.dim)
        assert torch.equal(rebuilt, tensor), name


def _recording_safe_open(read: list[str]):
    """safetensors.safe_open whose data reads (get_tensor, indexing a get_slice) append the tensor's name."""
    from safetensors import safe_open

    class Slice:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def __getitem__(self, index):
            read.append(self.name)
            return self.inner[index]

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

    class File:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

        def get_slice(self, name):
            return Slice(self.handle.get_slice(name), name)

        def keys(self):
            return self.handle.keys()

    return File


def _offsets(shard: Shard) -> list[int]:
    out, offset = [], 0
    for start, stop in shard.ranges:
        out.append(offset)
        offset += stop - start
    return out


@pytest.mark.parametrize("tp,ep,draft", [(1, 1, 0), (2, 2, 0), (4, 1, 0), (1, 1, 1), (2, 2, 1)])
def test_plan_memory_counts_the_bytes_a_rank_loads(parallel_checkpoint, tp, ep, draft):
    """backend/model/footprint.py with a layout (what scripts/plan_memory.py prints per device) is the size of
    the tensors rank 0 really holds, the MTP layer's too when speculative decoding serves it."""
    from backend.model.footprint import weight_bytes

    config = load_model_config(parallel_checkpoint)
    layout = ParallelLayout(tp, ep, 0)
    loaded = load_weights(parallel_checkpoint, config, torch.bfloat16, "cpu", layout=layout, draft_layers=draft)
    planned = weight_bytes(config, "dequantize", layout=layout, draft_layers=draft)
    assert (planned["draft layer (mtp)"] > 0) == bool(draft)
    assert sum(planned.values()) == sum(t.numel() * t.element_size() for t in loaded.values())
