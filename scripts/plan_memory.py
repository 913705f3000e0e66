#!/usr/bin/env python3
r"""How a DeepSeek-V4 model fits on GPUs: weights per device, KV bytes per token, token capacity.

    .venv/bin/python scripts/plan_memory.py --config docs/configs/deepseek-v4-flash.config.json \
        --tensor-parallel-size 8 --expert-parallel-size 8
    .venv/bin/python scripts/plan_memory.py --checkpoint /data/DeepSeek-V4-Flash --weight-format fp8 --json plan.json

Reads config.json only (no weight). Weights come from backend/model/footprint.py: what the engine
holds with --weight-format `dequantize` (every weight in bf16) or `fp8` (kept as published: FP8
linears, MXFP4 or FP8 experts, with their scales); the published checkpoint's size on disk (with
the mtp.* draft layer) is printed beside them, to compare with the real shards. Per device is what
ONE rank of the parallel layout holds, tensor by tensor (the MTP layer too with --num-speculative-tokens)
(backend/model/parallel_layout.py: split heads and groups, split or sliced experts, the vocabulary-parallel head,
everything else replicated). The KV pools are not split: DeepSeek-V4 has one K=V head and the compressors are
replicated, so every rank keeps the same pools. Capacity = what is left of --gpu-memory-gib x --utilization after
the rank's weights and --reserve-gib of activations, less the sliding windows and compressor state of
--max-running-requests requests and the ring snapshots of --prefix-cache-entries cached prefixes,
divided by the compressed pools' bytes per position.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.memory.kv_manager import KVCacheManager, model_kv_layout  # noqa: E402
from backend.model.config import load_model_config, parse_model_config  # noqa: E402
from backend.model.footprint import weight_bytes  # noqa: E402
from backend.model.parallel_layout import ParallelLayout  # noqa: E402
from kernels.modes import Numerics  # noqa: E402
from scripts.flag_types import at_least  # noqa: E402

GIB = 2**30


def kv_geometry(config, page_size: int, max_running: int, prefix_cache_entries: int = 0,
                prefix_cache_end_entries: int = 0, kv_cache_dtype: str = "bfloat16", speculative_tokens: int = 0) -> dict:
    """Per-position bytes of each pool (bf16 values, or the fp8 layout's bytes), per-request bytes of window +
    compressor state, and the prefix cache's ring snapshots (the compressor state in bf16, or with fp8, which
    implies DeepSeek's numerics, in fp32 as its compressors keep it). Speculative decoding adds the draft layer's
    window, a lookahead to each request's window and positions to the rings."""
    numerics = Numerics.of("deepseek" if kv_cache_dtype == "fp8" else "transformers", quantized_checkpoint=True)
    kv = KVCacheManager(config, num_tokens=1 << 20, swa_full_tokens_ratio=0.25, page_size=page_size,
                        max_running_requests=max_running, dtype=torch.bfloat16, device="meta",
                        kv_layout=model_kv_layout(config, torch.bfloat16, fp8=kv_cache_dtype == "fp8"),
                        state_dtype=numerics.compressor_dtype(torch.bfloat16),
                        draft_layers=1 if speculative_tokens else 0, speculative_tokens=speculative_tokens)
    if prefix_cache_entries:
        kv.enable_prefix_caching(math.lcm(128, page_size), prefix_cache_entries, prefix_cache_end_entries)
    per_token = kv.bytes_per_token()
    window_per_request = kv.window_pool.pages_per_running_request() * page_size * per_token["window"]
    state_per_request = kv.state_pool.bytes_per_slot()
    return {"bytes_per_token": per_token, "window_bytes_per_request": window_per_request,
            "state_bytes_per_request": state_per_request, "snapshot_bytes": kv.state_pool.spare_bytes(),
            "boundary_snapshot_bytes": kv.state_pool.bytes_per_slot(kv.state_pool.light_streams)}


def plan(config, weight_format: str, layout: ParallelLayout, gpu_memory_gib: float, utilization: float,
         reserve_gib: float, max_running: int, page_size: int, prefix_cache_entries: int = 0,
         prefix_cache_end_entries: int = 0, kv_cache_dtype: str = "bfloat16", speculative_tokens: int = 0,
         data_parallel_size: int = 1) -> dict:
    """ConfigError (naming the parameter) when the layout cannot split this model. With `data_parallel_size` D > 1
    (data-parallel attention: `layout` holds the expert split, tensor_parallel_size 1) each of the D ranks holds the
    whole attention, the embeddings and the head, its share of the experts, and pools for its own requests only: the
    capacity in all is D times a device's (`max_running` is then per rank)."""
    layout.check(config)
    prefix_cache_end_entries = min(prefix_cache_end_entries, prefix_cache_entries)  # none without the cache
    draft_layers = 1 if speculative_tokens else 0  # the MTP layer, loaded when speculative decoding serves it
    parts = weight_bytes(config, weight_format, draft_layers=draft_layers)
    published = weight_bytes(config, "published")
    on_disk = sum(published.values())
    per_rank = weight_bytes(config, weight_format, layout=layout, draft_layers=draft_layers,
                            data_parallel=data_parallel_size > 1)
    if not draft_layers:  # (not served: no such part)
        parts.pop("draft layer (mtp)"), per_rank.pop("draft layer (mtp)")
    weights, rank_weights = sum(parts.values()), sum(per_rank.values())
    geometry = kv_geometry(config, page_size, max_running, prefix_cache_entries, prefix_cache_end_entries,
                           kv_cache_dtype, speculative_tokens)
    per_token = geometry["bytes_per_token"]
    compressed_per_position = sum(v for k, v in per_token.items() if k != "window")
    budget = gpu_memory_gib * GIB * utilization - rank_weights - reserve_gib * GIB
    per_request = geometry["window_bytes_per_request"] + geometry["state_bytes_per_request"]
    # Prefix caching keeps a copy of the compressor rings per cached entry (backend/memory/prefix_cache.py): all of
    # them for a request's end, the CSA and indexer rings for a block boundary.
    snapshot_bytes = geometry["snapshot_bytes"]
    kv_budget = budget - max_running * per_request - snapshot_bytes
    capacity = max(0, int(kv_budget // compressed_per_position))
    return {
        "weight_format": weight_format, "kv_cache_dtype": kv_cache_dtype, "num_speculative_tokens": speculative_tokens,
        "num_gpus": max(layout.world_size, data_parallel_size), "data_parallel_size": data_parallel_size,
        "tensor_parallel_size": layout.tensor_parallel_size, "expert_parallel_size": layout.expert_parallel_size,
        "gpu_memory_gib": gpu_memory_gib, "weights_bytes": weights, "weights_by_part": parts,
        "weights_per_device_bytes": rank_weights, "weights_per_device_by_part": per_rank,
        "published_on_disk_bytes": on_disk, "published_draft_layer_bytes": published["draft layer (mtp)"],
        "kv_bytes_per_position": per_token, "kv_bytes_per_running_request": per_request,
        "prefix_cache_entries": prefix_cache_entries, "prefix_cache_end_entries": prefix_cache_end_entries,
        "prefix_cache_snapshot_bytes": snapshot_bytes,
        "prefix_cache_bytes_per_entry": {"request end": geometry["state_bytes_per_request"],
                                         "block boundary": geometry["boundary_snapshot_bytes"]},
        "fits": kv_budget > 0, "token_capacity_per_device": capacity,
        # the pools of data-parallel ranks hold different requests; tensor/expert-parallel ranks all hold the same
        "token_capacity_total": capacity * data_parallel_size,
    }


def print_plan(row: dict) -> None:
    if row["num_speculative_tokens"]:
        print(f"speculative decoding: {row['num_speculative_tokens']} drafts per decode (the MTP layer served)")
    print(f"weights ({row['weight_format']}): {row['weights_bytes'] / GIB:.1f} GiB in all, "
          f"{row['weights_per_device_bytes'] / GIB:.1f} GiB per device on {row['num_gpus']} GPU(s) of "
          f"{row['gpu_memory_gib']:g} GiB (data_parallel_size={row['data_parallel_size']}, "
          f"tensor_parallel_size={row['tensor_parallel_size']}, expert_parallel_size={row['expert_parallel_size']})")
    print(f"  {'':>17}  {'all':>9}  {'per device':>10}")
    for part, size in row["weights_by_part"].items():
        print(f"  {part:>17}: {size / GIB:8.2f}  {row['weights_per_device_by_part'][part] / GIB:10.2f} GiB")
    print(f"published checkpoint on disk (with the mtp layer, {row['published_draft_layer_bytes'] / GIB:.2f} GiB): "
          f"{row['published_on_disk_bytes']:,} bytes")
    per_token = ", ".join(f"{k} {v:.1f}" for k, v in row["kv_bytes_per_position"].items())
    print(f"KV bytes per position ({row['kv_cache_dtype']}): {per_token}; "
          f"per running request (window + compressor state): "
          f"{row['kv_bytes_per_running_request'] / 2**20:.1f} MiB")
    if row["prefix_cache_entries"]:
        per_entry = row["prefix_cache_bytes_per_entry"]
        print(f"prefix cache: {row['prefix_cache_entries']} entries' compressor-ring snapshots "
              f"({row['prefix_cache_end_entries']} request ends of {per_entry['request end'] / 2**20:.1f} MiB, "
              f"block boundaries of {per_entry['block boundary'] / 2**20:.1f} MiB) take "
              f"{row['prefix_cache_snapshot_bytes'] / GIB:.2f} GiB per device")
    if row["fits"]:
        print(f"token capacity per device: {row['token_capacity_per_device']:,} positions; in all: "
              f"{row['token_capacity_total']:,} ({'each data-parallel rank holds its own requests' if row['data_parallel_size'] > 1 else 'every rank holds the same pools'})")
    else:
        print("does not fit: the weights (and reserve) exceed the device memory")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a checkpoint directory (its config.json)")
    source.add_argument("--config", type=Path, help="a config.json file")
    parser.add_argument("--weight-format", choices=["dequantize", "fp8"], default="fp8")
    parser.add_argument("--gpu-memory-gib", type=float, default=140.4,
                        help="device memory (default an H200's: it reports 143,771 MiB)")
    parser.add_argument("--tensor-parallel-size", type=at_least(1), default=1)
    parser.add_argument("--expert-parallel-size", type=at_least(1), default=1)
    parser.add_argument("--data-parallel-size", type=at_least(1), default=1,
                        help="data-parallel attention: ranks each holding the whole attention and pools for their own "
                             "requests (with --tensor-parallel-size 1; --expert-parallel-size 1 or the same)")
    parser.add_argument("--utilization", type=float, default=0.9, help="fraction of device memory to use")
    parser.add_argument("--reserve-gib", type=float, default=4.0, help="activations and workspace per device")
    parser.add_argument("--max-running-requests", type=at_least(1), default=64)
    parser.add_argument("--page-size", type=at_least(1), default=64)
    parser.add_argument("--prefix-cache-entries", type=at_least(0),
                        default=EngineConfig.prefix_cache_entries if EngineConfig.enable_prefix_caching else 0,
                        help="the engine's prefix_cache_entries, 0 with enable_prefix_caching=false (each entry's "
                             "ring snapshot takes memory); default: the engine's default")
    parser.add_argument("--prefix-cache-end-entries", type=at_least(0), default=EngineConfig.prefix_cache_end_entries,
                        help="the engine's prefix_cache_end_entries (of the entries, the requests' ends, whose "
                             "snapshots also hold the HCA ring)")
    parser.add_argument("--kv-cache-dtype", choices=["bfloat16", "fp8", "both"], default="both",
                        help="what the pools store (fp8: DeepSeek's 584-byte entries and FP4 indexer keys); both: "
                             "the two plans and their ratios")
    parser.add_argument("--num-speculative-tokens", type=at_least(0), default=EngineConfig.num_speculative_tokens,
                        help="speculative decoding's drafts per decode: the MTP layer's weights and window, the "
                             "lookahead and longer compressor rings count too")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.prefix_cache_entries and args.prefix_cache_end_entries > args.prefix_cache_entries:
        parser.error("--prefix-cache-end-entries: at most --prefix-cache-entries, of which the ends are a part")
    try:
        if args.checkpoint is not None:
            config = load_model_config(args.checkpoint)
        else:
            config = parse_model_config(json.loads(args.config.read_text(encoding="utf-8")), str(args.config))
    except (OSError, ValueError) as exc:  # (no such file, not JSON, not a DeepSeek-V4 config)
        parser.error(f"--{'checkpoint' if args.checkpoint is not None else 'config'}: {exc}")
    if args.data_parallel_size > 1 and (args.tensor_parallel_size != 1
                                        or args.expert_parallel_size not in (1, args.data_parallel_size)):
        parser.error("--data-parallel-size: with --tensor-parallel-size 1 and --expert-parallel-size 1 or the same")
    layout = ParallelLayout(args.tensor_parallel_size, args.expert_parallel_size)
    dtypes = ["bfloat16", "fp8"] if args.kv_cache_dtype == "both" else [args.kv_cache_dtype]
    try:
        rows = [plan(config, args.weight_format, layout, args.gpu_memory_gib, args.utilization, args.reserve_gib,
                     args.max_running_requests, args.page_size, args.prefix_cache_entries,
                     args.prefix_cache_end_entries, dtype, args.num_speculative_tokens, args.data_parallel_size)
                for dtype in dtypes]
    except ValueError as exc:  # (a layout the model cannot be split by, a page size the pools cannot take: named)
        parser.error(str(exc))
    for row in rows:
        print_plan(row)
    if len(rows) == 2:
        print_ratios(*rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2))


def print_ratios(bf16: dict, fp8: dict) -> None:
    """fp8 over bf16, pool by pool, and the capacity the fp8 layout frees."""
    ratios = ", ".join(f"{name} {fp8['kv_bytes_per_position'][name] / size:.3f}"
                       for name, size in bf16["kv_bytes_per_position"].items())
    capacity = (f"{fp8['token_capacity_per_device'] / bf16['token_capacity_per_device']:.2f}x"
                if bf16["token_capacity_per_device"] else "n/a")
    print(f"fp8 / bf16 bytes per position: {ratios}; token capacity {capacity}")


if __name__ == "__main__":
    main()
