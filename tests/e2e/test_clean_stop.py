"""A server that stops cleanly every time, whatever it served.

Each cycle starts tritonserver over the real engine (MTP drafts on), serves mixed traffic, and stops it with SIGINT (as
a terminal's Ctrl-C) or SIGTERM (as an orchestrator): the seed report's experiment (a request decoding while a long
prompt is prefilled in chunks, that prompt's stream closed with cancel_requests after its first response), constrained
requests, a bad request, and a request still decoding when the signal comes. The stop must exit 0 with no crash, no
abort, no exit timeout in the log, no process and no /dev/shm file left behind.

Two failures this catches, both seen before: the stub crashing in a metric family's destructor at its teardown after a
constrained request (every stop), and a stub left running for nobody, its threads waiting forever for the GIL a blocked
backend call held when tritonserver exited.

DSV4_STOP_CYCLES sets the number of cycles (3 by default; docs/serving.md "Stopping the server" quotes 10).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import CHECKPOINT, _make_repository
from .triton_helpers import (CRASH_MARKERS, EXIT_TIMEOUT_S, REPO_ROOT, GrpcStreams, TritonServer, free_ports,
                             group_members, grpc_inputs, http_post, server_env, stub_argv, wait_for)

CYCLES = int(os.environ.get("DSV4_STOP_CYCLES", "3"))
LONG_PROMPT_TOKENS = 1500  # prefilled in 128-token chunks: 12 steps
CHUNK_TOKENS = 128


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return _make_repository(tmp_path_factory.mktemp("stop_repo"), f"checkpoint={CHECKPOINT}", "device=cpu",
                            "num_speculative_tokens=2", f"prefill_chunk_tokens={CHUNK_TOKENS}")


def _seed_experiment_with_cancel(server: TritonServer) -> None:
    """A victim decodes while an attacker's long prompt is prefilled; the attacker's stream is closed with
    cancel_requests after its first response; the victim and two constrained requests run to their end."""
    main, attacker = GrpcStreams(server.grpc_url), GrpcStreams(server.grpc_url)
    try:
        # First and alone: a gRPC stream's error carries no request id to match it by.
        main.send("bad", grpc_inputs("x", 8, sampling={"guided_decoding": {"regex": "(("}}))
        assert main.wait(["bad"], timeout=60)["bad"].error is not None
        main.send("victim", grpc_inputs("The victim", 60, sampling={"temperature": 0, "ignore_eos": True}))
        attacker.send("attacker", grpc_inputs([3 + i % 500 for i in range(LONG_PROMPT_TOKENS)], 2))
        choice = {"temperature": 0, "guided_decoding": {"choice": ["yes", "no"]}}
        main.send("choice", grpc_inputs("Is it spam?", 8, sampling=choice))
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        main.send("json", grpc_inputs("A number:", 24, sampling={"temperature": 0.8, "seed": 3,
                                                                   "guided_decoding": {"json": schema}}))
        deadline = time.monotonic() + 120
        first = attacker.results["attacker"]
        while not (first.num_responses or first.error) and time.monotonic() < deadline:
            attacker._take(timeout=max(0.01, deadline - time.monotonic()))
        assert first.error is None and first.num_responses, first.error
        results = main.wait(["victim", "choice", "json"], timeout=120)
    finally:
        attacker.close(cancel=True)
        main.close()
    assert results["victim"].error is None and len(results["victim"].ids) == 60
    assert results["choice"].text in ("yes", "no")
    assert "n" in json.loads(results["json"].text) or results["json"].finish_reason == "length"


def _leave_one_decoding(server: TritonServer) -> None:
    """A request still decoding when the stop comes: its client went away (closed its stream without cancelling).
    A client that keeps its stream open holds tritonserver's stop until its exit timeout, whatever the model does
    (tritonserver's gRPC and HTTP frontends wait for their streams; docs/serving.md "Stopping")."""
    streams = GrpcStreams(server.grpc_url)
    streams.send("inflight", grpc_inputs("Still going", 2000, sampling={"temperature": 0, "ignore_eos": True}))
    while not streams.results["inflight"].num_responses:
        streams._take(timeout=60)
    streams.close()


@pytest.mark.parametrize("cycle", range(CYCLES))
def test_the_server_stops_cleanly_after_mixed_traffic(repository, tmp_path, cycle):
    server = TritonServer(repository, tmp_path / "tritonserver.log").start()
    try:
        _seed_experiment_with_cancel(server)
        _leave_one_decoding(server)
    finally:
        server.stop(signal.SIGINT if cycle % 2 == 0 else signal.SIGTERM)
    assert server.unclean_stop() == [], f"{server.unclean_stop()}\n{server.log_tail()}"
    assert server.stop_s < 8, f"the stop took {server.stop_s:.1f} s"


LONG_REQUEST_TOKENS = 2000  # (minutes of decoding here: still running when the stop or the unload comes)


def _start_long_requests(streams: GrpcStreams, ids: list[str]) -> None:
    """Send each a long greedy request; return once every one has streamed its first response."""
    for rid in ids:
        streams.send(rid, grpc_inputs(f"Long {rid}", LONG_REQUEST_TOKENS,
                                      sampling={"temperature": 0, "ignore_eos": True}))
    deadline = time.monotonic() + 120
    while not all(streams.results[rid].num_responses for rid in ids):
        streams._take(timeout=max(0.01, deadline - time.monotonic()))


def _assert_cut_short(results: dict, reason: str) -> None:
    """Each request ended with an error naming `reason`, after some of its tokens and before all of them."""
    assert [r.error for r in results.values() if reason not in str(r.error)] == []
    assert all(0 < len(r.ids) < LONG_REQUEST_TOKENS for r in results.values())


@pytest.mark.parametrize("endpoint,extra_args", [("HTTP", ()), ("gRPC", ("--allow-http=false",))])
def test_requests_still_decoding_at_the_stop_end_in_time_for_a_clean_exit(repository, tmp_path, endpoint, extra_args):
    """A client keeps its stream open while its requests run (as a script waiting for their ends does), and
    tritonserver waits for them up to its exit timeout. They decode on through the grace that timeout leaves, then
    each ends with an UNAVAILABLE error; the client closes its stream, and the server exits cleanly within the timeout.
    (Without it, nothing ended them: the exit timeout expired, and tritonserver often crashed on its way out.) The
    model sees the stop over tritonserver's HTTP endpoint, or its gRPC one where it serves no HTTP."""
    server = TritonServer(repository, tmp_path / "tritonserver.log", extra_args=extra_args).start()
    streams, ids = GrpcStreams(server.grpc_url), [f"long{i}" for i in range(8)]
    stopper = threading.Thread(target=server.stop, args=(signal.SIGINT,))
    try:
        _start_long_requests(streams, ids)
        stopper.start()
        results = streams.wait(ids, timeout=EXIT_TIMEOUT_S)
    finally:
        streams.close()
        stopper.join() if stopper.ident else server.stop()
    _assert_cut_short(results, "tritonserver is stopping")
    assert server.unclean_stop() == [], f"{server.unclean_stop()}\n{server.log_tail()}"
    assert server.stop_s < EXIT_TIMEOUT_S, f"the stop took {server.stop_s:.1f} s"
    # (seen over an endpoint of tritonserver's: the Python backend's is_model_ready failing can crash the stub)
    log = server.log_path.read_text(errors="replace")
    where = f"http://{server.http_url}" if endpoint == "HTTP" else f"gRPC at {server.grpc_url}"
    assert f"watched for over {where}" in log
    assert f"tritonserver is stopping (seen over {endpoint}): the 8 requests running get" in log


def test_requests_still_decoding_when_the_model_is_unloaded_end_after_the_grace(repository, tmp_path):
    """An explicit unload (--model-control-mode=explicit) while requests decode: tritonserver waits for them without
    a timeout; each ends after the grace with the unload's error, and the model unloads."""
    server = TritonServer(repository, tmp_path / "tritonserver.log",
                          extra_args=("--model-control-mode=explicit", "--load-model=dsv4")).start()
    streams, ids = GrpcStreams(server.grpc_url), [f"unload{i}" for i in range(4)]
    try:
        _start_long_requests(streams, ids)
        status, body = http_post(f"http://{server.http_url}/v2/repository/models/dsv4/unload", {})
        assert status == 200, body
        results = streams.wait(ids, timeout=EXIT_TIMEOUT_S)
        streams.close()
        assert wait_for(lambda: not server.is_ready("/v2/models/dsv4/ready"), timeout=EXIT_TIMEOUT_S)
    finally:
        server.stop(signal.SIGINT)
    _assert_cut_short(results, "the model is being unloaded")
    assert "successfully unloaded 'dsv4'" in server.log_path.read_text(errors="replace")
    assert server.unclean_stop() == [], f"{server.unclean_stop()}\n{server.log_tail()}"


def _stub_shm_region(pgid: int) -> str | None:
    """The shm region named on the command line of the group's Python-backend stub."""
    stub = stub_argv(pgid)
    return stub[1][2].decode() if stub else None


def _ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _serve_two_http_answers_then_ctrl_c(tmp_path, env: dict[str, str]) -> tuple[int, str, int, str | None, bytes]:
    """The README's command as a user runs it (`bash scripts/serve.sh --set num_speculative_tokens=2`, on free ports),
    a constrained request over HTTP generate and a streamed one over generate_stream, then Ctrl-C as soon as the
    second answer is in. Returns the exit status, the log, the process group, the stub's shm region and the stream's
    body."""
    http, grpc, metrics = free_ports(3)
    log = tmp_path / "serve.log"
    command = ["bash", "scripts/serve.sh", "--set", "num_speculative_tokens=2", "--set", "device=cpu",
               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    with open(log, "wb") as out:
        serve = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 env={**server_env(), "DSV4_SKIP_SETUP": "1", **env}, start_new_session=True)
    try:
        assert wait_for(lambda: serve.poll() is None and _ready(http), timeout=180), log.read_text()[-3000:]
        shm = _stub_shm_region(serve.pid)
        base = f"http://127.0.0.1:{http}/v2/models/dsv4"
        status, body = http_post(f"{base}/generate", {"text_input": "Is it spam?", "max_tokens": 8, "parameters": {
            "temperature": 0, "guided_decoding": json.dumps({"choice": ["yes", "no"]})}})
        assert status == 200 and json.loads(body)["text_output"].endswith(("yes", "no")), body
        status, stream = http_post(f"{base}/generate_stream", {"text_input": "The quick brown fox", "max_tokens": 16,
                                                               "stream": True})
        assert status == 200 and b'"finish_reason":"length"' in stream, stream
        serve.send_signal(signal.SIGINT)
        returncode = serve.wait(timeout=EXIT_TIMEOUT_S + 10)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    return returncode, log.read_text(errors="replace"), serve.pid, shm, stream


def test_serve_sh_stops_cleanly_on_ctrl_c(tmp_path):
    """Exit status 0 after Ctrl-C, nothing in the log of a crash, no process and no shm region left."""
    returncode, text, pgid, shm, stream = _serve_two_http_answers_then_ctrl_c(tmp_path, {})
    assert stream.count(b"data:") >= 2, stream
    assert returncode == 0, text[-3000:]
    assert not [marker for marker in CRASH_MARKERS if marker in text], text[-3000:]
    assert wait_for(lambda: not group_members(pgid), timeout=5), f"left behind: {group_members(pgid)}"
    assert shm and not Path("/dev/shm", shm).exists()


def test_no_response_with_outputs_is_deleted_after_the_http_frontend(tmp_path):
    """tritonserver's stop deletes its HTTP frontend before anything else, and its generate endpoints end a reply on
    the FINAL response before deleting it: a FINAL carrying outputs, deleted in between, crashed the server at a
    Ctrl-C right after an answer (1 stop in about 40 here). Every deletion held back 300 ms by a preloaded shim
    (late_response_delete.c) shows such a response each time, where the crash needed the freed memory reused."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the shim this test preloads")
    shim = tmp_path / "late_response_delete.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(Path(__file__).with_name(
        "late_response_delete.c")), "-ldl"], check=True)
    returncode, text, _, _, _ = _serve_two_http_answers_then_ctrl_c(tmp_path, {"LD_PRELOAD": str(shim)})
    assert "[late_response_delete] loaded" in text, text[:3000]
    assert "[late_response_delete] a response" not in text, text[-3000:]
    assert returncode == 0 and not [marker for marker in CRASH_MARKERS if marker in text], text[-3000:]
