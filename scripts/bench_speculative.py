#!/usr/bin/env python3
"""Decode throughput with speculative decoding against without it, side by side in one run.

    python scripts/train_mtp_draft.py --out checkpoints/dsv4-tiny-mtp          # a draft worth measuring
    python scripts/bench_speculative.py --checkpoint checkpoints/dsv4-tiny-mtp --ks 0 1 2 3 --concurrency 1 8 32

For each run (--runs, interleaved: every k at every concurrency, then the next run, so that a noisy machine's drift
spreads over all cells), C prompts of --prompt-tokens generate --max-tokens tokens each (greedy, eos ignored) on an
engine with num_speculative_tokens = k, built for the cell and shut down after it: one engine lives at a time (an
idle second engine's overlap thread slowed the other's steps 2.8x on CPU, which is not what a server runs). Decode tok/s is C * (max_tokens - 1) over the time a max_tokens run takes
beyond a 1-token run (prefill and first token only), as in bench_engine.py. Each cell reports the median over runs
and the spread (min-max), the ratio to k = 0 at the same concurrency within each run (median and spread), and the
mean accepted length (tokens a verify emits). Prints a table; writes --csv, --json and --plot (decode tok/s by
concurrency, one line per k).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from scripts.bench_engine import throughput, time_engine  # noqa: E402
from scripts.bench_results import write_csv  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402


def decode_tokens_per_s(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """bench_engine.py's decode throughput: the max_tokens run's time beyond a 1-token run's."""
    return throughput(lambda batch, n: time_engine(engine, batch, n), prompts, max_tokens)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3], help="num_speculative_tokens values")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode steps without drafts from CUDA graphs (default: on for CUDA)")
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    ks = sorted(set(args.ks) | {0})
    most = max(args.concurrency)

    def engine_for(k: int) -> LLMEngine:
        return LLMEngine(EngineConfig(**checkpoint_settings(args), device=args.device, num_speculative_tokens=k,
                                      max_running_requests=most, max_num_batched_tokens=max(8192, most * (k + 1)),
                                      enable_prefix_caching=False, cuda_graphs=args.cuda_graphs))

    g = torch.Generator().manual_seed(0)
    vocab = engine_for(0)
    batches = {c: torch.randint(2, vocab.vocab_size, (c, args.prompt_tokens), generator=g).tolist()
               for c in args.concurrency}
    vocab.shutdown()
    speeds: dict[tuple[int, int], list[float]] = {}
    accepted: dict[tuple[int, int], list[float]] = {}
    for run in range(args.runs):
        for c in args.concurrency:
            for k in ks:
                engine = engine_for(k)
                try:
                    decode_tokens_per_s(engine, batches[c], 4)  # warm-up
                    counters = engine.scheduler.counters
                    verifies, drafts_accepted = counters.num_verifies, counters.num_accepted_tokens
                    speed = decode_tokens_per_s(engine, batches[c], args.max_tokens)
                    verifies = counters.num_verifies - verifies
                    emitted = verifies + counters.num_accepted_tokens - drafts_accepted
                finally:
                    engine.shutdown()
                speeds.setdefault((c, k), []).append(speed)
                accepted.setdefault((c, k), []).append(emitted / verifies if verifies else 1.0)
                print(f"run {run + 1} concurrency {c:>3} k {k}: {speed:8.1f} tok/s, mean accepted length "
                      f"{accepted[c, k][-1]:.2f}", flush=True)

    rows = []
    for c in args.concurrency:
        for k in ks:
            ratios = [s / base for s, base in zip(speeds[c, k], speeds[c, 0])]
            rows.append({"concurrency": c, "k": k, "tokens_per_s_median": round(statistics.median(speeds[c, k]), 1),
                         "tokens_per_s_min": round(min(speeds[c, k]), 1), "tokens_per_s_max": round(max(speeds[c, k]), 1),
                         "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
                         "ratio_max": round(max(ratios), 3),
                         "mean_accepted_length": round(statistics.mean(accepted[c, k]), 3), "runs": args.runs})
    print()
    print(f"{'C':>3} {'k':>2} | {'decode tok/s median (min-max)':>30} | {'vs k=0 median (min-max)':>24} | "
          f"{'accepted length':>15}")
    for r in rows:
        print(f"{r['concurrency']:>3} {r['k']:>2} | {r['tokens_per_s_median']:>10} ({r['tokens_per_s_min']}-"
              f"{r['tokens_per_s_max']}){'':>5} | {r['ratio_median']:>7}x ({r['ratio_min']}-{r['ratio_max']}) | "
              f"{r['mean_accepted_length']:>15}")
    if args.csv:
        write_csv(args.csv, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": args.device, "checkpoint": args.checkpoint, "rows": rows}, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for k in ks:
            cells = [r for r in rows if r["k"] == k]
            ax.errorbar([r["concurrency"] for r in cells], [r["tokens_per_s_median"] for r in cells],
                        yerr=[[r["tokens_per_s_median"] - r["tokens_per_s_min"] for r in cells],
                              [r["tokens_per_s_max"] - r["tokens_per_s_median"] for r in cells]],
                        marker="o", capsize=3, label=f"k={k}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("decode tok/s (median, min-max)")
        ax.set_title(f"speculative decoding, {args.device}")
        ax.legend()
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
