"""DeepSeek-V4 itself: configuration, checkpoint loading, building blocks and the forward.

- `config`: `ModelConfig` from a checkpoint's config.json (the reference's field names and legacy keys).
- `checkpoint`: the tensors of a checkpoint, checked against the shapes the config implies.
- `dummy_weights`: random tensors of the same names, shapes and published formats, built on the device (no file).
- `rotary`: RoPE / YaRN cos and sin tables (norms, mHC and activations are kernels/).
- `projections`: the linears that read the same input, as one GEMM.
- `quantization`: FP8 / MXFP4 weights as published.
- `compressor`: CSA/HCA (and indexer) compression plans over a ragged batch with ring-buffer state.
- `forward_batch`: one step's metadata (tokens, positions, where their memory is): the one batch builder.
- `static_batch`: the static shapes (buckets, padding) of decode steps that CUDA graphs replay.
- `staging`: a step's metadata packed into one buffer, one copy to the device.
- `graph_runner`: the static buffers and CUDA graphs of decode steps.
- `footprint`, `weight_names`: memory arithmetic and checkpoint names.
- `parallel_layout`, `comm`: how the model is split over ranks (who holds what) and the collectives its forward calls.
- `deepseek_v4`: the forward over a ragged batch and the paged pools of backend/memory.
"""
