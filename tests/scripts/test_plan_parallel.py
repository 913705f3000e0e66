"""The parallel layouts on paper: plan_memory.py's data-parallel capacity and estimate_decode_step.py's per-rank
step, at V4-Flash's published widths (nothing is allocated)."""

from __future__ import annotations

import json
from pathlib import Path

from estimate_decode_step import _roofline_ms, busiest_rank_experts, estimate, step_work
from plan_memory import plan

from backend.model.config import parse_model_config
from backend.model.parallel_layout import ParallelLayout

FLASH = Path(__file__).resolve().parents[2] / "docs" / "configs" / "deepseek-v4-flash.config.json"


def _flash():
    return parse_model_config(json.loads(FLASH.read_text()), str(FLASH))


def test_data_parallel_ranks_hold_their_own_requests():
    config = _flash()
    common = dict(gpu_memory_gib=141.0, utilization=0.9, reserve_gib=4.0, max_running=64, page_size=64,
                  kv_cache_dtype="fp8")
    tp = plan(config, "fp8", ParallelLayout(8, 8), **common)
    dp = plan(config, "fp8", ParallelLayout(1, 8), data_parallel_size=8, **common)
    # the whole attention and head on every rank: more weights per device, a bit less room per device...
    assert dp["weights_per_device_bytes"] > tp["weights_per_device_bytes"]
    assert dp["weights_per_device_by_part"]["embed+head"] == dp["weights_by_part"]["embed+head"]
    assert dp["token_capacity_per_device"] < tp["token_capacity_per_device"]
    # ...but each rank's pools hold other requests: the deployment holds 8 times a device's positions
    assert dp["token_capacity_total"] == 8 * dp["token_capacity_per_device"]
    assert tp["token_capacity_total"] == tp["token_capacity_per_device"]
    assert dp["token_capacity_total"] > 7 * tp["token_capacity_total"]


def test_the_decode_step_estimate_splits_attention_work_by_data_parallel_ranks():
    config = _flash()
    for context in (8192, 1 << 20):
        tp, dp = (estimate(config, layout, 8, 256, context) for layout in ("tp", "dp"))
        assert dp.tokens_per_rank == 32 and tp.tokens_per_rank == 256
        assert abs(dp.kv_gb * 8 - tp.kv_gb) <= 0.1  # every rank of tp reads every request's entries
        assert dp.comm_mb * 2 == tp.comm_mb  # one all-gather + one reduce-scatter against two all-reduces
        assert dp.weight_gb > tp.weight_gb  # the whole attention and head
    assert estimate(config, "dp", 8, 256, 1 << 20).roofline_ms < estimate(config, "tp", 8, 256, 1 << 20).roofline_ms
    assert estimate(config, "dp", 8, 256, 8192).roofline_ms > estimate(config, "tp", 8, 256, 8192).roofline_ms


def test_the_decode_step_reads_only_the_experts_its_batch_reaches():
    """k experts of each layer at one request (the shared expert is read whole, as every other weight), all of them
    as the batch grows: E (1 - (1 - k / E)^B) for uniform routing."""
    from backend.model.footprint import weight_bytes

    config = _flash()
    held = weight_bytes(config, "fp8")
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    one = estimate(config, "tp", 1, 1, 8192)
    assert one.expert_gb == round(held["routed experts"] * k / experts / 1e9, 2)
    others = sum(held.values()) - held["routed experts"] - held["draft layer (mtp)"]
    # the tables read by token, one row of each: the embedding and the hash layers' tid2eid
    hash_layers = config.mlp_layer_types.count("hash_moe")
    others -= (config.vocab_size - 1) * (2 * config.hidden_size + hash_layers * 8 * k)
    assert abs(one.weight_gb - one.expert_gb - others / 1e9) <= 0.01
    assert 0.98 * held["routed experts"] / 1e9 <= estimate(config, "tp", 1, 1024, 8192).expert_gb
    assert estimate(config, "tp", 1, 16, 8192).expert_gb < 0.4 * held["routed experts"] / 1e9
    # per rank under expert parallelism: what the batch reaches of the busiest rank's share (each MoE layer's exchange
    # waits for it): at one token 2.1 of a rank's 32 experts, where the average rank's is 6 / 8
    busiest = busiest_rank_experts(experts, k, 1, 8)
    assert 2.0 < busiest < 2.2 and busiest_rank_experts(experts, k, 256, 8) > 31.99
    assert abs(estimate(config, "tp", 8, 1, 8192).expert_gb - one.expert_gb / k * busiest) <= 0.01


def test_the_busiest_ranks_experts_are_those_of_random_routing():
    """busiest_rank_experts against routing drawn at random: each of B tokens picks k of E experts, the busiest of W
    ranks (E / W experts each) counted, the mean over 4,000 draws: within 3 % (2.7 % low at one token, where a
    token's k experts are distinct and the binomial count takes them as independent)."""
    import torch

    experts, k, ranks = 256, 6, 8
    generator = torch.Generator().manual_seed(0)
    for tokens in (1, 4, 16, 64):
        picks = torch.rand(4000, tokens, experts, generator=generator).topk(k, dim=-1).indices
        reached = torch.zeros(4000, experts, dtype=torch.bool).scatter_(1, picks.flatten(1), True)
        drawn = reached.view(4000, ranks, experts // ranks).sum(-1).max(-1).values.double().mean().item()
        assert abs(busiest_rank_experts(experts, k, tokens, ranks) - drawn) <= 0.03 * drawn, tokens


def test_a_verify_step_and_its_draft_passes_on_paper():
    """estimate_decode_step.py --drafts: a verify of 1 + K tokens a request reads the experts the B (1 + K) tokens
    reach, and each draft pass the MTP layer and the whole LM head again, so at one request one draft costs about
    1.4x a decode step on V4-Flash (uniform routing), and the published 0.77 acceptance gives 1.77 / 1.42."""
    from backend.model.footprint import draft_pass_weight_bytes, weight_bytes

    config = _flash()
    decode = estimate(config, "tp", 1, 1, 8192)
    verify_ms = _roofline_ms(step_work(config, "tp", 1, 1, 8192, tokens_per_request=2))
    one = estimate(config, "tp", 1, 1, 8192, drafts=1, acceptance=[0.77])
    head = weight_bytes(config, "fp8")["embed+head"] / 2  # (embedding and head the same size)
    draft = draft_pass_weight_bytes(config, "fp8", 1)
    assert head < draft < head + weight_bytes(config, "fp8", draft_layers=1)["draft layer (mtp)"]
    assert abs(one.verify_ms - (verify_ms + draft / 4.8e12 * 1e3)) < 0.01  # (rounded to 0.01 ms)
    assert 1.35 < one.verify_x < 1.5 and abs(one.speedup - 1.77 / one.verify_x) < 1e-3
    two = estimate(config, "tp", 1, 1, 8192, drafts=2, acceptance=[0.77, 0.38])
    assert two.verify_x > one.verify_x and two.speedup < one.speedup  # a second draft at 0.38 costs more than it gives
    assert decode.verify_ms is None


def test_a_verify_reads_a_requests_kv_entries_once():
    """The 1 + K queries of a verify row read their request's window, HCA entries and indexer keys once (and their
    own CSA picks each): at 1M positions a verify of one draft reads little more KV than a decode, not twice it;
    its FLOPs and the experts its tokens reach are those of 1 + K tokens."""
    config = _flash()
    decode, verify = (step_work(config, "tp", 8, 256, 1 << 20, tokens_per_request=n) for n in (1, 2))
    as_requests = step_work(config, "tp", 8, 512, 1 << 20)  # (the same tokens, each a request of its own)
    assert decode.kv < verify.kv < 1.05 * decode.kv and as_requests.kv > 1.9 * decode.kv
    assert verify.flops == as_requests.flops and verify.weights == as_requests.weights
    assert verify.tokens_per_rank == as_requests.tokens_per_rank == 512


def test_a_prefills_lm_head_computes_its_last_positions_logits_only():
    """bench_v4.py's prefill roofline: the LM head over one row (the chunk's last position), not over every token."""
    c = _flash()
    every_row, last_row = step_work(c, "tp", 1, 4096, 4096), step_work(c, "tp", 1, 4096, 4096, logits_rows=1)
    assert every_row.flops - last_row.flops == 4095 * 2 * c.hidden_size * c.vocab_size
    assert step_work(c, "tp", 1, 8, 4096, logits_rows=8).flops == step_work(c, "tp", 1, 8, 4096).flops
