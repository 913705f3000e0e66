#!/usr/bin/env python
"""Tune the hot kernels' tiles on this device at DeepSeek-V4-Flash's shapes; write kernels/configs/<device>.json.

vLLM's convention for tuned Triton kernels (benchmark_moe.py --tune), read back by the launch plans through
kernels/tuning.py. For each sweep (a kernel at one of bench_kernels.py's V4-Flash shapes) and each count (the decode
batches and the prefill chunk), the plan is run once to learn the shape key and default it asks kernels/tuning.py
with; every candidate (the default with one of a few changes laid over it) then runs through the kernel's own
wrapper as its tuned configuration, is checked against the torch reference (bench_kernels.py's tolerances) and, if
right, timed (bench_kernels.Timer: CUDA events, L2 flushed). A candidate that does not compile, is refused by the
plan or is wrong is skipped; what the fastest changes of the default is written, {} where no candidate is 3 % faster
than the default (cases sharing a key and count, as the FP8 linears of one width, are timed together): a plan at
another count lays it over its own default (kernels/tuning.py). A sweep that fails (out of memory, say) leaves its
kernel untuned and the others run. The sweep is estimated first: --budget-s drops the sweeps that do not fit, last
first, and no candidate starts once the budget is spent (what was timed is written); under scripts/gpu_check.sh the
budget is at most the part's limit less STARTUP_S (PART_LIMIT_S).

  python scripts/tune_kernels.py                                  # a GPU: every sweep, kernels/configs/<device>.json
  python scripts/tune_kernels.py --sweeps attention --budget-s 120
  python scripts/tune_kernels.py --device cpu --tiny --out FILE   # the machinery under the interpreter: tiny shapes,
                                                                  # two candidates that are not the default
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench_kernels import (DRY, FULL, TOLERANCES, Timer, _max_error, _to_float, attention_cases,  # noqa: E402
                                   attention_inputs, fp4_indexer_inputs, fp8_attention_inputs, fp8_layout_shapes,
                                   fp8_linear_weight, indexer_cases, indexer_inputs, moe_inputs, moe_weights,
                                   quantized_experts, _dequantized_bf16)

COMPILE_S = 3.0  # a guess at one variant's JIT compile on the GPU machine, for the estimate
STARTUP_S = 45.0  # imports, the first sweep's inputs and the writes: what a part's limit leaves out of the budget


@dataclass
class Sweep:
    """One kernel at one shape. cases(torch, device) yields (run the kernel, compute the reference's output) lazily;
    patches: the candidates' changes to the plan's default (a dict, or a function of the default giving one). For the
    estimate: run_ms, a guess at one run; variants, the kernels compiled per candidate; cases_per_count."""
    name: str
    kernel: str  # as the plan asks kernels/tuning.py
    cases: Callable[..., Iterator[tuple[Callable, Callable]]]
    patches: list
    run_ms: float
    variants: int = 1
    cases_per_count: int = 1


# --- the sweeps ---------------------------------------------------------------------------------------------------
def _attention_sweep(s, mode: str, fp8: bool, patches) -> Sweep:
    def cases(torch, device):
        from kernels.attention import sparse_paged_attention_reference, sparse_paged_attention_triton

        shapes = fp8_layout_shapes(s) if fp8 else s
        for case_mode, _name, positions in attention_cases(shapes):
            if case_mode != mode:
                continue
            if fp8:
                args, kwargs, values = fp8_attention_inputs(torch, shapes, device, positions, mode)
            else:
                args, kwargs = attention_inputs(torch, shapes, device, positions, mode)
                values = _to_float(torch, kwargs)
            yield (lambda a=args, k=kwargs: sparse_paged_attention_triton(*a, **k),
                   lambda a=args, v=values: sparse_paged_attention_reference(*_to_float(torch, a), **v))
    kv = "fp8" if fp8 else "bf16"
    return Sweep(f"attention {mode} {kv}", "attention", cases, patches, run_ms=2.0 if fp8 else 0.5, variants=2)


def _indexer_sweep(s, fp4: bool, patches) -> Sweep:
    def cases(torch, device):
        from kernels.indexer import indexer_scores_reference, indexer_scores_triton

        shapes = fp8_layout_shapes(s) if fp4 else s
        for _name, positions in indexer_cases(shapes):
            if fp4:
                args, values = fp4_indexer_inputs(torch, shapes, device, positions)
            else:
                args = indexer_inputs(torch, shapes, device, positions)
                values = _to_float(torch, args)
            yield lambda a=args: indexer_scores_triton(*a), lambda v=values: indexer_scores_reference(*v)
    return Sweep(f"indexer {'fp4' if fp4 else 'bf16'} keys", "indexer", cases, patches, run_ms=0.3)


def _moe_sweep(s, fmt: str, patches) -> Sweep:
    """fmt bf16: dense experts; fp8 / mxfp4: as published, with DeepSeek's numerics (the routing weight first, the
    down projection's input act_quant'ed), as the engine serves them."""
    def cases(torch, device):
        from kernels.moe import fused_moe_reference, fused_moe_triton

        gen = torch.Generator(device=device).manual_seed(1)
        if fmt == "bf16":
            weights = reference_weights = moe_weights(torch, s, device)
            order = {}
        else:
            weights = (quantized_experts(torch, device, fmt, s.num_experts, 2 * s.moe_inter, s.hidden, 2, gen),
                       quantized_experts(torch, device, fmt, s.num_experts, s.hidden, s.moe_inter, 1, gen))
            reference_weights = tuple(_dequantized_bf16(torch, w) for w in weights)
            order = dict(deepseek_order=True, quantize_hidden=True)
        for tokens in [*s.moe_decode_tokens, s.prefill_tokens]:
            x, ids, topk_weights, *_ = moe_inputs(torch, s, device, tokens, reference_weights)
            yield (lambda x=x, i=ids, w=topk_weights: fused_moe_triton(x, i, w, *weights, 10.0, **order),
                   lambda x=x, i=ids, w=topk_weights: fused_moe_reference(x, i, w, *reference_weights, 10.0, **order))
    return Sweep(f"moe {fmt}", "moe", cases, patches, run_ms=10.0, variants=2)


def _fp8_gemm_sweep(s, patches) -> Sweep:
    """Every FP8 linear of V4-Flash; the plan's key is the output width, so linears of one width are tuned together."""
    def cases(torch, device):
        from kernels.fp8_gemm import fp8_gemm_reference, fp8_gemm_triton

        gen = torch.Generator(device=device).manual_seed(0)
        for n, k in s.fp8_linears.values():
            w_q, w_scale = fp8_linear_weight(torch, device, n, k, gen)
            for tokens in [*s.decode_batches, s.prefill_tokens]:
                x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
                yield (lambda x=x, w=w_q, sc=w_scale: fp8_gemm_triton(x, w, sc),
                       lambda x=x, w=w_q, sc=w_scale: fp8_gemm_reference(x.float(), w, sc))
    return Sweep("fp8 gemm", "fp8_gemm", cases, patches, run_ms=0.3, cases_per_count=len(s.fp8_linears))


def _fp32_linear_sweep(s, patches) -> Sweep:
    """DeepSeek's fp32 LM head over its bf16 weight (the router shares the kernel, its own shape untuned)."""
    def cases(torch, device):
        from kernels.fp32_linear import fp32_linear_reference, fp32_linear_triton

        gen = torch.Generator(device=device).manual_seed(2)
        weight = (torch.randn(s.vocab, s.hidden, generator=gen, device=device) * s.hidden ** -0.5).to(torch.bfloat16)
        for tokens in s.decode_batches:
            x = torch.randn(tokens, s.hidden, generator=gen, device=device).to(torch.bfloat16)
            yield (lambda x=x: fp32_linear_triton(x, weight),
                   lambda x=x: fp32_linear_reference(x.double(), weight.double()).float())
    return Sweep("fp32 linear lm head", "fp32_linear", cases, patches, run_ms=0.3)


def _grouped_fp8_sweep(s, patches) -> Sweep:
    """The attention output's o_a_proj kept FP8."""
    def cases(torch, device):
        from kernels.fp8_gemm import Fp8Weight
        from kernels.grouped_linear import grouped_linear_reference, grouped_linear_triton

        gen = torch.Generator(device=device).manual_seed(3)
        k = s.num_heads * s.head_dim // s.o_groups
        weight = Fp8Weight(*fp8_linear_weight(torch, device, s.o_groups * s.o_lora_rank, k, gen))
        for tokens in [*s.decode_batches, s.prefill_tokens]:
            x = torch.randn(tokens, s.o_groups, k, generator=gen, device=device).to(torch.bfloat16)
            yield (lambda x=x: grouped_linear_triton(x, weight),
                   lambda x=x: grouped_linear_reference(x.float(), weight))
    return Sweep("grouped fp8 o_a", "grouped_fp8", cases, patches, run_ms=0.05)


def _halve(name: str, floor: int = 16):
    return lambda d: {name: max(floor, d[name] // 2)}


def _double(name: str):
    return lambda d: {name: d[name] * 2}


def v4_flash_sweeps() -> list[Sweep]:
    """A few candidates each, around the plans' own choices, in order of what V4-Flash's decode spends."""
    s = FULL
    attention = [_double("BLOCK_N"), _halve("BLOCK_N"), dict(BLOCK_H=16, num_warps=4),
                 lambda d: dict(num_stages=1 if d["num_stages"] > 1 else 2)]
    fp8_attention = [dict(BLOCK_H=16, num_warps=4), lambda d: dict(BLOCK_N=2 * d["BLOCK_N"], num_stages=2),
                     _halve("BLOCK_N"), dict(num_stages=2)]  # (64 keys, two stages: 252 registers, 200 KB shared)
    indexer = [_halve("BLOCK_E"), dict(BLOCK_E=256, num_warps=8), dict(num_warps=8), _halve("BLOCK_H")]
    moe = [dict(gate_up=dict(num_warps=8)), dict(down=dict(num_warps=8)), _double("BLOCK_M"),
           dict(gate_up=dict(num_stages=3), down=dict(num_stages=3))]
    fp8_gemm = [_halve("BLOCK_N", 64), _double("BLOCK_M"), dict(num_stages=4), dict(num_warps=8)]
    grouped = [_double("BLOCK_N"), _halve("BLOCK_N"), dict(num_stages=4), _double("num_warps")]
    fp32_linear = [_halve("BLOCK_N"), dict(BLOCK_K=64, num_stages=4), dict(num_warps=8)]
    return [_moe_sweep(s, "mxfp4", moe), _attention_sweep(s, "csa", True, fp8_attention),
            _attention_sweep(s, "hca", True, fp8_attention), _indexer_sweep(s, True, indexer),
            _fp8_gemm_sweep(s, fp8_gemm), _grouped_fp8_sweep(s, grouped), _fp32_linear_sweep(s, fp32_linear),
            _attention_sweep(s, "csa", False, attention),
            _attention_sweep(s, "hca", False, attention), _indexer_sweep(s, False, indexer),
            _attention_sweep(s, "window", True, fp8_attention), _attention_sweep(s, "window", False, attention),
            _moe_sweep(s, "fp8", moe), _moe_sweep(s, "bf16", moe)]


def tiny_sweeps() -> list[Sweep]:
    """bench_kernels.py's dry-run shapes, two candidates per kernel that are not the default (so that a test sees the
    written file change the plans)."""
    s = DRY
    return [_attention_sweep(s, "csa", True, [_halve("BLOCK_N"), dict(BLOCK_N=16, num_warps=2)]),
            _indexer_sweep(s, True, [dict(BLOCK_E=32), dict(BLOCK_E=64, num_warps=2)]),
            _moe_sweep(s, "bf16", [dict(gate_up=dict(BLOCK_N=16)), dict(down=dict(BLOCK_N=16))]),
            _fp8_gemm_sweep(s, [dict(BLOCK_N=64), dict(BLOCK_N=64, num_warps=2)]),
            _grouped_fp8_sweep(s, [dict(BLOCK_N=16, num_warps=1), dict(BLOCK_N=64, num_warps=4)]),
            _fp32_linear_sweep(s, [dict(BLOCK_N=32), dict(BLOCK_N=64, num_warps=2)])]


# --- running them -------------------------------------------------------------------------------------------------
MIN_GAIN = 0.03  # a candidate replaces the default only this much faster (less is the timing's noise)


def candidates(default: dict, patches, tiny: bool) -> list[dict]:
    """The default (left out with --tiny) and each patch over it, without repeats."""
    from kernels.tuning import overlay

    out = [] if tiny else [default]
    for patch in patches:
        candidate = overlay(default, patch(default) if callable(patch) else patch)
        if candidate not in out:
            out.append(candidate)
    return out


def _plan_request(kernel: str, run) -> tuple[str, int, dict]:
    """(shape key, count, default) the plan of `run` asks kernels/tuning.py for, learned by running it (over no table:
    the default, whatever an earlier run wrote)."""
    from kernels import tuning

    with tuning.recording() as requests, tuning.using({}):
        run()
    asked = [(key, count, default) for name, key, count, default in requests if name == kernel]
    assert asked, f"the plan never asked for a tuned {kernel} configuration"
    return asked[0]


def _first_error(torch, tolerance, run, expected) -> str | None:
    """Why this candidate's output cannot be used (it fails, or differs from the reference), or None."""
    try:
        error = _max_error(torch, run(), expected, *tolerance)
    except Exception as failure:  # noqa: BLE001 (a candidate the compiler or the plan refuses is skipped)
        return f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
    return None if error <= 1 else f"normalised error {error:.3g}"


def run_sweep(torch, device, timer, sweep: Sweep, tiny: bool, deadline: float | None = None) -> dict:
    """{shape key: {count: what the fastest correct candidate changes of the default}} of one sweep ({}: the default,
    unless a candidate is MIN_GAIN faster; with --tiny, which leaves the default out, the fastest). Past `deadline`
    (time.time()) no candidate starts: the counts whose candidates were all timed are returned (one cut short would
    replace what an earlier run tuned there with less)."""
    from kernels import tuning

    groups: dict[tuple[str, int], dict] = {}  # (key, count) -> default, cases [(run, expected)]
    for run, reference in sweep.cases(torch, device):
        key, count, default = _plan_request(sweep.kernel, run)
        group = groups.setdefault((key, count), dict(default=default, cases=[]))
        group["cases"].append((run, reference()))
    tolerance = TOLERANCES["attn_fp8" if sweep.kernel == "attention" else
                           {"indexer": "idx_fp4", "moe": "moe", "fp8_gemm": "fp8_gemm", "grouped_fp8": "grouped",
                            "fp32_linear": "fp32_linear"}[sweep.kernel]]
    best: dict = {}
    for (key, count), group in groups.items():
        timings = []
        for candidate in candidates(group["default"], sweep.patches, tiny):
            if deadline is not None and time.time() > deadline:
                print(f"    budget spent: {sweep.name} {key} count={count} left as it was", flush=True)
                timings = []
                break
            with tuning.using({sweep.kernel: {key: {count: tuning.difference(candidate, group["default"])}}}):
                errors = [_first_error(torch, tolerance, run, expected) for run, expected in group["cases"]]
                if any(errors):
                    print(f"    skip {candidate}: {next(e for e in errors if e)}", flush=True)
                    continue
                timings.append((sum(timer(run) for run, _ in group["cases"]), candidate))
        if timings:
            ms, chosen = min(timings, key=lambda pair: pair[0])
            default_ms = next((t for t, c in timings if c == group["default"]), None)
            if default_ms is not None and ms > (1 - MIN_GAIN) * default_ms:
                ms, chosen = default_ms, group["default"]
            versus = f", default {default_ms:.3f} ms" if default_ms is not None else ""
            patch = tuning.difference(chosen, group["default"])
            print(f"  {sweep.name} {key} count={count}: {ms:.3f} ms{versus} <- {patch or 'the default'}", flush=True)
            best.setdefault(key, {})[count] = patch
        if deadline is not None and time.time() > deadline:
            break
    return best


def estimate_s(sweep: Sweep, num_counts: int, repeat: int, on_gpu: bool) -> float:
    """Seconds a sweep should take: each candidate's compiles, then its runs (checked once, timed `repeat` times)."""
    num_candidates = len(sweep.patches) + 1
    compiles = num_candidates * sweep.variants * COMPILE_S if on_gpu else 0.0
    runs = num_counts * sweep.cases_per_count * num_candidates * (repeat + 2)
    return compiles + runs * sweep.run_ms / 1e3 * (1 if on_gpu else 100)


def within_budget(sweeps: list[Sweep], num_counts: int, repeat: int, on_gpu: bool, budget_s: float | None):
    """The sweeps that fit the budget, dropping from the end, and the estimate of those kept."""
    kept = list(sweeps)
    total = sum(estimate_s(sw, num_counts, repeat, on_gpu) for sw in kept)
    while budget_s is not None and kept and total > budget_s:
        total -= estimate_s(kept.pop(), num_counts, repeat, on_gpu)
    return kept, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="bench_kernels.py's dry-run shapes (for --device cpu)")
    parser.add_argument("--sweeps", default="", help="comma-separated prefixes of sweep names (default: all)")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per candidate and case (median)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds the whole sweep may take")
    parser.add_argument("--out", type=Path, help="the file to write (default: kernels/configs/<device>.json)")
    parser.add_argument("--copy-to", type=Path, help="also write it into this folder (a results folder)")
    options = parser.parse_args()
    if os.environ.get("PART_LIMIT_S"):  # (scripts/gpu_check.sh: the part's time limit, which may be cut)
        limit = float(os.environ["PART_LIMIT_S"]) - STARTUP_S
        options.budget_s = limit if options.budget_s is None else min(options.budget_s, limit)
    if options.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    import torch
    import triton

    from kernels import tuning

    if options.device == "cuda" and not torch.cuda.is_available():
        print("tune_kernels.py needs a GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    device = torch.device(options.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sweeps = tiny_sweeps() if options.tiny else v4_flash_sweeps()
    prefixes = [p.strip() for p in options.sweeps.split(",") if p.strip()]
    sweeps = [sw for sw in sweeps if not prefixes or any(sw.name.startswith(p) for p in prefixes)]
    shapes = DRY if options.tiny else FULL
    num_counts = len(shapes.decode_batches) + 1
    sweeps, estimate = within_budget(sweeps, num_counts, options.repeat, device.type == "cuda", options.budget_s)
    print(f"device {device_name}: {len(sweeps)} sweeps ({', '.join(sw.name for sw in sweeps)}), about "
          f"{estimate:.0f} s", flush=True)
    out = options.out or tuning.device_file(device_name)
    paths = [out] + ([options.copy_to / out.name] if options.copy_to else [])
    meta = dict(device=device_name, triton=triton.__version__, torch=torch.__version__,
                shapes="tiny" if options.tiny else "deepseek-v4-flash", written=time.strftime("%Y-%m-%d"))
    timer = Timer(torch, device, options.repeat)
    # (what an earlier run tuned stays, each sweep's shapes replaced: a run cut by its time limit loses nothing)
    table: dict = tuning.read_table(out) if out.is_file() else {}
    start = time.time()
    deadline = start + options.budget_s if options.budget_s is not None else None
    for sweep in sweeps:
        if deadline is not None and time.time() > deadline:
            print(f"budget spent: {sweep.name} and the rest not tuned", flush=True)
            break
        sweep_start = time.time()
        try:
            found = run_sweep(torch, device, timer, sweep, options.tiny, deadline)
        except Exception as failure:  # noqa: BLE001 (one sweep's failure, e.g. out of memory, leaves the others)
            print(f"  {sweep.name} failed, left untuned: {type(failure).__name__}: {failure}", flush=True)
            found = {}
        for key, by_count in found.items():
            table.setdefault(sweep.kernel, {}).setdefault(key, {}).update(by_count)
        for path in paths:  # after every sweep: a run stopped by its time limit keeps what it tuned
            tuning.write_table(path, table, **meta)
        print(f"  {sweep.name}: {time.time() - sweep_start:.0f} s, written to {', '.join(map(str, paths))}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"tuned in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
