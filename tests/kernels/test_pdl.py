"""Programmatic dependent launch (kernels/common.py): a kernel launched with it may start while the kernel before it
runs, so every kernel must wait for that one before it reads or writes anything. What a CPU can check: that every
Triton kernel here takes the PDL flag and waits first (the source, here; the compiled sm_90 PTX holds the wait:
scripts/check_kernels_compile.py, tests/kernels/test_compile.py), and that `launch` asks for the attribute exactly
when it is on. Whether it pays is for a GPU (gpu_check.sh's v4_shapes part)."""

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


WAIT = "wait_for_previous_kernel(PDL)"
# what a kernel may call before it waits: its program's indices, and the L2 prefetch of its weight rows
BEFORE_THE_WAIT = {"tl.program_id", "tl.arange", "tl.cdiv", "tl.minimum", "prefetch_weight_rows"}


def _statements_before_the_wait(node: ast.FunctionDef) -> list[ast.stmt]:
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
        else node.body
    waits = [i for i, statement in enumerate(body) if ast.unparse(statement) == WAIT]
    assert waits, f"{node.name} never calls {WAIT} in its body"
    return body[:waits[0]]


def test_every_kernel_waits_for_the_kernel_before_it_first():
    """Before its wait a kernel computes its program's indices and may ask L2 for its weight rows; it reads and
    writes nothing (the compiled PTX is held to the same: check_kernels_compile.pdl_problem)."""
    kernels = _triton_kernels()
    assert len(kernels) >= 20  # (the attention, MoE, GEMM, compressor, mHC, norm/rope, store and sampling kernels)
    prefetching = set()
    for file, node in kernels:
        params = {arg.arg: arg for arg in node.args.args}
        assert "PDL" in params and ast.unparse(params["PDL"].annotation) == "tl.constexpr", (file, node.name)
        assert ast.unparse(node.args.defaults[-1]) == "False" and node.args.args[-1].arg == "PDL", (file, node.name)
        for statement in _statements_before_the_wait(node):
            assert isinstance(statement, (ast.Assign, ast.Expr)), (file, node.name, ast.unparse(statement))
            calls = {ast.unparse(call.func) for call in ast.walk(statement) if isinstance(call, ast.Call)}
            assert calls <= BEFORE_THE_WAIT, (file, node.name, calls - BEFORE_THE_WAIT)
            if "prefetch_weight_rows" in calls:
                assert ast.unparse(statement).startswith("prefetch_weight_rows(PDL, w_ptr, "), (file, node.name)
                prefetching.add(node.name)
    # the kernels that stream a dense weight at decode ask for it while they wait
    assert prefetching == {"_fp8_gemm_kernel", "_grouped_fp8_kernel", "_fp32_linear_kernel"}


def test_weight_prefetch_lines_only_with_pdl_and_within_the_budget(restore_pdl):
    common.set_programmatic_dependent_launch(False)
    assert common.weight_prefetch_lines(128, 4096) == 0
    common.set_programmatic_dependent_launch(True, prefetch_weights=False)
    assert common.weight_prefetch_lines(128, 4096) == 0
    common.set_programmatic_dependent_launch(True)
    # 128 rows: 4 lines each (64 KB); 16 rows: 32 lines; never past a row's own lines; a power of two
    assert common.weight_prefetch_lines(128, 4096) == 4
    assert common.weight_prefetch_lines(16, 8192) == 32
    assert common.weight_prefetch_lines(16, 1024) == 8
    assert common.weight_prefetch_lines(128, 100) == 1
    assert common.weight_prefetch_lines(48, 8192) == 8  # (10 lines fit: 8)
    assert common.weight_prefetch_lines(1024, 8192) == 1  # (one line a row, whatever the budget)
    for rows, row_bytes in ((128, 4096), (16, 8192), (48, 8192), (32, 4096)):
        lines = common.weight_prefetch_lines(rows, row_bytes)
        assert lines & (lines - 1) == 0 and rows * lines * common.PREFETCH_LINE <= common.PREFETCH_BYTES


class _RecordedKernel:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def restore_pdl():
    before = dict(common._PDL)
    yield
    common.set_programmatic_dependent_launch(before["on"], prefetch_weights=before["prefetch"])


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
