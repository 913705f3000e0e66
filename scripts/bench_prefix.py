#!/usr/bin/env python3
"""Prefix caching on a multi-turn chat workload: the same conversations with the cache off and on, in one run.

    python scripts/bench_prefix.py --json results/prefix.json --plot docs/prefix_cache.png

--conversations conversations of --turns turns run concurrently, each turn submitted when the previous reply
has finished: turn k's prompt is the whole conversation so far (prompts and replies) plus a new message of
50-200 tokens (random, seeded), and the reply is --reply-tokens tokens (eos ignored). The real engine runs
in process on the built-in checkpoint (CPU by default) with enable_prefix_caching=false and =true on the
same conversations, for --repeats pairs run side by side (a noisy machine drifts), alternating their order
(off-on, on-off, ...) after a warm-up run of each mode that is not counted. Reported per mode: time to first
token (p50 / p99 over the conversations) per turn, prefill tokens the engine computed (from its step records), total wall time, and the hit rate (prompt
positions served from the cache over all prompt positions); the table gives the median over the repeats
and the min-max of each pair's off / on ratio. Timestamps are taken as tokens come out of the engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.request import RequestOutput, SamplingParams, Sequence  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402


class Conversation:
    def __init__(self, index: int, turns: int, vocab: int, seed: int):
        gen = torch.Generator().manual_seed(seed * 1000 + index)
        self.messages = [torch.randint(2, vocab, (int(torch.randint(50, 201, (1,), generator=gen)),),
                                       generator=gen).tolist() for _ in range(turns)]
        self.index, self.turn, self.history = index, 0, []
        self.active: Sequence | None = None
        self.submitted = self.first_token = None
        self.ttft: list[float] = []
        self.prompt_tokens = 0


def run(config: EngineConfig, conversations: int, turns: int, reply_tokens: int, seed: int) -> dict:
    engine = LLMEngine(config)
    convs = [Conversation(i, turns, engine.vocab_size, seed) for i in range(conversations)]
    params = SamplingParams(max_tokens=reply_tokens, ignore_eos=True)

    def on_output(conv: Conversation):
        def callback(out: RequestOutput):
            if out.new_token_ids and conv.first_token is None:
                conv.first_token = time.perf_counter()
            conv.reply.extend(out.new_token_ids)
            if out.finished:
                conv.ttft.append(conv.first_token - conv.submitted)
                conv.history = conv.prompt + conv.reply
                conv.turn += 1
                conv.active = None
        return callback

    started = time.perf_counter()
    while any(c.turn < turns for c in convs):
        for conv in convs:
            if conv.active is None and conv.turn < turns:
                conv.prompt = conv.history + conv.messages[conv.turn]
                conv.reply, conv.first_token = [], None
                conv.prompt_tokens += len(conv.prompt)
                conv.active = Sequence(f"c{conv.index}t{conv.turn}", conv.prompt, params)
                conv.submitted = time.perf_counter()
                engine.submit(conv.active, on_output(conv))
        engine.step()
    wall = time.perf_counter() - started
    engine.shutdown()
    prefill = sum(r.num_prefill_tokens for r in engine.scheduler.records)
    prompt_tokens = sum(c.prompt_tokens for c in convs)
    cache = engine.kv.prefix_cache
    per_turn = []
    for turn in range(turns):
        values = sorted(c.ttft[turn] for c in convs)
        per_turn.append({"turn": turn + 1, "ttft_p50_s": statistics.median(values),
                         "ttft_p99_s": values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]})
    return {"prefix_caching": config.enable_prefix_caching, "wall_s": wall, "prefill_tokens_computed": prefill,
            "prompt_tokens": prompt_tokens,
            "hit_rate": (cache.stats.cached_tokens / prompt_tokens) if cache is not None else 0.0,
            "per_turn": per_turn}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--num-tokens", type=int, default=32768, help="the engine's num_tokens")
    parser.add_argument("--repeats", type=int, default=4, help="off/on pairs (an even count balances their order)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.overlap_scheduling)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    def config(caching: bool) -> EngineConfig:
        return EngineConfig(**checkpoint_settings(args), device=args.device, num_tokens=args.num_tokens,
                            max_running_requests=max(16, args.conversations), enable_prefix_caching=caching,
                            overlap_scheduling=args.overlap_scheduling)

    # The first engine of a process is slower (first calls of every op, the allocator growing): a warm-up run
    # of both modes, not counted, and the pairs alternate their order (off-on, on-off, ...)
    for caching in (False, True):
        run(config(caching), args.conversations, args.turns, args.reply_tokens, args.seed + 1)
    runs = {False: [], True: []}
    for pair in range(args.repeats):
        for caching in ((False, True) if pair % 2 == 0 else (True, False)):
            runs[caching].append(run(config(caching), args.conversations, args.turns, args.reply_tokens, args.seed))
    summary = summarize(runs[False], runs[True])
    print_table(summary, runs[False], runs[True])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "off": runs[False], "on": runs[True]}, indent=2))
    if args.plot:
        plot(summary, args)
    return 0


def summarize(off: list[dict], on: list[dict]) -> list[dict]:
    """Per turn: the median over the repeats of each mode's TTFT p50 / p99, and the spread of the pairs' ratio."""
    rows = []
    for turn in range(len(off[0]["per_turn"])):
        row = {"turn": turn + 1}
        for name, runs in (("off", off), ("on", on)):
            for key in ("ttft_p50_s", "ttft_p99_s"):
                row[f"{name}_{key}"] = statistics.median(r["per_turn"][turn][key] for r in runs)
        ratios = [a["per_turn"][turn]["ttft_p50_s"] / b["per_turn"][turn]["ttft_p50_s"] for a, b in zip(off, on)]
        row["p50_ratio_min"], row["p50_ratio_median"], row["p50_ratio_max"] = \
            min(ratios), statistics.median(ratios), max(ratios)
        rows.append(row)
    return rows


def print_table(summary: list[dict], off: list[dict], on: list[dict]) -> None:
    print(f"median of {len(off)} alternating off/on pairs; ratio: off / on TTFT p50, median (min-max over pairs)")
    print(f"{'turn':>4} | {'TTFT p50 off (ms)':>17} {'on (ms)':>8} | {'ratio':>18} | {'p99 off':>8} {'on':>8}")
    for row in summary:
        ratio = f"{row['p50_ratio_median']:.1f}x ({row['p50_ratio_min']:.1f}-{row['p50_ratio_max']:.1f})"
        print(f"{row['turn']:>4} | {row['off_ttft_p50_s'] * 1e3:>17.1f} {row['on_ttft_p50_s'] * 1e3:>8.1f} | "
              f"{ratio:>18} | {row['off_ttft_p99_s'] * 1e3:>8.1f} {row['on_ttft_p99_s'] * 1e3:>8.1f}")
    computed = lambda runs: sorted({r["prefill_tokens_computed"] for r in runs})  # noqa: E731 (deterministic)
    walls = [a["wall_s"] / b["wall_s"] for a, b in zip(off, on)]
    print(f"prefill tokens computed: off {computed(off)}, on {computed(on)} "
          f"({off[0]['prefill_tokens_computed'] / max(1, on[0]['prefill_tokens_computed']):.1f}x fewer); "
          f"hit rate {statistics.median(r['hit_rate'] for r in on):.0%} of {on[0]['prompt_tokens']} prompt positions; "
          f"wall off / on {min(walls):.2f}-{max(walls):.2f}")


def plot(summary: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    turns = [row["turn"] for row in summary]
    for name, label in (("off", "prefix caching off"), ("on", "prefix caching on")):
        ax.plot(turns, [row[f"{name}_ttft_p50_s"] * 1e3 for row in summary], marker="o", label=f"{label}, p50")
        ax.plot(turns, [row[f"{name}_ttft_p99_s"] * 1e3 for row in summary], linestyle="--", label=f"{label}, p99")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (ms), median of runs")
    ax.set_title(f"{args.conversations} conversations x {args.turns} turns, replies of {args.reply_tokens} tokens, "
                 f"{args.repeats} runs")
    ax.legend()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    sys.exit(main())
