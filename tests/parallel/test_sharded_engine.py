"""Tensor and expert parallelism with real processes over gloo (CPU, fp32): the sharded engine against one rank.

Rank 0 is the engine in this process; ranks 1.. are the worker processes it spawns (backend/parallel/group.py).
Both engines get the same ragged steps (prefill chunks of different lengths beside decodes, across CSA and HCA
boundaries); logits must agree within 1e-5 at every step. scripts/generate.py --tensor-parallel-size 2 must
give the single rank's greedy tokens for prompts of 1 to 600 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.request import SamplingParams, Sequence
from backend.runner import Forward
from tests.e2e.triton_helpers import free_ports

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (1, 37, 150, 300)
CHUNK = 64


def _engine(checkpoint, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(checkpoint=str(checkpoint), device="cpu", num_tokens=8192, page_size=16,
                                  swa_full_tokens_ratio=0.5, **settings))


def _steps(prompts):
    """Per step, (request, tokens) pairs: prompts in chunks of CHUNK, finished prompts decoding, then 3 decodes."""
    done = [0] * len(prompts)
    steps = []
    while any(d < len(p) for d, p in zip(done, prompts)):
        step = [(r, min(CHUNK, len(p) - done[r]) if done[r] < len(p) else 1) for r, p in enumerate(prompts)]
        for r, n in step:
            done[r] += n
        steps.append(step)
    return steps + [[(r, 1) for r in range(len(prompts))]] * 3


class _Driver:
    """Runs `steps` through one engine's model (its rank group when sharded), greedy tokens appended."""

    def __init__(self, engine: LLMEngine, prompts):
        self.engine = engine
        self.seqs = [Sequence(f"r{i}", list(p)) for i, p in enumerate(prompts)]

    def step(self, work) -> torch.Tensor:
        engine, rows = self.engine, []
        for r, n in work:
            seq = self.seqs[r]
            engine.kv.extend(seq, n)
            start = seq.num_computed_tokens
            ids = seq.token_ids[start:start + n]
            rows.append(BatchRow(seq.pages, ids, start, start + n >= len(seq.prompt_ids)))
        batch = build_forward_batch(rows, engine.kv, "cpu")
        logits, _ = engine.runner.forward(Forward(batch))  # (a group's: every rank runs it)
        sampled = iter(logits.argmax(-1).tolist())
        for (r, n), row in zip(work, rows):
            seq = self.seqs[r]
            seq.num_computed_tokens += n
            engine.kv.release_slid_out(seq)
            if row.want_logits:
                seq.append_output(next(sampled))
        return logits


@pytest.fixture(scope="module")
def single(parallel_checkpoint):
    return _engine(parallel_checkpoint)


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2), (4, 4), (4, 1)])
def test_sharded_logits_equal_one_rank_on_ragged_steps(parallel_checkpoint, single, tp, ep):
    gen = torch.Generator().manual_seed(tp * 10 + ep)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    sharded = _engine(parallel_checkpoint, tensor_parallel_size=tp, expert_parallel_size=ep)
    try:
        one, many = _Driver(single, prompts), _Driver(sharded, prompts)
        for work in _steps(prompts):
            expected, actual = one.step(work), many.step(work)
            assert actual.shape == expected.shape
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        assert [s.output_ids for s in many.seqs] == [s.output_ids for s in one.seqs]
        for seq in one.seqs:
            single.kv.free(seq)
        single.kv.check()
    finally:
        sharded.shutdown()
    assert not _workers(), "a worker outlived the engine"


def _workers() -> list:
    """This process's children but multiprocessing's resource tracker (it lives as long as the parent)."""
    return [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


def test_published_checkpoint_shards_like_the_single_rank(parallel_checkpoint_published):
    """DeepSeek's layout, FP8 linears and MXFP4 experts, dequantized per rank: TP=2 + EP=2 equals one rank."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (3, 140)]
    single, sharded = _engine(parallel_checkpoint_published), _engine(parallel_checkpoint_published,
                                                                      tensor_parallel_size=2, expert_parallel_size=2)
    try:
        one, many = _Driver(single, prompts), _Driver(sharded, prompts)
        for work in _steps(prompts):
            torch.testing.assert_close(many.step(work), one.step(work), rtol=0, atol=1e-5)
    finally:
        sharded.shutdown()


def _generate(checkpoint, ids_file, *extra, prefix=()):
    """scripts/generate.py's greedy tokens for the prompts in ids_file (prefix: a command that runs it)."""
    result = subprocess.run([*prefix, sys.executable, str(REPO / "scripts" / "generate.py"), "--checkpoint",
                             str(checkpoint), "--input-ids-file", str(ids_file), "--max-tokens", "8",
                             "--device", "cpu", "--ignore-eos", *extra], capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["output_ids"] for r in json.loads(result.stdout)]


def _prompts_file(tmp_path, lengths) -> Path:
    gen = torch.Generator().manual_seed(1)
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps([torch.randint(2, 500, (n,), generator=gen).tolist() for n in lengths]))
    return ids_file


def test_generate_script_with_two_ranks_gives_the_single_rank_tokens(parallel_checkpoint, tmp_path):
    ids_file = _prompts_file(tmp_path, (1, 2, 33, 128, 129, 300, 600))
    assert _generate(parallel_checkpoint, ids_file, "--tensor-parallel-size", "2") == _generate(
        parallel_checkpoint, ids_file)


def _pid_namespace_prefix() -> list[str]:
    """A command that runs the next one as PID 1 of a new PID namespace (as a container's entrypoint), or skips."""
    prefix = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    try:
        probe = subprocess.run([*prefix, "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare(1) on this machine")
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.skip(f"this machine refuses a user PID namespace: {probe.stderr.strip()[-200:]}")
    return prefix


def test_ranks_start_when_rank_0_is_pid_1(parallel_checkpoint, tmp_path):
    """In a container, the process that spawns the worker ranks may be PID 1. A worker that checks whether its parent
    went (reparenting makes its parent PID 1) must not take that for gone."""
    prefix = _pid_namespace_prefix()
    ids_file = _prompts_file(tmp_path, (3, 70))
    two_ranks = ("--tensor-parallel-size", "2")
    assert _generate(parallel_checkpoint, ids_file, *two_ranks, prefix=prefix) == _generate(
        parallel_checkpoint, ids_file, *two_ranks)


def test_two_nodes_on_loopback(parallel_checkpoint, monkeypatch):
    """Multi-node through env:// (MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK): this process is node 0 (rank 0),
    scripts/serve_node.py is node 1 (rank 1); the greedy tokens are the single rank's and node 1 exits cleanly
    when the engine shuts down."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), NNODES="2")
    settings = dict(tensor_parallel_size=2, expert_parallel_size=2)
    sets = [f"checkpoint={parallel_checkpoint}", "device=cpu", "num_tokens=8192", "page_size=16",
            "swa_full_tokens_ratio=0.5", *(f"{k}={v}" for k, v in settings.items())]
    node1 = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_node.py"),
                              *(a for s in sets for a in ("--set", s))], env={**os.environ, **env, "NODE_RANK": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for key, value in {**env, "NODE_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        engine = _engine(parallel_checkpoint, **settings)
        monkeypatch.delenv("MASTER_ADDR")  # the single-rank engine below needs no group
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (5, 90)]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        try:
            got = [r["output_ids"] for r in engine.generate(prompts, params)]
        finally:
            engine.shutdown()
        expected = [r["output_ids"] for r in _engine(parallel_checkpoint).generate(prompts, params)]
        assert got == expected
        assert node1.wait(timeout=60) == 0, node1.stdout.read()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_another_node_given_other_settings_is_refused_naming_them(parallel_checkpoint, monkeypatch):
    """Another node builds its ranks' settings from its own --set flags: one given another page_size would build
    other pools (wrong logits, or a crash mid-step). Rank 0 refuses the group at start, naming the setting, and
    the other node's ranks end."""
    from backend.errors import ConfigError

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), NNODES="2")
    sets = [f"checkpoint={parallel_checkpoint}", "device=cpu", "num_tokens=8192", "page_size=32",
            "swa_full_tokens_ratio=0.5", "tensor_parallel_size=2"]
    node1 = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_node.py"),
                              *(a for s in sets for a in ("--set", s))], env={**os.environ, **env, "NODE_RANK": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for key, value in {**env, "NODE_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(ConfigError, match="rank 1 has page_size=32 where rank 0 has 16"):
            _engine(parallel_checkpoint, tensor_parallel_size=2, collective_timeout_s=60)
        assert node1.wait(timeout=60) != 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_data_parallel_rank_on_another_node_that_dies_fails_its_requests_at_once(parallel_checkpoint, monkeypatch):
    """DP=2 over two nodes on loopback (no expert parallelism: the ranks meet in no collective), node 1 killed while
    its rank decodes a request: rank 0 sees the rank's connection drop and ends every request with the reason in
    seconds, not after collective_timeout_s (10 minutes by default); later requests are refused."""
    import signal

    from backend.request import EngineUnavailable

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), NNODES="2")
    sets = [f"checkpoint={parallel_checkpoint}", "device=cpu", "num_tokens=8192", "page_size=16",
            "swa_full_tokens_ratio=0.5", "data_parallel_size=2"]
    node1 = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_node.py"),
                              *(a for s in sets for a in ("--set", s))], env={**os.environ, **env, "NODE_RANK": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for key, value in {**env, "NODE_RANK": "0"}.items():
            monkeypatch.setenv(key, value)
        engine = _engine(parallel_checkpoint, data_parallel_size=2)
        outputs = {}
        try:
            for i in range(2):
                engine.submit(Sequence(f"r{i}", list(range(2, 30 + i)), SamplingParams(max_tokens=5000,
                                                                                      ignore_eos=True)),
                              lambda out: outputs.setdefault(out.request_id, []).append(out))
            remote = next(f"r{i}" for i in range(2) if engine.rank_of(f"r{i}") == 1)
            deadline = time.monotonic() + 60
            while len(outputs.get(remote, [])) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            os.killpg(node1.pid, signal.SIGKILL)
            killed = time.monotonic()
            while not (outputs[remote][-1].finished or time.monotonic() - killed > 30):
                time.sleep(0.01)
            assert time.monotonic() - killed < 10
            end = outputs[remote][-1]
            assert end.finished and end.finish_reason.value == "error" and "rank 1 is gone" in end.error, end
            with pytest.raises(EngineUnavailable, match="rank 1 is gone"):
                engine.submit(Sequence("later", [1, 2]), lambda out: None)
        finally:
            engine.shutdown()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()


def test_a_silent_worker_times_out_the_step_instead_of_hanging(parallel_checkpoint):
    """A worker that stops answering (SIGSTOP: alive, silent) fails the in-flight requests after
    collective_timeout_s, and the engine refuses what comes next, naming the cause."""
    import signal

    from backend.request import EngineUnavailable

    engine = _engine(parallel_checkpoint, tensor_parallel_size=2, collective_timeout_s=3)
    (worker,) = _workers()
    try:
        worker.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        (result,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert result["finish_reason"] == "error" and "parallel group failed" in result["error"], result
        assert time.monotonic() - started < 30
        with pytest.raises(EngineUnavailable, match="cannot serve"):
            engine.submit(Sequence("later", [1, 2]), lambda out: None)
    finally:
        worker.kill()
        engine.shutdown()
    assert not _workers()


def test_an_idle_group_outlives_the_collective_timeout(parallel_checkpoint):
    """No request for longer than collective_timeout_s: the workers, waiting for rank 0's next step, are still there
    and serve the next request (an idle server is not a silent collective)."""
    engine = _engine(parallel_checkpoint, tensor_parallel_size=2, collective_timeout_s=3)
    try:
        (first,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        time.sleep(6)
        (after,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert after["finish_reason"] == "length" and after["output_ids"] == first["output_ids"], after
    finally:
        engine.shutdown()
    assert not _workers()


def test_a_stop_a_silent_worker_does_not_take_stays_within_its_budget(parallel_checkpoint):
    """shutdown(timeout) with a worker stopped while idle (SIGSTOP: it reads no Stop): the Stop gets the time left,
    then the worker is ended (SIGTERM waits on a stopped process: SIGKILL), not after collective_timeout_s."""
    import signal

    engine = _engine(parallel_checkpoint, tensor_parallel_size=2, collective_timeout_s=60)
    (worker,) = _workers()
    worker.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    engine.shutdown(timeout=3)
    assert time.monotonic() - started < 15
    assert not _workers()


@pytest.mark.parametrize("failing", ["load_model", "make_runner"])  # (its shard; its graphs, after the workers' ready)
def test_rank_0_failing_to_start_takes_its_workers_and_the_process_group_with_it(parallel_checkpoint, monkeypatch,
                                                                                 failing):
    import torch.distributed as dist

    import backend.engine

    def broken(*args, **kwargs):
        raise RuntimeError("rank 0's shard is unreadable")

    with monkeypatch.context() as patch:
        patch.setattr(backend.engine, failing, broken)
        with pytest.raises(RuntimeError, match="unreadable"):
            _engine(parallel_checkpoint, tensor_parallel_size=2)
    assert not _workers() and not dist.is_initialized()
    engine = _engine(parallel_checkpoint, tensor_parallel_size=2)  # (a new group starts in this process)
    try:
        (result,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert result["finish_reason"] == "length"
    finally:
        engine.shutdown()


def test_deepseeks_numerics_and_the_fp8_cache_shard_like_the_single_rank(deepseek_published_checkpoint):
    """numerics=auto on DeepSeek's published layout (its numerics, the fp8 KV layout in every rank's pools) with
    EP=2: each rank's experts, then the routed sums all-reduced; the same logits as one rank."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (3, 140)]
    single = _engine(deepseek_published_checkpoint)
    sharded = _engine(deepseek_published_checkpoint, expert_parallel_size=2)
    try:
        assert single.kv.kv_layout.fp8 and sharded.kv.kv_layout.fp8 and sharded.model.numerics.name == "deepseek"
        one, many = _Driver(single, prompts), _Driver(sharded, prompts)
        for work in _steps(prompts):
            torch.testing.assert_close(many.step(work), one.step(work), rtol=0, atol=1e-5)
    finally:
        sharded.shutdown()


@pytest.mark.parametrize("tp, ep, cuda_graphs, adaptive", [(2, 1, False, False), (1, 2, False, False),
                                                       (2, 1, True, False), (2, 1, True, True)])
def test_speculative_decoding_shards_like_the_single_rank(parallel_checkpoint, monkeypatch, tp, ep, cuda_graphs,
                                                          adaptive):
    """Speculative decoding with two ranks (every rank runs the verify forward and each draft pass, rank 0 draws):
    with k = 2 and drafts that are partly right, the greedy tokens are the single rank's without speculation. With
    cuda_graphs (static steps, eagerly on CPU) the draft passes after a static verify step are one static chain on
    every rank (the workers run the DraftChain rank 0 sends). With adaptive_speculation, rank 0's gate made to change
    mode every third step: the workers follow plain steps, verifies that stop drafting and plain steps that start."""
    from backend.engine_core import SpeculationGate
    from tests.engine.test_speculative import OracleDrafter

    decisions = iter(range(10 ** 6))
    monkeypatch.setattr(SpeculationGate, "drafts", lambda gate, num_rows: next(decisions) // 3 % 2 == 0)

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (5, 140)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    single = _engine(parallel_checkpoint)
    expected = [r["output_ids"] for r in single.generate(prompts, params)]
    sharded = _engine(parallel_checkpoint, num_speculative_tokens=2, tensor_parallel_size=tp, expert_parallel_size=ep,
                      cuda_graphs=cuda_graphs, adaptive_speculation=adaptive)
    try:
        executor = sharded.executor
        executor.drafter = OracleDrafter(executor.drafter, dict(enumerate(expected)), 0.3, sharded.vocab_size,
                                         dict(enumerate(map(len, prompts))))
        assert [r["output_ids"] for r in sharded.generate(prompts, params)] == expected
        assert sharded.stats()["num_accepted_tokens"] > 0
        assert bool(cuda_graphs) == bool(sharded.core.runner.draft_chains and sharded.core.runner.draft_chains.keys)
        decodes = [r for r in sharded.scheduler.records if not r.num_prefill_tokens]
        assert adaptive == any(not r.num_verifies for r in decodes)  # (plain steps only where the gate chose them)
    finally:
        sharded.shutdown()


def test_worker_ranks_build_their_dummy_shards_from_the_overridden_config(parallel_checkpoint, tmp_path):
    """generate.py's --load-format dummy and --hf-overrides reach the worker processes: each rank plans the
    overridden config and builds its own random shard (a rank that read the 4-layer config, or looked for weight
    files in a directory holding only config.json, would fail the step)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text((parallel_checkpoint / "config.json").read_text())
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps([[5, 6, 7], list(range(2, 140))]))
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), "--checkpoint",
                             str(tmp_path / "model"), "--load-format", "dummy", "--hf-overrides",
                             '{"num_hidden_layers": 3}', "--input-ids-file", str(ids_file), "--max-tokens", "6",
                             "--device", "cpu", "--ignore-eos", "--tensor-parallel-size", "2",
                             "--expert-parallel-size", "2"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [len(r["output_ids"]) for r in json.loads(result.stdout)] == [6, 6]


def _fails_before_joining(index, spec, first_rank):
    """A worker's main (spawned: this module's function, by name) whose rank fails before it joins the group, as a
    CUDA device it cannot set or an import that fails would."""
    raise RuntimeError("no such device on this rank")


def _fails_while_loading(index, spec, first_rank):
    from backend.errors import ConfigError
    from backend.parallel.group import join

    join(spec, first_rank + index)
    raise ConfigError("parameter 'num_tokens': too few for this rank's pools")


@pytest.mark.parametrize("main,stage", [(_fails_before_joining, "before joining"),
                                        (_fails_while_loading, "while loading")])
def test_a_worker_that_fails_to_start_fails_rank_0_at_once_saying_why(parallel_checkpoint, main, stage):
    """A worker that failed before it joined left rank 0 in the rendezvous until collective_timeout_s (10 minutes by
    default), and one that failed while loading its shard was reported as "Connection closed by peer": rank 0 now
    knows at once, with the worker's own error, and leaves no worker and none of its error files behind."""
    import tempfile

    import torch.distributed as dist

    from backend.model.comm import RankGroupError
    from backend.model.parallel_layout import ParallelLayout
    from backend.parallel.group import RankGroup

    config = EngineConfig(checkpoint=str(parallel_checkpoint), device="cpu", tensor_parallel_size=2,
                          collective_timeout_s=120)
    error_files = set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*"))
    started = time.monotonic()
    with pytest.raises(RankGroupError, match=f"{stage}.*rank 1 .*(no such device|'num_tokens': too few)"):
        RankGroup.start(config, ParallelLayout.from_config(config), main).wait_ready()
    assert time.monotonic() - started < 60
    assert not _workers() and not dist.is_initialized()
    assert set(Path(tempfile.gettempdir()).glob("pytorch-errorfile-*")) <= error_files


def test_a_master_addr_set_for_something_else_leaves_one_node_on_its_own_store(parallel_checkpoint, monkeypatch):
    """A MASTER_ADDR in the environment (a cluster's pod or job sets one for its own use) moved a one-node group to
    env://, which then wanted a MASTER_PORT, or met another model's group at it. Only NNODES > 1 means several."""
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # (TEST-NET-1: nothing answers there)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    engine = _engine(parallel_checkpoint, tensor_parallel_size=2, collective_timeout_s=60)
    try:
        assert engine.group.spec.init_method.startswith("tcp://127.0.0.1:")
        (result,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert result["finish_reason"] == "length"
    finally:
        engine.shutdown()
