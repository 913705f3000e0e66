#!/usr/bin/env python3
"""The V4-Flash-shaped dummy model served by tritonserver, under perf_analyzer's streaming load: time to first token
and inter-token latency at each concurrency.

    python scripts/bench_v4_serving.py --out results/v4_serving                 # a GPU: V4-Flash's widths
    python scripts/bench_v4_serving.py --device cpu --layers 2 --hf-overrides '{"hidden_size": 128, ...}' \\
        --concurrency 1 2 --input-tokens 16 --output-tokens 8 --out /tmp/v4_serving   # the same run at tiny shapes

1. Checks that this machine can serve at all (tritonserver, its Python backend stub and perf_analyzer, with every
   shared library they load, a python3 of the stub's version with torch): what is missing is printed, exit 3.
   Without this checkout's venv (a GPU image), --bundle serves from scripts/pack_serving.sh's bundle.
2. Writes a model repository (scripts/make_model_repository.py, into --out) serving --checkpoint (default
   docs/configs/deepseek-v4-flash.config.json) with load_format=dummy on --device, cut to --layers layers (default:
   as many as fit the GPU beside pools for the largest concurrency, as scripts/bench_v4.py chooses), the rest of
   its parameters at their defaults (on CUDA: fp8 weights as published, DeepSeek's numerics, fp8 KV, CUDA graphs)
   or as --set gives them; serves it with scripts/serve.sh on free ports (its log: OUT/server.log).
3. At each --concurrency (default 1 16 64) runs scripts/perf_analyzer.sh: streaming gRPC requests of
   --input-tokens prompt tokens generating exactly --output-tokens (ignore_eos), into OUT/c<N>/. Time to first
   token and inter-token latency come from the server's own histograms (dsv4_time_to_first_token_seconds,
   dsv4_inter_token_latency_seconds: per token the engine produced, where perf_analyzer's timestamps are per text
   response, and the fallback tokenizer of a dummy model decodes most ids to no text), read before and after the
   level: mean, and p50 / p90 interpolated in their buckets.
Writes OUT/v4_serving.json (one object per concurrency), OUT/v4_serving.csv and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench_results import write_csv  # noqa: E402
from scripts.bench_v4 import FLASH, fitting_layers, free_device_gib, pool_sizes  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags  # noqa: E402

HISTOGRAMS = {"ttft": "dsv4_time_to_first_token_seconds", "itl": "dsv4_inter_token_latency_seconds"}
NOT_READY = 4  # exit status: the server did not come up (its log says why)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser, checkpoint=str(FLASH))
    parser.set_defaults(load_format="dummy")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int, help="layers of the model (default: as many as fit the GPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--measurement-interval-ms", type=int, default=6000)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0, help="model load and start-up")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="another config.pbtxt parameter (repeatable)")
    parser.add_argument("--bundle", type=Path, help="serve from this .txz of scripts/pack_serving.sh (unpacked into "
                        "OUT/bundle): a machine without this checkout's venv")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "v4_serving")
    return parser.parse_args(argv)


# --- 1. can this machine serve ------------------------------------------------------------------------------------
def server_env(bundle: Path | None, out: Path) -> dict[str, str]:
    """scripts/env.sh's environment (what serve.sh and perf_analyzer.sh run under), read back from bash; with a
    bundle, its server and perf_analyzer (unpacked into OUT/bundle)."""
    given = {}
    if bundle is not None:
        unpacked = out / "bundle"
        unpacked.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xJf", str(bundle), "-C", str(unpacked)], check=True)
        _stub_for_this_python(unpacked)
        given = {"TRITON_HOME": str(unpacked / "tritonserver"), "PERF_ANALYZER": str(unpacked / "perf_analyzer")}
    env = subprocess.run(["bash", "-c", 'source "$1" && env -0', "bash", str(REPO / "scripts" / "env.sh")],
                         capture_output=True, check=True, env={**os.environ, **given}).stdout  # (a path with spaces)
    return dict(item.split("=", 1) for item in env.decode().split("\0") if "=" in item)


def _stub_for_this_python(unpacked: Path) -> None:
    """Put the backend stub built for python3's version (the bundle carries every one the wheel ships) in place."""
    version = subprocess.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    stub = unpacked / "stubs" / version / "triton_python_backend_stub"
    if stub.exists():  # else the packed one stays, and the check below names the mismatch
        shutil.copy2(stub, unpacked / "tritonserver" / "backends" / "python" / stub.name)


def missing_for_serving(env: dict[str, str]) -> list[str]:
    """What keeps this machine from serving: binaries, the shared libraries they load, the stub's Python."""
    backend = Path(env["TRITON_BACKEND_DIR"]) / "python"
    stub = backend / "triton_python_backend_stub"
    binaries = [Path(env["TRITON_BIN"]), stub, backend / "libtriton_python.so", Path(env["PERF_ANALYZER"])]
    problems = [f"{path} does not exist" for path in binaries if not path.exists()]
    for path in binaries:
        if path.exists():
            ldd = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env).stdout
            problems += [f"{path.name} needs {line.split()[0]}, not found (LD_LIBRARY_PATH: "
                         f"{env.get('LD_LIBRARY_PATH', '')})" for line in ldd.splitlines() if "not found" in line]
    if stub.exists():
        wanted = re.search(r"libpython(\d+\.\d+)", subprocess.run(["ldd", str(stub)], capture_output=True, text=True,
                                                                 env=env).stdout)
        found = subprocess.run(["python3", "-c", "import sys, numpy, torch, tokenizers, transformers; "
                                "print('%d.%d' % sys.version_info[:2], numpy.__version__)"],
                               capture_output=True, text=True, env=env)
        if found.returncode:
            problems.append(f"python3 on PATH cannot import what model.py needs: {found.stderr.strip()[-300:]}")
        elif wanted and found.stdout.split()[0] != wanted.group(1):
            problems.append(f"the backend stub embeds Python {wanted.group(1)}, python3 on PATH is "
                            f"{found.stdout.split()[0]}")
        elif int(found.stdout.split()[1].split(".")[0]) >= 2:
            problems.append(f"the backend stub needs numpy < 2, python3 has {found.stdout.split()[1]}")
    return problems


# --- 2. the served model ------------------------------------------------------------------------------------------
def repository_sets(args) -> dict[str, str]:
    """The config.pbtxt parameters: the dummy model cut to --layers, pools for the largest concurrency, and --set."""
    most, positions = max(args.concurrency), args.input_tokens + args.output_tokens
    overrides = dict(args.hf_overrides or {})
    if args.layers is None:
        import torch

        if args.device != "cuda" or not torch.cuda.is_available():
            raise SystemExit("--layers: the default fits a GPU's memory")
        memory = free_device_gib(other_processes=2)  # (tritonserver's and its Python stub's contexts)
        args.layers = fitting_layers(args.checkpoint, overrides, memory, most, positions)
    overrides["num_hidden_layers"] = args.layers
    sets = {"load_format": args.load_format, "device": args.device, "hf_overrides": json.dumps(overrides),
            "max_running_requests": str(most), **{k: str(v) for k, v in pool_sizes(most, positions).items()}}
    for item in args.sets:
        key, _, value = item.partition("=")
        sets[key.strip()] = value
    return sets


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


class Server:
    """scripts/serve.sh over a model repository on free ports, in its own process group (stopped with it)."""

    def __init__(self, repository: Path, log: Path, env: dict[str, str]):
        self.http, self.grpc, self.metrics = free_ports(3)
        self.log = log
        command = ["bash", str(REPO / "scripts" / "serve.sh"), "--model-repository", str(repository),
                   "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                   "--", f"--backend-config=python,shm-region-prefix-name=dsv4_v4_serving_{os.getpid()}_"]
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the server is ready and its metrics endpoint answers: tritonserver opens the metrics port after
        the HTTP one, so a ready HTTP endpoint alone does not say the histograms can be read yet."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if self._answers(f"http://127.0.0.1:{self.http}/v2/health/ready") and \
                    self._answers(f"http://127.0.0.1:{self.metrics}/metrics"):
                return True
            time.sleep(0.5)
        return False

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def lost_a_port(self) -> bool:
        """A port found free can be taken by another process before tritonserver binds it; it then exits."""
        return self.process.poll() is not None and "already in use" in self.log.read_text(errors="replace")

    def histograms(self) -> dict[str, dict]:
        """{kind: {"count", "sum", "buckets": [(le, cumulative count)]}} of the TTFT and ITL histograms."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = {}
        for kind, family in HISTOGRAMS.items():
            def value(suffix: str) -> float:
                match = re.search(rf"^{family}_{suffix}\{{[^}}]*\}} (\S+)$", text, re.M)
                return float(match.group(1)) if match else 0.0

            buckets = [(float(le), float(v)) for le, v in
                       re.findall(rf'^{family}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} (\S+)$', text, re.M)]
            out[kind] = {"count": value("count"), "sum": value("sum"), "buckets": sorted(buckets)}
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def start_server(args, env: dict[str, str], attempts: int = 3) -> tuple[Server, bool]:
    """A server on free ports, started again on new ones when it lost one of them at start-up; and whether it is
    ready."""
    for _ in range(attempts):
        server = Server(args.out / "repo", args.out / "server.log", env)
        ready = server.wait_ready(args.ready_timeout_s)
        if ready or not server.lost_a_port():
            break
        server.stop()
    return server, ready


# --- 3. the load and its latencies --------------------------------------------------------------------------------
def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a cumulative histogram, linear within its bucket (as Prometheus' histogram_quantile)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = le, cumulative
    return lower


def latency(before: dict, after: dict) -> dict:
    """Mean, p50 and p90 in ms of what a histogram observed between two readings."""
    count = after["count"] - before["count"]
    earlier = dict(before["buckets"])
    buckets = [(le, value - earlier.get(le, 0.0)) for le, value in after["buckets"]]

    def ms(seconds):
        return None if seconds is None else round(seconds * 1e3, 3)

    return {"count": int(count), "mean_ms": ms((after["sum"] - before["sum"]) / count if count else None),
            "p50_ms": ms(quantile(buckets, 0.5)), "p90_ms": ms(quantile(buckets, 0.9))}


def run_level(args, server: Server, tokenizer: Path, concurrency: int, env: dict[str, str]) -> dict:
    out = args.out / f"c{concurrency}"
    before = server.histograms()
    subprocess.run(["bash", str(REPO / "scripts" / "perf_analyzer.sh"), "--url", f"127.0.0.1:{server.grpc}",
                    "--concurrency", str(concurrency), "--input-tokens", str(args.input_tokens), "--output-tokens",
                    str(args.output_tokens), "--tokenizer", str(tokenizer), "--measurement-interval-ms",
                    str(args.measurement_interval_ms), "--out", str(out)], check=True, env=env)
    after = server.histograms()
    with open(out / "summary.csv") as f:
        perf = next(csv.DictReader(f))
    ttft, itl = latency(before["ttft"], after["ttft"]), latency(before["itl"], after["itl"])
    requests_per_s = float(perf["Inferences/Second"])
    return {"concurrency": concurrency, "input_tokens": args.input_tokens, "output_tokens": args.output_tokens,
            "layers": args.layers, "requests": ttft["count"], "requests_per_s": requests_per_s,
            "output_tokens_per_s": requests_per_s * args.output_tokens,
            **{f"ttft_{k}": v for k, v in ttft.items() if k != "count"},
            **{f"itl_{k}": v for k, v in itl.items() if k != "count"}}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'concurrency':>11} {'requests':>8} {'req/s':>7} {'tok/s':>8} | {'TTFT ms mean':>12} {'p50':>8} "
          f"{'p90':>8} | {'ITL ms mean':>11} {'p50':>7} {'p90':>7}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['requests']:>8} {r['requests_per_s']:7.2f} {r['output_tokens_per_s']:8.1f} | "
              f"{r['ttft_mean_ms']:12.2f} {r['ttft_p50_ms']:8.2f} {r['ttft_p90_ms']:8.2f} | {r['itl_mean_ms']:11.3f} "
              f"{r['itl_p50_ms']:7.3f} {r['itl_p90_ms']:7.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(server_env(args.bundle, args.out), DSV4_SKIP_SETUP="1")  # laid out (or not: the check below says)
    env.pop("TRITON_INTERPRET", None)
    problems = missing_for_serving(env)
    if problems:
        print("cannot serve on this machine:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 3
    from backend.config import EngineConfig
    from backend.engine import tokenizer_directory
    from scripts.make_model_repository import make_repository

    sets = repository_sets(args)
    print(f"serving {args.checkpoint} with {sets}", flush=True)
    make_repository(args.out / "repo", sets, args.checkpoint)
    tokenizer = tokenizer_directory(EngineConfig(checkpoint=args.checkpoint, load_format=args.load_format))
    server, ready = start_server(args, env)
    try:
        if not ready:
            print(f"tritonserver not ready (exit status {server.process.poll()}); the end of {server.log}:\n"
                  f"{server.log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
            return NOT_READY
        rows = [run_level(args, server, tokenizer / "tokenizer.json", c, env) for c in args.concurrency]
    finally:
        server.stop()
    print_table(rows)
    (args.out / "v4_serving.json").write_text(json.dumps(rows, indent=2))
    write_csv(args.out / "v4_serving.csv", rows)
    shutil.rmtree(args.out / "repo", ignore_errors=True)  # written again by the next run; the parameters are above
    print(f"wrote {args.out / 'v4_serving.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
