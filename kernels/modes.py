"""The modes a deployment runs in, each resolved once where it is planned (backend/deployment.py) and handed on as
one typed object: nothing downstream asks a tensor's dtype, or a loose flag, which mode it is in.

    numerics = Numerics.of("deepseek", quantized_checkpoint=True)   # what the forward computes
    layout = KVLayout.deepseek_fp8(head_dim=512, rope_dim=64, index_head_dim=128)   # what the KV pools store

`Numerics` goes to `KernelDispatch` (kernels/dispatch.py), which applies it to the kernels' modes and from which the
model reads the rest (backend/model/deepseek_v4.py). `KVLayout` goes to the memory pools
(backend/memory/kv_manager.py), which size their tensors by it and hand it, with each layer's tensors, to whoever
writes entries into them; the kernels that read entries take the layout's bytes as their input format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant_formats import indexer_fp4_entry_bytes, kv_fp8_entry_bytes

@dataclass(frozen=True)
class Numerics:
    """What the forward computes beyond transformers' DeepseekV4ForCausalLM: the roundings DeepSeek's own inference
    applies (its model was trained with them; README "Numerics"). Every field False: transformers' computation."""

    name: str = "transformers"  # "transformers" or "deepseek"
    fp32_router: bool = False  # the router's logits from an fp32 input and weight
    fp32_head: bool = False  # the LM head in fp32
    fp32_mix: bool = False  # mHC's mix in fp32, rounded once (DeepSeek's hc_post)
    # the compressors' projections in fp32 with fp32 weights, their rings kept in fp32 and pooled in fp32; each entry
    # rounded to the model's dtype before its norm and rope
    fp32_compressors: bool = False
    round_kv_entries: bool = False  # attention entries (window, CSA, HCA) rounded as stored: nope values e4m3 per 64
    round_indexer: bool = False  # the indexer's keys and queries rotated and rounded to e2m1 per 32
    act_quant: bool = False  # the inputs of the FP8/FP4 linears (experts' down input too) act_quant'ed, e4m3 per 128
    routing_weight_first: bool = False  # the experts weight their SwiGLU output before the down projection

    @classmethod
    def of(cls, name: str, quantized_checkpoint: bool) -> "Numerics":
        """`name`'s numerics: act_quant applies to a quantized checkpoint's FP8/FP4 linears only (a bf16 checkpoint
        runs plain GEMMs in DeepSeek's code too)."""
        if name == "transformers":
            return cls()
        if name != "deepseek":
            raise ValueError(f"numerics are 'transformers' or 'deepseek' (backend/config.py resolves 'auto'), "
                             f"got {name!r}")
        return cls(name, fp32_router=True, fp32_head=True, fp32_mix=True, fp32_compressors=True,
                   round_kv_entries=True, round_indexer=True, act_quant=quantized_checkpoint,
                   routing_weight_first=True)

    def compressor_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the compressors' projections and rings in a deployment computing in `dtype`."""
        return torch.float32 if self.fp32_compressors else dtype


@dataclass(frozen=True)
class KVLayout:
    """How the paged pools store an attention entry (window, CSA, HCA: head_dim values, the trailing rope_dim of them
    rotated) and a CSA indexer key (index_head_dim values): as values of the model's dtype, or in DeepSeek's fp8
    layout (uint8 pools; kernels/quant_formats.py): the nope values e4m3 with a ue8m0 scale per 64, the rope values
    bf16 (584 bytes an entry at V4's widths, against 1,024 in bf16), the indexer keys rotated and e2m1 with a scale
    per 32 (68 bytes against 256)."""

    fp8: bool
    dtype: torch.dtype  # the pools' element type: uint8 (the fp8 layout's bytes) or the values' dtype
    head_dim: int
    rope_dim: int
    index_head_dim: int

    def __post_init__(self):
        if self.fp8 != (self.dtype == torch.uint8):
            raise ValueError(f"the fp8 layout stores bytes (uint8), values a float dtype: fp8={self.fp8}, "
                             f"dtype {self.dtype}")
        self.entry_width, self.index_key_width  # noqa: B018 (widths the layout cannot hold are refused here)

    @classmethod
    def values(cls, dtype: torch.dtype, head_dim: int, rope_dim: int, index_head_dim: int) -> "KVLayout":
        return cls(False, dtype, head_dim, rope_dim, index_head_dim)

    @classmethod
    def deepseek_fp8(cls, head_dim: int, rope_dim: int, index_head_dim: int) -> "KVLayout":
        return cls(True, torch.uint8, head_dim, rope_dim, index_head_dim)

    @property
    def name(self) -> str:
        return "fp8" if self.fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def entry_width(self) -> int:
        """Elements (of `dtype`) of one attention entry."""
        return kv_fp8_entry_bytes(self.head_dim, self.rope_dim) if self.fp8 else self.head_dim

    @property
    def index_key_width(self) -> int:
        """Elements (of `dtype`) of one indexer key."""
        return indexer_fp4_entry_bytes(self.index_head_dim) if self.fp8 else self.index_head_dim

    @property
    def entry_bytes(self) -> int:
        return self.entry_width * self.dtype.itemsize

    @property
    def index_key_bytes(self) -> int:
        return self.index_key_width * self.dtype.itemsize
