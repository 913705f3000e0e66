#!/usr/bin/env python3
"""Write a deterministic DeepSeek-V4 checkpoint, in any of the layouts and formats DeepSeek-V4 ships in.

    python scripts/make_checkpoint.py --out checkpoints/dsv4-tiny            # the built-in model
    python scripts/make_checkpoint.py --out /data/dsv4-flash-2l --flash-shaped  # real widths, 2 layers, bf16
    python scripts/make_checkpoint.py --out /tmp/tiny-fp8 --layout deepseek --quantize fp8-mxfp4

--layout (backend/model/weight_names.py): `hf-modules` (transformers' module names, the default and
the built-in model), `transformers` (what save_pretrained writes) or `deepseek` (DeepSeek's published
names, one tensor per expert). --quantize: `none`; `fp8-mxfp4` as V4-Flash and V4-Pro ship (FP8
e4m3 linears with e8m0 128x128 block scales, MXFP4 routed experts with e8m0 scales per 32); `fp8`
as V4-Flash-Base ships (FP8 linears and experts, float32 power-of-two scales). Quantized
checkpoints need the deepseek or transformers layout (per-expert tensors), and carry the
`quantization_config` and `expert_dtype` of the published config.json. Their weights *are* the
quantized values: the random weights are drawn, then quantized, and the files hold the result.

The tiny model keeps DeepSeek-V4's structural constants (window 128, compress rates 4 and 128,
hc_mult 4, 20 Sinkhorn iterations, hash-routed layers first, sqrtsoftplus routing with a correction
bias, a shared expert, YaRN on the compress rope, all three attention layer types, and one MTP layer,
`mtp.0.*`, the draft of speculative decoding, as every published V4 checkpoint has) with widths
small enough for a CPU to serve it interactively. Weights are random but deterministic: each
tensor's generator is seeded from its name, so the same command always writes the same bytes.
Router and indexer weights are initialised large enough that their scores do not tie, and the hash
routing table `tid2eid` holds real (distinct, per-token) expert ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.model.checkpoint import draft_layer_shapes  # noqa: E402
from backend.model.config import parse_model_config  # noqa: E402
from backend.model.dummy_weights import init_scale  # noqa: E402
from backend.model.quantization import FP8_LINEARS, quantize_fp8, quantize_mxfp4  # noqa: E402
from backend.model.weight_names import original_name  # noqa: E402

LAYOUTS = ("hf-modules", "transformers", "deepseek")
QUANTIZATIONS = ("none", "fp8", "fp8-mxfp4")

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=48,
    num_experts_per_tok=2,
    n_routed_experts=8,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=8,
    partial_rotary_factor=0.25,
    max_position_embeddings=65536,
    layer_types=[
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

# DeepSeek-V4-Flash's widths (the reference config's defaults) with two layers, one of each
# compressed kind, for kernel and engine benchmarks on a GPU.
FLASH_SHAPED_CONFIG = dict(
    num_hidden_layers=2,
    layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe"],
    max_position_embeddings=65536 * 16,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

# Text the tiny tokenizer's byte-level BPE merges are learned from (any fixed text would do).
_CORPUS = """
The quick brown fox jumps over the lazy dog. A request that is already decoding should keep
making progress while a long prompt is prefilled in chunks. The scheduler decides every step:
which requests decode, how many prompt tokens are prefilled, and when a decode must be interleaved.
def forward(self, hidden_states, positions):
    return self.attention(hidden_states, positions) + hidden_states
Sliding-window attention keeps the last one hundred and twenty-eight tokens of every layer;
compressed sparse attention keeps one entry per four tokens and an indexer picks the top entries;
heavily compressed attention keeps one entry per one hundred and twenty-eight tokens.
Hello, world! Bonjour le monde. Hallo Welt. こんにちは世界. 你好，世界. Привет, мир.
for i in range(10): print(i * i)  # squares
The numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and the letters a b c d e f g h i j k l m n o p.
"""


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    assert tokenizer.token_to_id(BOS) == 0 and tokenizer.token_to_id(EOS) == 1
    return tokenizer


def _generator(name: str, seed: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def init_tensor(name: str, shape: tuple[int, ...], config, seed: int) -> torch.Tensor:
    """A deterministic value for one named parameter, scaled as backend/model/dummy_weights.init_scale says."""
    g = _generator(name, seed)
    if name.rsplit(".", 1)[-1] == "tid2eid":
        vocab, k = shape
        return torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:k] for _ in range(vocab)])
    mean, std = init_scale(name, shape)
    values = torch.randn(shape, generator=g) * std
    return values + mean if mean else values


def make_config(flash_shaped: bool = False, **overrides):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**(FLASH_SHAPED_CONFIG if flash_shaped else TINY_CONFIG), **overrides})


def parameter_shapes(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names, shapes and dtypes of every saved tensor, read off the reference on the meta device, and the
    `num_nextn_predict_layers` MTP layers, which the reference does not build (backend/model/checkpoint.py)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    ours = parse_model_config(config.to_dict())
    for j in range(ours.num_nextn_predict_layers):
        shapes.update({name: (shape, torch.float32) for name, shape in draft_layer_shapes(ours, j).items()})
    return shapes


def write_checkpoint(out: Path, flash_shaped: bool = False, seed: int = 0, shard_bytes: int = 4 * 2**30,
                     layout: str = "hf-modules", quantize: str = "none", **config_overrides) -> None:
    """Write config.json, safetensors (sharded above shard_bytes) and the tokenizer files to `out`."""
    from tqdm import tqdm

    if layout not in LAYOUTS or quantize not in QUANTIZATIONS:
        raise ValueError(f"layout must be one of {LAYOUTS} and quantize one of {QUANTIZATIONS}")
    if quantize != "none" and layout == "hf-modules":
        raise ValueError("quantized checkpoints store one tensor per expert: use --layout deepseek or transformers")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = make_config(flash_shaped, **config_overrides)
    dtype = torch.bfloat16 if flash_shaped else torch.float32
    shapes = parameter_shapes(config)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, (shape, ref_dtype) in tqdm(shapes.items(), desc="tensors", disable=not flash_shaped):
        tensor = init_tensor(name, shape, config, seed)
        tensor = tensor.to(torch.int64 if not ref_dtype.is_floating_point else dtype).contiguous()
        for stored_name, stored in stored_tensors(name, tensor, layout, quantize):
            if size and size + stored.nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][stored_name] = stored
            size += stored.nbytes
    _save_shards(out, shards)
    config.dtype = "bfloat16" if flash_shaped else "float32"
    config.save_pretrained(out)
    if quantize != "none":
        _declare_quantization(out / "config.json", quantize)
    _write_tokenizer(out, config)


def stored_tensors(name: str, tensor: torch.Tensor, layout: str, quantize: str):
    """(name, tensor) pairs as `layout` stores the engine tensor `name` (experts split, FP8/MXFP4 per `quantize`)."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and layout != "hf-modules":
        half = tensor.shape[1] // 2
        for expert in range(tensor.shape[0]):
            parts = ({"w1": tensor[expert, :half], "w3": tensor[expert, half:]} if name.endswith("gate_up_proj")
                     else {"w2": tensor[expert]})
            for proj, part in parts.items():
                yield from _quantized(original_name(name, layout, expert, proj), part.contiguous(), quantize,
                                      is_expert=True)
        return
    stored_name = original_name(name, layout)
    if quantize != "none" and name.endswith(FP8_LINEARS):
        yield from _quantized(stored_name, tensor, quantize, is_expert=False)
    else:
        yield stored_name, tensor


def _quantized(weight_name: str, weight: torch.Tensor, quantize: str, is_expert: bool):
    """`weight_name` and its `.scale` as `quantize` stores it: fp8-mxfp4 (V4-Flash: e8m0 scales, MXFP4
    experts), fp8 (V4-Flash-Base: FP8 experts too, float32 power-of-two scales), none."""
    if quantize == "none":
        yield weight_name, weight
        return
    quantized, scale = quantize_mxfp4(weight) if is_expert and quantize == "fp8-mxfp4" else quantize_fp8(weight)
    if quantize == "fp8":
        scale = scale.to(torch.float32)
    yield weight_name, quantized
    yield weight_name[: -len(".weight")] + ".scale", scale


def _declare_quantization(config_path: Path, quantize: str) -> None:
    """The published config.json's quantization fields."""
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    raw["expert_dtype"] = "fp4" if quantize == "fp8-mxfp4" else "fp8"
    config_path.write_text(json.dumps(raw, indent=2) + "\n")


def _save_shards(out: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in shard})
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(out: Path, config) -> None:
    """tokenizer.json and its config; no chat template, as DeepSeek-V4's published checkpoints have none (the server
    renders their `messages` in DeepSeek's format: backend/deepseek_v4_chat.jinja)."""
    tokenizer = build_tokenizer(min(config.vocab_size, 512))
    tokenizer.save(str(out / "tokenizer.json"))
    # (UTF-8 as transformers writes it, the special tokens unescaped: what the server must read under any locale)
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
             "model_max_length": config.max_position_embeddings},
            indent=2, ensure_ascii=False,
        ),
        encoding="utf-8",
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="directory to write")
    parser.add_argument("--flash-shaped", action="store_true", help="real DeepSeek-V4-Flash widths, 2 layers, bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-gb", type=float, default=4.0, help="largest safetensors shard")
    parser.add_argument("--layout", choices=LAYOUTS, default="hf-modules", help="tensor names (see above)")
    parser.add_argument("--quantize", choices=QUANTIZATIONS, default="none", help="weight format (see above)")
    args = parser.parse_args()
    write_checkpoint(args.out, args.flash_shaped, args.seed, int(args.shard_gb * 2**30), args.layout, args.quantize)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
