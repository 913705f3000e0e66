#!/usr/bin/env python3
"""A paper estimate of one decode step per rank: tensor-parallel attention against data-parallel attention.

    python scripts/estimate_decode_step.py --config docs/configs/deepseek-v4-flash.config.json --ranks 8 \
        --batch 256 --contexts 8192 131072 1048576 --csv results/decode_step.csv

Two layouts of W ranks, both with expert parallelism (each rank holds E / W routed experts whole):
- `tp` (tensor_parallel_size = W, today's): every rank runs all B requests; the query heads, the grouped output
  projection and the shared expert are split W ways, while the K=V head, q_a, the compressors and the indexer are
  replicated, so every rank reads every request's KV entries and scores every request's indexer keys. Two
  all-reduces of [B, hidden] per layer (attention output, MoE output).
- `dp` (data_parallel_size = W): every rank runs B / W requests with the whole attention, and the MoE layers meet:
  an all-gather of [B, hidden] before the experts and a reduce-scatter after them.

Counted per rank and step, from config.json's widths alone (nothing runs): the weights read (as published: FP8
linears, MXFP4 experts, bf16 embeddings and norms; of the rank's routed experts only those the batch reaches,
E (1 - (1 - k / E)^B) of E for uniform routing: k at B = 1, nearly all at B = 256, at the busiest rank's share, which
every MoE layer's exchange waits for; of the embedding, B rows), the KV
bytes read (DeepSeek's fp8 layout: 584 B an entry, 68 B an indexer key; window 128 positions, the CSA top-k picks,
every HCA entry, every CSA indexer key), the FLOPs (projections, attention over the entries read, indexer scoring,
experts, shared expert, router, the LM head), and the bytes each rank sends (ring collectives, bf16 activations).
`roofline_ms` is max(bytes / HBM bandwidth, FLOPs / dense bf16 peak) at H200's 4.8 TB/s and 989 TFLOP/s, a lower
bound, not a measurement; communication is listed apart (NVLink's 900 GB/s for scale). Nothing here has run on a GPU.

With --drafts K, speculative decoding's step beside it: a verify step of the B requests with 1 + K tokens each (the
experts their B (1 + K) tokens reach, each token's FLOPs; a request's KV entries read once, its 1 + K queries' CSA picks
each) and the K draft passes after it, each over the B requests
(footprint.draft_pass_weight_bytes: the MTP layer, of its experts those the requests reach, the LM head it shares);
`verify_ms` their rooflines together and `verify_x` that over the decode step's. With --acceptance a_1 .. a_K (vLLM's
per-position acceptance rates: a_i the share of verifies that accept draft i, and so every draft before it, e.g.
V4-Flash's published 0.77 0.38), `speedup` = (1 + a_1 + ... + a_K) / verify_x: the tokens a step emits on average
over what it costs, where both steps run at their rooflines.

    python scripts/estimate_decode_step.py --config docs/configs/deepseek-v4-flash.config.json --ranks 1 --batch 1 \
        --contexts 8192 --drafts 1 --acceptance 0.77
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.model.config import CSA, HCA, parse_model_config  # noqa: E402
from backend.model.footprint import draft_pass_weight_bytes, experts_reached, step_weight_bytes  # noqa: E402
from backend.model.parallel_layout import ParallelLayout  # noqa: E402
from kernels.quant_formats import indexer_fp4_entry_bytes, kv_fp8_entry_bytes  # noqa: E402
from scripts.bench_results import write_csv  # noqa: E402
from scripts.flag_types import at_least  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
BF16_FLOPS_PER_S = 989e12  # H200 dense bf16
LAYOUTS = ("tp", "dp")



def parse_rates(text: str) -> list[float]:
    """Per-position acceptance rates separated by commas or spaces ("0.77,0.38", "0.77 0.38"); anything else is
    refused (argparse's error)."""
    try:
        rates = [float(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"acceptance rates are numbers, got {text!r}") from None
    if problem := acceptance_problem(rates):
        raise argparse.ArgumentTypeError(problem)
    return rates


def acceptance_flag(parser: argparse.ArgumentParser, values: list[str] | None, default: list[float]) -> list[float]:
    """The rates of an --acceptance flag (nargs="+": "0.77 0.38" or "0.77,0.38"), or `default` when not given."""
    try:
        return parse_rates(" ".join(values)) if values else default
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--acceptance: {exc}")


def acceptance_problem(rates: list[float]) -> str | None:
    """Why `rates` are not per-position acceptance rates (probabilities that never increase: a verify accepts draft
    i + 1 only with draft i), or None."""
    if not all(0.0 <= r <= 1.0 for r in rates):
        return f"acceptance rates are probabilities, got {rates}"
    if any(later > earlier for earlier, later in zip(rates, rates[1:])):
        return (f"per-position acceptance rates cannot increase (a draft is accepted only with those before it), "
                f"got {rates}")
    return None


def expected_tokens_per_step(rates: list[float], k: int) -> float:
    """The tokens a verify of k drafts emits on average at per-position acceptance rates a_1, a_2, ...: 1 + a_1 + ...
    + a_k (the token after the accepted drafts, and draft i where it is accepted); NaN past the rates given."""
    return 1.0 + sum(rates[:k]) if k <= len(rates) else float("nan")

@dataclass
class StepEstimate:
    layout: str
    context: int
    tokens_per_rank: int
    weight_gb: float
    expert_gb: float  # of weight_gb, the routed experts the batch reaches
    kv_gb: float
    tflop: float
    comm_mb: float
    roofline_ms: float
    verify_ms: float | None = None  # --drafts K: the verify step of 1 + K tokens a request and the K draft passes
    verify_x: float | None = None  # verify_ms over roofline_ms
    speedup: float | None = None  # --acceptance: (1 + the drafts accepted on average) / verify_x


def entries_read(layer_type: str, context: int, c, queries: int = 1) -> float:
    """KV entries one request's `queries` consecutive queries read in a layer, each entry once: their windows, and
    the CSA picks (each query its own, at most every entry) or every HCA entry."""
    window = min(c.sliding_window + queries - 1, context)
    if layer_type == CSA:
        return window + min(queries * c.index_topk, context / c.csa_rate)
    if layer_type == HCA:
        return window + context / c.hca_rate
    return window


@dataclass
class StepWork:
    """What one rank's step must do, unrounded: bytes of weights read by part, KV bytes read, FLOPs, bytes sent."""
    weights: dict[str, float]
    kv: float
    flops: float
    comm: float
    tokens_per_rank: int


def lm_head_flops(c, rows: float) -> float:
    """The LM head's FLOPs over `rows` rows (the whole vocabulary)."""
    return rows * 2 * c.hidden_size * c.vocab_size


def step_work(c, layout: str, ranks: int, batch: int, context: int, logits_rows: int | None = None,
              tokens_per_request: int = 1) -> StepWork:
    """One decode step of `batch` requests at `context` positions each, on one of `ranks` ranks (see the module
    docstring); `logits_rows`: the rows the LM head computes, if not every one of this rank's (a prefill's: its last
    position's); `tokens_per_request`: a verify's 1 + K (each token its own FLOPs and experts, a request's KV entries
    read once). scripts/bench_v4.py puts its measured steps beside it."""
    d, heads, dh, q = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank
    hi, di, inter, k = c.index_n_heads, c.index_head_dim, c.moe_intermediate_size, c.num_experts_per_tok
    requests = -(-batch // ranks) if layout == "dp" else batch  # whose attention this rank runs (the busiest's)
    own = requests * tokens_per_request  # the tokens of those
    batch *= tokens_per_request  # (every rank's tokens, from here on)
    split = ranks if layout == "tp" else 1  # the share of the heads (and the shared expert) a rank computes
    entry, index_key = kv_fp8_entry_bytes(dh, c.qk_rope_head_dim), indexer_fp4_entry_bytes(di)
    kv = flops = 0.0
    for layer_type in c.layer_types:
        entries = entries_read(layer_type, context, c)  # (a query's)
        kv += requests * entries_read(layer_type, context, c, tokens_per_request) * entry
        replicated = 2 * d * q + 2 * d * dh  # q_a and the K=V projection: every rank, its requests
        per_head = 2 * q * heads * dh + 2 * heads * dh * c.o_lora_rank + 2 * c.o_groups * c.o_lora_rank * d
        per_head += 4 * heads * dh * entries  # scores and the weighted sum over the entries read
        if layer_type == CSA:
            kv += requests * (context / c.csa_rate) * index_key
            replicated += 2 * 2 * (2 * dh) * d + 2 * 2 * (2 * di) * d + 2 * q * hi * di + 2 * d * hi
            replicated += 2 * hi * di * context / c.csa_rate  # the indexer scores every CSA key
        elif layer_type == HCA:
            replicated += 2 * 2 * dh * d
        flops += own * (replicated + per_head / split)
        routed_pairs = batch * k / ranks  # (expert parallelism: every token's pairs on their experts' ranks)
        flops += routed_pairs * 6 * d * inter + (own / split) * 6 * d * inter + own * 2 * d * c.n_routed_experts
    head_rows = own if logits_rows is None else logits_rows
    flops += lm_head_flops(c, head_rows) / (ranks if layout == "tp" else 1)  # (vocabulary-parallel under TP)
    weights = _weights_read(c, layout, ranks, batch)
    activation = batch * d * 2  # [B, hidden] in bf16
    ring = (ranks - 1) / ranks
    per_layer = (2 * 2 * ring * activation) if layout == "tp" else (2 * ring * activation)  # 2 all-reduces | AG + RS
    return StepWork(weights, kv, flops, per_layer * len(c.layer_types), own)


def estimate(c, layout: str, ranks: int, batch: int, context: int, drafts: int = 0,
             acceptance: list[float] | None = None) -> StepEstimate:
    """step_work's step, rounded for the table, with its roofline at H200's bandwidth and bf16 peak; with `drafts`,
    the verify step and its draft passes beside it (the module docstring)."""
    work = step_work(c, layout, ranks, batch, context)
    weights = sum(work.weights.values())
    roofline = _roofline_ms(work)
    row = StepEstimate(layout, context, work.tokens_per_rank, round(weights / 1e9, 2),
                       round(work.weights["routed experts"] / 1e9, 2), round(work.kv / 1e9, 2),
                       round(work.flops / 1e12, 2), round(work.comm / 1e6, 1), round(roofline, 2))
    if drafts:
        verify = _roofline_ms(step_work(c, layout, ranks, batch, context, tokens_per_request=1 + drafts))
        verify += drafts * _draft_pass_ms(c, layout, ranks, batch)
        row.verify_ms, row.verify_x = round(verify, 2), round(verify / roofline, 3)
        if acceptance:
            row.speedup = round(expected_tokens_per_step(acceptance, drafts) / (verify / roofline), 3)
    return row


def _roofline_ms(work: StepWork) -> float:
    return max((sum(work.weights.values()) + work.kv) / HBM_BYTES_PER_S, work.flops / BF16_FLOPS_PER_S) * 1e3


def _draft_pass_ms(c, layout: str, ranks: int, batch: int) -> float:
    """One draft pass over a rank's share of `batch` requests, at the bandwidth (its weights dominate: the MTP layer
    and the LM head; its own KV reads, a window, are left out)."""
    return (draft_pass_weight_bytes(c, "fp8", batch, layout=_rank_layout(layout, ranks), data_parallel=layout == "dp")
            / HBM_BYTES_PER_S * 1e3)


def _weights_read(c, layout: str, ranks: int, batch: int) -> dict[str, float]:
    """What a step of `batch` requests reads of a rank's weights as the engine holds them (with the dp layout the head
    whole), by part: the experts every rank's tokens reach among its own (footprint.step_weight_bytes), counted at
    the busiest rank's share (every MoE layer ends in an exchange, which waits for it)."""
    parts = step_weight_bytes(c, "fp8", batch, layout=_rank_layout(layout, ranks), data_parallel=layout == "dp")
    if ranks > 1:
        average = experts_reached(c.n_routed_experts, c.num_experts_per_tok, batch) / ranks
        parts["routed experts"] *= busiest_rank_experts(c.n_routed_experts, c.num_experts_per_tok, batch,
                                                        ranks) / average
    return parts


def busiest_rank_experts(num_experts: int, top_k: int, tokens: int, ranks: int) -> float:
    """Of the E / W experts each of W expert-parallel ranks holds, those `tokens` tokens reach on the rank they reach
    most, expected: each expert is reached with p = 1 - (1 - k / E)^B, so a rank's count is Binomial(E / W, p)
    (experts taken as independent: within 3 % of random routing's, 2.7 % low at one token), and the busiest is the
    largest of W such counts. V4-Flash on 8 ranks: 2.1 at one token where the average is 0.75, 13.9 against 10.1 at
    16, all 32 at 256."""
    held, p = num_experts // ranks, 1 - (1 - top_k / num_experts) ** tokens
    below = expected = 0.0  # P(count <= c); E[max] = sum over c of P(max > c)
    for count in range(held):
        below += math.comb(held, count) * p ** count * (1 - p) ** (held - count)
        expected += 1 - min(below, 1.0) ** ranks
    return expected


def _rank_layout(layout: str, ranks: int) -> ParallelLayout:
    """The engine's layout of `layout` over `ranks`: tensor and expert parallel, or experts split alone (dp)."""
    return ParallelLayout(ranks, ranks) if layout == "tp" else ParallelLayout(1, ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="a DeepSeek-V4 config.json")
    parser.add_argument("--ranks", type=at_least(1), default=8)
    parser.add_argument("--batch", type=at_least(1), default=256,
                        help="requests decoding in the step, all ranks together")
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[8192, 131072, 1048576])
    parser.add_argument("--drafts", type=at_least(0), default=0,
                        help="K: also a verify step of 1 + K tokens a request and its K draft passes")
    parser.add_argument("--acceptance", nargs="+", metavar="A",
                        help="per-position acceptance rates, one per draft: the share of verifies that accept draft i "
                             "and every draft before it (V4-Flash: 0.77 0.38, or 0.77,0.38)")
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.acceptance = acceptance_flag(parser, args.acceptance, [])
    if args.acceptance and len(args.acceptance) != args.drafts:
        parser.error(f"--acceptance takes one rate per draft: {args.drafts}, got {len(args.acceptance)}")
    try:
        config = parse_model_config(json.loads(args.config.read_text(encoding="utf-8")), str(args.config))
        _rank_layout("tp", args.ranks).check(config)
    except (OSError, ValueError) as exc:  # (no such file, not JSON, not a V4 config, heads the ranks cannot split)
        parser.error(f"--config {args.config} (--ranks {args.ranks}): {exc}")
    rows = [estimate(config, layout, args.ranks, args.batch, context, args.drafts, args.acceptance)
            for context in args.contexts for layout in LAYOUTS]
    print(f"one decode step per rank: {args.ranks} ranks, batch {args.batch}, {args.config.name} (paper estimate)")
    print(f"{'context':>9} {'layout':>6} {'requests':>8} | {'weights GB':>10} {'experts':>7} {'KV GB':>7} "
          f"{'TFLOP':>7} | {'sent MB':>8} | {'roofline ms':>11}")
    for r in rows:
        print(f"{r.context:>9} {r.layout:>6} {r.tokens_per_rank:>8} | {r.weight_gb:>10} {r.expert_gb:>7} {r.kv_gb:>7} "
              f"{r.tflop:>7} | {r.comm_mb:>8} | {r.roofline_ms:>11}")
    if args.drafts:
        print(f"\nwith {args.drafts} draft(s) a request: the verify step and its draft passes "
              f"(speed-up at acceptance {' '.join(map(str, args.acceptance)) or '-'})")
        print(f"{'context':>9} {'layout':>6} | {'verify ms':>9} {'x decode':>8} {'speed-up':>8}")
        for r in rows:
            print(f"{r.context:>9} {r.layout:>6} | {r.verify_ms:>9} {r.verify_x:>8} {r.speedup or '-':>8}")
    if args.csv:
        write_csv(args.csv, [asdict(r) for r in rows])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
