"""DeepSeek-V4 forward over a ragged batch and paged memory.

Legend: T = tokens in the batch, N = hc_mult streams, D = hidden, H = heads, Dh = head_dim,
Hi / Di = indexer heads / head dim, R = rows that want logits.

One forward: embed -> for each layer [mHC collapse -> attention -> mHC mix -> mHC collapse -> MoE
-> mHC mix] -> hyper-head -> norm -> lm_head (only at the rows' last tokens). Attention writes each
token's K=V into the window pool, closes compressor windows into the compressed pools, then calls
the sparse paged attention kernel over window + compressed entries. Every hot path goes through
the engine's `KernelDispatch` (Triton kernels or their torch references); the pools' tensors are
reached only through `kv.layer(i)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.memory.kv_manager import KVCacheManager, LayerMemory
from backend.model.compressor import compress
from backend.model.config import CSA, SLIDING, ModelConfig
from backend.model.forward_batch import ForwardBatch
from backend.model.layers import (Rotary, apply_rope, hyper_connection, hyper_head, hyper_mix, rms_norm,
                                  shared_expert, unweighted_rms_norm)
from kernels.dispatch import KernelDispatch


class DeepseekV4Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device, dtype: torch.dtype,
                 kernels: KernelDispatch | None = None):
        self.config = config
        self.w = weights
        self.device = device
        self.dtype = dtype
        self.kernels = kernels or KernelDispatch()
        self.rotary = {label: Rotary(config, label, device) for label in ("main", "compress")}
        # Optional debug hook: called with (layer, batch, scores, indices) at every CSA indexer.
        self.indexer_observer = None

    # --- the whole model --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCacheManager) -> torch.Tensor:
        """Logits [R, vocab] (fp32) at `batch.logits_token_index`."""
        c, w = self.config, self.w
        hidden = w["model.embed_tokens.weight"][batch.input_ids]  # [T, D]
        streams = hidden.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [T, N, D]
        rope = {label: r.cos_sin(batch.positions, self.dtype) for label, r in self.rotary.items()}
        for i in range(c.num_hidden_layers):
            streams = self._layer(i, streams, batch, kv, rope)
        last = streams[batch.logits_token_index]
        last = hyper_head(last, w["model.hc_head.hc_fn"], w["model.hc_head.hc_base"], w["model.hc_head.hc_scale"], c)
        last = rms_norm(last, w["model.norm.weight"], c.rms_norm_eps)
        return F.linear(last, w["lm_head.weight"]).float()

    def _layer(self, i: int, streams, batch, kv, rope):
        c, p = self.config, f"model.layers.{i}."
        post, comb, collapsed = hyper_connection(streams, self.w[p + "attn_hc.fn"], self.w[p + "attn_hc.base"],
                                                 self.w[p + "attn_hc.scale"], c)
        x = rms_norm(collapsed, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
        streams = hyper_mix(streams, self._attention(i, x, batch, kv, rope), post, comb)
        post, comb, collapsed = hyper_connection(streams, self.w[p + "ffn_hc.fn"], self.w[p + "ffn_hc.base"],
                                                 self.w[p + "ffn_hc.scale"], c)
        x = rms_norm(collapsed, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        return hyper_mix(streams, self._moe(i, x, batch.input_ids), post, comb)

    # --- attention --------------------------------------------------------------------------------
    def _attention(self, i: int, x: torch.Tensor, batch: ForwardBatch, kv: KVCacheManager, rope) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn."
        layer_type = c.layer_types[i]
        cos, sin = rope["main" if layer_type == SLIDING else "compress"]
        num_tokens = x.shape[0]

        linear = self.kernels.linear
        q_residual = rms_norm(linear(x, w[p + "q_a_proj.weight"]), w[p + "q_a_norm.weight"], c.rms_norm_eps)
        q = linear(q_residual, w[p + "q_b_proj.weight"]).view(num_tokens, c.num_attention_heads, c.head_dim)
        q = apply_rope(unweighted_rms_norm(q, c.rms_norm_eps), cos, sin)  # [T, H, Dh]
        kv_new = rms_norm(linear(x, w[p + "kv_proj.weight"]), w[p + "kv_norm.weight"], c.rms_norm_eps)
        kv_new = apply_rope(kv_new, cos, sin)  # [T, Dh]
        memory = kv.layer(i)
        memory.window_kv.view(-1, c.head_dim)[batch.window_write_index] = kv_new

        comp_table, topk = None, None
        if memory.pool is not None:
            comp_table = batch.comp_block_tables[memory.pool]
            self._compress_into(i, "compressor.", memory.pool, x, batch, memory, memory.compressed_kv, comp_table)
        if layer_type == CSA:
            topk = self._indexer_topk(i, x, q_residual, batch, memory, rope["compress"])

        out = self.kernels.sparse_paged_attention(
            q, w[p + "sinks"], c.head_dim ** -0.5, batch.token_seq, batch.positions,
            memory.window_kv, batch.window_block_table, batch.window_first_page, c.sliding_window,
            memory.compressed_kv, comp_table, memory.compress_rate, topk,
        )
        out = apply_rope(out, cos, -sin)  # undo the rotation V picked up as K
        return self._output_projection(i, out)

    def _output_projection(self, i: int, out: torch.Tensor) -> torch.Tensor:
        c, p = self.config, f"model.layers.{i}.self_attn."
        groups = out.reshape(out.shape[0], c.o_groups, -1)  # [T, G, H*Dh/G]
        w_a = self.w[p + "o_a_proj.weight"].view(c.o_groups, c.o_lora_rank, -1)  # [G, R, H*Dh/G]
        grouped = torch.einsum("tgi,gri->tgr", groups, w_a).flatten(1)
        return self.kernels.linear(grouped, self.w[p + "o_b_proj.weight"])

    def _compress_into(self, i, prefix, stream, x, batch, memory: LayerMemory, pool_tensor, block_table) -> None:
        """Run one compressor (main CSA/HCA, or the CSA indexer) and store the entries it closes."""
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn.{prefix}"
        plan = batch.plans[stream]
        state_kv, state_gate = memory.state[stream]
        entries = compress(
            F.linear(x, w[p + "kv_proj.weight"]), F.linear(x, w[p + "gate_proj.weight"]), state_kv, state_gate, plan,
            w[p + "position_bias"], w[p + "kv_norm.weight"], c.rms_norm_eps,
            lambda positions: self.rotary["compress"].cos_sin(positions, self.dtype),
        )
        if plan.num_entries:
            page_size = pool_tensor.shape[1]
            pages = block_table[plan.entry_row, plan.entry_index // page_size].long()
            pool_tensor.view(-1, pool_tensor.shape[-1])[pages * page_size + plan.entry_index % page_size] = entries

    def _indexer_topk(self, i, x, q_residual, batch, memory: LayerMemory, compress_cos_sin) -> torch.Tensor:
        """Lightning indexer: top-k compressed entries per query, -1 where fewer are causal. [T, k]"""
        c, w, p = self.config, self.w, f"model.layers.{i}.self_attn.compressor.indexer."
        index_k = memory.index_k
        self._compress_into(i, "compressor.indexer.", "indexer", x, batch, memory, index_k,
                            batch.comp_block_tables["csa"])
        q = self.kernels.linear(q_residual, w[p + "q_b_proj.weight"]).view(x.shape[0], c.index_n_heads,
                                                                            c.index_head_dim)
        q = apply_rope(q, *compress_cos_sin)  # the indexer's queries use the compress rope, as its keys do
        weights = F.linear(x, w[p + "scorer.weights_proj.weight"]).float() * c.index_n_heads ** -0.5
        scores = self.kernels.indexer_scores(q, weights, c.index_head_dim ** -0.5, batch.token_seq, batch.positions,
                                             index_k, batch.comp_block_tables["csa"], c.csa_rate)
        top_k = min(c.index_topk, scores.shape[1])
        indices = scores.topk(top_k, dim=-1).indices
        causal = (batch.positions + 1) // c.csa_rate
        indices = torch.where(indices >= causal[:, None], torch.full_like(indices, -1), indices).to(torch.int32)
        if self.indexer_observer is not None:
            self.indexer_observer(i, batch, scores, indices)
        return indices

    # --- mixture of experts -------------------------------------------------------------------------
    def _moe(self, i: int, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        c, w, p = self.config, self.w, f"model.layers.{i}.mlp."
        router_logits = F.linear(x, w[p + "gate.weight"])
        if c.mlp_layer_types[i] == "hash_moe":
            ids, weights = self.kernels.route_hash(router_logits, w[p + "gate.tid2eid"], input_ids,
                                                   c.routed_scaling_factor)
        else:
            ids, weights = self.kernels.route_topk(router_logits, w[p + "gate.e_score_correction_bias"],
                                                   c.num_experts_per_tok, c.routed_scaling_factor)
        routed = self.kernels.fused_moe(x, ids, weights, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"],
                                        c.swiglu_limit)
        return routed + shared_expert(x, w[p + "shared_experts.gate_proj.weight"], w[p + "shared_experts.up_proj.weight"],
                                      w[p + "shared_experts.down_proj.weight"], c.swiglu_limit, self.kernels.linear)
