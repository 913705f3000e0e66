#!/usr/bin/env python3
"""Decode throughput of the engine against transformers' `generate()`, side by side in one run.

    python scripts/bench_engine.py --concurrency 1 8 32 --json results/bench_engine.json

For each concurrency C, C prompts of --prompt-tokens tokens each generate --max-tokens tokens
(greedy, eos ignored) through the engine (all submitted at once, so they batch) and through the
reference's batched `generate()` (equal-length prompts, so it batches without padding) on the same
machine. Decode throughput is C * (max_tokens - 1) tokens over the time a max_tokens run takes
beyond a 1-token run (which is prefill and first token only); end-to-end throughput counts all
C * max_tokens tokens over the whole run. Prints a table and writes a list of objects
{concurrency, engine_tokens_per_s, reference_tokens_per_s, ratio, ...} (tokens_per_s = decode).

With --mixed-lengths the C prompts have different lengths (--prompt-tokens +- 50 %), as real
traffic does. The reference cannot batch those (its compressors do not read the attention mask,
so left padding would be compressed into CSA/HCA entries), so it generates them one at a time,
while the engine still batches them.
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


def prompts(count: int, length: int, vocab: int, mixed_lengths: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(count)
    if not mixed_lengths:
        return torch.randint(2, vocab, (count, length), generator=g).tolist()
    lengths = torch.randint(max(1, length // 2), length * 3 // 2 + 1, (count,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def time_engine(engine: LLMEngine, batch: list[list[int]], max_tokens: int, temperature: float = 0.0) -> float:
    """Seconds to generate max_tokens for every prompt of `batch` (greedy, or sampled at `temperature`, seeded)."""
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                             seed=i if temperature else None) for i in range(len(batch))]
    start = time.perf_counter()
    results = engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    assert all(len(r["output_ids"]) == max_tokens for r in results)
    return elapsed


def time_reference(model, batch: list[list[int]], max_tokens: int) -> float:
    """One batched generate() when the prompts have equal lengths, else one generate() per prompt; on one intra-op
    thread, as the engine runs decode steps (docs/host-loop.md#threads; it sets the count of the thread its steps run
    on, which with overlap scheduling is not this one)."""
    groups = [batch] if len({len(p) for p in batch}) == 1 else [[p] for p in batch]
    torch.set_num_threads(1)
    start = time.perf_counter()
    for group in groups:
        ids = torch.tensor(group)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=1)
        assert out.shape[1] - ids.shape[1] == max_tokens
    return time.perf_counter() - start


def throughput(timer, batch: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, end-to-end tokens/s) of one backend."""
    first_token_s = timer(batch, 1)
    total_s = timer(batch, max_tokens)
    decode = len(batch) * (max_tokens - 1) / max(total_s - first_token_s, 1e-9)
    return decode, len(batch) * max_tokens / total_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="prompts of different lengths (the reference then runs them one by one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.overlap_scheduling)
    parser.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens,
                        help="the engine drafts this many tokens per decode with the checkpoint's MTP layer")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from transformers import DeepseekV4ForCausalLM

    # Each batch runs twice (to 1 token, then to --max-tokens): with prefix caching the second run would restore
    # what the first computed, which the reference cannot; the comparison is of computing, so the cache is off.
    engine = LLMEngine(EngineConfig(checkpoint=args.checkpoint, device=args.device,
                                    max_running_requests=max(args.concurrency),
                                    max_num_batched_tokens=max(8192, max(args.concurrency)),
                                    enable_prefix_caching=False, overlap_scheduling=args.overlap_scheduling,
                                    num_speculative_tokens=args.num_speculative_tokens))
    reference = DeepseekV4ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval().to(args.device)
    time_engine(engine, prompts(1, 8, engine.vocab_size), 4)  # warm-up
    rows = []
    for c in args.concurrency:
        batch = prompts(c, args.prompt_tokens, engine.vocab_size, args.mixed_lengths)
        engine_decode, engine_e2e = throughput(lambda b, n: time_engine(engine, b, n), batch, args.max_tokens)
        ref_decode, ref_e2e = throughput(lambda b, n: time_reference(reference, b, n), batch, args.max_tokens)
        rows.append({"concurrency": c, "mixed_lengths": args.mixed_lengths,
                     "num_speculative_tokens": args.num_speculative_tokens,
                     "mean_accepted_length": engine.stats()["mean_accepted_length"],
                     "engine_tokens_per_s": round(engine_decode, 1),
                     "reference_tokens_per_s": round(ref_decode, 1), "ratio": round(engine_decode / ref_decode, 2),
                     "engine_end_to_end_tokens_per_s": round(engine_e2e, 1),
                     "reference_end_to_end_tokens_per_s": round(ref_e2e, 1),
                     "end_to_end_ratio": round(engine_e2e / ref_e2e, 2)})
        print(f"concurrency {c:>3}: decode engine {engine_decode:8.1f} tok/s, reference {ref_decode:8.1f} tok/s "
              f"({engine_decode / ref_decode:.2f}x)", flush=True)
    print()
    print(f"{'concurrency':>11} | {'decode tok/s: engine':>20} {'reference':>10} {'ratio':>6} | "
          f"{'end-to-end: engine':>18} {'reference':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['concurrency']:>11} | {r['engine_tokens_per_s']:>20} {r['reference_tokens_per_s']:>10} "
              f"{r['ratio']:>5}x | {r['engine_end_to_end_tokens_per_s']:>18} "
              f"{r['reference_end_to_end_tokens_per_s']:>10} {r['end_to_end_ratio']:>5}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
