"""OpenAI Triton kernels for DeepSeek-V4's hot paths, each beside the plain-torch reference that defines it.

The engine reaches them through `kernels.dispatch.KernelDispatch`. This file stays empty of imports and carries no `__version__` on
purpose: transformers probes for an importable package named `kernels` (Hugging Face's kernel hub)
and treats one without a version as absent, so the reference model keeps its own code paths.
"""
