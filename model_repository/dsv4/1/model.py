"""Triton Python-backend entry point for the DeepSeek-V4 engine (decoupled mode).

Thin by design: `initialize` finds the repository, builds the engine from the config.pbtxt
parameters and hands both to `backend.serving.adapter.TritonAdapter`, which parses requests,
submits them, streams the responses back (exactly one FINAL per request), turns client
cancellation into engine aborts and exports the metrics.
"""

import gc
import glob
import json
import os
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


def _repo_root(hint: str, model_dir: str) -> Path:
    """The checkout holding `backend/`: the repo_root parameter, $DSV4_REPO_ROOT, or ../.. of the model."""
    for candidate in (hint, os.environ.get("DSV4_REPO_ROOT", ""), str(Path(model_dir).resolve().parents[1])):
        if candidate and (Path(candidate) / "backend" / "config.py").is_file():
            return Path(candidate).resolve()
    raise RuntimeError(f"cannot find the dsv4 repository (backend/config.py): repo_root={hint!r}, model {model_dir}")


def _single_threaded_mkl(params: dict) -> None:
    """MKL's own threads, used from the engine's thread, made CPU prefill steps 1.9x slower than on a main thread;
    single-threaded MKL costs a main thread nothing (docs/host-loop.md#threads). Only the environment, read once when
    torch loads MKL, does it, and torch then defaults to one intra-op thread: `cpu_threads` defaults to the CPUs here.
    A MKL_NUM_THREADS the server was started with is kept. Only for CPU deployments (decided before torch is
    imported: device cpu, or auto on a machine without NVIDIA devices): MKL computes nothing of a GPU step."""
    device = params.get("device", "").strip() or "auto"
    on_cpu = device == "cpu" or (device == "auto" and not glob.glob("/dev/nvidia[0-9]*"))
    if not on_cpu or "MKL_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return
    os.environ["MKL_NUM_THREADS"] = "1"
    if not params.get("cpu_threads", "").strip():
        params["cpu_threads"] = str(len(os.sched_getaffinity(0)))


class TritonPythonModel:
    def initialize(self, args):
        config_json = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config_json.get("parameters", {}).items()}
        root = _repo_root(params.pop("repo_root", "").strip(), args["model_repository"])
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from backend.serving import stub_watchdog  # the standard library only: torch is not imported yet
        from backend.stack_dump import dump_stacks_on_sigusr1

        self._watchdog = stub_watchdog.start_for_this_stub()  # from here on, this process cannot outlive tritonserver
        dump_stacks_on_sigusr1()
        _single_threaded_mkl(params)
        # Imported here: sys.path only knows the repository from now on.
        from backend.config import EngineConfig
        from backend.engine import LLMEngine
        from backend.serving.adapter import TritonAdapter

        config = EngineConfig.from_parameters(params)  # ConfigError names the bad parameter
        if not os.path.isabs(config.checkpoint):
            config.checkpoint = str(root / config.checkpoint)
        if config.chat_template is not None and not os.path.isabs(config.chat_template):
            config.chat_template = str(root / config.chat_template)
        pb_utils.Logger.log_info(f"[dsv4] repo {root}; MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS', '')}; "
                                 f"engine config {config}")
        self.adapter = TritonAdapter(LLMEngine(config), pb_utils, args["model_name"], args["model_version"])
        self.adapter.start()

    def execute(self, requests):
        # submit() answers a bad request itself; nothing may leave here raised: the backend would then close every
        # sender of the batch, those of the requests already taken in too, and delete their response factories.
        for request in requests:
            try:
                self.adapter.submit(request)
            except Exception as exc:  # noqa: BLE001
                pb_utils.Logger.log_error(f"[dsv4] a request could not be taken in: {exc}")
        return None

    def finalize(self):
        # Everything of the backend's this model holds is destroyed here, while tritonserver still listens: metric
        # objects and response senders message the server when they go (TritonAdapter.shutdown).
        self.adapter.shutdown()
        self.adapter = None
        gc.collect()
