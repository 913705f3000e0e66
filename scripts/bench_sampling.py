#!/usr/bin/env python3
"""What drawing sampled rows costs a step at DeepSeek-V4's vocabulary: the sampler's rows filtered together where the
logits are against the old way, each row copied to the host, filtered and drawn there, side by side in one run.

    python scripts/bench_sampling.py                          # CPU: the two ways should cost the same
    python scripts/bench_sampling.py --device cuda --csv results/sampling.csv

For each parameter set (temperature alone; with top-p; with top-k and top-p) and row count (--rows), --repeats draws
of every row of random logits [rows, --vocab] (each row a seeded request of its own), timed from the call to the
tokens on the host (CUDA synchronized), the median; on CPU on one intra-op thread, as the engine's decode steps run.
Prints a table; writes --csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.request import SamplingParams  # noqa: E402
from backend.sampler import Sampler, SamplerState, filter_logits  # noqa: E402
from scripts.bench_results import write_csv  # noqa: E402

PARAMETER_SETS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50, top_p 0.95": SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
}


def per_row_on_the_host(logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
    """The sampler before rows were filtered together: every row to the host, filtered and drawn there."""
    tokens = torch.argmax(logits, dim=-1)
    for row, state in enumerate(states):
        probs = torch.softmax(filter_logits(logits[row].cpu(), state.params), dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=state.generator_on(probs.device)))
    return tokens


def time_draws(draw, logits: torch.Tensor, params: SamplingParams, repeats: int) -> float:
    """The median seconds of `repeats` draws of every row, from the call to the tokens on the host."""
    times = []
    for repeat in range(repeats):
        states = [SamplerState(SamplingParams(**{**vars(params), "seed": row}), [1]) for row in range(len(logits))]
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        draw(logits, states).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # (as the engine's decode steps run: docs/host-loop.md#threads)
    sampler, rows = Sampler(), []
    for name, params in PARAMETER_SETS.items():
        for count in args.rows:
            logits = (torch.randn(count, args.vocab) * 3).to(args.device)
            time_draws(sampler.sample, logits, params, 1)  # (warm-up)
            together = time_draws(sampler.sample, logits, params, args.repeats)
            host = time_draws(per_row_on_the_host, logits, params, args.repeats)
            rows.append({"device": args.device, "params": name, "rows": count, "vocab": args.vocab,
                         "together_ms": round(together * 1e3, 3), "per_row_host_ms": round(host * 1e3, 3),
                         "speedup": round(host / together, 2)})
            print(f"{name:<40} rows {count:>4}: together {together * 1e3:8.2f} ms, per row on the host "
                  f"{host * 1e3:8.2f} ms, {host / together:6.2f}x", flush=True)
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
