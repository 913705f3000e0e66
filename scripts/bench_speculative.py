#!/usr/bin/env python3
"""Decode throughput with speculative decoding against without it, side by side in one run, and what a verify step
costs against a plain decode step.

    python scripts/train_mtp_draft.py --out checkpoints/dsv4-tiny-mtp          # a draft worth measuring
    python scripts/bench_speculative.py --checkpoint checkpoints/dsv4-tiny-mtp --ks 0 1 2 3 --concurrency 1 8 32
    python scripts/bench_speculative.py --checkpoint checkpoints/dsv4-tiny-mtp --ks 0 1 2 --cuda-graphs \
        --draft-chains static eager                                            # the static draft chain against eager
    python scripts/bench_speculative.py --device cuda --checkpoint docs/configs/deepseek-v4-flash.config.json \
        --load-format dummy --hf-overrides '{"num_hidden_layers": 4}' \
        --engine-settings '{"weight_format": "fp8", "numerics": "deepseek", "kv_cache_dtype": "fp8"}'
                                                                               # V4-Flash's widths (a GPU: too big
                                                                               # for a CPU host's memory)

For each run (--runs, interleaved: every k at every concurrency, then the next run, so that a noisy machine's drift
spreads over all cells), C prompts of --prompt-tokens generate --max-tokens tokens each (greedy, or sampled at
--temperature; eos ignored) on an
engine with num_speculative_tokens = k, built for each k in each run (its concurrencies and draft chains measured in
turn) and shut down after it: one engine lives at a time (an idle second engine's overlap thread slowed the other's
steps 2.8x on CPU, which is not what a server runs). Decode
tok/s is C * (max_tokens - 1) over the time a max_tokens run takes beyond a 1-token run (prefill and first token
only), as in bench_engine.py. Each cell reports the median over runs and the spread (min-max), the ratio to k = 0 at
the same concurrency within each run (median and spread), the mean accepted length (tokens a verify emits), and the
share of decode steps that ran at static shapes (with --cuda-graphs: a graph's replay on CUDA; the others ran eagerly,
a launch per kernel; serving's prefix caching is off here unless --engine-settings turns it on).
Prints a table; writes --csv, --json and --plot (decode tok/s by concurrency, one line per k).

Step cost: in the same timed runs, a step's cost is the time from its scheduling to the next step's (wall clock: the
host's work, the forward, with drafts the verify and the draft passes, and what overlap scheduling hides), the median
over the steps where all C requests decode (with k > 0: each verifying k drafts). The verify step's cost ratio is its
cost over k = 0's at the same concurrency within each run (median, min-max over runs), and the speed-up it gives at
per-position acceptance rates a_i (--acceptance, vLLM's: the share of verifies that accept draft i, and so every
draft before it; V4-Flash's published 0.77, 0.38 at k = 2) is (1 + a_1 + ... + a_k) / cost ratio, the tokens a step
emits on average over what it costs (not projected for a k past the rates given).
With --cuda-graphs the verify steps run at static shapes and the draft passes after them as one static chain
(--draft-chains eager: pass by pass, as before there were chains; both: side by side). Prints a second table; writes
--cost-csv (default: --csv's name with _step_cost) and, with --plot, a second figure (_step_cost) of the cost ratios
and projected speed-ups by concurrency.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.scheduler.step_record import StepKind  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from scripts.bench_engine import throughput, time_engine  # noqa: E402
from scripts.bench_results import write_csv  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402
from scripts.estimate_decode_step import acceptance_flag, expected_tokens_per_step  # noqa: E402
from scripts.flag_types import at_least  # noqa: E402


def decode_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                        temperature: float = 0.0) -> float:
    """bench_engine.py's decode throughput: the max_tokens run's time beyond a 1-token run's (NaN where a busy machine
    made the 1-token run the longer: that run measured nothing)."""
    decode = throughput(lambda batch, n: time_engine(engine, batch, n, temperature), prompts, max_tokens)[0]
    return decode if decode < len(prompts) * (max_tokens - 1) * 1e6 else math.nan  # (throughput's floor: 1 ns)


def measure(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, k: int,
            temperature: float = 0.0, warm_up_tokens: int = 4) -> tuple[float, float, float | None, float]:
    """(decode tok/s, mean accepted length, step cost in s, share of decode steps at static shapes) of `prompts` on
    `engine`, after a warm-up run of `warm_up_tokens` (adaptive_speculation measures both modes in its first steps
    at a batch size: a longer warm-up times what follows)."""
    decode_tokens_per_s(engine, prompts, warm_up_tokens, temperature)
    counters, records = engine.scheduler.counters, engine.scheduler.records
    verifies, drafts_accepted = counters.num_verifies, counters.num_accepted_tokens
    records.clear()  # (the scheduler's last steps, a bounded deque: from here, this run's)
    speed = decode_tokens_per_s(engine, prompts, max_tokens, temperature)
    verifies = counters.num_verifies - verifies
    emitted = verifies + counters.num_accepted_tokens - drafts_accepted
    steps = list(records)
    return speed, emitted / verifies if verifies else 1.0, step_cost_s(steps, len(prompts), k), static_share(steps)


def step_cost_s(records: list, concurrency: int, k: int) -> float | None:
    """The median time from a full step's scheduling to the next step's: steps where all `concurrency` requests
    decode, each verifying k drafts (None: no such step)."""
    full = [later.time - step.time for step, later in zip(records, records[1:])
            if step.kind is StepKind.DECODE and step.num_running == concurrency
            and step.num_decode_tokens == concurrency * (1 + k)]
    return statistics.median(full) if full else None


def static_share(records: list) -> float:
    """The share of decode steps that ran at a static shape (a CUDA graph's replay on CUDA; the rest ran eagerly,
    a launch per kernel): 1.0 where every one did, or with no decode step."""
    decodes = [step for step in records if step.kind is StepKind.DECODE]
    return sum(step.timing.static_shape for step in decodes) / len(decodes) if decodes else 1.0


V4_FLASH_ACCEPTANCE = [0.77, 0.38]  # per position at k = 2, vLLM PR #41044


def free_device_memory() -> None:
    """What engines already shut down held, freed before the next is built: an engine's parts refer to each other, so
    its weights and pools wait for a full collection otherwise (at V4-Flash's widths, 15-19 GiB an engine: a few alive
    at once did not fit an H100)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spread(values: list[float], digits: int = 3) -> dict:
    """Median, min and max of the runs that measured something (NaN where none did)."""
    values = [v for v in values if not math.isnan(v)] or [math.nan]
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--engine-settings", type=json.loads, default={}, metavar="JSON",
                        help='more EngineConfig fields, e.g. \'{"weight_format": "fp8", "numerics": "deepseek"}\'')
    parser.add_argument("--ks", type=at_least(0), nargs="+", default=[0, 1, 2, 3], help="num_speculative_tokens values")
    parser.add_argument("--concurrency", type=at_least(1), nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=at_least(1), default=16)
    parser.add_argument("--max-tokens", type=at_least(1), default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampled requests (seeded) instead of greedy ones; how they draft: --engine-settings "
                             "'{\"draft_sampling\": \"argmax\" or \"sample\"}' (default auto: argmax with "
                             "--cuda-graphs)")
    parser.add_argument("--runs", type=at_least(1), default=3)
    parser.add_argument("--warm-up-tokens", type=at_least(0), default=4,
                        help="tokens of the untimed run before each timed one (with adaptive_speculation: its "
                             "measuring steps)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode and verify steps at static shapes (CUDA graphs on CUDA; default: on for CUDA)")
    parser.add_argument("--draft-chains", nargs="+", choices=["static", "eager"], default=["static"],
                        help="after a static verify step: its draft passes as one static chain, or pass by pass")
    parser.add_argument("--acceptance", nargs="+", metavar="A",
                        help="per-position acceptance rates for the projected speed-up, separated by spaces or commas "
                             f"(default V4-Flash's at k=2: {' '.join(map(str, V4_FLASH_ACCEPTANCE))})")
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--cost-csv", type=Path, help="the step-cost table (default: --csv with _step_cost)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    args.acceptance = acceptance_flag(parser, args.acceptance, V4_FLASH_ACCEPTANCE)
    ks = sorted(set(args.ks) | {0})
    most = max(args.concurrency)

    def engine_for(k: int) -> LLMEngine:
        return LLMEngine(EngineConfig(**{**checkpoint_settings(args), "device": args.device,
                                         "num_speculative_tokens": k, "max_running_requests": most,
                                         "max_num_batched_tokens": max(8192, most * (k + 1)),
                                         "enable_prefix_caching": False, "cuda_graphs": args.cuda_graphs,
                                         **args.engine_settings}))

    g = torch.Generator().manual_seed(0)
    first = engine_for(0)
    batches = {c: torch.randint(2, first.vocab_size, (c, args.prompt_tokens), generator=g).tolist()
               for c in args.concurrency}
    # (sampled requests under draft_sampling=sample draft pass by pass, as without chains)
    drafts_in_chains = first.core.runner.graphs is not None and not (
        args.temperature > 0 and first.core.executor.drafter.sample_drafts)
    first.shutdown()
    first = None
    free_device_memory()
    # (k, draft chain) cells: without static chains every chain is eager
    chains = sorted(set(args.draft_chains), reverse=True) if drafts_in_chains else ["eager"]
    cells = [(0, "-")] + [(k, chain) for k in ks if k for chain in chains]
    speeds: dict[tuple[int, int, str], list[float]] = {}
    accepted: dict[tuple[int, int, str], list[float]] = {}
    costs: dict[tuple[int, int, str], list[float | None]] = {}
    static: dict[tuple[int, int, str], list[float]] = {}
    for run in range(args.runs):
        for k in ks:
            engine = engine_for(k)
            static_chains = engine.core.runner.draft_chains
            try:
                for c in args.concurrency:
                    for chain in [chain for kc, chain in cells if kc == k]:
                        # (the eager cell: the same engine with its static chains set aside, pass by pass)
                        engine.core.runner.draft_chains = static_chains if chain != "eager" else None
                        cell = c, k, chain
                        speed, length, cost, share = measure(engine, batches[c], args.max_tokens, k,
                                                             args.temperature, args.warm_up_tokens)
                        speeds.setdefault(cell, []).append(speed)
                        accepted.setdefault(cell, []).append(length)
                        costs.setdefault(cell, []).append(cost)
                        static.setdefault(cell, []).append(share)
                        print(f"run {run + 1} concurrency {c:>3} k {k} chain {chain:>6}: {speed:8.1f} tok/s, mean "
                              f"accepted length {length:.2f}, step {cost * 1e3 if cost else float('nan'):.2f} ms, "
                              f"{share:.0%} of decode steps static", flush=True)
            finally:
                engine.shutdown()
                engine = static_chains = None
                free_device_memory()

    rows = []
    for c in args.concurrency:
        for k, chain in cells:
            cell, base = (c, k, chain), (c, 0, "-")
            ratios = [s / b for s, b in zip(speeds[cell], speeds[base])]
            rows.append({"concurrency": c, "k": k, "draft_chain": chain,
                         **{f"tokens_per_s_{name}": v for name, v in spread(speeds[cell], 1).items()},
                         **{f"ratio_{name}": v for name, v in spread(ratios).items()},
                         "mean_accepted_length": round(statistics.mean(accepted[cell]), 3),
                         "static_decode_steps": round(statistics.mean(static[cell]), 3), "runs": args.runs})
    cost_rows = step_cost_rows(args, cells, costs, accepted)
    print_tables(rows, cost_rows, args.acceptance)
    if args.csv:
        write_csv(args.csv, rows)
    cost_csv = args.cost_csv or (args.csv and args.csv.with_name(args.csv.stem + "_step_cost.csv"))
    if cost_csv and cost_rows:
        write_csv(cost_csv, cost_rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": args.device, "checkpoint": args.checkpoint, "rows": rows,
                                         "temperature": args.temperature, "acceptance": args.acceptance,
                                         "step_cost": cost_rows}, indent=2))
    if args.plot:
        plot(args, rows, cost_rows)


def step_cost_rows(args, cells, costs, accepted) -> list[dict]:
    """Per concurrency and verify cell: its step cost, its ratio to k = 0's within each run, the speed-up that ratio
    gives at --acceptance and at the draft's own acceptance here (runs without a full step at either are left out)."""
    rows = []
    for c in args.concurrency:
        for k, chain in cells:
            cell = c, k, chain
            pairs = [(cost, base) for cost, base in zip(costs[cell], costs[c, 0, "-"]) if cost and base]
            if not pairs:
                continue
            ratios = [cost / base for cost, base in pairs]
            expected = expected_tokens_per_step(args.acceptance, k)
            measured = statistics.mean(accepted[cell])
            rows.append({"concurrency": c, "k": k, "draft_chain": chain,
                         **{f"step_ms_{name}": v for name, v in spread([cost * 1e3 for cost, _ in pairs]).items()},
                         **{f"cost_ratio_{name}": v for name, v in spread(ratios).items()},
                         "expected_tokens_per_step": round(expected, 3),
                         **{f"projected_speedup_{name}": v
                            for name, v in spread([expected / ratio for ratio in ratios]).items()},
                         "mean_accepted_length": round(measured, 3),
                         "speedup_at_measured_acceptance": round(measured / statistics.median(ratios), 3),
                         "runs": len(pairs)})
    return rows


def print_tables(rows: list[dict], cost_rows: list[dict], acceptance: list[float]) -> None:
    print()
    print(f"{'C':>3} {'k':>2} {'chain':>6} | {'decode tok/s median (min-max)':>30} | {'vs k=0 median (min-max)':>24} | "
          f"{'accepted length':>15} | {'static decode steps':>19}")
    for r in rows:
        print(f"{r['concurrency']:>3} {r['k']:>2} {r['draft_chain']:>6} | {r['tokens_per_s_median']:>10} "
              f"({r['tokens_per_s_min']}-{r['tokens_per_s_max']}){'':>5} | {r['ratio_median']:>7}x "
              f"({r['ratio_min']}-{r['ratio_max']}) | {r['mean_accepted_length']:>15} | "
              f"{r['static_decode_steps']:>18.0%}")
    print()
    print(f"step cost (schedule to schedule, all requests decoding); projected speed-up at acceptance "
          f"{', '.join(f'{a:g}' for a in acceptance)} = (1 + their sum up to k) / cost ratio")
    print(f"{'C':>3} {'k':>2} {'chain':>6} | {'step ms median (min-max)':>26} | {'cost vs k=0 (min-max)':>24} | "
          f"{'tokens/step':>11} | {'projected speed-up (min-max)':>28} | {'at accepted length here':>23}")
    for r in cost_rows:
        print(f"{r['concurrency']:>3} {r['k']:>2} {r['draft_chain']:>6} | {r['step_ms_median']:>9} "
              f"({r['step_ms_min']}-{r['step_ms_max']}) | {r['cost_ratio_median']:>7}x ({r['cost_ratio_min']}-"
              f"{r['cost_ratio_max']}) | {r['expected_tokens_per_step']:>11} | {r['projected_speedup_median']:>7}x "
              f"({r['projected_speedup_min']}-{r['projected_speedup_max']}) | "
              f"{r['speedup_at_measured_acceptance']:>7}x ({r['mean_accepted_length']})")


def plot(args, rows: list[dict], cost_rows: list[dict]) -> None:
    """Decode tok/s by concurrency (--plot); the cost ratios and projected speed-ups beside it (_step_cost)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def lines(ax, table, key, label):
        for k, chain in dict.fromkeys((r["k"], r["draft_chain"]) for r in table):
            cells = [r for r in table if (r["k"], r["draft_chain"]) == (k, chain)]
            middle = [r[f"{key}_median"] for r in cells]
            ax.errorbar([r["concurrency"] for r in cells], middle,
                        yerr=[[m - r[f"{key}_min"] for m, r in zip(middle, cells)],
                              [r[f"{key}_max"] - m for m, r in zip(middle, cells)]],
                        marker="o", capsize=3, label=f"k={k}" + (f" {chain}" if chain != "-" else ""))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()

    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    lines(ax, rows, "tokens_per_s", "decode tok/s (median, min-max)")
    ax.set_title(f"speculative decoding, {args.device}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    verify = [r for r in cost_rows if r["k"]]
    if verify:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        lines(left, verify, "cost_ratio", "verify step cost / decode step cost")
        lines(right, verify, "projected_speedup", "projected speed-up")
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_title(f"at acceptance {', '.join(f'{a:g}' for a in args.acceptance)}")
        fig.tight_layout()
        fig.savefig(args.plot.with_name(args.plot.stem + "_step_cost" + args.plot.suffix), dpi=120)


if __name__ == "__main__":
    main()
