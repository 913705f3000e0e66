"""The one table between the names checkpoints use and the engine's own.

Three layouts are read, told apart by their tensor names (never by a flag the user must know):
- `deepseek`: DeepSeek's published layout (V4-Flash, V4-Flash-Base, V4-Pro): `embed.weight`,
  `layers.i.attn.wq_a.weight`, `layers.i.ffn.experts.E.w1.weight`, ... (no `model.` prefix), with
  FP8/MXFP4 weights beside `.scale` tensors and the `mtp.*` draft layer (`mtp.0.e_proj`, `mtp.0.attn.wq_a`, ...:
  a layer's names plus e_proj/h_proj/enorm/hnorm/norm and hc_head_*; the engine's `model.mtp.0.*`);
- `transformers`: what `DeepseekV4ForCausalLM.save_pretrained` (transformers 5.23) writes: it
  reverses the renames below on the module names, so the names are the original ones with
  `model.` in front of all but `head.weight` — except where a reverse rename cannot apply
  (`model.embed_tokens.weight` and `model.hc_head.hc_*` stay, their renames being anchored at the
  start) or is ambiguous (the attention's `kv_norm` comes back as `attn.norm`);
- `hf-modules`: transformers' in-memory module names (`model.embed_tokens.weight`,
  `model.layers.i.mlp.experts.gate_up_proj`, ...), which are also the engine's names. A model that
  transformers loaded from such names writes them back with save_pretrained except for one reverse
  rename, `kv_norm` -> `norm` (`self_attn.norm`, `compressor.norm`, `compressor.indexer.norm`): read
  as `kv_norm`.

The renames are transformers' `conversion_mapping.py` entry `deepseek_v4`, in its order. Routed
experts are stored one tensor each (`experts.E.w1/w2/w3`) in the first two layouts and merged in
the engine: `gate_up_proj[E] = cat(w1[E], w3[E])` (w1 = gate, w3 = up), `down_proj[E] = w2[E]`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

LAYOUTS = ("deepseek", "transformers", "hf-modules")

# (pattern, replacement) over the original name without any `model.` prefix, applied in order.
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"(?<!^mtp\.\d)\.norm\.", ".kv_norm."),  # (an MTP layer's own final norm, `mtp.j.norm`, keeps its name)
    (r"\.hc_head_fn$", ".hc_head.hc_fn"),  # an MTP layer's hyper-head (the model's are anchored above)
    (r"\.hc_head_base$", ".hc_head.hc_base"),
    (r"\.hc_head_scale$", ".hc_head.hc_scale"),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]
_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight$")
_DRAFT_LAYER = re.compile(r"^(model\.)?mtp\.(\d+)\.")
_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.")
# save_pretrained's reverse of `.norm.` -> `.kv_norm.` on module names (the final `model.norm` has no such parent)
_HF_MODULES_KV_NORM = re.compile(r"\.(self_attn|compressor|indexer)\.norm\.")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: an engine tensor, or a slice of a merged expert tensor."""

    name: str  # the engine's name
    expert: int | None = None  # routed expert index, for per-expert tensors
    half: str | None = None  # "gate" or "up" (the two halves of gate_up_proj), None for down_proj / others


def detect_layout(names: Iterable[str]) -> str:
    """hf-modules names its layers' parts `self_attn`/`mlp`, the others `attn`/`ffn`; only DeepSeek's
    own layout has no `model.` prefix."""
    names = set(names)
    if not ({"embed.weight", "model.embed.weight", "model.embed_tokens.weight"} & names):
        raise ValueError("not a DeepSeek-V4 checkpoint: no embed.weight, model.embed.weight or "
                         "model.embed_tokens.weight among its tensors")
    if "embed.weight" in names:
        return "deepseek"
    if any(".self_attn." in name or ".mlp." in name for name in names):
        return "hf-modules"
    return "transformers"


def draft_layer_index(name: str) -> int | None:
    """j for a tensor of multi-token-prediction layer j (`mtp.j.*`, the speculative-decoding draft), else None."""
    match = _DRAFT_LAYER.match(name)
    return int(match[2]) if match else None


def layer_index(name: str) -> int | None:
    """i for a tensor of the model's layer i (`layers.i.*`, `model.layers.i.*`), else None."""
    match = _LAYER.match(name)
    return int(match[2]) if match else None


def engine_target(name: str, layout: str) -> Target:
    """The engine tensor a checkpoint tensor named `name` (in `layout`) fills."""
    if layout == "hf-modules":
        return Target(_HF_MODULES_KV_NORM.sub(r".\1.kv_norm.", name))
    if layout == "transformers" and name.startswith("model."):
        name = name[len("model."):]
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    if not name.startswith("lm_head."):
        name = "model." + name
    match = _EXPERT.match(name)
    if match is None:
        return Target(name)
    proj = match["proj"]
    merged = "gate_up_proj" if proj in ("w1", "w3") else "down_proj"
    return Target(f"{match['prefix']}.{merged}", int(match["expert"]), {"w1": "gate", "w3": "up"}.get(proj))


def original_name(engine_name: str, layout: str, expert: int | None = None, proj: str | None = None) -> str:
    """The name `layout` stores an engine tensor (or one expert's w1/w2/w3 of it) under.

    The inverse of engine_target, built by searching it: used to write checkpoints in each
    layout (scripts/make_checkpoint.py) and in error messages.
    """
    if layout == "hf-modules":
        return engine_name
    base = engine_name[len("model."):] if engine_name.startswith("model.") else engine_name
    candidate = _inverse(base)
    if expert is not None:
        candidate = re.sub(r"\.experts\.(gate_up_proj|down_proj)$", f".experts.{expert}.{proj}.weight", candidate)
    if layout == "transformers":
        candidate = _as_saved_by_transformers(candidate)
    return candidate


def _as_saved_by_transformers(original: str) -> str:
    """An original name as save_pretrained writes it (see the module docstring)."""
    if original == "head.weight":
        return original
    original = re.sub(r"^embed\.weight$", "embed_tokens.weight", original)
    original = re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", original)
    original = re.sub(r"\.attn\.kv_norm\.", ".attn.norm.", original)
    return "model." + original


_INVERSE = [
    ("lm_head.weight", "head.weight"), ("embed_tokens.weight", "embed.weight"), ("hc_head.hc_fn", "hc_head_fn"),
    ("hc_head.hc_base", "hc_head_base"), ("hc_head.hc_scale", "hc_head_scale"),
    (".compressor.indexer.scorer.weights_proj.", ".indexer.weights_proj."),
    (".compressor.indexer.q_b_proj.", ".indexer.wq_b."), (".compressor.indexer.", ".indexer.compressor."),
    (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.fn", ".hc_attn_fn"), (".attn_hc.base", ".hc_attn_base"), (".attn_hc.scale", ".hc_attn_scale"),
    (".ffn_hc.fn", ".hc_ffn_fn"), (".ffn_hc.base", ".hc_ffn_base"), (".ffn_hc.scale", ".hc_ffn_scale"),
    (".sinks", ".attn_sink"), (".compressor.kv_norm.", ".compressor.norm."), (".position_bias", ".ape"),
    (".q_a_proj.", ".wq_a."), (".q_b_proj.", ".wq_b."), (".kv_proj.", ".wkv."), (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."), (".o_b_proj.", ".wo_b."), (".q_a_norm.", ".q_norm."),
    (".gate.e_score_correction_bias", ".gate.bias"),
    (".shared_experts.wgate.", ".shared_experts.w1."), (".shared_experts.down_proj.", ".shared_experts.w2."),
    (".shared_experts.up_proj.", ".shared_experts.w3."),
    (".self_attn.", ".attn."), (".mlp.", ".ffn."),
]


def _inverse(name: str) -> str:
    for engine_part, original_part in _INVERSE:
        name = name.replace(engine_part, original_part)
    return name
