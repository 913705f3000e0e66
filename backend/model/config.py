"""DeepSeek-V4 model configuration read from a checkpoint's config.json.

Field names and defaults follow `transformers.DeepseekV4Config` (5.23.0), including its handling
of legacy keys (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, flat YaRN parameters),
so a config.json that the reference accepts means the same thing here. transformers is not
imported at run time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from backend.errors import is_int, is_number

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATE_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


class UnsupportedCheckpoint(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    layer_types: list[str] | None = None
    compress_rates: dict | None = None
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    mlp_layer_types: list[str] | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hidden_act: str = "silu"
    rms_norm_eps: float = 1.0e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = None
    # Quantized checkpoints (DeepSeek's published V4-Flash / V4-Pro): FP8 block-scaled linears, and
    # routed experts in MXFP4 ("fp4") or FP8 ("fp8"; V4-Flash-Base). None: bf16/fp32 weights.
    quantization_config: dict | None = None
    expert_dtype: str | None = None
    num_nextn_predict_layers: int = 0  # the mtp.* draft layers a checkpoint carries (not used)
    qk_rope_head_dim: int = field(init=False, default=0)

    @property
    def csa_rate(self) -> int:
        return self.compress_rates[CSA]

    @property
    def hca_rate(self) -> int:
        return self.compress_rates[HCA]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def layers_of_type(self, layer_type: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == layer_type]


def _normalise(raw: dict, source: str = "config") -> dict:
    """Apply the reference's legacy-key folding and defaults (DeepseekV4Config.__post_init__)."""
    raw = dict(raw)
    legacy_ratios = raw.pop("compress_ratios", None)
    legacy_csa = raw.pop("compress_rate_csa", None)
    legacy_hca = raw.pop("compress_rate_hca", None)
    legacy_hash = raw.pop("num_hash_layers", None)
    legacy_rope_dim = raw.pop("qk_rope_head_dim", None)
    if "rope_scaling" in raw and raw.get("rope_parameters") is None:
        raw["rope_parameters"] = raw.pop("rope_scaling")
    known = {f.name for f in fields(ModelConfig) if f.init}
    cfg = {k: v for k, v in raw.items() if k in known}
    defaults = ModelConfig.__dataclass_fields__
    n = cfg.get("num_hidden_layers", defaults["num_hidden_layers"].default)

    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    if legacy_csa is not None:
        rates[CSA] = legacy_csa
    if legacy_hca is not None:
        rates[HCA] = legacy_hca
    cfg["compress_rates"] = rates

    layer_types = cfg.get("layer_types")
    if layer_types is None and legacy_ratios is not None:
        if unknown := [r for r in legacy_ratios if r not in _RATE_TO_LAYER_TYPE]:
            raise UnsupportedCheckpoint(f"{source}: compress_ratios {unknown} are none of "
                                        f"{sorted(_RATE_TO_LAYER_TYPE)}")
        layer_types = [_RATE_TO_LAYER_TYPE[r] for r in legacy_ratios]
    if layer_types is None:
        interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = [HCA] * min(n, 2) + interleave
    cfg["layer_types"] = list(layer_types[:n])

    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = legacy_hash if legacy_hash is not None else 3
        mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    cfg["mlp_layer_types"] = list(mlp_types[:n])

    head_dim = cfg.get("head_dim", defaults["head_dim"].default)
    if cfg.get("partial_rotary_factor") is None:
        cfg["partial_rotary_factor"] = legacy_rope_dim / head_dim if legacy_rope_dim is not None else 64 / 512
    cfg["rope_parameters"] = _rope_parameters(cfg)
    return cfg


def _rope_parameters(cfg: dict) -> dict:
    """{'main': {...}, 'compress': {...}} as the reference builds it; YaRN applies to 'compress' only."""
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return {label: _yarn_defaults(dict(rp[label]), cfg) for label in ("main", "compress")}
    factor = cfg["partial_rotary_factor"]
    main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": factor}
    yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    if "type" in yarn and "rope_type" not in yarn:
        yarn["rope_type"] = yarn["type"]  # kept too, as the reference keeps it
    compress = {**yarn, "rope_theta": cfg.get("compress_rope_theta", 160000.0), "partial_rotary_factor": factor}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"main": main, "compress": _yarn_defaults(compress, cfg)}


def _yarn_defaults(params: dict, cfg: dict) -> dict:
    """transformers' default for YaRN's original_max_position_embeddings: "if not provided, defaults to
    max_position_embeddings"."""
    if params.get("rope_type", params.get("type")) == "yarn":
        params.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", ModelConfig.max_position_embeddings))
    return params


# Counts and widths: a config (or hf_overrides) setting one to 0 describes no model.
_SIZES = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
          "q_lora_rank", "num_experts_per_tok", "n_routed_experts", "sliding_window", "o_groups", "o_lora_rank",
          "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "max_position_embeddings")


def _validate(config: ModelConfig, source: str) -> None:
    def bad(msg: str) -> UnsupportedCheckpoint:
        return UnsupportedCheckpoint(f"{source}: {msg}")

    if small := [k for k in _SIZES if getattr(config, k) < 1]:
        raise bad(f"{small[0]}={getattr(config, small[0])}: must be at least 1")
    if config.num_experts_per_tok > config.n_routed_experts:
        raise bad(f"num_experts_per_tok={config.num_experts_per_tok} exceeds n_routed_experts={config.n_routed_experts}")
    for name in ("layer_types", "mlp_layer_types"):
        if len(getattr(config, name)) != config.num_hidden_layers:
            raise bad(f"len({name})={len(getattr(config, name))} != num_hidden_layers={config.num_hidden_layers}")
    if unknown := [t for t in config.layer_types if t not in LAYER_TYPES]:
        raise bad(f"unsupported layer_types {unknown}; expected {LAYER_TYPES}")
    if unknown := [t for t in config.mlp_layer_types if t not in MLP_LAYER_TYPES]:
        raise bad(f"unsupported mlp_layer_types {unknown}; expected {MLP_LAYER_TYPES}")
    if config.num_key_value_heads != 1:
        raise bad(f"num_key_value_heads={config.num_key_value_heads}: DeepSeek-V4 uses one shared K=V head")
    if config.scoring_func != "sqrtsoftplus":
        raise bad(f"scoring_func={config.scoring_func!r} is not supported (only 'sqrtsoftplus')")
    if config.hidden_act != "silu":
        raise bad(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
    if config.n_shared_experts != 1:
        raise bad(f"n_shared_experts={config.n_shared_experts} is not supported (only 1)")
    if not config.norm_topk_prob:
        raise bad("norm_topk_prob=false is not supported")
    if config.tie_word_embeddings:
        raise bad("tie_word_embeddings=true is not supported")
    for layer_type in (CSA, HCA):
        rate = config.compress_rates.get(layer_type) if isinstance(config.compress_rates, dict) else None
        if type(rate) is not int or rate < 1:
            raise bad(f"compress_rates[{layer_type!r}]={rate!r}: must be an integer of at least 1")
    _validate_token_ids(config, bad)
    for label, params in config.rope_parameters.items():
        _validate_rope_numbers(label, params, bad)
        if params.get("rope_type", "default") not in ("default", "yarn"):
            raise bad(f"rope_parameters[{label!r}].rope_type={params['rope_type']!r} is not supported")
        rope_dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
        if rope_dim != config.qk_rope_head_dim:  # (the rotary tables' width, against the KV layout's rope columns)
            raise bad(f"rope_parameters[{label!r}] rotates {rope_dim} dims, head_dim * partial_rotary_factor "
                      f"{config.qk_rope_head_dim}: they must agree")
    if config.qk_rope_head_dim % 2 or config.qk_rope_head_dim > min(config.head_dim, config.index_head_dim):
        raise bad(f"rope dim {config.qk_rope_head_dim} must be even and fit head_dim and index_head_dim")
    if (config.num_attention_heads * config.head_dim) % config.o_groups:
        raise bad("num_attention_heads * head_dim must be divisible by o_groups")
    _validate_quantization(config, bad)


# The numbers of a rope_parameters entry the rotary tables read (backend/model/rotary.py), which may be absent or null
# where marked.
_ROPE_NUMBERS = {"rope_theta": False, "partial_rotary_factor": True, "factor": True, "original_max_position_embeddings":
                 True, "attention_factor": True, "mscale": True, "mscale_all_dim": True, "beta_fast": True,
                 "beta_slow": True}


def _validate_rope_numbers(label: str, params, bad) -> None:
    """A rope parameter given as a string would fail only at the rotary tables, after the weights are read."""
    if not isinstance(params, dict):
        raise bad(f"rope_parameters[{label!r}] must be an object, got {params!r}")
    for key, optional in _ROPE_NUMBERS.items():
        value = params.get(key)
        if value is None and optional:
            continue
        if not is_number(value) or value <= 0:
            raise bad(f"rope_parameters[{label!r}].{key}={value!r}: must be a positive number")


def _validate_token_ids(config: ModelConfig, bad) -> None:
    """bos/eos ids inside the vocabulary (an eos id beyond it never ends a request)."""
    named = {"eos_token_id": config.eos_token_ids, "bos_token_id": [config.bos_token_id]}
    for key, tokens in named.items():
        if problem := token_ids_problem(key, [t for t in tokens if t is not None], config.vocab_size):
            raise bad(problem)


def token_ids_problem(key: str, tokens: list, vocab_size: int) -> str | None:
    """What is wrong with ids a config file gives under `key`, or None: each must be a token of the vocabulary."""
    if bad := [token for token in tokens if not is_int(token) or not 0 <= token < vocab_size]:
        return f"{key} {bad[0]!r} is not a token id of the vocabulary [0, {vocab_size})"
    return None


# What DeepSeek's FP8 checkpoints declare, and all this engine reads.
_FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def _validate_quantization(config: ModelConfig, bad) -> None:
    quant = config.quantization_config
    if quant is None:
        if config.expert_dtype not in (None, "bf16", "bfloat16"):
            raise bad(f"expert_dtype={config.expert_dtype!r} without a quantization_config")
        return
    if not isinstance(quant, dict):
        raise bad(f"quantization_config must be an object, got {quant!r}")
    for key, value in _FP8_QUANTIZATION.items():
        if quant.get(key, value) != value:
            raise bad(f"quantization_config.{key}={quant.get(key)!r} is not supported (only {value!r})")
    if quant.get("scale_fmt") not in (None, "ue8m0"):
        raise bad(f"quantization_config.scale_fmt={quant['scale_fmt']!r} is not supported (only 'ue8m0')")
    if list(quant.get("weight_block_size") or [128, 128]) != [128, 128]:
        raise bad(f"quantization_config.weight_block_size={quant['weight_block_size']!r} is not supported "
                  "(only [128, 128])")
    nested = quant.get("expert_dtype")  # (where transformers moves it: V4.1 ships it there)
    if nested is not None and config.expert_dtype is not None and nested != config.expert_dtype:
        raise bad(f"expert_dtype={config.expert_dtype!r} but quantization_config.expert_dtype={nested!r}")
    if config.expert_dtype is None:
        config.expert_dtype = nested or "fp4"  # what a quantized config without the key means
    if config.expert_dtype not in ("fp4", "fp8"):
        raise bad(f"expert_dtype={config.expert_dtype!r} is not supported (fp4 or fp8)")


# Keys config.json may carry beyond ModelConfig's fields: the legacy ones `_normalise` folds in, and their types.
_LEGACY_KEYS = {"compress_ratios": "list", "compress_rate_csa": "int", "compress_rate_hca": "int",
                "num_hash_layers": "int", "qk_rope_head_dim": "int", "rope_scaling": "dict | None"}


def config_keys() -> dict[str, str]:
    """Every key of config.json this engine reads, and its type as annotated (`int`, `float`, `list[str] | None`, ...):
    what `hf_overrides` may set (backend/config.py checks them)."""
    keys = {f.name: f.type for f in fields(ModelConfig) if f.init}
    keys.update(_LEGACY_KEYS)
    return keys


_TYPE_CHECKS = {"int": is_int, "float": is_number, "bool": lambda v: isinstance(v, bool),
                "str": lambda v: isinstance(v, str), "list": lambda v: isinstance(v, list),
                "dict": lambda v: isinstance(v, dict), "None": lambda v: v is None}


def value_fits(value, annotation: str) -> bool:
    """Whether a JSON value fits a field annotation such as `int | list[int] | None`, a list's elements included."""
    return any(_fits_part(value, part.strip()) for part in annotation.split("|"))


def _fits_part(value, annotation: str) -> bool:
    outer, _, inner = annotation.rstrip("]").partition("[")
    if not _TYPE_CHECKS[outer](value):
        return False
    return not inner or all(_TYPE_CHECKS[inner](element) for element in value)


def _check_types(raw: dict, source: str) -> None:
    """Each key this engine reads holds a value of its type (a string for a number, or null for a size, would fail
    deep inside the model's construction, naming nothing)."""
    keys = config_keys()
    for key, value in raw.items():
        if key in keys and not value_fits(value, keys[key]):
            raise UnsupportedCheckpoint(f"{source}: {key}={value!r} is not of type {keys[key]}")


def config_path(checkpoint: str | Path) -> Path:
    """A checkpoint's config.json, or the checkpoint itself when it is a config file (load_format=dummy serves
    docs/configs/*.config.json as they are)."""
    path = Path(checkpoint)
    return path if path.is_file() else path / "config.json"


def checkpoint_directory(checkpoint: str | Path) -> Path:
    """Where a checkpoint's other files (tokenizer, generation_config.json) would be: the directory of its config."""
    return config_path(checkpoint).parent


def load_model_config(checkpoint: str | Path, overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig of `checkpoint` (a directory, or a config.json file); `overrides` (hf_overrides) replace
    config.json's top-level keys before anything is read from it."""
    path = config_path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {checkpoint}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UnsupportedCheckpoint(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise UnsupportedCheckpoint(f"{path} must hold a JSON object, got {type(raw).__name__}")
    source = f"{path} with hf_overrides {overrides}" if overrides else str(path)
    _check_not_shadowed(raw, overrides or {}, source)
    raw.update(overrides or {})
    if raw.get("model_type") != "deepseek_v4":
        raise UnsupportedCheckpoint(f"{source}: model_type is {raw.get('model_type')!r}, expected 'deepseek_v4'")
    return parse_model_config(raw, source)


# A key, and the keys that take precedence over it where config.json has them (`_normalise`, as the reference reads
# them): an override of the first alone would be accepted and change nothing, or change only part of the model.
_SHADOWED_BY = {"rope_theta": ("rope_parameters",), "compress_rope_theta": ("rope_parameters",),
                "rope_scaling": ("rope_parameters",), "partial_rotary_factor": ("rope_parameters",),
                "qk_rope_head_dim": ("partial_rotary_factor", "rope_parameters"),
                "compress_ratios": ("layer_types",), "num_hash_layers": ("mlp_layer_types",),
                "compress_rates": ("compress_rate_csa", "compress_rate_hca")}


def _takes_precedence(shadow: str, value, key: str) -> bool:
    """Whether config.json's `shadow`, holding `value`, is read instead of `key`."""
    if shadow == "rope_parameters" and key != "rope_scaling":  # (the flat keys are read beside a flat YaRN dict;
        return isinstance(value, dict) and isinstance(value.get("main"), dict)  # the nested form replaces them)
    return value is not None


def _check_not_shadowed(raw: dict, overrides: dict, source: str) -> None:
    for key in overrides:
        shadows = [k for k in _SHADOWED_BY.get(key, ())
                   if k not in overrides and _takes_precedence(k, raw.get(k), key)]
        if shadows:
            raise UnsupportedCheckpoint(f"{source}: hf_overrides sets {key!r}, but config.json's {shadows[0]!r} "
                                        f"takes precedence over it: override {shadows[0]!r} instead (or as well)")


def parse_model_config(raw: dict, source: str = "config") -> ModelConfig:
    """A validated ModelConfig from config.json's contents; `source` names it in errors."""
    _check_types(raw, source)
    config = ModelConfig(**_normalise(raw, source))
    config.qk_rope_head_dim = int(config.head_dim * config.partial_rotary_factor)
    _validate(config, source)
    return config
