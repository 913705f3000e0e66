"""Every command in README.md and docs/*.md runs as written, or says why it is not run.

Each fenced block whose language is bash, sh, shell, console or python is a command. It is run unless the line
before its opening fence says otherwise, in an HTML comment (invisible once rendered):

    <!-- docs-test: skip (why) -->              not run; the reason is required
    <!-- docs-test: server KEY=VALUE ... -->    run against a server whose model has these parameters, as
                                                `bash scripts/serve.sh --set KEY=VALUE ...` serves it

A fenced block without a language marked `<!-- docs-test: output -->` is what the command block before it prints:
compared line by line, trailing spaces ignored. `<!-- docs-test: output contains -->`: its lines appear in what the
command prints, in order.

Commands that name 127.0.0.1 or localhost on port 8000, 8001 or 8002 run against a tritonserver this test starts
on free ports over the repository serve.sh would serve (model_repository/, or a copy with the marker's parameters
written by scripts/make_model_repository.py, as `serve.sh --set` writes one), one server per page and set of
parameters, with those ports put in place of the documented ones. `/tmp/` becomes a directory of this test's own.
Everything runs from the repository root, bash blocks under `bash -e -o pipefail`, Python blocks with
`.venv/bin/python`, with the venv left off PATH as in a new shell: a command that needs a bare `python` with torch
fails here as it would for a reader.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .triton_helpers import REPO_ROOT, TritonServer

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
COMMAND_LANGUAGES = {"bash", "sh", "shell", "console", "python", "py"}
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
SERVER_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):(?P<port>800[012])\b")
COMMAND_TIMEOUT_S = 180
# Commands never run here, whatever the docs say: a server would take the documented ports (which other servers on
# the machine may hold) and serve until stopped (this test serves the same repository on free ports instead); test.sh
# is the whole suite, this test included. Their blocks must be marked skip; checked before anything runs.
MUST_NOT_RUN = re.compile(r"(?m)^[^#\n]*(?:scripts/serve\.sh|scripts/serve_node\.py|scripts/test\.sh|"
                          r"\btritonserver\s+--|genai-perf)")
VENV_PYTHON = ".venv/bin/python"


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str | None  # the docs-test comment's body, if any
    expected: str | None = None  # the output block's text
    expected_contains: bool = False

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        if self.marker and self.marker.startswith("skip"):
            return re.fullmatch(r"skip\s*\((?P<why>.+)\)", self.marker)["why"]
        return None

    @property
    def server_sets(self) -> tuple[str, ...]:
        if self.marker and self.marker.startswith("server"):
            return tuple(sorted(self.marker.split()[1:]))
        return ()

    @property
    def needs_server(self) -> bool:
        return bool(SERVER_ADDRESS.search(self.text))


@dataclass
class Page:
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def parse(page: Path) -> Page:
    """The command blocks of a page, their markers and expected outputs, and whatever in the markers is wrong."""
    lines = page.read_text().splitlines()
    out = Page()
    name = page.relative_to(REPO_ROOT)
    last_command: Block | None = None
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        if end == len(lines):
            out.problems.append(f"{name}:{i + 1}: a fence that is never closed")
            break
        indent = len(fence["indent"])
        text = "\n".join(line[indent:] for line in lines[i + 1:end])
        marker_match = MARKER.match(lines[i - 1]) if i > 0 else None
        marker = marker_match["body"] if marker_match else None
        if marker_match:
            used_markers.add(i - 1)
        lang = fence["lang"].lower()
        where = f"{name}:{i + 1}"
        if lang in COMMAND_LANGUAGES:
            block = Block(page, i + 1, lang, text, marker)
            if marker is not None and not (re.fullmatch(r"skip\s*\(.+\)", marker) or
                                           re.fullmatch(r"server(\s+[\w.]+=\S+)+", marker)):
                out.problems.append(f"{where}: unknown docs-test marker {marker!r} (skip (why), server KEY=VALUE ...)")
            out.blocks.append(block)
            last_command = block
        elif marker is not None:
            if marker not in ("output", "output contains"):
                out.problems.append(f"{where}: a block without a command language takes only an output marker")
            elif last_command is None or last_command.skip_reason is not None or last_command.expected is not None:
                out.problems.append(f"{where}: an output block must follow a command block that runs")
            else:
                last_command.expected = text
                last_command.expected_contains = marker == "output contains"
        i = end + 1
    for number, line in enumerate(lines):
        if MARKER.match(line) and number not in used_markers:
            out.problems.append(f"{name}:{number + 1}: a docs-test marker not on the line before a fenced block")
    return out


PARSED = {page: parse(page) for page in PAGES}
BLOCKS = [block for parsed in PARSED.values() for block in parsed.blocks]


def test_every_marker_is_understood():
    problems = [problem for parsed in PARSED.values() for problem in parsed.problems]
    assert not problems, "\n".join(problems)


def test_server_commands_are_marked():
    """serve.sh, serve_node.py, tritonserver itself and test.sh never run here (MUST_NOT_RUN): their blocks say why."""
    unmarked = [block.where for block in BLOCKS if block.skip_reason is None and MUST_NOT_RUN.search(block.text)]
    assert not unmarked, f"blocks that start a server must be marked `<!-- docs-test: skip (why) -->`: {unmarked}"


def test_commands_use_the_venv_interpreter():
    """One convention: `.venv/bin/python scripts/...`, never a bare `python` (which has no torch on a new machine)."""
    bare = re.compile(r"(?<![\w./-])python3?(?= scripts/| -m | -c |\s*$| -\s*$)")
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in bare.finditer(line):
                if "/opt/tritonserver" in line or FENCE.match(line):  # the OpenAI frontend's own interpreter; a fence
                    continue
                found.append(f"{page.relative_to(REPO_ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "use .venv/bin/python:\n" + "\n".join(found)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    in_fence = False
    for line in page.read_text().splitlines():
        if FENCE.match(line) or re.match(r"^\s*```\s*$", line):
            in_fence = not in_fence
        elif not in_fence and (heading := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            found.add(re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-"))
    return found


def test_links_resolve():
    """Every relative link of the docs names a file that exists, and an anchor its page has."""
    broken = []
    for page in PAGES:
        text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def reader_env(tmp: Path) -> dict[str, str]:
    """A new shell's environment: neither the venv nor tritonserver on PATH, none of what scripts/env.sh exports."""
    env = dict(os.environ)
    ours = {os.path.realpath(p) for p in (REPO_ROOT / ".venv" / "bin", Path(sys.executable).parent,
                                          REPO_ROOT / "build" / "tritonserver" / "bin")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) not in ours)
    for key in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH", "LD_LIBRARY_PATH", "TRITON_INTERPRET", "DSV4_REPO_ROOT",
                "DSV4_VENV", "DSV4_SITE_PACKAGES", "DSV4_PYTHON_LIBDIR", "TRITON_HOME", "TRITON_BIN",
                "TRITON_BACKEND_DIR", "PERF_LIB_DIR", "PERF_ANALYZER"):
        env.pop(key, None)
    env["TMPDIR"] = str(tmp)
    env["DSV4_SKIP_SETUP"] = "1"  # the set-up has run (the reader ran one of the two commands): no script redoes it
    return env


def test_sourcing_env_sh_lets_a_reader_run_the_servers_tools_by_hand(tmp_path):
    """What README.md and docs/serving.md say `source scripts/env.sh` gives a new shell: tritonserver, perf_analyzer
    and the venv's python on PATH, and the backend directory tritonserver needs to be told."""
    script = 'source scripts/env.sh && command -v tritonserver perf_analyzer python && echo "$TRITON_BACKEND_DIR"'
    run = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=reader_env(tmp_path), capture_output=True,
                         text=True, timeout=60)
    expected = ["build/tritonserver/bin/tritonserver", ".venv/bin/perf_analyzer", ".venv/bin/python",
                "build/tritonserver/backends"]
    assert run.stdout.split() == [str(REPO_ROOT / path) for path in expected], run
    assert (REPO_ROOT / "build/tritonserver/backends/python").is_dir()


class Servers:
    """One tritonserver per page and set of parameters, started when a block needs it; a page's servers are stopped
    when the blocks of another page begin, and all of them at the end."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.running: dict[tuple[Path, tuple[str, ...]], TritonServer] = {}
        self.stopped: list[TritonServer] = []

    def get(self, page: Path, sets: tuple[str, ...]) -> TritonServer:
        for key in [key for key in self.running if key[0] != page]:
            self._stop(key)
        key = (page, sets)
        if key not in self.running:
            where = self.tmp / f"server{len(self.running) + len(self.stopped)}"
            where.mkdir()
            repository = REPO_ROOT / "model_repository"  # what `bash scripts/serve.sh` serves
            if sets:  # what `bash scripts/serve.sh --set ...` serves (it writes the copy to build/model_repository)
                command = [sys.executable, str(REPO_ROOT / "scripts" / "make_model_repository.py"),
                           "--out", str(where / "repo")]
                for item in sets:
                    command += ["--set", item]
                subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO_ROOT)
                repository = where / "repo"
            self.running[key] = TritonServer(repository, where / "tritonserver.log").start()
        return self.running[key]

    def _stop(self, key) -> None:
        server = self.running.pop(key)
        server.stop()
        self.stopped.append(server)

    def close(self) -> list[str]:
        for key in list(self.running):
            self._stop(key)
        return [f"{server.log_path}: {problem}" for server in self.stopped for problem in server.unclean_stop()]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    servers = Servers(tmp_path_factory.mktemp("docs_servers"))
    yield servers
    problems = servers.close()
    assert not problems, "a server did not stop cleanly:\n" + "\n".join(problems)


def localize(text: str, server: TritonServer | None, tmp: Path) -> str:
    if server is not None:
        ports = {"8000": server.http_port, "8001": server.grpc_port, "8002": server.metrics_port}
        text = SERVER_ADDRESS.sub(lambda m: f"127.0.0.1:{ports[m['port']]}", text)
    return text.replace("/tmp/", f"{tmp}/")


def normalized(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_documented_command(block: Block, servers: Servers, tmp_path: Path):
    if block.skip_reason is not None:
        pytest.skip(f"marked in the docs: {block.skip_reason}")
    if MUST_NOT_RUN.search(block.text):
        pytest.fail(f"{block.where} starts a server or the suite: not run (test_server_commands_are_marked)")
    server = servers.get(block.page, block.server_sets) if block.needs_server or block.server_sets else None
    if server is not None and re.search(r":8002\b", block.text):
        time.sleep(0.5)  # the engine's metrics are refreshed every 100 ms
    text = localize(block.text, server, tmp_path)
    if block.lang in ("python", "py"):
        command = [VENV_PYTHON, "-c", text]
    elif block.lang == "console":  # `$ command` lines; the rest is what they print
        command = ["bash", "-e", "-o", "pipefail", "-c",
                   "\n".join(line[2:] for line in text.splitlines() if line.startswith("$ "))]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", text]
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=reader_env(tmp_path), capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: still running after {COMMAND_TIMEOUT_S} s:\n{text}")
    report = f"{block.where}:\n{text}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    if server is not None:
        report += f"\n--- tritonserver log\n{server.log_tail(3000)}"
    assert done.returncode == 0, f"exit status {done.returncode}: {report}"
    if block.expected is None:
        return
    expected = normalized(localize(block.expected, server, tmp_path))
    actual = normalized(done.stdout)
    if block.expected_contains:
        remaining = iter(actual)
        missing = [line for line in expected if line and not any(line == got for got in remaining)]
        assert not missing, f"not printed (in this order): {missing}\n{report}"
    else:
        assert actual == expected, "the output differs from the docs:\n" + "\n".join(
            f"  doc: {e!r}\n  got: {a!r}" for e, a in zip(expected + [""] * len(actual), actual + [""] * len(expected))
            if e != a)[:4000] + f"\n{report}"
