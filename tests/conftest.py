"""Suite-wide settings, applied before any test module is imported.

- TRITON_INTERPRET=1: the Triton kernels under test run on CPU tensors through Triton's
  interpreter. It must be set before any @triton.jit decorator runs, and the engine tests import
  the kernel modules too (through kernels.dispatch), so it is set here. On CPU the engine itself
  always calls the torch references, so nothing else changes. The end-to-end fixtures remove it
  from tritonserver's environment.
- One intra-op thread: the models under test are tiny, their forwards are thousands of small tensor
  ops, which run faster on one thread than on two (and CI has two cores, shared with tritonserver
  in the end-to-end tests).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
