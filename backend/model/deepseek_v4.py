"""DeepSeek-V4 forward over a ragged batch and paged memory.

Legend: T = tokens in the batch, N = hc_mult streams, D = hidden, H = heads, Dh = head_dim,
Hi / Di = indexer heads / head dim, R = rows that want logits.

One forward: embed -> for each layer [mHC collapse + norm -> attention -> mHC mix -> mHC collapse +
norm -> MoE -> mHC mix (routed + shared)] -> hyper-head -> norm -> lm_head (only at the rows' last
tokens). Attention writes each token's K=V into the window pool, closes compressor windows into the
compressed pools, then calls the sparse paged attention kernel over window + compressed entries.

Every op of a layer goes through the engine's `KernelDispatch` (a fused Triton kernel, or its torch
reference: the same math), and the linears that read the same input are one GEMM
(backend/model/projections.py), so a decode step issues a few dozen launches per layer
(scripts/count_launches.py) and no host synchronisation: every shape comes from the batch's host-side
metadata (ForwardBatch). The pools' tensors are reached only through `kv.layer(i)`.

DeepSeek's numerics (`Numerics`, kernels/modes.py, carried by the dispatch) add the roundings its own inference
applies (its model was trained with them): each attention entry, window and compressed, is rounded where it is
stored (the nope values to e4m3 per 64), the indexer's keys and queries are rotated and rounded to e2m1 per 32, the
router's logits, the LM head, the mHC mix and the compressors (projections, rings, pooling) are fp32, the experts
apply the routing weight before their down projection, and on a quantized checkpoint the inputs of DeepSeek's
FP8/FP4 linears are act_quant'ed (kernels/quant_formats.py has the roundings; the attention and indexer then read
what DeepSeek's would). Pools in DeepSeek's fp8 layout (`KVLayout`, handed over with each layer's tensors) hold those
values as its bytes: the kernels that store the entries encode them, and the attention and indexer kernels decode
them as they read.

Under a `ParallelLayout` of several ranks (backend/model/parallel_layout.py) the weights are this rank's parts:
the attention runs its share of the heads and groups and all-reduces the output projection, the MoE
its experts (or its slice of every expert) plus its slice of the shared expert, summed in one
all-reduce, and the LM head its rows of the vocabulary, all-gathered. Every rank runs the same forward
on the same batch; the collectives go through `comm`. Under data parallelism every rank runs its own batch over
its own pools with the whole attention and LM head, and with expert parallelism the ranks meet at each MoE layer
(`_experts_of_every_rank`); a rank without requests in a step takes its part in those meetings alone
(`idle_forward`).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from backend.model.comm import Communicator
from backend.model.config import CSA, SLIDING, ModelConfig
from backend.model.forward_batch import ForwardBatch
from backend.model.parallel_layout import ParallelLayout
from backend.model.projections import (ATTENTION_INPUT, FP32_ATTENTION_INPUT, QUANTIZED_ATTENTION_INPUT,
                                       SHARED_EXPERT_INPUT, fuse_projections)
from backend.model.rotary import Rotary, cos_sin_tables
from kernels.compressor import CompressorRun
from kernels.dispatch import KernelDispatch
from kernels.fp8_gemm import Fp8Weight
from kernels.moe import QuantizedExperts, Routing

if TYPE_CHECKING:  # the forward is handed the pools; it never makes them
    from backend.memory.kv_manager import KVCacheManager, LayerMemory


class PendingMix(NamedTuple):
    """A block's output not yet mixed into the residual streams: the next collapse mixes it in as it reads them."""

    block_out: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    second: torch.Tensor | None = None  # the shared expert's output, added to the routed one in fp32


class DeepseekV4Model:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device, dtype: torch.dtype,
                 kernels: KernelDispatch | None = None, layout: ParallelLayout = ParallelLayout(),
                 comm: Communicator = Communicator(), side_stream: bool = False):
        """`kernels` carries the deployment's numerics (kernels/modes.py): the model's own ops follow them too.
        `side_stream` (CUDA): a layer's independent branches on a second stream (`use_side_stream`)."""
        self.config = config
        self.layout, self.comm = layout, comm
        split = layout.tensor_parallel_size if layout.attention_split else 1
        self.local_heads, self.local_groups = config.num_attention_heads // split, config.o_groups // split
        self.first_expert = layout.expert_range(config.n_routed_experts)[0]
        self.w = weights
        self.device = device
        self.dtype = dtype
        self.kernels = kernels or KernelDispatch()
        self.numerics = self.kernels.numerics
        self.use_side_stream(side_stream)
        if self.kernels.use_triton(torch.empty(0, device=device)):
            self._experts_for_kernels()
        self.rotary = {label: Rotary(config, label, device) for label in ("main", "compress")}
        # The blocks: the main layers, then the MTP layers loaded (speculative decoding's drafts, DeepSeek's
        # MTPBlock: sliding-window attention, top-k routing), numbered on as the window pool numbers them.
        self.num_draft_layers = sum(1 for name in weights if name.startswith("model.mtp.") and
                                    name.endswith(".e_proj.weight"))
        mains = range(config.num_hidden_layers)
        self.prefixes = ([f"model.layers.{i}." for i in mains]
                         + [f"model.mtp.{j}." for j in range(self.num_draft_layers)])
        self.layer_types = config.layer_types + [SLIDING] * self.num_draft_layers
        self.mlp_types = config.mlp_layer_types + ["moe"] * self.num_draft_layers
        quantized_input = QUANTIZED_ATTENTION_INPUT if self.numerics.act_quant else frozenset()
        fp32_input = FP32_ATTENTION_INPUT if self.numerics.fp32_compressors else frozenset()
        self.attention_input = [fuse_projections(weights, p, ATTENTION_INPUT, quantized_input, fp32_input)
                                for p in self.prefixes]
        self.shared_expert_input = [fuse_projections(weights, p, SHARED_EXPERT_INPUT) for p in self.prefixes]
        self.hc = dict(hc_mult=config.hc_mult, eps=config.rms_norm_eps, hc_eps=config.hc_eps,
                       sinkhorn_iters=config.hc_sinkhorn_iters)
        # Optional debug hook: called with (layer, batch, scores, indices) at every CSA indexer.
        self.indexer_observer = None

    # --- the whole model --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCacheManager, return_streams: bool = False):
        """Logits [R, vocab] (fp32) at `batch.logits_token_index`; with `return_streams`, (logits, the last layer's
        residual streams [T, N, D] before the hyper-head: what the MTP layer drafts from)."""
        c, w = self.config, self.w
        hidden = w["model.embed_tokens.weight"][batch.input_ids]  # [T, D]
        streams = hidden.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()  # [T, N, D]
        rope, entry_rope = self._rope_tables(batch)
        pending = None
        for i in range(c.num_hidden_layers):
            streams, pending = self._layer(i, streams, pending, batch, kv, rope, entry_rope)
        streams = self._mixed(streams, pending)
        logits = self._logits(streams[batch.logits_token_index], "model.")
        return (logits, streams) if return_streams else logits

    @torch.inference_mode()
    def draft(self, batch: ForwardBatch, kv: KVCacheManager, hidden: torch.Tensor, logits_index: torch.Tensor,
              j: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer j over `batch` (its input ids: each position's *next* token) and `hidden` [T, N, D] (the main
        model's residual streams at the same positions, or the draft's own for a chained draft), as DeepSeek's
        MTPBlock: x = e_proj(enorm(embed(next token))) + h_proj(hnorm(h)) on each stream, one sliding-window block
        (its own window in the window pool), its hyper-head and norm, the shared LM head. Returns (logits [R, vocab]
        at `logits_index`, its residual streams [T, N, D]: the hidden a chained draft continues from)."""
        c, w, k, p = self.config, self.w, self.kernels, f"model.mtp.{j}."
        eps = c.rms_norm_eps
        embedded = k.norm_rope(w["model.embed_tokens.weight"][batch.input_ids], w[p + "enorm.weight"], eps)
        normed = k.norm_rope(hidden.to(self.dtype), w[p + "hnorm.weight"], eps)  # each stream normed on its own
        x = (self._quantized_linear(embedded, w[p + "e_proj.weight"]).unsqueeze(1)
             + self._quantized_linear(normed.flatten(0, 1), w[p + "h_proj.weight"]).view(hidden.shape))
        rope = {"main": self.rotary["main"].cos_sin(batch.positions, self.dtype)}
        streams = self._mixed(*self._layer(c.num_hidden_layers + j, x, None, batch, kv, rope, {}))
        if logits_index.numel() == 0:  # (a pass that only fills the draft layer's window)
            return streams.new_empty((0, c.vocab_size), dtype=torch.float32), streams
        return self._logits(streams[logits_index], p), streams

    def _rope_tables(self, batch: ForwardBatch) -> tuple[dict, dict]:
        """The step's rope tables, computed together (`cos_sin_tables`): {label: (cos, sin)} at the tokens' positions,
        and {stream: (cos, sin)} of the compress rope at each closing entry, once per plan (the indexer shares the
        CSA plan)."""
        plans = list({id(plan): plan for plan in batch.plans.values()}.values())
        requests = [(self.rotary[label], batch.positions) for label in self.rotary]
        tables = cos_sin_tables(requests + [(self.rotary["compress"], plan.entry_pos) for plan in plans], self.dtype)
        rope = dict(zip(self.rotary, tables))
        by_plan = {id(plan): table for plan, table in zip(plans, tables[len(requests):])}
        return rope, {stream: by_plan[id(plan)] for stream, plan in batch.plans.items()}

    def _logits(self, last: torch.Tensor, prefix: str) -> torch.Tensor:
        """The hyper-head, the final norm and the LM head over the streams [R, N, D] of the rows that want logits
        (`prefix`: the main model's, "model.", or an MTP layer's own hyper-head and norm; the LM head is shared)."""
        c, w = self.config, self.w
        last = self.kernels.hc_head(last, w[prefix + "hc_head.hc_fn"], w[prefix + "hc_head.hc_base"],
                                    w[prefix + "hc_head.hc_scale"], eps=c.rms_norm_eps, hc_eps=c.hc_eps,
                                    norm_weight=w[prefix + "norm.weight"])
        head = w["lm_head.weight"]
        logits = self.kernels.fp32_linear(last, head) if self.numerics.fp32_head else F.linear(last, head).float()
        return self.comm.all_gather_last(logits) if self.layout.vocabulary_parallel else logits

    def _layer(self, i: int, streams, pending: "PendingMix | None", batch, kv, rope, entry_rope):
        """Layer i over `streams` with the block output `pending` not yet mixed into them; returns (streams, the MoE's
        output to mix into them). Each mix runs with the collapse after it (one launch at decode sizes)."""
        w, p = self.w, self.prefixes[i]
        # DeepSeek's FP8 linears and experts read their input act_quant'ed: a collapse that mixes a block's output in
        # writes x so too (the GEMMs then need no act_quant launch of their own)
        quantize = self.numerics.act_quant
        streams, post, comb, x, *x_quantized = self._collapse(
            streams, pending, w[p + "attn_hc.fn"], w[p + "attn_hc.base"], w[p + "attn_hc.scale"],
            w[p + "input_layernorm.weight"], quantize_x=quantize and pending is not None)
        attention = PendingMix(self._attention(i, x, batch, kv, rope, entry_rope, *x_quantized), post, comb)
        streams, post, comb, x, *x_quantized = self._collapse(
            streams, attention, w[p + "ffn_hc.fn"], w[p + "ffn_hc.base"], w[p + "ffn_hc.scale"],
            w[p + "post_attention_layernorm.weight"], quantize_x=quantize)
        routed, shared = self._moe(i, x, batch.input_ids, batch.dp_token_counts, *x_quantized)
        if self.layout.world_size > 1 and not self.layout.data_parallel:  # routed (+ split shared) partial sums
            if self.layout.attention_split:
                routed, shared = self.comm.all_reduce(routed + shared.float()), None
            else:
                routed = self.comm.all_reduce(routed)
        return streams, PendingMix(routed, post, comb, shared)

    def _collapse(self, streams, pending: "PendingMix | None", fn, base, scale, norm_weight, quantize_x=False):
        """(streams with `pending` mixed in, post, comb, x): the mHC collapse before a block; quantize_x (after a
        block's output): and x's act_quant, (e4m3 values, scales), where the kernels read it (none for the
        references: `KernelDispatch.hc_mix_collapse`)."""
        if pending is None:
            assert not quantize_x, "x is quantized by the collapse that mixes a block's output in"
            return (streams, *self.kernels.hc_collapse(streams, fn, base, scale, norm_weight, **self.hc))
        return self.kernels.hc_mix_collapse(streams, pending.block_out, pending.post, pending.comb, pending.second,
                                            fn, base, scale, norm_weight, **self.hc, quantize_x=quantize_x)

    def _mixed(self, streams, pending: "PendingMix | None"):
        """`pending` mixed into the streams on its own (after the last layer)."""
        if pending is None:
            return streams
        return self.kernels.hc_mix(streams, pending.block_out, pending.post, pending.comb, pending.second)

    # --- attention --------------------------------------------------------------------------------
    def _attention(self, i: int, x: torch.Tensor, batch: ForwardBatch, kv: KVCacheManager, rope,
                   entry_rope, x_quantized=None) -> torch.Tensor:
        c, w, k, p = self.config, self.w, self.kernels, self.prefixes[i] + "self_attn."
        layer_type = self.layer_types[i]
        cos, sin = rope["main" if layer_type == SLIDING else "compress"]
        num_tokens, eps = x.shape[0], c.rms_norm_eps

        proj = self.attention_input[i](x, k, self._act, x_quantized)  # every linear of x: a GEMM a group, column views
        # q_a's RMSNorm: computed by the FP8 GEMMs that read it (q_b, and the indexer's) as they load it, else once
        q_a, q_norm = proj["self_attn.q_a_proj"], dict(rms_norm=(w[p + "q_a_norm.weight"], eps))
        if not isinstance(w[p + "q_b_proj.weight"], Fp8Weight):
            q_a, q_norm = k.linear_input(q_a, **q_norm), {}
        elif layer_type == CSA:  # two GEMMs read it: act_quant'ed once for both where each would quantize it ahead
            q_norm["x_quantized"] = k.shared_linear_input(q_a, **q_norm)
        memory = kv.layer(i)
        comp_table, topk = None, None
        with self._side_branch():  # what writes the KV pools, and the indexer: beside q_b's GEMM where forked
            self._store_window_entries(proj["self_attn.kv_proj"], w[p + "kv_norm.weight"], cos, sin, batch, memory)
            if memory.pool is not None:
                comp_table = batch.comp_block_tables[memory.pool]
                compressors = [("compressor.", memory.pool, memory.compressed_kv, comp_table)]
                if layer_type == CSA:  # and the indexer's keys (over the same plan: one launch with the Triton kernels)
                    compressors.append(("compressor.indexer.", "indexer", memory.index_k,
                                        batch.comp_block_tables["csa"]))
                self._compress_into(i, compressors, proj, batch, memory, entry_rope)
            if layer_type == CSA:
                topk = self._indexer_topk(i, proj, q_a, q_norm, batch, memory, rope["compress"])
        q = self._quantized_linear(q_a, w[p + "q_b_proj.weight"], **q_norm).view(num_tokens, self.local_heads,
                                                                                 c.head_dim)
        self._join_side_branch()

        out = k.sparse_paged_attention(
            q, w[p + "sinks"], c.head_dim ** -0.5, batch.token_seq, batch.positions,
            memory.window_kv, batch.window_block_table, batch.window_first_page, c.sliding_window,
            memory.compressed_kv, comp_table, memory.compress_rate, topk, rope_dim=c.qk_rope_head_dim,
            q_norm_eps=eps, rope=(cos, sin),  # q's per-head unweighted norm and rope, and V's rotation (as K) undone
        )
        return self._output_projection(i, out)

    def _store_window_entries(self, kv_proj, norm_weight, cos, sin, batch: ForwardBatch, memory: LayerMemory) -> None:
        """Each token's K=V entry (normed, rotated) into its window slot, as the pool stores it."""
        self.kernels.store_window_entries(kv_proj, norm_weight, self.config.rms_norm_eps, cos, sin, memory.window_kv,
                                          batch.window_write_index, memory.kv_layout)

    def _output_projection(self, i: int, out: torch.Tensor) -> torch.Tensor:
        p, g = self.prefixes[i] + "self_attn.", self.local_groups
        grouped = self.kernels.grouped_linear(out.view(out.shape[0], g, -1), self.w[p + "o_a_proj.weight"])
        out = self._quantized_linear(grouped, self.w[p + "o_b_proj.weight"])
        return self.comm.all_reduce(out) if self.layout.attention_split else out

    def _compress_into(self, i, compressors, proj, batch, memory: LayerMemory, entry_rope) -> None:
        """Run the layer's compressors, (weights' prefix, stream, pool, block table) each (main CSA/HCA, and the CSA
        indexer's), and store the entries they close."""
        runs = []
        for prefix, stream, pool, block_table in compressors:
            w, p = self.w, f"model.layers.{i}.self_attn.{prefix}"
            runs.append(CompressorRun(
                proj[f"self_attn.{prefix}kv_proj"], proj[f"self_attn.{prefix}gate_proj"], *memory.state[stream],
                batch.plans[stream], w[p + "position_bias"], w[p + "kv_norm.weight"], self.config.rms_norm_eps,
                *entry_rope[stream], pool, block_table, entry_dtype=self.dtype, keys=stream == "indexer"))
        self.kernels.compress_and_store(runs, memory.kv_layout)

    def _indexer_topk(self, i, proj, q_a, q_norm: dict, batch, memory: LayerMemory, compress_cos_sin) -> torch.Tensor:
        """Lightning indexer: top-k compressed entries per query [T, k] (picks past the causal ones are ignored
        by the attention kernel); its queries from q_a's RMSNorm (q_norm: the norm its GEMM is to compute, if any, and
        the act_quant of it q_b's GEMM reads too)."""
        c, w, k, p = self.config, self.w, self.kernels, f"model.layers.{i}.self_attn.compressor.indexer."
        index_k = memory.index_k  # (its keys the compressors stored, with the layer's own entries)
        # the indexer's queries use the compress rope, as its keys do, and are rounded as the keys are stored: by the
        # FP8 GEMM that writes them (`KernelDispatch.linear`'s epilogue), else by a launch after it
        q = self._quantized_linear(q_a, w[p + "q_b_proj.weight"], **q_norm,
                                   rope=(*compress_cos_sin, c.index_head_dim),
                                   round_indexer=self.numerics.round_indexer)
        q = q.view(q_a.shape[0], c.index_n_heads, c.index_head_dim)
        weights = proj["self_attn.compressor.indexer.scorer.weights_proj"]  # the head scaling goes with the softmax's
        scale = c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5
        scores = k.indexer_scores(q, weights, scale, batch.token_seq, batch.positions, index_k,
                                  batch.comp_block_tables["csa"], c.csa_rate, max_entries=batch.max_entries["csa"])
        # Raw top-k: picks of non-causal (-inf) entries are ignored by the attention kernel itself.
        indices = scores.topk(min(c.index_topk, scores.shape[1]), dim=-1).indices
        if self.indexer_observer is not None:
            causal = (batch.positions + 1) // c.csa_rate
            self.indexer_observer(i, batch, scores, torch.where(indices >= causal[:, None], -1, indices))
        return indices

    # --- mixture of experts -------------------------------------------------------------------------
    def _moe(self, i: int, x: torch.Tensor, input_ids: torch.Tensor, dp_token_counts: tuple[int, ...] = (),
             x_quantized=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(routed experts' output in fp32, shared expert's output): the mix kernel adds them. x_quantized: x's
        act_quant, as the collapse wrote it (for the routed experts of this rank's own tokens)."""
        c, w, k, p = self.config, self.w, self.kernels, self.prefixes[i] + "mlp."
        with self._side_branch():  # the shared expert: beside the router and the routed experts where forked
            shared = self._shared_expert(i, x, x_quantized)
        gate = w[p + "gate.weight"]
        router_logits = k.fp32_linear(x, gate) if self.numerics.fp32_router else k.linear(x, gate)
        if self.mlp_types[i] == "hash_moe":
            routing = Routing(router_logits, w[p + "gate.tid2eid"], c.num_experts_per_tok, c.routed_scaling_factor,
                              input_ids)
        else:
            routing = Routing(router_logits, w[p + "gate.e_score_correction_bias"], c.num_experts_per_tok,
                              c.routed_scaling_factor)
        # The experts act_quant x themselves (quantize_hidden), as a shared expert's FP8 GEMM does: only a shared
        # expert dequantized at load is given x rounded (the router reads it as it is).
        if self.layout.moe_exchange:
            routed = self._experts_of_every_rank(p, x, *k.route(routing), dp_token_counts)
        else:  # routed by the experts' own launches (at decode sizes, by their alignment's)
            routed = self._local_experts(p, x, None, None, x_quantized, routing)
        self._join_side_branch()
        return routed, shared

    def _shared_expert(self, i: int, x: torch.Tensor, x_quantized=None) -> torch.Tensor:
        k, p = self.kernels, self.prefixes[i] + "mlp."
        shared = self.shared_expert_input[i]
        if shared.quantizes_its_input:  # its GEMM reads x's act_quant where it would quantize x ahead
            gate_up = shared.product(x, functools.partial(k.linear, x_quantized=x_quantized))
        else:
            gate_up = shared.product(self._act(x), k.linear)
        return self._quantized_linear(gate_up, self.w[p + "shared_experts.down_proj.weight"],
                                      swiglu_limit=self.config.swiglu_limit)

    # --- a second stream ---------------------------------------------------------------------------
    def use_side_stream(self, on: bool) -> None:
        """Run a layer's independent branches on a second CUDA stream beside the step's own (SGLang's alternate stream
        for DeepSeek's shared experts): the writes into the KV pools and the indexer beside q_b's GEMM, the shared
        expert beside the router and the routed experts. At decode sizes each branch is a few small kernels that leave
        most SMs idle; side by side they fill them. A CUDA graph records each fork and join."""
        assert not on or torch.device(self.device).type == "cuda", "a second stream is a CUDA stream"
        self.side_stream = torch.cuda.Stream(self.device) if on else None

    @contextlib.contextmanager
    def _side_branch(self):
        """Queue the block's work on the side stream, after what the step's stream has queued so far (a fork); on the
        step's stream without one. What the branch allocates lives in the side stream's memory and is read on the
        step's stream after the join: the side stream's next use of that memory comes after the next fork, which
        waits for those reads (so no record_stream)."""
        if self.side_stream is None:
            yield
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            yield

    def _join_side_branch(self) -> None:
        """The step's stream waits for the side branch (a join); nothing without a side stream."""
        if self.side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)

    def _local_experts(self, p: str, x, ids, weights, x_quantized=None, routing=None) -> torch.Tensor:
        """This rank's routed experts over the pairs of `x` routed to them (by `ids` and `weights`, or by `routing`),
        [T, D] fp32; another rank's experts' pairs are left out (first_expert)."""
        w = self.w
        return self.kernels.fused_moe(x, ids, weights, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"],
                                      self.config.swiglu_limit, out_dtype=torch.float32, x_quantized=x_quantized,
                                      routing=routing, first_expert=self.first_expert)

    def _experts_of_every_rank(self, p: str, x, ids, weights, dp_token_counts: tuple[int, ...]) -> torch.Tensor:
        """Data-parallel ranks with split experts: every rank's tokens and routings all-gathered (padded to the largest
        rank's count: padding pairs route nowhere), this rank's experts over all of them, the partial sums
        reduce-scattered back; this rank's tokens' routed output [T, D] fp32. Routing ids travel as fp32 (exact below
        2^24) beside the weights: one gather for both."""
        local, most = x.shape[0], max(dp_token_counts)
        # (at most what this rank declared: a draft pass's count is agreed before the step's first pass, and a grammar
        # may end rows since; every rank pads to the same largest count all the same)
        assert local <= dp_token_counts[self.layout.rank], "the step's token counts must hold this rank's"
        pad = most - local
        routing = torch.cat([F.pad(ids, (0, 0, 0, pad), value=-1).float(), F.pad(weights.float(), (0, 0, 0, pad))], 1)
        every_x = self.comm.all_gather_rows(F.pad(x, (0, 0, 0, pad)))
        every_routing = self.comm.all_gather_rows(routing)
        top_k = ids.shape[1]
        routed = self._local_experts(p, every_x, every_routing[:, :top_k].long(), every_routing[:, top_k:])
        return self.comm.reduce_scatter_rows(routed)[:local]

    @torch.inference_mode()
    def idle_forward(self, dp_token_counts: tuple[int, ...], draft: bool = False) -> None:
        """A data-parallel rank with no request in this step: its part of every MoE layer's exchange (no tokens of its
        own; its experts still serve the other ranks'), as SGLang's and vLLM's idle data-parallel ranks do; `draft`:
        of the MTP layer's, in a draft pass (speculative decoding)."""
        if not self.layout.moe_exchange:
            return
        c = self.config
        x = torch.empty(0, c.hidden_size, dtype=self.dtype, device=self.device)
        ids = torch.empty(0, c.num_experts_per_tok, dtype=torch.long, device=self.device)
        weights = torch.empty(0, c.num_experts_per_tok, dtype=torch.float32, device=self.device)
        for i in [c.num_hidden_layers] if draft else range(c.num_hidden_layers):
            self._experts_of_every_rank(self.prefixes[i] + "mlp.", x, ids, weights, dp_token_counts)

    def _experts_for_kernels(self) -> None:
        """Quantized experts repacked, in place and tensor by tensor, into the layout the MoE kernels read (MXFP4;
        QuantizedExperts.for_kernels); the torch references read either layout."""
        for name, weight in self.w.items():
            if isinstance(weight, QuantizedExperts):
                self.w[name] = weight.for_kernels()

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        """The input of one of DeepSeek's FP8/FP4 linears as its inference quantizes it (act_quant: e4m3 per 128,
        power-of-two scales), on a quantized checkpoint under DeepSeek's numerics; otherwise x."""
        return self.kernels.round_activations(x) if self.numerics.act_quant else x

    def _quantized_linear(self, x: torch.Tensor, weight, *, rope=None, round_indexer: bool = False,
                          x_quantized=None, **prologue) -> torch.Tensor:
        """x @ weight^T for one of DeepSeek's FP8/FP4 linears: an Fp8Weight's GEMM act_quants x in registers
        (kernels/fp8_gemm.py) or reads `x_quantized`, computes the prologue (`KernelDispatch.linear`: a SwiGLU or an
        RMSNorm of x) as it loads it and the epilogue (its heads roped: rope, round_indexer) as it stores; a weight
        dequantized at load gets the prologue's output act_quant'ed first (`_act`)."""
        epilogue = dict(rope=rope, round_indexer=round_indexer)
        if isinstance(weight, Fp8Weight):
            return self.kernels.linear(x, weight, x_quantized=x_quantized, **prologue, **epilogue)
        return self.kernels.linear(self._act(self.kernels.linear_input(x, **prologue)), weight, **epilogue)
