#!/usr/bin/env python
"""The engine on a device against the engine on CPU in fp32, with and without CUDA graphs (greedy tokens).

    python scripts/check_engine_device.py [--device cuda] [--max-tokens 24] [--checkpoint DIR] [--json FILE]
                                          [--num-speculative-tokens 1 2] [--variants pdl side_stream ...]

Generates greedily for prompts of 1..300 tokens (batched, so decode steps have several rows and cross
CSA/HCA boundaries), then for a second wave of prompts that start like the first wave's (restored from the
prefix cache: block boundaries snapshotted inside the first wave's chunks, and their exact ends), with: CPU
fp32 without the prefix cache (the reference run); the device in fp32 with cuda_graphs off and on and the
cache on (must equal the reference token for token, and must have restored from the cache); the device in
bf16 with graphs on and off (must equal each other; their agreement with fp32 is reported, not required:
bf16 rounding may flip a near-tie); with --num-speculative-tokens k [k ...], also the device in fp32 with k drafts per
decode from the checkpoint's MTP layer, graphs off and on (must equal the reference: speculation changes no greedy
token; with graphs and k = 1 the draft pass follows each verify on the device, the host reading both at once, and with
k > 1 the host plans the chain from the verify's output); with --variants, also the device in fp32 with graphs on in
each: `pdl`, every kernel launched while the one before it runs (a Hopper GPU); `side_stream`, a layer's independent
branches on a second stream; `pdl+side_stream` (must equal the reference: each kernel waits on the device for what it
reads). Then sampled requests on the device (fp32, graphs on; with each k too: argmax drafts in the static chain):
seeded requests with top-k, top-p and log-probabilities generated twice by one engine must draw the same tokens (their
generators on the device), every log-probability finite and at most 0.
Prints one row per run; exit status 1 when a required equality fails.
`--device cpu` checks the script itself (the padded static step runs eagerly there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from backend.config import DEFAULT_CHECKPOINT, EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.request import SamplingParams  # noqa: E402
from scripts import step_variants  # noqa: E402

PROMPT_LENGTHS = [1, 7, 60, 127, 130, 255, 300]
POOLS = dict(max_running_requests=8, num_tokens=16384, page_size=16, swa_full_tokens_ratio=0.5)  # (every run's)


def waves(gen: torch.Generator) -> list[list[list[int]]]:
    """The first wave's prompts, and a second wave sharing their prefixes (at 128 and 256: boundaries inside the
    first wave's chunks, and whole first-wave prompts)."""
    first = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    tail = lambda n: torch.randint(2, 512, (n,), generator=gen).tolist()  # noqa: E731
    return [first, [first[6][:200] + tail(30), first[5] + tail(9), first[4][:129] + tail(12), first[6] + tail(3)]]


def generate(checkpoint: str, device: str, dtype: str, cuda_graphs: bool, prompt_waves, max_tokens: int,
             prefix_caching: bool, speculative_tokens: int = 0, variant: str = "") -> tuple[list[list[int]], int]:
    """Every wave's greedy tokens, and the prompt positions the cache served. `variant`: a step variant's settings on
    (scripts/step_variants.py)."""
    engine = LLMEngine(EngineConfig(checkpoint=checkpoint, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                                    enable_prefix_caching=prefix_caching, num_speculative_tokens=speculative_tokens,
                                    **step_variants.settings(variant), **POOLS))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens = [r["output_ids"] for prompts in prompt_waves for r in engine.generate(prompts, params)]
    cache = engine.kv.prefix_cache
    return tokens, cache.stats.cached_tokens if cache is not None else 0


def sampled_twice(checkpoint: str, device: str, prompts: list[list[int]], max_tokens: int,
                  speculative_tokens: int) -> dict:
    """Seeded sampled requests generated twice by one engine (graphs on, the prefix cache off: both runs take the same
    steps): whether the tokens repeat, and whether every log-probability is finite and at most 0."""
    engine = LLMEngine(EngineConfig(checkpoint=checkpoint, device=device, dtype="float32", enable_prefix_caching=False,
                                    num_speculative_tokens=speculative_tokens, **POOLS))
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=40 if i % 2 else 0, top_p=0.9, seed=i,
                             logprobs=2, ignore_eos=True) for i in range(len(prompts))]
    runs = [engine.generate(prompts, params) for _ in range(2)]
    engine.shutdown()
    logprobs = [lp for r in runs[0] for lp in r["logprobs"]]
    return dict(num_speculative_tokens=speculative_tokens,
                repeated=[r["output_ids"] for r in runs[0]] == [r["output_ids"] for r in runs[1]],
                logprobs_valid=bool(logprobs) and all(-float("inf") < lp.logprob <= 0.0 for lp in logprobs))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions equal up to each sequence's first difference."""
    same = total = 0
    for x, y in zip(a, b):
        prefix = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        same, total = same + prefix, total + len(x)
    return same / max(total, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--num-speculative-tokens", type=int, nargs="*", default=[],
                        help="also run with these many drafts per decode (fp32, graphs off and on; must equal)")
    parser.add_argument("--variants", nargs="*", default=[], metavar="V", choices=step_variants.NAMES,
                        help="also run in these variants (pdl, side_stream, pdl+side_stream; fp32, graphs on; "
                             "must equal)")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    prompt_waves = waves(torch.Generator().manual_seed(0))
    reference, _ = generate(options.checkpoint, "cpu", "float32", False, prompt_waves, options.max_tokens, False)
    runs = [("float32", False, True, 0, ""), ("float32", True, True, 0, ""), ("bfloat16", False, False, 0, ""),
            ("bfloat16", True, False, 0, "")]
    runs += [("float32", graphs, True, k, "") for k in options.num_speculative_tokens if k for graphs in (False, True)]
    runs += [("float32", True, True, 0, variant) for variant in options.variants]
    rows, failed, outputs = [], False, {}
    for dtype, graphs, must_equal, speculative, variant in runs:
        tokens, cached = generate(options.checkpoint, options.device, dtype, graphs, prompt_waves,
                                  options.max_tokens, True, speculative, variant)
        outputs[(dtype, graphs, speculative, variant)] = tokens
        equal = tokens == reference
        failed |= (must_equal and not equal) or cached == 0
        rows.append(dict(device=options.device, dtype=dtype, cuda_graphs=graphs, num_speculative_tokens=speculative,
                         variant=variant, equal_to_cpu_fp32=equal,
                         agreement_with_cpu_fp32=agreement(tokens, reference), required=must_equal,
                         cached_tokens=cached))
    bf16_graphs_equal = outputs[("bfloat16", True, 0, "")] == outputs[("bfloat16", False, 0, "")]
    failed |= not bf16_graphs_equal
    print(f"{'device':<7} {'dtype':<9} {'graphs':<6} {'drafts':<6} {'variant':<17} {'== cpu fp32':<11} "
          f"{'agreement':>9}  {'required':<8} cached positions")
    for r in rows:
        print(f"{r['device']:<7} {r['dtype']:<9} {str(r['cuda_graphs']):<6} {r['num_speculative_tokens']:<6} "
              f"{r['variant']:<17} {str(r['equal_to_cpu_fp32']):<11} "
              f"{r['agreement_with_cpu_fp32']:>9.3f}  {str(r['required']):<8} {r['cached_tokens']}")
    print(f"bf16 graphs on == off: {bf16_graphs_equal}")
    sampled = [sampled_twice(options.checkpoint, options.device, prompt_waves[0], options.max_tokens, k)
               for k in sorted({0, *options.num_speculative_tokens})]
    for r in sampled:
        print(f"sampled, seeded, drafts {r['num_speculative_tokens']}: the same tokens twice {r['repeated']}, "
              f"log-probabilities valid {r['logprobs_valid']}")
        failed |= not (r["repeated"] and r["logprobs_valid"])
    if options.json:
        options.json.write_text(json.dumps(dict(runs=rows, bf16_graphs_equal=bf16_graphs_equal, sampled=sampled),
                                           indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
