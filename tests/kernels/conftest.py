"""Run the Triton kernels on CPU tensors through Triton's interpreter.

TRITON_INTERPRET must be set before any @triton.jit decorator runs (the decorator picks the interpreter
then) and stays set while kernels run (the interpreter checks it again), so this sets it at import, which
pytest does while collecting this folder; it stays set for the rest of the session. Kernel modules that
another test folder imported before this conftest was loaded are reloaded so their kernels are interpreted.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

for _name in ("kernels.attention", "kernels.indexer", "kernels.moe"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
