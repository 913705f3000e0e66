#!/usr/bin/env python3
"""DeepSeek-V4-Flash's shapes end to end on one device: decode steps and a prefill, each beside its roofline.

    python scripts/bench_v4.py                                   # a GPU: V4-Flash's widths, as many layers as fit
    python scripts/bench_v4.py --device cpu --hf-overrides '{"hidden_size": 128, ...}' --layers 4 \\
        --batches 1 2 --context 256 --out /tmp/v4_shapes.json    # the same run at tiny shapes

The model is --checkpoint (default docs/configs/deepseek-v4-flash.config.json) with load_format=dummy: random weights
built on the device in the published formats (FP8 linears with 128x128 block scales, MXFP4 experts; weight_format
fp8), its config changed by --hf-overrides and cut to --layers layers (default: as many as fit the device beside the
pools of the largest batch, by scripts/plan_memory.py's plan), DeepSeek's numerics with the fp8 KV cache, decode
steps at static shapes (CUDA graphs on CUDA, the same padded steps eagerly elsewhere).

  decode   B requests (--batches, default 1 16 64 256) whose pools hold --context positions each (default 8192; the
           pages allocated, not computed: a step reads the same entries whatever they hold), one token each at the
           last position: the median of --repeat steps (bench_kernels.Timer: CUDA events, L2 flushed before each).
  prefill  one prompt of --context tokens in one forward (eager): tokens/s.
  --variants V ... --variant-batches B ...  then decode steps at these batches again in each variant, their graphs
           captured anew: the same model, side by side with the steps above. A variant is `pdl` (programmatic
           dependent launch, a Hopper GPU: kernels/common.py, the weight-streaming kernels prefetching their first
           weight lines while they wait), `side_stream` (a layer's independent branches on a second CUDA stream:
           DeepseekV4Model.use_side_stream), both (`pdl+side_stream`), or `pdl+no_prefetch` (scripts/step_variants.py).

Per layer: the step less what runs outside the layers (embedding, hyper-head, norm, LM head; timed alone), over the
layers; extrapolated to the config's own layer count (43 for V4-Flash): outside + layers x per layer.
Roofline: what the step must touch over the rates measured in this run on this device (a device copy: the copy
bandwidth; a matmul in the model's dtype): the weights the batch reaches (footprint.step_weight_bytes: every attention
and shared weight, E (1 - (1 - k/E)^B) of each layer's experts for uniform routing, one embedding row a token) and the
KV entries read at that context (estimate_decode_step.step_work), over the copy bandwidth, or its FLOPs over the
matmul rate where those take longer (a prefill: its FLOPs counted at the mean context, context / 2).

Writes --out (default docs/results/<device>-<date>/v4_shapes.json): a JSON list of objects, one per case at the
layers measured and one extrapolated (`extrapolated`: true), with kind, batch, context, layers, step_ms, roofline_ms,
per_layer_ms, per_layer_roofline_ms, outside_ms, weight_gb, kv_gb, tflop, copy_gbps, matmul_tflops, ratio
(step / roofline), variant ("" for the steps as configured) and, for the prefill, tokens_per_s; the same rows as CSV
beside it (--csv), and a table. Both are written again after each case is measured, so a run cut short keeps what it
measured; a variant that fails is reported and the next one runs (exit status 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench_results import write_csv  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402
from scripts import step_variants  # noqa: E402

FLASH = REPO / "docs" / "configs" / "deepseek-v4-flash.config.json"
GIB = 2**30
DECODE_TOKEN = 2
# Left of the device for what the pools and weights do not count: the prefill's activations (a 8K-token step at
# V4-Flash's widths), the CUDA graphs' pool, the allocator's slack.
RESERVE_GIB = 16.0
CONTEXT_GIB = 0.75  # a CUDA context with torch's kernels loaded, about (what another process's costs the device)


def free_device_gib(other_processes: int = 0) -> float:
    """GiB free on the GPU now (the total less what is already in use: this process's CUDA context, anything else
    on the device), less CONTEXT_GIB for each other process that will hold a context of its own (a server's)."""
    import torch

    return torch.cuda.mem_get_info()[0] / GIB - other_processes * CONTEXT_GIB


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser, checkpoint=str(FLASH))
    parser.set_defaults(load_format="dummy")
    parser.add_argument("--layers", type=int, help="layers of the model (default: as many as fit the device)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=8192, help="positions each decoding request holds; "
                        "the prefill's prompt length")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeat", type=int, default=10, help="timed steps per case (the median is reported)")
    parser.add_argument("--memory-gib", type=float,
                        help="device memory the default --layers must fit (default: what is free on the device, "
                             "on CUDA)")
    parser.add_argument("--variants", nargs="*", default=[], choices=step_variants.TIMED, metavar="V",
                        help=f"decode steps again in these variants ({', '.join(step_variants.TIMED)}), beside the "
                             "ones as configured, in this run")
    parser.add_argument("--variant-batches", type=int, nargs="*", default=[1, 16], metavar="B",
                        help="the batches the variants' decode steps are timed at")
    parser.add_argument("--out", type=Path, help="the JSON (default docs/results/<device>-<date>/v4_shapes.json)")
    parser.add_argument("--csv", type=Path, help="the CSV (default: --out with .csv)")
    return parser.parse_args(argv)


def fitting_layers(config_path, overrides: dict, memory_gib: float, batch: int, context: int) -> int:
    """The most layers (of the config's own) whose weights (as published, fp8) and pools for `batch` + 1 requests of
    `context` positions, fp8, fit `memory_gib` with RESERVE_GIB to spare (scripts/plan_memory.py's plan)."""
    from backend.model.config import load_model_config
    from backend.model.parallel_layout import ParallelLayout
    from scripts.plan_memory import plan

    total = load_model_config(config_path, overrides).num_hidden_layers
    for layers in range(total, 0, -1):
        config = load_model_config(config_path, {**overrides, "num_hidden_layers": layers})
        room = plan(config, "fp8", ParallelLayout(), memory_gib, 1.0, RESERVE_GIB, batch + 1, 64,
                    kv_cache_dtype="fp8")
        if room["fits"] and room["token_capacity_per_device"] >= (batch + 1) * context:
            return layers
    raise SystemExit(f"not one layer of {config_path} fits {memory_gib:g} GiB with the pools of {batch} requests of "
                     f"{context} positions")


def pool_sizes(requests: int, positions: int, window: int = 128, page: int = 64) -> dict:
    """The pool parameters (num_tokens, swa_full_tokens_ratio, page_size) of `requests` requests of `positions`
    positions each and one more prefilling them in one chunk: its window pages and every decode's, in the window
    pool."""
    window_positions = max(requests * (window + 2 * page), positions + window + 2 * page)
    num_tokens = max((requests + 1) * (positions + page), window_positions)
    return dict(num_tokens=num_tokens, swa_full_tokens_ratio=min(1.0, window_positions / num_tokens), page_size=page)


def engine_config(args, overrides: dict, max_batch: int):
    """An EngineConfig whose pools hold `max_batch` decoding requests and one prefill of --context positions."""
    from backend.config import EngineConfig

    return EngineConfig(**dict(checkpoint_settings(args), hf_overrides=overrides), device=args.device,
                        weight_format="fp8", numerics="deepseek", kv_cache_dtype="fp8",
                        max_running_requests=max_batch, max_num_batched_tokens=max(args.context, max_batch),
                        **pool_sizes(max_batch, args.context), enable_prefix_caching=False, cuda_graphs=True)


class Bench:
    """The model and its pools, and the timings of its steps."""

    def __init__(self, torch, args, config):
        from backend.deployment import load_model, plan_deployment
        from backend.model.graph_runner import DecodeGraphs
        from backend.model.comm import Communicator
        from scripts.bench_kernels import Timer

        self.torch, self.args = torch, args
        self.device, self.dtype = config.resolved_device(), config.resolved_dtype()
        self.deployment = plan_deployment(config, self.device, self.dtype)
        self.kv, self.model_config = self.deployment.kv, self.deployment.model_config
        self.model = load_model(config, self.deployment, self.device, self.dtype, self.deployment.layout,
                                Communicator())
        self.graphs = DecodeGraphs(self.model, self.kv, config.max_running_requests, capture=self.device == "cuda")
        self.timer = Timer(torch, torch.device(self.device), args.repeat)

    def use_variant(self, variant: str) -> None:
        """The steps from here on in `variant` (scripts/step_variants.py): their graphs captured anew."""
        from backend.model.graph_runner import DecodeGraphs
        from kernels.common import set_programmatic_dependent_launch

        settings = step_variants.settings(variant)
        set_programmatic_dependent_launch(settings["programmatic_dependent_launch"],
                                          prefetch_weights=step_variants.prefetches_weights(variant))
        self.model.use_side_stream(settings["side_stream"])
        self.graphs = DecodeGraphs(self.model, self.kv, self.graphs.max_rows, capture=self.device == "cuda")

    def decoding(self, count: int, context: int) -> list:
        """`count` requests whose pools hold `context` positions: the compressed pools every entry before the last
        position, the window pool its window (a decode at the last position reads nothing else)."""
        from backend.request import Sequence

        seqs = []
        for i in range(count):
            seq = Sequence(f"decode-{i}", [DECODE_TOKEN] * context)
            seq.num_computed_tokens = context - 1
            self.kv.extend(seq, 1)
            seqs.append(seq)
        return seqs

    def decode_ms(self, seqs: list) -> float:
        from backend.model.forward_batch import BatchRow, build_forward_batch
        from backend.model.staging import BatchStager
        from backend.model.static_batch import static_key

        rows = [BatchRow(s.pages, [DECODE_TOKEN], s.num_computed_tokens, True) for s in seqs]
        key = static_key(rows)
        staged = BatchStager(self.device, depth=1).stage(build_forward_batch(rows, self.kv, pad_to=key))
        return self.timer(lambda: self.graphs.forward(key, staged, lambda _: None))

    def outside_ms(self, rows: int) -> float:
        """What a step runs outside its layers for `rows` rows: the embedding, the hyper-head, the norm, the LM head."""
        torch, weights = self.torch, self.model.w
        ids = torch.full((rows,), DECODE_TOKEN, dtype=torch.long, device=self.device)

        def outside():
            with torch.inference_mode():
                streams = weights["model.embed_tokens.weight"][ids].unsqueeze(1)
                self.model._logits(streams.expand(-1, self.model_config.hc_mult, -1).contiguous(), "model.")

        return self.timer(outside)

    def prefill_ms(self, context: int) -> float:
        from backend.model.forward_batch import BatchRow, build_forward_batch
        from backend.request import Sequence

        seq = Sequence("prefill", [DECODE_TOKEN + i % 100 for i in range(context)])
        self.kv.extend(seq, context)
        batch = build_forward_batch([BatchRow(seq.pages, seq.prompt_ids, 0, True)], self.kv).to(self.device)
        try:
            return self.timer(lambda: self.model.forward(batch, self.kv))
        finally:
            self.kv.free(seq)


def roofline(config, work, logits_rows: int, rates: dict) -> dict:
    """The step's bytes (weights + KV) over the copy bandwidth, or its FLOPs over the matmul rate where those take
    longer; and the same bound of what runs outside the layers (the LM head over `logits_rows` rows)."""
    from scripts.estimate_decode_step import lm_head_flops

    def bound(num_bytes: float, flops: float) -> float:
        return max(num_bytes / (rates["copy_gbps"] * 1e9), flops / (rates["matmul_tflops"] * 1e12)) * 1e3

    weights = sum(work.weights.values())
    outside = bound(work.weights["embed+head"], lm_head_flops(config, logits_rows))
    return dict(roofline_ms=bound(weights + work.kv, work.flops), outside_roofline_ms=outside,
                weight_gb=weights / 1e9, kv_gb=work.kv / 1e9, tflop=work.flops / 1e12)


def case_rows(kind: str, batch: int, context: int, measured: dict, layers: int, full_layers: int, bound: dict,
              full_bound: dict, rates: dict) -> list[dict]:
    """A case at the layers measured, and extrapolated to the config's own layer count."""
    per_layer = (measured["step_ms"] - measured["outside_ms"]) / layers
    per_layer_roofline = (bound["roofline_ms"] - bound["outside_roofline_ms"]) / layers
    row = dict(kind=kind, batch=batch, context=context, layers=layers, extrapolated=False, **measured,
               per_layer_ms=per_layer, per_layer_roofline_ms=per_layer_roofline, **bound, **rates)
    full_step = measured["outside_ms"] + full_layers * per_layer
    full = dict(row, layers=full_layers, extrapolated=True, step_ms=full_step, **full_bound)
    if "tokens_per_s" in row:
        full["tokens_per_s"] = context / full_step * 1e3
    for r in (row, full):
        r["ratio"] = r["step_ms"] / r["roofline_ms"]
    return [row, full]


def run(args, save) -> list[str]:
    """Times every case, handing each case's rows to `save` as it is measured (a run cut short keeps them);
    returns the variants that failed (each one's error printed; the variants after it still run)."""
    import torch

    from backend.model.config import load_model_config
    from scripts.bench_kernels import copy_bandwidth, matmul_rate
    from scripts.estimate_decode_step import step_work

    pdl = any(step_variants.settings(variant)["programmatic_dependent_launch"] for variant in args.variants)
    if pdl:  # (before the model is built: refused at once)
        from backend.deployment import check_programmatic_dependent_launch

        check_programmatic_dependent_launch(args.device)
    if args.variants and args.device != "cuda":
        raise SystemExit("--variants are CUDA's (programmatic dependent launch, a second stream): --device cuda")
    overrides = dict(args.hf_overrides or {})
    max_batch = max(args.batches + (args.variant_batches if args.variants else []))
    if args.layers is None:
        if args.memory_gib is None and args.device != "cuda":
            raise SystemExit("--layers or --memory-gib: the default fits the GPU's memory")
        memory = args.memory_gib or free_device_gib()
        args.layers = fitting_layers(args.checkpoint, overrides, memory, max_batch, args.context)
    full_config = load_model_config(args.checkpoint, overrides)  # the config's own layers
    overrides["num_hidden_layers"] = args.layers
    bench = Bench(torch, args, engine_config(args, overrides, max_batch))
    config, timer, device = bench.model_config, bench.timer, torch.device(bench.device)
    copy_bytes, matmul_n = (2 * GIB, 8192) if device.type == "cuda" else (64 * 2**20, 512)
    rates = dict(copy_gbps=copy_bandwidth(torch, device, timer, copy_bytes),
                 matmul_tflops=matmul_rate(torch, device, timer, matmul_n, bench.dtype))
    print(f"{config.num_hidden_layers} of {full_config.num_hidden_layers} layers ({', '.join(config.layer_types)}); "
          f"{bench.device}: copy {rates['copy_gbps']:.0f} GB/s, matmul {rates['matmul_tflops']:.3g} TFLOP/s",
          flush=True)

    def bounds(batch: int, context: int, logits_rows: int, prefill: bool = False) -> tuple[dict, dict]:
        """At the layers measured and at the config's own. A prefill's: its FLOPs counted at the mean position
        (context / 2) and its weights (every expert reached); the KV entries its queries read are left out (its
        FLOPs bound it)."""
        works = [step_work(c, "tp", 1, batch, context, logits_rows) for c in (config, full_config)]
        return tuple(roofline(c, dataclasses.replace(w, kv=0.0) if prefill else w, logits_rows, rates)
                     for c, w in zip((config, full_config), works))

    def decode_rows(batches: list[int], variant: str) -> None:
        seqs = bench.decoding(max(batches), args.context)
        try:
            for batch in batches:
                measured = dict(step_ms=bench.decode_ms(seqs[:batch]), outside_ms=bench.outside_ms(batch),
                                variant=variant)
                save(case_rows("decode", batch, args.context, measured, config.num_hidden_layers,
                               full_config.num_hidden_layers, *bounds(batch, args.context, batch), rates))
                print(f"decode batch {batch}{f' ({variant})' if variant else ''}: {measured['step_ms']:.2f} ms",
                      flush=True)
        finally:
            for seq in seqs:
                bench.kv.free(seq)

    decode_rows(args.batches, "")
    step = bench.prefill_ms(args.context)
    measured = dict(step_ms=step, outside_ms=bench.outside_ms(1), tokens_per_s=args.context / step * 1e3,
                    variant="")
    save(case_rows("prefill", 1, args.context, measured, config.num_hidden_layers, full_config.num_hidden_layers,
                   *bounds(args.context, args.context // 2, 1, prefill=True), rates))
    failed = []
    for variant in args.variants:  # last: the process keeps the last one
        try:
            bench.use_variant(variant)
            decode_rows(args.variant_batches, variant)
        except Exception:  # (a driver refusing one variant's launches leaves the rows above and the other variants)
            traceback.print_exc()
            print(f"variant {variant} failed", file=sys.stderr, flush=True)
            failed.append(variant)
    return failed


def default_out() -> Path:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    slug = (re.search(r"[A-Z]\d{2,3}", name) or re.search(r"\w+", name)).group(0).lower()
    return REPO / "docs" / "results" / f"{slug}-{datetime.date.today().isoformat()}" / "v4_shapes.json"


def print_table(rows: list[dict]) -> None:
    print(f"\n{'kind':<24} {'batch':>5} {'context':>7} {'layers':>6} | {'step ms':>9} {'roofline':>9} {'x':>5} | "
          f"{'per layer':>9} {'roofline':>9} | {'weights GB':>10} {'KV GB':>7} {'tok/s':>9}")
    for r in rows:
        layers = f"{r['layers']}{'*' if r['extrapolated'] else ''}"
        tokens = f"{r['tokens_per_s']:9.0f}" if "tokens_per_s" in r else f"{'':>9}"
        kind = f"{r['kind']} {r['variant']}".strip()
        print(f"{kind:<24} {r['batch']:>5} {r['context']:>7} {layers:>6} | {r['step_ms']:9.3f} "
              f"{r['roofline_ms']:9.3f} {r['ratio']:5.2f} | {r['per_layer_ms']:9.3f} {r['per_layer_roofline_ms']:9.3f} "
              f"| {r['weight_gb']:10.3f} {r['kv_gb']:7.3f} {tokens}")
    print("(* extrapolated: the steps outside the layers, plus the layers' mean time for each of the config's layers; "
          "a variant's name after its kind: --variants)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_v4.py --device cuda needs a GPU (use --device cpu with small --hf-overrides)", file=sys.stderr)
            return 2
    out, rows = args.out or default_out(), []

    def save(stage: list[dict]) -> None:
        rows.extend(stage)
        out.parent.mkdir(parents=True, exist_ok=True)  # only once there is something to write
        out.write_text(json.dumps(rows, indent=2))
        write_csv(args.csv or out.with_suffix(".csv"), rows, list(dict.fromkeys(k for r in rows for k in r)))

    failed = run(args, save)
    print_table(rows)
    print(f"wrote {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
