"""A deployment, decided before any weight is read: what every rank plans the same way, and loads.

    deployment = plan_deployment(config, device, dtype)   # config.json, the layout, formats, numerics, the pools
    model = load_model(config, deployment, device, dtype, layout, comm)   # this rank's shard

Rank 0's engine (backend/engine.py) and every worker rank (backend/parallel/group.py) call these two, so a worker
imports only what a forward needs: not the engine, the tokenizer, the scheduler or the sampler. Every choice the
config leaves to `auto` (weight format, numerics, KV cache dtype) is resolved here once, from the config and the
checkpoint's config.json, and refused with a ConfigError naming the parameter when it cannot work. The numerics and
the KV cache's layout become typed objects here (kernels/modes.py), which the pools, the kernel dispatch and the model
are built with.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial

import torch

from backend.config import ConfigError, EngineConfig
from backend.host_memory import keep_freed_host_memory
from backend.memory.kv_manager import KVCacheManager, model_kv_layout
from backend.model.checkpoint import check_quantized_parts, load_weights, tensor_names
from backend.model.comm import Communicator
from backend.model.config import ModelConfig, load_model_config
from backend.model.dummy_weights import dummy_weights
from backend.model.deepseek_v4 import DeepseekV4Model
from backend.model.parallel_layout import ParallelLayout
from backend.model.weight_names import draft_layer_index
from kernels.common import set_programmatic_dependent_launch
from kernels.dispatch import KernelDispatch, default_mode
from kernels.modes import KVLayout, Numerics

logger = logging.getLogger(__name__)


@dataclass
class Deployment:
    """What a config and its checkpoint resolve to (the same on every rank), and this rank's memory pools."""

    model_config: ModelConfig
    layout: ParallelLayout  # the ranks' split (rank 0's view; a worker loads with its own rank)
    weight_format: str  # "dequantize" or "fp8"
    numerics: Numerics
    kv_layout: KVLayout
    draft_layers: int  # the MTP layers loaded for speculative decoding (0: none)
    kv: KVCacheManager


def _out_of_memory(exc: RuntimeError) -> bool:
    return "alloc" in str(exc).lower() or "memory" in str(exc).lower()


def _memory_pools(config: EngineConfig, model_config, dtype, device, kv_layout: KVLayout,
                  numerics: Numerics) -> KVCacheManager:
    """The pools the config asks for; ConfigError when they could not serve a single request. The compressor rings
    are kept in the numerics' compressor dtype (DeepSeek's compressors project, keep state and pool in fp32)."""
    speculative = config.num_speculative_tokens
    if speculative:
        _check_draft_layer(config, model_config)
    try:
        kv = KVCacheManager(model_config, num_tokens=config.num_tokens,
                            swa_full_tokens_ratio=config.swa_full_tokens_ratio, page_size=config.page_size,
                            max_running_requests=config.max_running_requests, dtype=dtype, device=device,
                            max_step_tokens=config.max_num_batched_tokens, kv_layout=kv_layout,
                            state_dtype=numerics.compressor_dtype(dtype),
                            draft_layers=1 if speculative else 0, speculative_tokens=speculative)
    except (MemoryError, RuntimeError) as exc:  # (torch's out-of-memory errors are RuntimeErrors)
        if isinstance(exc, RuntimeError) and not _out_of_memory(exc):
            raise
        why = f"{type(exc).__name__}: {str(exc)[:200] or 'no message'}"
        raise ConfigError(f"parameters 'num_tokens' ({config.num_tokens}), 'page_size' ({config.page_size}) and "
                          f"'max_running_requests' ({config.max_running_requests}): the pools do not fit the "
                          f"{torch.device(device).type} memory ({why}); scripts/plan_memory.py sizes them") from exc
    if kv.max_request_positions() == 0:
        window = kv.window_pool
        if speculative:
            raise ConfigError(
                f"parameter 'num_speculative_tokens': a decode with {speculative} drafts holds "
                f"{window.pages_per_running_request()} window pages, more than the {window.num_pages} of the window "
                "pool: lower num_speculative_tokens, or raise num_tokens or swa_full_tokens_ratio")
        raise ConfigError(
            f"parameter 'swa_full_tokens_ratio': the window pool holds {window.num_pages} pages of {config.page_size} "
            f"positions (num_tokens * swa_full_tokens_ratio), fewer than one sliding window needs "
            f"({window.pages_per_running_request()}); raise num_tokens or swa_full_tokens_ratio, or lower page_size")
    _check_running_windows(config, kv.window_pool)
    return kv


def _check_running_windows(config: EngineConfig, window) -> None:
    """max_running_requests decoding requests each hold their sliding window's pages: a window pool short of them
    makes long decodes evict each other, step after step, and leaves prefills a one-page chunk. A warning, not a
    refusal: short requests hold fewer pages, and a pool sized for them serves them."""
    each = window.pages_per_running_request()
    if config.max_running_requests * each > window.num_pages:
        logger.warning(
            "max_running_requests=%d decoding requests hold %d window pages (%d each: a sliding window and the page "
            "it straddles), more than the window pool's %d (num_tokens * swa_full_tokens_ratio / page_size): past "
            "%d requests whose windows are full, decodes evict each other. Lower max_running_requests to %d or "
            "raise num_tokens or swa_full_tokens_ratio", config.max_running_requests,
            config.max_running_requests * each, each, window.num_pages, window.num_pages // each,
            window.num_pages // each)


def _check_draft_layer(config: EngineConfig, model_config) -> None:
    """Speculative decoding drafts with the checkpoint's MTP layer: config.json must declare one, and (weights read
    from files) the files must hold it. transformers' save_pretrained writes config.json's num_nextn_predict_layers but
    not the layer, so the tensor index (or the files' headers: no weight is read) is checked here, before the load."""
    problem = None
    if model_config.num_nextn_predict_layers < 1:
        problem = "has none (num_nextn_predict_layers is 0 in its config.json)"
    elif config.load_format != "dummy" and 0 not in map(draft_layer_index, tensor_names(config.checkpoint)):
        problem = ("declares one in its config.json (num_nextn_predict_layers >= 1) but its files hold no mtp.0.* "
                   "tensor (what transformers' save_pretrained writes)")
    if problem:
        raise ConfigError(f"parameter 'num_speculative_tokens': {config.num_speculative_tokens} drafts with the "
                          f"checkpoint's MTP layer (mtp.0.*), and {config.checkpoint} {problem}: set "
                          "num_speculative_tokens to 0")


def resolve_weight_format(config: EngineConfig, model_config, device: str) -> str:
    """`auto`: keep a quantized checkpoint quantized on CUDA (V4-Flash does not fit any GPU in bf16),
    dequantize on CPU; `fp8` needs a quantized checkpoint."""
    quantized = model_config.quantization_config is not None
    if config.weight_format == "auto":
        return "fp8" if quantized and device == "cuda" else "dequantize"
    if config.weight_format == "fp8" and not quantized:
        raise ConfigError("parameter 'weight_format': 'fp8' needs a quantized (FP8) checkpoint; this one has no "
                          "quantization_config")
    return config.weight_format


def resolve_kv_layout(config: EngineConfig, model_config, numerics: Numerics, device: str, dtype) -> KVLayout:
    """What the pools store: DeepSeek's fp8 byte layout, or values of a float dtype. `auto`: fp8 where DeepSeek's
    numerics run on CUDA (the memory it frees is the point) or on a quantized checkpoint (the layout its model was
    trained for), else the model's dtype."""
    roundings = numerics.round_kv_entries and numerics.round_indexer  # what the fp8 layout holds exactly
    if config.kv_cache_dtype == "fp8":
        problem = _kv_groups_problem(model_config)
        if problem:
            raise ConfigError(f"parameter 'kv_cache_dtype': the fp8 layout needs {problem}")
        if not roundings:
            raise ConfigError("parameter 'kv_cache_dtype': 'fp8' stores DeepSeek's roundings of the entries and its "
                              "rotated indexer keys, which numerics=transformers does not compute: set "
                              "numerics=deepseek (or auto, on a DeepSeek checkpoint)")
        return model_kv_layout(model_config, dtype, fp8=True)
    if config.kv_cache_dtype == "bfloat16" and dtype != torch.bfloat16:
        raise ConfigError(f"parameter 'kv_cache_dtype': 'bfloat16' needs dtype bfloat16 (the pools store the "
                          f"model's values), this deployment computes in {dtype}; use auto or fp8")
    quantized = model_config.quantization_config is not None
    fp8 = config.kv_cache_dtype == "auto" and roundings and (device == "cuda" or quantized)
    return model_kv_layout(model_config, dtype, fp8=fp8)


def resolve_numerics(config: EngineConfig, model_config, layout: ParallelLayout) -> Numerics:
    """DeepSeek's or transformers'. `auto`: DeepSeek's numerics on a quantized checkpoint its roundings apply to
    (DeepSeek's published checkpoints: the model was trained with them), transformers' otherwise (the unquantized
    checkpoints, the built-in one among them, are what transformers is the reference for). `deepseek` on a checkpoint
    the roundings cannot apply to is refused naming the parameter."""
    problem = _kv_groups_problem(model_config) or _linear_groups_problem(model_config, layout)
    if config.numerics == "deepseek" and problem:
        raise ConfigError(f"parameter 'numerics': 'deepseek' needs {problem}")
    quantized = model_config.quantization_config is not None
    name = config.numerics
    if name == "auto":
        name = "deepseek" if quantized and not problem else "transformers"
    return Numerics.of(name, quantized_checkpoint=quantized)


def _kv_groups_problem(c) -> str | None:
    """Why DeepSeek's KV roundings (nope values by 64, rotated indexer keys by 32) cannot apply, or None. (The
    attention kernel reads an entry in two halves of whole 64-column groups: head_dim a multiple of 128.)"""
    nope, index_dim = c.head_dim - c.qk_rope_head_dim, c.index_head_dim
    if c.head_dim % 128 or nope <= 0 or nope % 64 or index_dim % 32 or index_dim & (index_dim - 1):
        return (f"head_dim a multiple of 128, head_dim - rope dims a multiple of 64 and index_head_dim a power of "
                f"two of at least 32 (DeepSeek-V4: 512, 448 and 128); this checkpoint has {c.head_dim}, {nope} and "
                f"{index_dim}")
    return None


def _linear_groups_problem(c, layout: ParallelLayout) -> str | None:
    """Why the act_quant of a quantized checkpoint's FP8/FP4 linears' inputs (groups of 128, each rank's slice of a
    split input too) cannot apply, or None."""
    if c.quantization_config is None:
        return None
    split = layout.tensor_parallel_size
    inputs = {"hidden_size": c.hidden_size, "q_lora_rank": c.q_lora_rank,
              "o_groups * o_lora_rank / tensor_parallel_size": c.o_groups * c.o_lora_rank // split,
              "moe_intermediate_size / tensor_parallel_size": c.moe_intermediate_size // split}
    bad = {name: width for name, width in inputs.items() if width % 128}
    if bad:
        return (f"on a quantized checkpoint the FP8 linears' inputs in groups of 128, which {bad} do not divide into "
                f"(DeepSeek-V4: 4096, 1024, 8192, 2048)")
    return None


def plan_deployment(config: EngineConfig, device, dtype, model_config: ModelConfig | None = None) -> Deployment:
    """Everything decided before a weight is read, the memory pools on `device` included (`model_config`: the
    checkpoint's, where the caller read it already). Raises ConfigError / UnsupportedCheckpoint naming what to
    change."""
    if str(device) == "cpu":  # every rank plans its pools here: its CPU steps' temporaries are reused from now on
        keep_freed_host_memory()
    model_config = model_config or load_model_config(config.checkpoint, config.hf_overrides)
    layout = ParallelLayout.from_config(config)
    layout.check(model_config)
    weight_format = resolve_weight_format(config, model_config, config.resolved_device())
    if weight_format == "fp8":  # (every rank's parts of the weights kept quantized: on their scales' block grid)
        for rank in range(layout.world_size):
            check_quantized_parts(model_config, ParallelLayout.from_config(config, rank),
                                  1 if config.num_speculative_tokens else 0)
    numerics = resolve_numerics(config, model_config, layout)
    kv_layout = resolve_kv_layout(config, model_config, numerics, config.resolved_device(), dtype)
    kv = _memory_pools(config, model_config, dtype, device, kv_layout, numerics)
    if config.enable_prefix_caching:
        try:
            kv.enable_prefix_caching(math.lcm(128, config.page_size), config.prefix_cache_entries,
                                     config.prefix_cache_end_entries)
        except (MemoryError, RuntimeError) as exc:  # (its snapshot slots: a ring state of every layer each)
            if isinstance(exc, RuntimeError) and not _out_of_memory(exc):
                raise
            raise ConfigError(f"parameters 'prefix_cache_entries' ({config.prefix_cache_entries}) and "
                              f"'prefix_cache_end_entries' ({config.prefix_cache_end_entries}): the prefix cache's "
                              f"snapshots do not fit the {torch.device(device).type} memory "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    return Deployment(model_config, layout, weight_format, numerics, kv_layout,
                      1 if config.num_speculative_tokens else 0, kv)


def load_model(config: EngineConfig, deployment: Deployment, device, dtype, layout: ParallelLayout,
               comm: Communicator, kernel_mode: str | None = None) -> DeepseekV4Model:
    """The shard of rank `layout.rank` (all of the model on one rank), its MTP layers too when speculative decoding
    serves them, with its kernel dispatch (the deployment's numerics; `kernel_mode` overrides the config's choice,
    e.g. "triton" for the kernels under Triton's interpreter on CPU): read from the checkpoint, or with
    load_format=dummy built at random on `device` (backend/model/dummy_weights.py)."""
    if config.programmatic_dependent_launch:  # (before a weight is read: a device without it hears at once)
        check_programmatic_dependent_launch(device)
    build = dummy_weights if config.load_format == "dummy" else partial(load_weights, config.checkpoint)
    weights = build(deployment.model_config, dtype, device, deployment.weight_format, layout=layout,
                    draft_layers=deployment.draft_layers)
    kernels = KernelDispatch(kernel_mode or default_mode(config.use_reference_kernels), deployment.numerics)
    set_programmatic_dependent_launch(config.programmatic_dependent_launch)
    return DeepseekV4Model(deployment.model_config, weights, device, dtype, kernels, layout=layout, comm=comm,
                           side_stream=config.side_stream)


def check_programmatic_dependent_launch(device) -> None:
    """ConfigError, naming the parameter, unless `device` has programmatic dependent launch (kernels/common.py): a
    CUDA device of compute capability 9.0 or more."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (9, 0):
        found = f"compute capability {capability[0]}.{capability[1]}" if capability else "no CUDA device"
        raise ConfigError(f"programmatic_dependent_launch=true needs a CUDA device of compute capability 9.0 or more "
                          f"(Hopper); {device} has {found}")


def check_deployment(config: EngineConfig) -> int:
    """plan_deployment without allocating anything (the pools on the meta device); returns the prefill chunk budget.
    What make_model_repository.py checks before writing a repository."""
    from backend.scheduler.policies import resolve_prefill_chunk_tokens

    return resolve_prefill_chunk_tokens(config, plan_deployment(config, "meta", config.resolved_dtype()).kv)
