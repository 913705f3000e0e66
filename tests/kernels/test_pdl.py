"""Programmatic dependent launch (kernels/common.py): a kernel launched with it may start while the kernel before it
runs, so every kernel must wait for that one before it reads or writes anything. What a CPU can check: that every
Triton kernel here takes the PDL flag and waits first (the source, here; the compiled sm_90 PTX holds the wait:
scripts/check_kernels_compile.py, tests/kernels/test_compile.py), and that `launch` asks for the attribute exactly
when it is on. Whether it pays is for a GPU (gpu_check.sh's v4_overlap part)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kernels import common

KERNELS_DIR = Path(common.__file__).parent


def _triton_kernels() -> list[tuple[str, ast.FunctionDef]]:
    """Every @triton.jit function in kernels/ that a plan launches (named *_kernel), with its file's name."""
    found = []
    for path in sorted(KERNELS_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")
                    and node.name != common.wait_for_previous_kernel.fn.__name__
                    and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)):
                found.append((path.name, node))
    return found


def _first_statement(node: ast.FunctionDef) -> ast.stmt:
    body = node.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if docstring else body[0]


def test_every_kernel_waits_for_the_kernel_before_it_first():
    kernels = _triton_kernels()
    assert len(kernels) >= 20  # (the attention, MoE, GEMM, compressor, mHC, norm/rope, store and sampling kernels)
    for file, node in kernels:
        params = {arg.arg: arg for arg in node.args.args}
        assert "PDL" in params and ast.unparse(params["PDL"].annotation) == "tl.constexpr", (file, node.name)
        assert ast.unparse(node.args.defaults[-1]) == "False" and node.args.args[-1].arg == "PDL", (file, node.name)
        assert ast.unparse(_first_statement(node)) == "wait_for_previous_kernel(PDL)", (file, node.name)


class _RecordedKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def restore_pdl():
    before = common.programmatic_dependent_launch()
    yield
    common.set_programmatic_dependent_launch(before)


def test_launch_asks_for_the_attribute_only_when_it_is_on(restore_pdl):
    kernel = _RecordedKernel()
    launches = [(kernel, (4, 1), ("x", 3), {"BLOCK": 16, "num_warps": 2}), (kernel, (1,), (), {})]
    common.set_programmatic_dependent_launch(False)
    common.launch(launches)
    assert kernel.calls == [((4, 1), ("x", 3), {"BLOCK": 16, "num_warps": 2}), ((1,), (), {})]
    kernel.calls.clear()
    common.set_programmatic_dependent_launch(True)
    common.launch(launches)
    assert kernel.calls == [((4, 1), ("x", 3), {"BLOCK": 16, "num_warps": 2, "PDL": True, "launch_pdl": True}),
                            ((1,), (), {"PDL": True, "launch_pdl": True})]
