#!/usr/bin/env python3
"""Decode throughput of the engine against transformers' `generate()`, side by side in one run.

    python scripts/bench_engine.py --concurrency 1 8 32 --json results/bench_engine.json

For each concurrency C, C prompts of --prompt-tokens tokens each generate --max-tokens tokens
(greedy, eos ignored) through the engine (all submitted at once, so they batch) and through the
reference's batched `generate()` on the same machine. Throughput counts generated tokens over the
whole wall time of the run (prefill included, the same for both). Prints a table and writes a list
of objects {concurrency, engine_tokens_per_s, reference_tokens_per_s, ratio}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import DEFAULT_CHECKPOINT, EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.request import SamplingParams  # noqa: E402


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    return torch.randint(2, vocab, (count, length), generator=g).tolist()


def run_engine(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(r["output_ids"]) == max_tokens for r in results)
    return len(batch) * max_tokens / elapsed


def run_reference(model, batch: list[list[int]], max_tokens: int) -> float:
    ids = torch.tensor(batch)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=1)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == max_tokens
    return len(batch) * max_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from transformers import DeepseekV4ForCausalLM

    engine = LLMEngine(EngineConfig(checkpoint=args.checkpoint, device=args.device,
                                    max_running_requests=max(args.concurrency),
                                    max_num_batched_tokens=max(8192, max(args.concurrency))))
    reference = DeepseekV4ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval().to(args.device)
    run_engine(engine, prompts(1, 8, engine.vocab_size), 4)  # warm-up
    rows = []
    for c in args.concurrency:
        batch = prompts(c, args.prompt_tokens, engine.vocab_size)
        engine_tps = run_engine(engine, batch, args.max_tokens)
        reference_tps = run_reference(reference, batch, args.max_tokens)
        rows.append({"concurrency": c, "engine_tokens_per_s": round(engine_tps, 1),
                     "reference_tokens_per_s": round(reference_tps, 1), "ratio": round(engine_tps / reference_tps, 2)})
        print(f"concurrency {c:>3}: engine {engine_tps:8.1f} tok/s  reference {reference_tps:8.1f} tok/s  "
              f"ratio {engine_tps / reference_tps:5.2f}x", flush=True)
    print()
    print(f"{'concurrency':>11} {'engine tok/s':>13} {'reference tok/s':>16} {'ratio':>7}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['engine_tokens_per_s']:>13} {r['reference_tokens_per_s']:>16} {r['ratio']:>6}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
