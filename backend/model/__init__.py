"""DeepSeek-V4 itself: configuration, checkpoint loading, building blocks and the forward.

- `config`: `ModelConfig` from a checkpoint's config.json (the reference's field names and legacy keys).
- `checkpoint`: the tensors of a checkpoint, checked against the shapes the config implies.
- `layers`: norms, rotary embeddings, mHC hyper-connections, the shared expert.
- `compressor`: CSA/HCA (and indexer) compressors over a ragged batch with ring-buffer state.
- `forward_batch`: one step's metadata (tokens, positions, where their memory is).
- `deepseek_v4`: the forward over a ragged batch and the paged pools of backend/memory.
"""
