"""tritonserver serving the engine over two ranks (tensor_parallel_size=2, or data_parallel_size=2 with
expert_parallel_size=2: the stub's engine and one worker process it spawns), against the single-rank engine; and
what a dead worker does to the requests and the server.

Stopping the server must leave no worker behind: the fixture's stop checks every process of the server's
group (the worker included) is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .conftest import _make_repository, _serve
from .triton_helpers import (REPO_ROOT, GrpcStreams, grpc_inputs, http_generate, server_env, settled, stream_all,
                             wait_for)

PROMPTS = ["Hello world", "The quick brown fox", "a", "Tensor parallel serving", "x" * 40]
MAX_TOKENS = 8


LAYOUTS = {"tp": ("tensor_parallel_size=2",), "dp": ("data_parallel_size=2", "expert_parallel_size=2")}


def _repository(tmp_path_factory, checkpoint, *sets, layout: str = "tp"):
    return _make_repository(tmp_path_factory.mktemp(f"{layout}_repo"), f"checkpoint={checkpoint}", "device=cpu",
                            *LAYOUTS[layout], *sets)


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, parallel_checkpoint):
    yield from _serve(_repository(tmp_path_factory, parallel_checkpoint), tmp_path_factory.mktemp("tp_log"))


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory, parallel_checkpoint):
    yield from _serve(_repository(tmp_path_factory, parallel_checkpoint, layout="dp"),
                      tmp_path_factory.mktemp("dp_log"))


def _offline(checkpoint, prompts, max_tokens):
    prompts_file = REPO_ROOT / "build" / f"tp_prompts_{time.monotonic_ns()}.json"
    prompts_file.write_text(json.dumps(prompts))
    try:
        cmd = [sys.executable, str(REPO_ROOT / "scripts" / "generate.py"), "--checkpoint", str(checkpoint),
               "--prompts-file", str(prompts_file), "--max-tokens", str(max_tokens), "--device", "cpu"]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300, env=server_env())
    finally:
        prompts_file.unlink()
    return json.loads(done.stdout)


def _workers(server) -> list[psutil.Process]:
    """The rank group's live worker processes: the spawned children under tritonserver's Python stub."""
    workers = []
    for p in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                workers.append(p)
        except psutil.Error:  # gone (or a zombie) meanwhile
            pass
    return workers


def test_two_ranks_stream_the_single_rank_tokens(tp_server, parallel_checkpoint):
    assert len(_workers(tp_server)) == 1
    expected = _offline(parallel_checkpoint, PROMPTS, MAX_TOKENS)
    for got, want in zip(stream_all(tp_server, PROMPTS, MAX_TOKENS), expected):
        assert got.error is None, got.error
        assert (got.ids, got.text, got.num_finals) == (want["output_ids"], want["text"], 1)


def test_data_parallel_ranks_stream_the_single_rank_tokens(dp_server, parallel_checkpoint):
    """Requests placed on both ranks (each its own attention and pools), the experts split: one rank's tokens, and
    each rank's load in the metrics."""
    assert len(_workers(dp_server)) == 1
    expected = _offline(parallel_checkpoint, PROMPTS, MAX_TOKENS)
    for got, want in zip(stream_all(dp_server, PROMPTS, MAX_TOKENS), expected):
        assert got.error is None, got.error
        assert (got.ids, got.text, got.num_finals) == (want["output_ids"], want["text"], 1)
    usage = settled(lambda: dp_server.metric_values("dsv4_rank_pool_usage_ratio"))
    window = {re.search(r'rank="(\d+)"', label).group(1): value for label, value in usage.items()
              if 'pool="window"' in label}
    # both ranks served: each one's prefix cache keeps the window pages of the requests it ran
    assert set(window) == {"0", "1"} and all(value > 0 for value in window.values()), usage
    running = dp_server.metric_values("dsv4_rank_requests_running")
    assert {re.search(r'rank="(\d+)"', label).group(1) for label in running} == {"0", "1"}


def test_ctrl_c_lets_the_requests_on_two_ranks_finish(tmp_path_factory, parallel_checkpoint):
    """A Ctrl-C in the server's terminal reaches its whole process group, the worker ranks too, while tritonserver
    waits for the requests running (their grace, stop_grace_s), which need every rank. The worker ended at once
    (torch's spawn makes SIGINT its end), failing them: "worker process gone". Workers now ignore SIGINT and end with
    the stub; the request finishes and tritonserver exits cleanly."""
    for server in _serve(_repository(tmp_path_factory, parallel_checkpoint), tmp_path_factory.mktemp("tp_sigint_log")):
        streams = GrpcStreams(server.grpc_url)
        try:
            streams.send("r", grpc_inputs("Once upon a time", 48, sampling={"temperature": 0, "ignore_eos": True}))
            while not streams.results["r"].ids:  # streaming has begun
                streams._take(timeout=60)
            os.killpg(server.process.pid, signal.SIGINT)
            result = streams.wait(["r"], timeout=60)["r"]
        finally:
            streams.close()
        assert (result.error, len(result.ids), result.finish_reason) == (None, 48, "length"), result
        assert server.process.wait(timeout=30) == 0


@pytest.mark.parametrize("layout,control", [("tp", "none"), ("tp", "explicit"), ("dp", "none")])
def test_a_killed_worker_fails_the_stream_and_the_server_answers(tmp_path_factory, parallel_checkpoint, layout,
                                                                 control):
    """SIGKILL the worker while a long generation streams: the request ends with an error (no hang), the server
    still answers and stops cleanly. With explicit model control the model unloads itself, so its ready
    endpoint says not ready (as Triton's vLLM backend does); otherwise later requests get UNAVAILABLE at once."""
    explicit = control == "explicit"
    repository = _repository(tmp_path_factory, parallel_checkpoint, "collective_timeout_s=30",
                             f"unload_when_unavailable={str(explicit).lower()}", layout=layout)
    extra = ("--model-control-mode=explicit", "--load-model=dsv4") if explicit else ()
    for server in _serve(repository, tmp_path_factory.mktemp("tp_kill_log"), *extra):
        assert server.is_ready("/v2/models/dsv4/ready")
        (worker,) = _workers(server)
        streams = GrpcStreams(server.grpc_url)
        try:
            streams.send("long", grpc_inputs("Once upon a time", 2000, sampling={"temperature": 0, "ignore_eos": True}))
            while not streams.results["long"].ids:  # streaming has begun
                streams._take(timeout=60)
            worker.send_signal(signal.SIGKILL)
            started = time.monotonic()
            result = streams.wait(["long"], timeout=60)["long"]
            assert time.monotonic() - started < 60
            assert result.error is not None or result.finish_reason == "error", result
            assert len(result.ids) < 2000
        finally:
            streams.close()
        if explicit:
            assert wait_for(lambda: not server.is_ready("/v2/models/dsv4/ready"), timeout=30)
            assert not _workers(server)  # the unloaded model's group is gone
        else:
            status, body = http_generate(server, {"text_input": "after", "max_tokens": 4})
            assert status >= 400 and "cannot serve" in json.dumps(body), (status, body)
            streams = GrpcStreams(server.grpc_url)
            try:
                streams.send("after", grpc_inputs("after", 4))
                refused = streams.wait(["after"], timeout=30)["after"]
            finally:
                streams.close()
            assert refused.error and "cannot serve" in refused.error
            assert server.is_ready("/v2/models/dsv4/ready")  # Triton 2.51: no way to say otherwise here
