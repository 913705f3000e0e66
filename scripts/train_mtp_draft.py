#!/usr/bin/env python3
"""Train only the MTP (draft) layer of a checkpoint to predict the main model's own next-next tokens.

    python scripts/train_mtp_draft.py --out checkpoints/dsv4-tiny-mtp          # the built-in checkpoint's draft
    python scripts/bench_engine.py --checkpoint checkpoints/dsv4-tiny-mtp --num-speculative-tokens 2

The built-in checkpoint's weights are random, so its MTP layer drafts nothing the model would say. This script gives
it a draft worth measuring, in a few CPU minutes:
1. the engine generates text from random prompts (greedy, and some sampled at --temperature, eos ignored);
2. transformers' reference model reads those sequences once; a hook keeps its last layer's residual streams, the
   hidden state the MTP layer drafts from (DeepSeek's MTPBlock reads them before the hyper-head);
3. the MTP layer, built from transformers' own modules (a sliding-window decoder layer with top-k routing, plus
   e_proj/h_proj, enorm/hnorm, its hyper-head and norm; the embedding and LM head are the main model's and stay
   frozen), learns with cross-entropy to predict token t + 2 from the streams at t and the embedding of token t + 1,
   which is what `DeepseekV4Model.draft` computes;
4. the checkpoint is copied to --out with the new `mtp.0.*` tensors, and the engine measures the acceptance it reaches
   on held-out prompts with k = 1, 2 and 3 (greedy), printed as a table.

Only unquantized checkpoints in transformers' module names (the built-in layout) are written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import DEFAULT_CHECKPOINT, EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.model.checkpoint import draft_layer_shapes  # noqa: E402
from backend.model.config import load_model_config  # noqa: E402
from backend.model.weight_names import detect_layout  # noqa: E402
from backend.request import SamplingParams  # noqa: E402

PREFIX = "model.mtp.0."


class DraftLayer(nn.Module):
    """DeepSeek's MTPBlock over transformers' modules; parameter names are the engine's under `model.mtp.0.`."""

    def __init__(self, config):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer, DeepseekV4HyperHead,
                                                                          DeepseekV4RMSNorm, DeepseekV4RotaryEmbedding)

        super().__init__()
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer = DeepseekV4DecoderLayer(config, 0)  # config: one sliding-window layer with top-k routing
        self.e_proj, self.h_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.enorm, self.hnorm, self.norm = (DeepseekV4RMSNorm(d, eps) for _ in range(3))
        self.hc_head = DeepseekV4HyperHead(config)
        self.rotary = DeepseekV4RotaryEmbedding(config)

    def forward(self, next_embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """next_embeds [B, S, D] (the token after each position), streams [B, S, N, D] -> hidden [B, S, D]."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        positions = torch.arange(next_embeds.shape[1]).unsqueeze(0)
        x = self.e_proj(self.enorm(next_embeds)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=next_embeds, attention_mask=None,
                                                 past_key_values=None, position_ids=positions)
        rope = {label: self.rotary(next_embeds, position_ids=positions, layer_type=label)
                for label in ("main", "compress")}
        x = self.layer(x, position_embeddings=rope, position_ids=positions, attention_mask=mask)
        return self.norm(self.hc_head(x))

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors under the engine's names (the rotary tables are not tensors of the checkpoint)."""
        return {PREFIX + name.removeprefix("layer."): t.detach().clone().contiguous()
                for name, t in self.state_dict().items() if not name.startswith("rotary.")}

    def load_engine_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        own = ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head")  # the MTPBlock's own parts; the rest: the layer

        def module_name(name: str) -> str:
            rest = name.removeprefix(PREFIX)
            return rest if rest.split(".")[0] in own else "layer." + rest

        missing, unexpected = self.load_state_dict({module_name(n): t for n, t in tensors.items()}, strict=False)
        missing = [name for name in missing if not name.startswith("rotary.")]
        if missing or unexpected:
            raise SystemExit(f"the checkpoint's MTP layer does not fit the draft module: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")


def one_layer_config(checkpoint: Path):
    """The checkpoint's transformers config, cut to the draft layer's shape: one sliding layer, top-k routing."""
    from transformers import DeepseekV4Config

    raw = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    for legacy in ("compress_ratios", "num_hash_layers"):
        raw.pop(legacy, None)
    raw.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    config = DeepseekV4Config(**raw)
    config._attn_implementation = config._experts_implementation = "eager"  # (modules used outside a PreTrainedModel)
    return config


def generate_sequences(engine: LLMEngine, count: int, prompt_tokens: int, new_tokens: int, temperature: float,
                       seed: int) -> torch.Tensor:
    """[count, prompt + new] token ids the engine generated (half greedy, half sampled at `temperature`)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, engine.vocab_size, (count, prompt_tokens), generator=g).tolist()
    params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0 if i % 2 == 0 else temperature,
                             seed=seed + i) for i in range(count)]
    results = engine.generate(prompts, params)
    return torch.tensor([p + r["output_ids"] for p, r in zip(prompts, results)])


@torch.no_grad()
def main_model_streams(reference, tokens: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """[B, S, N, D]: the reference model's last decoder layer output (its residual streams) at every position."""
    kept = []
    hook = reference.model.layers[-1].register_forward_hook(lambda module, args, output: kept.append(output))
    try:
        for start in range(0, len(tokens), batch):
            reference(tokens[start:start + batch])
    finally:
        hook.remove()
    return torch.cat(kept)


def train(draft: DraftLayer, embed: torch.Tensor, head: torch.Tensor, tokens: torch.Tensor, streams: torch.Tensor,
          steps: int, lr: float, batch: int, seed: int) -> list[float]:
    """Cross-entropy of token t + 2 given the streams at t and the embedding of token t + 1; returns the losses."""
    trainable = [p for name, p in draft.named_parameters() if not name.endswith("e_score_correction_bias")]
    for name, p in draft.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))  # (set by load balancing, not by gradients)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        rows = torch.randint(0, len(tokens), (batch,), generator=g)
        ids, hidden = tokens[rows], streams[rows]
        out = draft(F.embedding(ids[:, 1:-1], embed), hidden[:, :-2])  # positions 0 .. S-3
        loss = F.cross_entropy(F.linear(out, head).flatten(0, 1), ids[:, 2:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:>4}: loss {losses[-1]:.3f}", flush=True)
    return losses


@torch.no_grad()
def top1(draft: DraftLayer, embed, head, tokens, streams) -> float:
    """How often the draft's argmax is the next-next token (held-out sequences)."""
    out = draft(F.embedding(tokens[:, 1:-1], embed), streams[:, :-2])
    return float((F.linear(out, head).argmax(-1) == tokens[:, 2:]).float().mean())


def write_checkpoint(source: Path, out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`source` copied to `out`, its MTP layer's tensors replaced."""
    if out.resolve() != source.resolve():
        shutil.copytree(source, out, dirs_exist_ok=True)
    path = out / "model.safetensors"
    stored = load_file(path)
    missing = sorted(set(tensors) - set(stored))
    if missing:
        raise SystemExit(f"{path}: no {missing[0]!r}; the checkpoint has no MTP layer to replace")
    stored.update({name: tensor.to(stored[name].dtype) for name, tensor in tensors.items()})
    save_file(stored, path, metadata={"format": "pt"})


def acceptance(checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy decoding from `prompts` with k = 1, 2, 3: the mean tokens a verify emits and the drafts accepted."""
    rows = []
    for k in (1, 2, 3):
        engine = LLMEngine(EngineConfig(checkpoint=str(checkpoint), device="cpu", num_speculative_tokens=k,
                                        max_running_requests=len(prompts), enable_prefix_caching=False))
        try:
            engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            stats = engine.stats()
        finally:
            engine.shutdown()
        rows.append({"k": k, "mean_accepted_length": round(stats["mean_accepted_length"], 3),
                     "acceptance_rate": round(stats["num_accepted_tokens"] / stats["num_draft_tokens"], 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--out", type=Path, required=True, help="where the checkpoint with the trained draft goes")
    parser.add_argument("--sequences", type=int, default=128, help="generated training sequences")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=112)
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled half of the sequences")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args()

    from transformers import DeepseekV4ForCausalLM

    config = load_model_config(args.checkpoint)
    files = list(args.checkpoint.glob("*.safetensors"))
    if config.quantization_config is not None or len(files) != 1 or detect_layout(load_file(files[0]).keys()) \
            != "hf-modules":
        raise SystemExit("train_mtp_draft.py writes unquantized single-file checkpoints in transformers' module names "
                         "(the built-in layout)")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(checkpoint=str(args.checkpoint), device="cpu", enable_prefix_caching=False,
                                    max_running_requests=32))
    try:
        tokens = generate_sequences(engine, args.sequences, args.prompt_tokens, args.new_tokens, args.temperature,
                                    args.seed)
        held_out = generate_sequences(engine, 16, args.prompt_tokens, args.new_tokens, args.temperature,
                                      args.seed + 10_000)
    finally:
        engine.shutdown()
    reference = DeepseekV4ForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    streams, held_out_streams = main_model_streams(reference, tokens), main_model_streams(reference, held_out)
    embed = reference.model.embed_tokens.weight.detach()
    head = reference.lm_head.weight.detach()
    del reference
    print(f"data: {len(tokens)} sequences of {tokens.shape[1]} tokens ({time.perf_counter() - started:.0f} s)")

    draft = DraftLayer(one_layer_config(args.checkpoint))
    names = set(draft_layer_shapes(config, 0))
    if set(draft.engine_tensors()) != names:
        raise SystemExit(f"the draft module's tensors {sorted(set(draft.engine_tensors()) ^ names)[:4]} differ from the "
                         "engine's MTP layer")
    draft.load_engine_tensors({name: t for name, t in load_file(files[0]).items() if name.startswith(PREFIX)})
    before = top1(draft, embed, head, held_out, held_out_streams)
    training = time.perf_counter()
    losses = train(draft, embed, head, tokens, streams, args.steps, args.lr, args.batch, args.seed)
    train_s = time.perf_counter() - training
    after = top1(draft, embed, head, held_out, held_out_streams)
    write_checkpoint(args.checkpoint, args.out, draft.engine_tensors())
    print(f"trained {args.steps} steps in {train_s:.0f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out "
          f"next-next top-1 {before:.3f} -> {after:.3f}; wrote {args.out}")

    rows = acceptance(args.out, held_out[:8, :args.prompt_tokens].tolist(), args.new_tokens)
    print(f"\n{'k':>2} | {'mean accepted length':>20} | {'draft acceptance':>16}")
    for row in rows:
        print(f"{row['k']:>2} | {row['mean_accepted_length']:>20} | {row['acceptance_rate']:>16}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"loss_first": losses[0], "loss_last": losses[-1], "top1_before": before,
                                         "top1_after": after, "train_s": train_s, "acceptance": rows}, indent=2))


if __name__ == "__main__":
    main()
