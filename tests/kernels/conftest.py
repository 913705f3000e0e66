"""The kernel tests run through Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
before any kernel module is imported (the @triton.jit decorator reads it then).

With DSV4_TEST_DEVICE=cuda (scripts/gpu_check.sh) they run compiled on the GPU instead, tensors created
on it by default; `torch.Generator()` then makes a CUDA generator, since random tensors made on the
default device refuse a CPU one."""

import os

import torch

ON_CUDA = os.environ.get("DSV4_TEST_DEVICE") == "cuda"
assert os.environ.get("TRITON_INTERPRET") == "1" or ON_CUDA, \
    "tests/conftest.py must set TRITON_INTERPRET before kernels load"

if ON_CUDA:
    _Generator = torch.Generator

    def _generator_on_the_default_device(device=None):
        return _Generator(device if device is not None else "cuda")

    torch.Generator = _generator_on_the_default_device
