"""Start a real tritonserver and talk to it (gRPC streaming, HTTP generate / generate_stream, metrics).

Used by tests/e2e/conftest.py; nothing here is a test. The server gets free ports, its own
shm-region prefix (so its /dev/shm files can be checked and cleaned), a low exit timeout, and
is stopped (SIGTERM, then SIGKILL) whatever happens.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_HOME = REPO_ROOT / "build" / "tritonserver"
TRITON_BIN = TRITON_HOME / "bin" / "tritonserver"
MODEL = "dsv4"
# tritonserver's --exit-timeout-secs, as scripts/serve.sh sets it. A clean stop of this model takes 2-3.5 s on the CPU:
# most of it tritonserver's own one-second polls while it unloads, and the stub's exit.
EXIT_TIMEOUT_S = 10
# What tritonserver or the backend stub print when a stop is not clean.
CRASH_MARKERS = ("Segfault encountered", "Exit timeout expired", "Signal (11)", "Signal (6)", "Non-graceful termination",
                 "stub watchdog")


def server_env() -> dict[str, str]:
    """What scripts/env.sh exports, computed here so a bare `pytest` works too."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    site = sysconfig.get_paths()["purelib"]
    libs = [f"{site}/nvidia_pytriton.libs", sysconfig.get_config_var("LIBDIR"), str(TRITON_HOME / "lib")]
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    env.pop("DSV4_REPO_ROOT", None)  # the repository's repo_root parameter decides
    env.pop("TRITON_INTERPRET", None)  # tests of kernels set it; a server never runs the interpreter
    return env


def free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
    ports = [s.getsockname()[1] for s in sockets]
    for sock in sockets:
        sock.close()
    return ports


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def dump_stacks(pids: list[int], path: Path, timeout_s: float = 60.0) -> str:
    """The stacks of each process in `pids` (tritonserver, its stub, the stub's rank processes): a server that hangs at
    start-up is otherwise gone, and its cause with it, once the test stops it. Those that dump their Python stacks on
    SIGUSR1 (backend/stack_dump.py) get it, and write them to the server's log; every thread's native stack is written
    to `path` with gdb where it is installed. Returns what to say of it in the failure."""
    for pid in pids:
        if _catches(pid, signal.SIGUSR1):
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)  # (one at a time: they share the log, and would interleave their lines)
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb here to dump the native stacks of its processes)"
    with open(path, "w") as out:
        for pid in pids:
            out.write(f"=== pid {pid}: {_command_line(pid)}\n")
            out.flush()
            try:
                subprocess.run([gdb, "-batch", "-nx", "-p", str(pid), "-ex", "thread apply all bt"], stdout=out,
                               stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                out.write(f"(gdb took more than {timeout_s:g} s)\n")
    text = path.read_text(errors="replace")
    return f"the native stacks of its {len(pids)} processes ({path}):\n{text[-40_000:]}"


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught >> (sig - 1) & 1)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "(gone)"


def stub_argv(pgid: int) -> tuple[int, list[bytes]] | None:
    """The pid and command line of the group's Python-backend stub (its arguments: the model, its shm region)."""
    for pid in group_members(pgid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"triton_python_backend_stub"):
            return pid, argv
    return None


def shm_files(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}*"))


@dataclass
class TritonServer:
    model_repository: Path
    log_path: Path
    ready_timeout_s: float = 180.0
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    shm_prefix: str = field(default_factory=lambda: f"dsv4_test_{os.getpid()}_{uuid.uuid4().hex[:8]}_")
    process: subprocess.Popen | None = None
    stray_shm: list[str] = field(default_factory=list)
    stray_pids: list[int] = field(default_factory=list)
    returncode: int | None = None  # tritonserver's exit status, once stopped
    stop_s: float | None = None  # how long the stop took, signal to exit
    extra_args: tuple[str, ...] = ()  # more tritonserver options (e.g. --model-control-mode=explicit)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, attempts: int = 3) -> "TritonServer":
        """Start on free ports. A port found free can be taken by another process before tritonserver binds it (it
        then exits at start-up): that is retried on new ports."""
        for attempt in range(attempts):
            try:
                return self._start()
            except RuntimeError as exc:
                if "already in use" not in str(exc) or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> "TritonServer":
        if not TRITON_BIN.exists():
            raise RuntimeError(f"{TRITON_BIN} missing: run `bash scripts/setup.sh` (scripts/test.sh does)")
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        cmd = [
            str(TRITON_BIN),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={TRITON_HOME / 'backends'}",
            "--http-address=127.0.0.1", f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            *self.extra_args,
        ]
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                        start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.is_ready() and self.metrics_answer():  # the metrics port opens after the HTTP one
                return
            time.sleep(0.2)
        stacks = self.log_path.with_name(self.log_path.name + ".stacks")
        dumped = dump_stacks(group_members(self.process.pid), stacks)  # (first: the log then has the Python ones)
        raise RuntimeError(f"tritonserver not ready after {self.ready_timeout_s:.0f} s:\n{self.log_tail(20_000)}\n"
                           f"{dumped}")

    @property
    def serves_http(self) -> bool:
        return not any(arg in ("--allow-http=false", "--allow-http=0") for arg in self.extra_args)

    def is_ready(self, path: str = "/v2/health/ready") -> bool:
        """The HTTP endpoint's answer at `path` (the server's readiness, or /v2/models/NAME/ready); over gRPC where
        the server serves no HTTP."""
        if not self.serves_http:
            import tritonclient.grpc
            from tritonclient.utils import InferenceServerException

            model = re.fullmatch(r"/v2/models/([^/]+)/ready", path)
            with tritonclient.grpc.InferenceServerClient(self.grpc_url) as client:
                try:
                    return (client.is_model_ready(model.group(1), client_timeout=2) if model
                            else client.is_server_ready(client_timeout=2))
                except InferenceServerException:
                    return False
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """`sig` (SIGTERM or SIGINT, as a terminal's Ctrl-C), wait, SIGKILL; then kill (and remember) any process of
        its group that outlived it (a backend stub) and remove (and remember) any /dev/shm files it left."""
        if self.process is None:
            return
        if self.process.poll() is None:
            started = time.monotonic()
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=EXIT_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
            self.stop_s = time.monotonic() - started
        self.returncode = self.process.returncode
        deadline = time.monotonic() + 5  # a stub notices its parent is gone within ~0.1 s
        while group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stray_pids = group_members(self.process.pid)
        if self.stray_pids:
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while group_members(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stray_shm = shm_files(self.shm_prefix)
        for name in self.stray_shm:
            Path("/dev/shm", name).unlink(missing_ok=True)

    def unclean_stop(self) -> list[str]:
        """What was wrong with the stop: a non-zero exit, a crash or an exit timeout in the log, a process left behind
        (killed by `stop`), /dev/shm files left behind. Empty for a clean stop."""
        problems = [f"exit status {self.returncode}"] if self.returncode != 0 else []
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        problems += [f"log: {marker!r}" for marker in CRASH_MARKERS if marker in log]
        problems += [f"processes left: {self.stray_pids}"] if self.stray_pids else []
        problems += [f"/dev/shm files left: {self.stray_shm}"] if self.stray_shm else []
        return problems

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server log, without the border lines of its big status tables; where the server crashed, the
        log from just before its first crash marker instead (a crash's stack trace can be followed by pages of
        shutdown lines)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        text = "\n".join(line for line in lines if not line.startswith("+-"))
        crashes = [text.find(marker) for marker in CRASH_MARKERS if marker in text]
        if crashes and len(text) - min(crashes) > chars // 2:
            start = max(0, min(crashes) - chars // 4)
            return text[start:start + chars]
        return text[-chars:]

    # --- metrics ---------------------------------------------------------------------------
    def metrics_answer(self) -> bool:
        try:
            self.metrics_text()
            return True
        except (urllib.error.URLError, OSError):
            return False

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def metric_values(self, name: str) -> dict[str, float]:
        """{label string: value} of one metric family from the Prometheus text."""
        values = {}
        for line in self.metrics_text().splitlines():
            match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
            if match:
                values[match.group(1) or ""] = float(match.group(2))
        return values


# --- gRPC streaming ---------------------------------------------------------------------------


def grpc_inputs(prompt: str | list[int] | None, max_tokens: int, stream: bool = True, sampling: dict | None = None,
                extra: dict[str, np.ndarray] | None = None):
    """A request's inputs: `prompt` as text_input or input_ids (None: `extra` gives it, e.g. messages)."""
    import tritonclient.grpc as grpcclient

    arrays: dict[str, np.ndarray] = {}
    if isinstance(prompt, str):
        arrays["text_input"] = np.array([prompt.encode()], dtype=np.object_)
    elif prompt is not None:
        arrays["input_ids"] = np.asarray(prompt, dtype=np.int32)
    arrays["max_tokens"] = np.array([max_tokens], dtype=np.int32)
    arrays["stream"] = np.array([stream])
    arrays["sampling_parameters"] = np.array([json.dumps(sampling or {"temperature": 0}).encode()], dtype=np.object_)
    arrays.update(extra or {})
    inputs = []
    for name, array in arrays.items():
        dtype = {"O": "BYTES", "b": "BOOL", "i": "INT32", "f": "FP32"}[array.dtype.kind]
        inp = grpcclient.InferInput(name, list(array.shape), dtype)
        inp.set_data_from_numpy(array)
        inputs.append(inp)
    return inputs


@dataclass
class StreamResult:
    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_responses: int = 0
    num_finals: int = 0
    error: str | None = None
    num_cached_tokens: int | None = None  # when the request asked for it (return_num_cached_tokens)
    answer_parts: list[tuple[str, str, list]] = field(default_factory=list)  # parse_chat_output's, per response

    @property
    def text(self) -> str:
        return "".join(self.texts)


class GrpcStreams:
    """One gRPC stream carrying many requests; responses collected per request id."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue = queue.Queue()
        self.results: dict[str, StreamResult] = {}
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def send(self, request_id: str, inputs) -> None:
        self.results[request_id] = StreamResult()
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def _take(self, timeout: float) -> str | None:
        """Record one event; return its request id when that request is now complete."""
        result, error = self.events.get(timeout=timeout)
        if error is not None:
            match = re.search(r"request id: (\S+)", str(error))
            # Errors carry no response object: match them to the oldest request still open.
            open_ids = [rid for rid, r in self.results.items() if not r.num_finals and r.error is None]
            rid = match.group(1) if match and match.group(1) in self.results else (open_ids[0] if open_ids else None)
            if rid is not None:
                self.results[rid].error = str(error)
            return rid
        response = result.get_response()
        res = self.results[response.id]
        final = response.parameters["triton_final_response"].bool_param
        if response.outputs:
            res.num_responses += 1
            res.texts.extend(t.decode() for t in result.as_numpy("text_output"))
            res.ids.extend(result.as_numpy("output_ids").tolist())
            reason = result.as_numpy("finish_reason")[0].decode()
            res.finish_reason = reason or res.finish_reason
            if result.as_numpy("num_cached_tokens") is not None:
                res.num_cached_tokens = int(result.as_numpy("num_cached_tokens")[0])
            if result.as_numpy("tool_calls") is not None:
                res.answer_parts.append((result.as_numpy("reasoning_content")[0].decode(),
                                         result.as_numpy("content")[0].decode(),
                                         json.loads(result.as_numpy("tool_calls")[0])))
        if final:
            res.num_finals += 1
            return response.id
        return None

    def wait(self, request_ids, timeout: float = 120.0) -> dict[str, StreamResult]:
        pending = set(request_ids)
        deadline = time.monotonic() + timeout
        while pending:
            pending -= {self._take(max(0.01, deadline - time.monotonic()))}
            pending = {rid for rid in pending if not (self.results[rid].num_finals or self.results[rid].error)}
        return {rid: self.results[rid] for rid in request_ids}

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_all(server: "TritonServer", prompts: list, max_tokens: int,
               extra: dict[str, np.ndarray] | None = None) -> list[StreamResult]:
    """Every prompt's result, all sent greedily on one gRPC stream at once (so they batch); `extra`: more inputs."""
    streams = GrpcStreams(server.grpc_url)
    try:
        ids = [f"p{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            streams.send(rid, grpc_inputs(prompt, max_tokens, extra=extra))
        results = streams.wait(ids, timeout=180)
    finally:
        streams.close()
    return [results[rid] for rid in ids]


# --- HTTP generate ----------------------------------------------------------------------------


def http_post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_generate(server: TritonServer, body: dict) -> tuple[int, dict]:
    status, raw = http_post(f"http://{server.http_url}/v2/models/{MODEL}/generate", body)
    return status, json.loads(raw)


def http_generate_stream(server: TritonServer, body: dict) -> list[dict]:
    """The SSE events of one generate_stream call, as dicts."""
    status, raw = http_post(f"http://{server.http_url}/v2/models/{MODEL}/generate_stream", body)
    events = [json.loads(line[len("data:"):]) for line in raw.decode().splitlines() if line.startswith("data:")]
    if status != 200:
        raise RuntimeError(f"generate_stream returned {status}: {raw[:500]!r}")
    return events


def as_list(value) -> list:
    """HTTP generate returns a one-element output as a scalar, longer ones as lists."""
    return value if isinstance(value, list) else [value]


def settled(read, quiet_s: float = 0.5, timeout: float = 20.0):
    """`read()` once it has stopped changing for `quiet_s` seconds. The backend mirrors engine stats into
    the metrics every 0.1 s, so a counter read right after a request ends may still miss that request."""
    deadline = time.monotonic() + timeout
    value = read()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = read()
        if again == value:
            return value
        value = again
    raise AssertionError(f"{read} did not settle within {timeout} s")


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
