#!/usr/bin/env python3
"""The seed bug report's controlled experiment, at small scale, for each scheduling policy.

    python scripts/bench_starvation.py --json results/starvation.json --plot results/starvation.png

A victim (short prompt, --victim-tokens of output, eos ignored) starts decoding; once it has
produced --attacker-after tokens, an attacker with a --attacker-prompt-tokens prompt asking for
--attacker-max-tokens tokens arrives. The real engine (in process, built-in checkpoint) runs both
under each policy of --policies:
  alone               the victim by itself
  prefill_first       the historical `prefill(budget) or decode()`
  interleave:N        prefill_first with decode_interleave_every=N
  mixed               every step carries every runnable decode plus a prefill chunk
  itl:MS              mixed, with the prefill tokens per step sized for an MS-millisecond step
Timestamps are taken as tokens come out of the engine (the callback), never from a log. The
default chunk (565 tokens) splits the default 32768-token attacker into 58 chunks, as in the
report (200,019 tokens in 58 chunks of 3456). A policy may be listed more than once (repetitions,
e.g. `--policies prefill_first,itl:150,prefill_first,itl:150`); each run is a row, and a line per policy gives the
median and the spread (min-max) of the attacker's TTFT over prefill_first's median and of the victim's worst gap over
the ITL target. `--no-overlap-scheduling` runs the loop without overlap; `--attacker-prompt-tokens 8192
--victim-tokens 200`, a shorter run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine, RequestOutput  # noqa: E402
from backend.request import SamplingParams, Sequence  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402

DEFAULT_POLICIES = "alone,prefill_first,interleave:8,interleave:4,mixed,itl:150"


@dataclass
class Trace:
    submitted: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        self.token_times.extend([now] * len(out.new_token_ids))
        if out.finished:
            self.finished.set()


def engine_config(policy: str, args) -> EngineConfig:
    kwargs = dict(**checkpoint_settings(args), device=args.device, prefill_chunk_tokens=args.prefill_chunk_tokens,
                  max_running_requests=4, max_num_batched_tokens=max(8192, args.prefill_chunk_tokens + 4),
                  num_tokens=2 * (args.attacker_prompt_tokens + args.victim_tokens), swa_full_tokens_ratio=0.25,
                  enable_prefix_caching=args.enable_prefix_caching, overlap_scheduling=args.overlap_scheduling)
    if policy.startswith("interleave:"):
        kwargs.update(policy="prefill_first", decode_interleave_every=int(policy.split(":")[1]))
    elif policy.startswith("itl:"):
        kwargs.update(policy="mixed", itl_target_ms=float(policy.split(":")[1]))
    elif policy in ("mixed", "prefill_first"):
        kwargs.update(policy=policy)
    elif policy != "alone":
        raise SystemExit(f"unknown policy {policy!r}")
    return EngineConfig(**kwargs)


def run_policy(policy: str, args) -> dict:
    engine = LLMEngine(engine_config(policy, args))
    g = torch.Generator().manual_seed(0)
    victim_prompt = torch.randint(2, engine.vocab_size, (args.victim_prompt_tokens,), generator=g).tolist()
    attacker_prompt = torch.randint(2, engine.vocab_size, (args.attacker_prompt_tokens,), generator=g).tolist()
    victim, attacker = Trace(), Trace()

    def victim_output(out: RequestOutput) -> None:
        victim.on_output(out)
        if policy != "alone" and len(victim.token_times) == args.attacker_after and not attacker.submitted:
            attacker.submitted = time.monotonic()
            engine.submit(Sequence("attacker", attacker_prompt,
                                   SamplingParams(max_tokens=args.attacker_max_tokens, ignore_eos=True)),
                          attacker.on_output)

    engine.start()
    try:
        victim.submitted = time.monotonic()
        engine.submit(Sequence("victim", victim_prompt, SamplingParams(max_tokens=args.victim_tokens, ignore_eos=True)),
                      victim_output)
        victim.finished.wait()
        if policy != "alone":
            attacker.finished.wait()
    finally:
        engine.shutdown()
    return summarize(policy, engine, victim, attacker, args)


def summarize(policy: str, engine: LLMEngine, victim: Trace, attacker: Trace, args) -> dict:
    gaps = [b - a for a, b in zip(victim.token_times, victim.token_times[1:])]
    records = [r for r in engine.scheduler.records if r.time >= victim.submitted]
    prefill = [r.timing.duration_s for r in records if r.kind.value == "prefill"]
    decode = [r.timing.duration_s for r in records if r.kind.value == "decode"]
    mixed = [r.timing.duration_s for r in records if r.kind.value == "mixed"]
    end = max(victim.token_times[-1], attacker.token_times[-1] if attacker.token_times else 0.0)
    return {
        "policy": policy,
        "victim_wall_s": victim.token_times[-1] - victim.submitted,
        "victim_output_tokens": len(victim.token_times),
        "victim_max_gap_s": max(gaps),
        "victim_p99_gap_s": sorted(gaps)[int(0.99 * (len(gaps) - 1))],
        "victim_median_gap_s": statistics.median(gaps),
        **{f"victim_gaps_over_{t:g}s": sum(g > t for g in gaps) for t in args.gap_thresholds},
        "attacker_ttft_s": (attacker.token_times[0] - attacker.submitted) if attacker.token_times else None,
        "prefill_steps": len(prefill),
        "decode_steps": len(decode),
        "mixed_steps": len(mixed),
        "median_prefill_step_s": statistics.median(prefill) if prefill else None,
        "median_decode_step_s": statistics.median(decode) if decode else None,
        "median_mixed_step_s": statistics.median(mixed) if mixed else None,
        "longest_prefill_streak": engine.scheduler.counters.longest_prefill_streak,
        "total_wall_s": end - victim.submitted,
        "itl_target_ms": engine.config.itl_target_ms,
        "itl_infeasible_steps": engine.scheduler.counters.num_itl_infeasible,
        "cost_model_level_shifts": engine.scheduler.cost_model.num_level_shifts,
        # For the plot: victim token times and the prefill-carrying steps, relative to the victim's submit.
        "victim_token_times_s": [t - victim.submitted for t in victim.token_times],
        "prefill_spans_s": [(r.time - victim.submitted, r.timing.duration_s) for r in records if r.num_prefill_tokens],
    }


def print_table(rows: list[dict], thresholds: list[float]) -> None:
    cols = [("policy", "policy", "{}"), ("victim wall", "victim_wall_s", "{:.2f}"),
            ("max gap", "victim_max_gap_s", "{:.3f}"), ("p99 gap", "victim_p99_gap_s", "{:.3f}"),
            ("median gap", "victim_median_gap_s", "{:.3f}")]
    cols += [(f"gaps>{t:g}s", f"victim_gaps_over_{t:g}s", "{}") for t in thresholds]
    cols += [("attacker ttft", "attacker_ttft_s", "{:.2f}"), ("prefill steps", "prefill_steps", "{}"),
             ("med prefill", "median_prefill_step_s", "{:.3f}"), ("med decode", "median_decode_step_s", "{:.4f}"),
             ("med mixed", "median_mixed_step_s", "{:.3f}"), ("total wall", "total_wall_s", "{:.2f}"),
             ("infeasible", "itl_infeasible_steps", "{}"), ("level shifts", "cost_model_level_shifts", "{}")]
    header = " | ".join(f"{name:>13}" for name, _, _ in cols)
    print(header)
    print("-" * len(header))
    for row in rows:
        cells = [fmt.format(row[key]) if row[key] is not None else "—" for _, key, fmt in cols]
        print(" | ".join(f"{c:>13}" for c in cells))


def print_summary(rows: list[dict]) -> None:
    """Per policy over its runs, median (min-max): the attacker's TTFT against prefill_first's median, and the victim's
    worst gap against the ITL target. A noisy machine shows in the spread: report it, never the best run."""
    rows = [row for row in rows if row["attacker_ttft_s"] is not None]  # (not `alone`, nor an attacker that failed)
    first = [row["attacker_ttft_s"] for row in rows if row["policy"] == "prefill_first"]
    print()
    for policy in dict.fromkeys(row["policy"] for row in rows):
        runs = [row for row in rows if row["policy"] == policy]
        ttfts = [r["attacker_ttft_s"] for r in runs]
        line = f"{policy}: {len(runs)} run{'s' if len(runs) > 1 else ''}, attacker TTFT {_spread(ttfts, '{:.2f}')} s"
        if first:
            base = statistics.median(first)
            line += f", / prefill_first's median {_spread([t / base for t in ttfts], '{:.2f}x')}"
        if runs[0]["itl_target_ms"] is not None:
            gaps = [r["victim_max_gap_s"] * 1e3 / r["itl_target_ms"] for r in runs]
            line += f", worst gap / target {_spread(gaps, '{:.2f}x')}"
        print(line)


def _spread(values: list[float], fmt: str) -> str:
    median, low, high = (fmt.format(v) for v in (statistics.median(values), min(values), max(values)))
    return median if len(values) == 1 else f"{median} ({low}-{high})"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.6 * len(rows) + 1), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        for start, duration in row["prefill_spans_s"]:
            ax.axvspan(start, start + duration, color="tab:orange", alpha=0.25, lw=0)
        times = row["victim_token_times_s"]
        ax.vlines(times, 0, 1, color="tab:blue", lw=0.5)
        ax.set_yticks([])
        ax.set_ylabel(row["policy"], rotation=0, ha="right", va="center")
        ax.set_title(f"max victim gap {row['victim_max_gap_s']:.2f} s", fontsize=8, loc="right")
    axes[-1, 0].set_xlabel("seconds since the victim was submitted "
                           "(blue: victim tokens; orange: steps carrying attacker prefill)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--victim-prompt-tokens", type=int, default=16)
    parser.add_argument("--victim-tokens", type=int, default=700)
    parser.add_argument("--attacker-prompt-tokens", type=int, default=32768)
    parser.add_argument("--attacker-max-tokens", type=int, default=3)
    parser.add_argument("--attacker-after", type=int, default=20, help="victim tokens before the attacker arrives")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=565)
    parser.add_argument("--gap-thresholds", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.enable_prefix_caching, help="the engine default: on")
    parser.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.overlap_scheduling, help="the engine default: on")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    rows = []
    for policy in args.policies.split(","):
        print(f"running {policy} ...", flush=True)
        rows.append(run_policy(policy.strip(), args))
    print()
    print_table(rows, args.gap_thresholds)
    print_summary(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
