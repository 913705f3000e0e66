#!/usr/bin/env python
"""The engine on a device against the engine on CPU in fp32, with and without CUDA graphs (greedy tokens).

    python scripts/check_engine_device.py [--device cuda] [--max-tokens 24] [--checkpoint DIR] [--json FILE]

Generates greedily for prompts of 1..300 tokens (batched, so decode steps have several rows and cross
CSA/HCA boundaries) with: CPU fp32 (the reference run); the device in fp32 with cuda_graphs off and on
(must equal the reference token for token); the device in bf16 with graphs on and off (must equal each
other; their agreement with fp32 is reported, not required: bf16 rounding may flip a near-tie). Prints one
row per run; exit status 1 when a required equality fails. `--device cpu` checks the script itself (the
padded static step runs eagerly there).
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

PROMPT_LENGTHS = [1, 7, 60, 127, 130, 255, 300]


def generate(checkpoint: str, device: str, dtype: str, cuda_graphs: bool, prompts, max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(checkpoint=checkpoint, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                                    max_running_requests=8, num_tokens=16384, page_size=16,
                                    swa_full_tokens_ratio=0.5))
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [r["output_ids"] for r in results]


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
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    reference = generate(options.checkpoint, "cpu", "float32", False, prompts, options.max_tokens)
    runs = [("float32", False, True), ("float32", True, True), ("bfloat16", False, False), ("bfloat16", True, False)]
    rows, failed, outputs = [], False, {}
    for dtype, graphs, must_equal in runs:
        tokens = generate(options.checkpoint, options.device, dtype, graphs, prompts, options.max_tokens)
        outputs[(dtype, graphs)] = tokens
        equal = tokens == reference
        failed |= must_equal and not equal
        rows.append(dict(device=options.device, dtype=dtype, cuda_graphs=graphs, equal_to_cpu_fp32=equal,
                         agreement_with_cpu_fp32=agreement(tokens, reference), required=must_equal))
    bf16_graphs_equal = outputs[("bfloat16", True)] == outputs[("bfloat16", False)]
    failed |= not bf16_graphs_equal
    print(f"{'device':<7} {'dtype':<9} {'graphs':<6} {'== cpu fp32':<11} {'agreement':>9}  required")
    for r in rows:
        print(f"{r['device']:<7} {r['dtype']:<9} {str(r['cuda_graphs']):<6} {str(r['equal_to_cpu_fp32']):<11} "
              f"{r['agreement_with_cpu_fp32']:>9.3f}  {r['required']}")
    print(f"bf16 graphs on == off: {bf16_graphs_equal}")
    if options.json:
        options.json.write_text(json.dumps(dict(runs=rows, bf16_graphs_equal=bf16_graphs_equal), indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
