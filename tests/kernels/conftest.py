"""The kernel tests run through Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
before any kernel module is imported (the @triton.jit decorator reads it then)."""

import os

assert os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("DSV4_TEST_DEVICE") == "cuda", \
    "tests/conftest.py must set TRITON_INTERPRET before kernels load"
