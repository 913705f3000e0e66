"""Data-parallel attention with real processes over gloo (CPU, fp32): each rank its own requests and pools.

The forward (the first tests): rank 0 is this process (its model and pools as the engine builds them); ranks 1.. are worker processes
(backend/parallel/group.py). Requests of different lengths are spread unevenly over the ranks and prefilled in
chunks beside the decodes of those that finished, so ranks run different batches in every step, some no batch at
all (their MoE exchange alone), across CSA and HCA boundaries. The reference is one rank running every rank's rows
in one batch: logits within 1e-5, the same greedy tokens.

The engine (the later tests): requests placed on the ranks by load, each rank's scheduler planning its own steps,
against the single-rank engine's greedy tokens; preemption, the prefix cache, cancellation and deadlines per rank; the
step log's rank; a killed worker.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from backend.config import ConfigError, EngineConfig
from backend.deployment import load_model, plan_deployment
from backend.engine import LLMEngine
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.model.parallel_layout import ParallelLayout
from backend.request import EngineUnavailable, SamplingParams, Sequence
from backend.runner import Forward, ModelRunner
from tests.engine import endings

CHUNK = 64
POOLS = dict(device="cpu", num_tokens=8192, page_size=16, swa_full_tokens_ratio=0.5)


class _DataParallelRanks:
    """Data-parallel ranks' forwards alone: rank 0 is this process (its model and pools as the engine builds them),
    ranks 1.. are processes that run the batches sent them on their own runner; every rank's page bookkeeping is kept
    here (the pools of ranks 1.. live in their processes; here they are planned on the meta device, pages without
    memory). Each step every rank gets its batch (or none: its part of the MoE exchanges alone) and every rank's
    token counts, as the engines' lock-step agreement gives them."""

    def __init__(self, checkpoint, dp: int, ep: int):
        import torch.multiprocessing as mp

        from backend.parallel.group import local_store

        self.config = EngineConfig(checkpoint=str(checkpoint), data_parallel_size=dp, expert_parallel_size=ep,
                                   **POOLS)
        context = mp.get_context("spawn")
        store = local_store(dp, timeout_s=120)
        self.inboxes = [context.Queue() for _ in range(1, dp)]
        self.outbox = context.Queue()
        self.workers = [context.Process(target=_forward_worker,
                                        args=(self.config, rank, store.port, inbox, self.outbox), daemon=True)
                        for rank, inbox in enumerate(self.inboxes, start=1)]
        for worker in self.workers:
            worker.start()
        self.runner, pools = _join_as(self.config, 0, store.port, store)
        self.kv = [pools] + [plan_deployment(self.config, "meta", self.config.resolved_dtype()).kv
                             for _ in range(1, dp)]

    def forward(self, rows_per_rank: list[list[BatchRow]]) -> list:
        batches = [build_forward_batch(rows, kv) if rows else None for rows, kv in zip(rows_per_rank, self.kv)]
        counts = tuple(b.num_tokens if b is not None else 0 for b in batches)
        for inbox, batch in zip(self.inboxes, batches[1:]):
            inbox.put((batch, counts))
        own = self.runner.forward(Forward(batches[0], dp_token_counts=counts))[0]
        theirs = dict(self.outbox.get(timeout=120) for _ in self.inboxes)
        return [own] + [theirs[rank] for rank in range(1, len(batches))]

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for worker in self.workers:
            worker.join(30)
        torch.distributed.destroy_process_group()


def _join_as(config, rank: int, store_port: int, store=None):
    """Join the gloo group as `rank` (rank 0 with its store), load that rank's shard: its runner and pools."""
    import torch.distributed as dist

    from backend.model.comm import DistributedCommunicator
    from backend.parallel.group import store_client

    store = store or store_client(store_port, config.world_size, timeout_s=120)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=config.world_size)
    deployment = plan_deployment(config, "cpu", config.resolved_dtype())
    model = load_model(config, deployment, "cpu", config.resolved_dtype(), ParallelLayout.from_config(config, rank),
                       DistributedCommunicator())
    return ModelRunner(model, deployment.kv), deployment.kv


def _forward_worker(config, rank: int, store_port: int, inbox, outbox) -> None:
    torch.set_num_threads(1)
    runner, _ = _join_as(config, rank, store_port)
    while (work := inbox.get()) is not None:
        batch, counts = work
        logits = runner.forward(Forward(batch, dp_token_counts=counts))[0]
        outbox.put((rank, logits))
    torch.distributed.destroy_process_group()


def _work(prompt_lengths):
    """Each request's chunks: its prompt in chunks of CHUNK, then 3 decodes."""
    return [[min(CHUNK, n - done) for done in range(0, n, CHUNK)] + [1, 1, 1] for n in prompt_lengths]


def _run(ranks: _DataParallelRanks, single: LLMEngine, prompts_per_rank: list[list[list[int]]]):
    """Step every rank's requests (a request's next chunk each step, while it has one) through the data-parallel
    group and, all in one batch, through `single`; compare each rank's logits with the reference's rows."""
    seqs = [[Sequence(f"r{r}.{i}", list(p)) for i, p in enumerate(prompts)] for r, prompts in enumerate(prompts_per_rank)]
    refs = [[Sequence(s.request_id, list(s.prompt_ids)) for s in rank] for rank in seqs]
    work = [_work([len(p) for p in prompts]) for prompts in prompts_per_rank]
    steps = max(len(w) for rank in work for w in rank)
    idle_steps = 0
    for step in range(steps):
        rows, ref_rows, stepped = [], [], []
        for r, rank in enumerate(seqs):
            rank_rows = []
            for i, seq in enumerate(rank):
                if step >= len(work[r][i]):
                    continue
                n = work[r][i][step]
                rank_rows.append(_row(ranks.kv[r], seq, n))
                ref_rows.append(_row(single.kv, refs[r][i], n))
                stepped.append((r, i, n))
            rows.append(rank_rows)
        idle_steps += sum(not rank_rows for rank_rows in rows)
        logits = ranks.forward(rows)
        expected = single.model.forward(build_forward_batch(ref_rows, single.kv), single.kv)
        actual = torch.cat([part for part in logits if part is not None])
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        sampled = iter(actual.argmax(-1).tolist())
        ref_sampled = iter(expected.argmax(-1).tolist())
        for (r, i, n), row in zip(stepped, [row for rank_rows in rows for row in rank_rows]):
            for seq, kv, token in ((seqs[r][i], ranks.kv[r], sampled), (refs[r][i], single.kv, ref_sampled)):
                seq.num_computed_tokens += n
                kv.release_slid_out(seq)
                if row.want_logits:
                    seq.append_output(next(token))
    assert [[s.output_ids for s in rank] for rank in seqs] == [[s.output_ids for s in rank] for rank in refs]
    for r, rank in enumerate(seqs):
        for seq, ref in zip(rank, refs[r]):
            ranks.kv[r].free(seq)
            single.kv.free(ref)
        ranks.kv[r].check()
    single.kv.check()
    return idle_steps


def _row(kv, seq: Sequence, n: int) -> BatchRow:
    kv.extend(seq, n)
    start = seq.num_computed_tokens
    return BatchRow(seq.pages, seq.token_ids[start:start + n], start, start + n >= len(seq.prompt_ids))


def _prompts(gen, lengths_per_rank):
    return [[torch.randint(2, 500, (n,), generator=gen).tolist() for n in lengths] for lengths in lengths_per_rank]


def _workers() -> list:
    return [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def single(parallel_checkpoint):
    return LLMEngine(EngineConfig(checkpoint=str(parallel_checkpoint), **POOLS))


@pytest.fixture(scope="module")
def single_without_overlap(parallel_checkpoint):
    return LLMEngine(EngineConfig(checkpoint=str(parallel_checkpoint), overlap_scheduling=False, **POOLS))


# Uneven: one rank has the long prompts, another a short one, another none at first; steps where a rank has no
# request run its MoE exchange alone.
LENGTHS = {2: [[300, 1], [37, 150, 70]], 4: [[300], [1, 37], [150, 70, 9], []]}


@pytest.mark.parametrize("dp,ep", [(2, 1), (2, 2), (4, 4)])
def test_data_parallel_logits_equal_one_rank_on_ragged_uneven_steps(parallel_checkpoint, single, dp, ep):
    ranks = _DataParallelRanks(parallel_checkpoint, dp, ep)
    try:
        idle_steps = _run(ranks, single, _prompts(torch.Generator().manual_seed(dp * 10 + ep), LENGTHS[dp]))
        assert idle_steps > 0  # some rank took part in a step without a request of its own
    finally:
        ranks.close()
    assert not _workers(), "a worker outlived the group"


def test_published_checkpoint_data_parallel_with_expert_parallel(parallel_checkpoint_published):
    """DeepSeek's layout, FP8 linears and MXFP4 experts, dequantized: DP=2 + EP=2 equals one rank."""
    single = LLMEngine(EngineConfig(checkpoint=str(parallel_checkpoint_published), **POOLS))
    ranks = _DataParallelRanks(parallel_checkpoint_published, 2, 2)
    try:
        _run(ranks, single, _prompts(torch.Generator().manual_seed(5), [[140], [3, 70]]))
    finally:
        ranks.close()
        single.shutdown()


@pytest.mark.parametrize("settings,parameter", [
    (dict(data_parallel_size=2, tensor_parallel_size=2), "data_parallel_size"),
    (dict(data_parallel_size=4, expert_parallel_size=2), "expert_parallel_size"),  # 1 or the world
    (dict(data_parallel_size=0), "data_parallel_size"),
])
def test_a_data_parallel_size_that_cannot_work_is_refused(settings, parameter):
    with pytest.raises(ConfigError, match=f"'{parameter}'"):
        EngineConfig(device="cpu", **settings)


def test_experts_that_do_not_divide_over_the_ranks_are_refused(parallel_checkpoint):
    from backend.model.config import load_model_config

    with pytest.raises(ConfigError, match="'expert_parallel_size'"):  # 8 experts over 16 ranks
        ParallelLayout(expert_parallel_size=16, data_parallel_size=16).check(load_model_config(parallel_checkpoint))
    ParallelLayout(data_parallel_size=16).check(load_model_config(parallel_checkpoint))  # whole experts on each: fine


def test_layouts_under_data_parallelism():
    dp = ParallelLayout(expert_parallel_size=2, rank=1, data_parallel_size=2)
    assert dp.shard("lm_head.weight", (512, 64)) is None  # each rank's rows are its own: the whole head
    assert dp.shard("model.layers.0.self_attn.q_b_proj.weight", (512, 48)) is None
    assert dp.shard("model.layers.0.mlp.experts.gate_up_proj", (8, 64, 64)).ranges == ((4, 8),)
    assert dp.moe_exchange and not dp.vocabulary_parallel
    assert not ParallelLayout(data_parallel_size=2).moe_exchange  # whole experts: the ranks never meet
    assert ParallelLayout(expert_parallel_size=2).vocabulary_parallel


# --- the engine over data-parallel ranks -------------------------------------------------------------------------

def _dp_engine(checkpoint, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(checkpoint=str(checkpoint), **{**POOLS, **settings}))


def _settled_stats(engine: LLMEngine, timeout_s: float = 10.0) -> dict:
    """The engine's stats once every rank has reported itself idle (the other ranks' come with their outputs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if all(not r["num_running"] and not r["num_waiting"] for r in stats["ranks"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


GENERATE_LENGTHS = (1, 37, 150, 300, 600, 5, 64)


@pytest.mark.parametrize("dp,ep,overlap", [(2, 2, True), (2, 2, False), (2, 1, True)])
def test_the_engine_over_ranks_generates_the_single_rank_tokens(parallel_checkpoint, single, single_without_overlap,
                                                                dp, ep, overlap, tmp_path, monkeypatch):
    """Requests spread over the ranks that end every way a request can (a stop token, a stop string, a cancel, a
    deadline, max_tokens: tests/engine/endings.py): the single rank's outputs, token for token. The reference runs
    without overlap: it learns each ending before it schedules the request's next step."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in GENERATE_LENGTHS]
    params = [SamplingParams(max_tokens=16, temperature=0.0)] * len(prompts)
    requests = endings.with_endings(prompts, params, single.generate(prompts, params))
    expected = endings.run(single_without_overlap, requests, endings.FakeClock(monkeypatch))
    step_log = tmp_path / "steps.jsonl"
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=dp, expert_parallel_size=ep, step_log=str(step_log),
                        overlap_scheduling=overlap)
    try:
        got = endings.run(engine, requests, endings.FakeClock(monkeypatch))
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert got == expected and all(stream.ends_once for stream in got)
    assert endings.finish_reasons(expected) == {"stop", "cancelled", "timeout", "length"}
    assert engine.overlap == overlap
    ranks = stats["ranks"]
    assert [r["rank"] for r in ranks] == list(range(dp)) and all(r["load_tokens"] == 0 for r in ranks)
    records = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert {r["rank"] for r in records} == set(range(dp))  # every rank served requests, and its steps say whose
    padded = [r["dp_padding_tokens"] for r in records]
    assert (max(padded) > 0) == (ep > 1)  # uneven ranks pad their MoE exchange; without one nothing is padded
    for rank in range(dp):  # each rank's prompt tokens: its own requests', placed by load
        placed = sum(r["num_prefill_tokens"] for r in records if r["rank"] == rank)
        assert 0.25 * sum(GENERATE_LENGTHS) < placed < 0.75 * sum(GENERATE_LENGTHS)
    assert not _workers()


def test_preemption_and_the_prefix_cache_work_per_rank(parallel_checkpoint, single):
    """Small pools (each rank preempts), and prompts that extend earlier ones (restored from their rank's cache):
    the single rank's tokens all the same."""
    gen = torch.Generator().manual_seed(8)
    base = [torch.randint(2, 500, (100,), generator=gen).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [r["output_ids"] for r in single.generate(base, params)]
    # 512 positions per rank: four requests of 140 positions cannot all run at once on a rank (test_engine.py's case)
    tight = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2, num_tokens=512,
                       swa_full_tokens_ratio=1.0)
    try:
        assert [r["output_ids"] for r in tight.generate(base, params)] == expected
        assert all(rank["num_preemptions"] > 0 for rank in _settled_stats(tight)["ranks"])
    finally:
        tight.shutdown()
    long = [torch.randint(2, 500, (300,), generator=gen).tolist() for _ in range(4)]  # two cache blocks of 128 each
    extended = [p + [7, 8, 9] for p in long]
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2)
    try:
        engine.generate(long, params)
        again = engine.generate(extended, params)
    finally:
        engine.shutdown()
    assert all(r["num_cached_tokens"] > 0 for r in again)  # each request found its prefix on the rank it went to
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in single.generate(extended, params)]


def test_cancellation_and_deadlines_on_the_ranks(parallel_checkpoint):
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2)
    outputs: dict[str, list] = {}
    done = threading.Event()

    def collect(raw):
        outputs.setdefault(raw.request_id, []).append(raw)
        if len([r for r in outputs.values() if r[-1].finished]) == 4:
            done.set()

    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        engine.start()
        for i in range(3):
            engine.submit(Sequence(f"long{i}", list(range(2, 40 + i)), params), collect)
        engine.submit(Sequence("deadline", list(range(2, 30)), SamplingParams(max_tokens=400, ignore_eos=True,
                                                                               timeout_ms=300)), collect)
        while len(outputs.get("long1", [])) < 3:
            time.sleep(0.01)
        assert engine.abort("long1") and not engine.abort("nobody")
        assert engine.abort("long0") and engine.abort("long2")
        assert done.wait(60)
        stats = _settled_stats(engine)
    finally:
        engine.shutdown()
    assert all(outputs[i][-1].finished for i in outputs)
    ranks = stats["ranks"]
    assert {rank["rank"] for rank in ranks if rank["num_steps"]} == {0, 1}  # both ranks served
    assert all(rank["load_tokens"] == 0 for rank in ranks)
    assert outputs["deadline"][-1].finish_reason.value == "timeout"
    for rank in ranks:  # every page back (the prefix cache may keep some, none held by a request)
        assert all(count == 0 for count in rank["pages_held_by_requests"].values())


def test_a_killed_worker_ends_the_requests_and_later_ones_are_refused(parallel_checkpoint):
    """Both ranks' requests end with an error, and a request sent the moment a client learns of its failure (from
    its output callback, before the engine's step has seen the failure) is refused as the later ones are."""
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2, collective_timeout_s=30)
    outputs: dict[str, list] = {}
    resent: dict[str, str] = {}

    def on_output(raw):
        outputs.setdefault(raw.request_id, []).append(raw)
        if raw.finished and raw.error:
            try:
                engine.submit(Sequence(f"resent-{raw.request_id}", [2, 3]), lambda _: None)
                resent[raw.request_id] = "admitted"
            except EngineUnavailable as exc:
                resent[raw.request_id] = str(exc)

    try:
        engine.start()
        for i in range(2):
            engine.submit(Sequence(f"r{i}", list(range(2, 30)), SamplingParams(max_tokens=2000, ignore_eos=True)),
                          on_output)
        deadline = time.monotonic() + 30
        while not (all(len(outputs.get(f"r{i}", [])) > 2 for i in range(2)) and
                   engine.stats()["ranks"][1]["num_running"]) and time.monotonic() < deadline:
            time.sleep(0.01)  # (until rank 1 has sent stats saying its request runs)
        os.kill(engine.group._processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not all(outputs[f"r{i}"][-1].finished for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(outputs[f"r{i}"][-1].error for i in range(2))
        assert sorted(resent) == ["r0", "r1"] and all("cannot serve" in why for why in resent.values()), resent
        with pytest.raises(EngineUnavailable, match="cannot serve"):
            engine.submit(Sequence("after", [2, 3]), lambda raw: None)
        # (the gauges: the dead rank's last stats said its request ran, and stayed so while the model stayed loaded)
        stats = _settled_stats(engine)
        assert [(r["num_running"], r["num_waiting"]) for r in stats["ranks"]] == [(0, 0), (0, 0)], stats["ranks"]
        assert not any(stats["ranks"][1]["pages_used"].values()) and stats["num_draft_tokens"] >= 0
    finally:
        engine.shutdown()
    assert not _workers()


def test_a_cancel_a_full_inbox_refuses_is_sent_once_the_rank_takes_messages_again(parallel_checkpoint):
    """A rank busy with a long step while requests keep coming fills its inbox; a client's abort of one of its
    requests then found the inbox refusing the Cancel, and the engine failed every request and refused every later
    one for good, as for a lost rank. The Cancel waits behind what the inbox refused and goes once it takes
    messages again: that request ends cancelled, the others go on, the engine serves on."""
    import zmq

    class Refusing:  # rank 1's inbox socket, refusing while `full`
        def __init__(self, socket):
            self.socket, self.full, self.refused = socket, True, 0

        def send_pyobj(self, message, flags=0):
            if self.full:
                self.refused += 1
                raise zmq.Again()
            return self.socket.send_pyobj(message, flags)

        def __getattr__(self, name):
            return getattr(self.socket, name)

    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2)
    try:
        outputs = _decoding_on_both_ranks(engine, max_tokens=2000)
        elsewhere, here = sorted((f"r{i}" for i in range(2)), key=lambda r: -engine.rank_of(r))
        links = engine.group.links
        inbox = links._to[1] = Refusing(links._to[1])
        assert engine.abort(elsewhere)
        time.sleep(0.5)
        assert inbox.refused > 1 and not outputs[elsewhere][-1].finished and engine.unavailable is None
        inbox.full = False
        deadline = time.monotonic() + 30
        while not outputs[elsewhere][-1].finished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert outputs[elsewhere][-1].finish_reason.value == "cancelled"
        assert not outputs[here][-1].finished and engine.unavailable is None
        assert engine.abort(here)
    finally:
        engine.shutdown()
    assert not _workers()


def test_a_long_prompt_never_starves_the_decodes_of_its_rank(parallel_checkpoint, tmp_path):
    """The seed report's scenario on each rank: a decoding request per rank, then a 600-token prompt in 64-token chunks
    lands beside one of them; with the default policy that rank's victim gets a token in every step of the burst."""
    step_log = tmp_path / "steps.jsonl"
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2, prefill_chunk_tokens=64,
                        step_log=str(step_log))
    outputs: dict[str, list] = {}

    def collect(raw):
        outputs.setdefault(raw.request_id, []).append(raw)

    try:
        engine.start()
        victims = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
        for i in range(2):
            engine.submit(Sequence(f"victim{i}", list(range(2, 20)), victims), collect)
        while not all(len(outputs.get(f"victim{i}", [])) > 2 for i in range(2)):
            time.sleep(0.01)
        engine.submit(Sequence("attacker", torch.randint(2, 500, (600,)).tolist(), SamplingParams(max_tokens=1)),
                      collect)
        while not (outputs.get("attacker") and outputs["attacker"][-1].finished):
            time.sleep(0.01)
        for i in range(2):
            engine.abort(f"victim{i}")
        stats = engine.stats()
    finally:
        engine.shutdown()
    records = [json.loads(line) for line in step_log.read_text().splitlines()]
    burst = [r for r in records if r["num_prefill_tokens"] >= 64]  # the attacker's chunks (on the rank it went to)
    assert len(burst) >= 9 and len({r["rank"] for r in burst}) == 1
    assert all(r["num_decode_tokens"] >= 1 for r in burst)  # every chunk carried the victim of that rank
    assert stats["decode_stalls"] == 0


def test_sampling_logprobs_and_structured_outputs_on_the_ranks(parallel_checkpoint, single):
    """Seeded sampling with penalties, log-probabilities and a JSON schema, on requests spread over the ranks: the
    single rank's tokens (each request's own generator draws in the same order on any rank), and its log-probabilities
    within float rounding."""
    from backend.structured.params import guided_decoding_from_sampling

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (5, 80, 200, 33)]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=11, logprobs=2),
              SamplingParams(max_tokens=24, guided_decoding=guided_decoding_from_sampling(
                  {"guided_decoding": {"json": schema}}, "test")),
              SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, repetition_penalty=1.2),
              SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)]
    expected = single.generate(prompts, params)
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2)
    try:
        got = engine.generate(prompts, params)
        # the schema compiled on rank 1, where its request went (by load: the second placed), and is counted in the
        # engine's stats and compile times all the same
        deadline = time.monotonic() + 10
        while engine.stats()["grammars"]["compiled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # (a rank's stats come every 0.2 s)
        assert engine.grammars.stats()["compiled"] == 0 and engine.stats()["grammars"]["compiled"] == 1
        assert len(engine.take_grammar_compile_seconds()) == 1 and engine.take_grammar_compile_seconds() == []
    finally:
        engine.shutdown()
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    for one, many in zip(expected, got):
        for a, b in zip(one.get("logprobs") or [], many.get("logprobs") or []):
            assert a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert len(got[0]["logprobs"]) == 12


def test_a_prompt_follows_its_prefix_to_the_rank_that_cached_it(parallel_checkpoint, single):
    """Prefix-cache affinity: the extension of a prompt served on rank 1 goes to rank 1 although rank 0 is as free
    (and is restored from rank 1's cache), but not to a rank loaded beyond the least by more than its own load."""
    gen = torch.Generator().manual_seed(9)
    other, prompt = (torch.randint(2, 500, (300,), generator=gen).tolist() for _ in range(2))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2)
    try:
        engine.generate([other, prompt], params)  # `other` on rank 0, `prompt` on rank 1
        (again,) = engine.generate([prompt + [7, 8, 9]], params)  # both ranks idle: rank 1, where its prefix is
        assert again["num_cached_tokens"] > 0
        assert again["output_ids"] == single.generate([prompt + [7, 8, 9]], params)[0]["output_ids"]
        busy = SamplingParams(max_tokens=4000)
        engine.submit(Sequence("busy", list(range(2, 40)), busy), lambda raw: None)  # rank 0 (tie): load 4038
        engine.submit(Sequence("busier", list(range(2, 60)), busy), lambda raw: None)  # rank 1: load 4058
        engine.submit(Sequence("follows", prompt + [5], params), lambda raw: None)  # rank 1: 4058 <= 4038 + 309
        engine.submit(Sequence("spills", prompt + [6], params), lambda raw: None)
        placed = {name: engine.rank_of(name) for name in ("busy", "busier", "follows", "spills")}
    finally:
        engine.shutdown()
    # "spills": rank 1 (4058 + 309) is now further ahead of rank 0 (4038) than its own 309 tokens: rank 0
    assert placed == {"busy": 0, "busier": 1, "follows": 1, "spills": 0}


def test_generate_waits_for_another_ranks_last_output_on_its_way_to_the_consumer(parallel_checkpoint, monkeypatch):
    """Another rank's last output leaves the placements before its consumer records it (a slow consumer: 0.3 s
    here): generate() took the engine for idle with a request unfinished and raised."""
    import backend.output_processor as output_processor

    process = output_processor.OutputProcessor.process

    def slow_on_the_ranks_thread(self, output):
        if output.finished and threading.current_thread().name == "dsv4-ranks":
            time.sleep(0.3)
        return process(self, output)

    monkeypatch.setattr(output_processor.OutputProcessor, "process", slow_on_the_ranks_thread)
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2)
    try:
        results = engine.generate([list(range(2, 20)), list(range(2, 21))],
                                  SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        engine.shutdown()
    assert [r["finish_reason"] for r in results] == ["length", "length"]


def _decoding_on_both_ranks(engine: LLMEngine, max_tokens: int) -> dict[str, list]:
    """Start `engine` (two ranks) and decode a request on each ("r0", "r1") until both have a few outputs; the outputs
    by request, still growing."""
    outputs: dict[str, list] = {}
    engine.start()
    for i in range(2):
        engine.submit(Sequence(f"r{i}", list(range(2, 30 + i)), SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                      lambda raw: outputs.setdefault(raw.request_id, []).append(raw))
    deadline = time.monotonic() + 60
    while not all(len(outputs.get(f"r{i}", [])) > 2 for i in range(2)):
        assert time.monotonic() < deadline, {i: len(outputs.get(f"r{i}", [])) for i in range(2)}
        time.sleep(0.01)
    return outputs


def _stop_a_worker_mid_decode(engine: LLMEngine):
    """Start `engine` (two ranks), decode a request on each, then stop the worker (SIGSTOP); (it, the outputs)."""
    outputs = _decoding_on_both_ranks(engine, max_tokens=5000)
    (worker,) = engine.group._processes
    os.kill(worker.pid, signal.SIGSTOP)
    return worker, outputs


def test_shutdown_keeps_its_budget_with_a_rank_in_lock_step_that_stopped_answering(parallel_checkpoint):
    """A worker stopped (SIGSTOP) while rank 0's loop waits for it in a collective: shutdown(3 s) ended the lock
    step from its own thread too, a second collective with the silent rank, and waited the whole collective
    timeout (tritonserver kills a model past its exit timeout); SIGTERM to a stopped process waited 5 s more."""
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2, collective_timeout_s=40)
    worker, _ = _stop_a_worker_mid_decode(engine)
    time.sleep(1.0)  # (rank 0's loop is in a collective with it by now)
    start = time.monotonic()
    engine.shutdown(timeout=3.0)
    assert time.monotonic() - start < 5.0
    assert not worker.is_alive()


def test_a_rank_that_stops_answering_without_collectives_fails_its_requests(parallel_checkpoint):
    """Data parallelism without expert parallelism: the ranks meet in no collective, so a rank that hangs (SIGSTOP
    here) timed out nowhere, and its requests, a cancel of them too, waited forever. Silent for
    collective_timeout_s with requests on it, it fails them, and the engine refuses what comes next."""
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, collective_timeout_s=3)
    try:
        _, outputs = _stop_a_worker_mid_decode(engine)
        deadline = time.monotonic() + 20
        while not all(outputs[f"r{i}"][-1].finished for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(outputs[f"r{i}"][-1].finished for i in range(2))
        assert "sent nothing" in (engine.unavailable or "")
        with pytest.raises(EngineUnavailable):
            engine.submit(Sequence("later", [2, 3, 4], SamplingParams(max_tokens=2)), lambda raw: None)
    finally:
        engine.shutdown(timeout=3.0)


@pytest.mark.parametrize("overlap,drafts", [(True, 0), (False, 0), (False, 1)])
def test_a_step_that_fails_on_rank_0_in_lock_step_fails_the_group_at_once(parallel_checkpoint, overlap, drafts):
    """Expert parallelism over data-parallel ranks: a forward that raises on rank 0 leaves the worker in that step's
    MoE exchange. Rank 0 went on: with overlap its next step's exchange met the worker's old one, and gloo aborted
    the process (the server's stub) on the size mismatch; without, both waited out the collective timeout. Now the
    group is broken at once: every request ends with an error within seconds, later ones are refused, no worker is
    left."""
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2, collective_timeout_s=120,
                        overlap_scheduling=overlap, num_speculative_tokens=drafts)
    forward, calls, armed = engine.core.runner.forward, [], threading.Event()

    def fails_once_armed(job_forward, *args, **kwargs):
        if armed.is_set():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected fault")
        return forward(job_forward, *args, **kwargs)

    engine.core.runner.forward = fails_once_armed
    try:
        outputs = _decoding_on_both_ranks(engine, max_tokens=5000)
        armed.set()  # (both ranks decoding: the next forward of rank 0's fails)
        deadline = time.monotonic() + 20
        while not all(outputs[f"r{i}"][-1].finished for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(outputs[f"r{i}"][-1].finished and outputs[f"r{i}"][-1].error for i in range(2)), \
            {i: outputs[f"r{i}"][-1] for i in range(2)}
        assert len(calls) == 1  # (no forward after the one that failed)
        with pytest.raises(EngineUnavailable, match="cannot serve"):
            engine.submit(Sequence("later", [2, 3, 4], SamplingParams(max_tokens=2)), lambda raw: None)
    finally:
        engine.shutdown(timeout=5.0)
    assert not _workers()


def test_a_sampling_fault_in_lock_step_fails_only_its_step(parallel_checkpoint):
    """A fault after a step's forward (its collectives all made: sampling here) leaves the ranks in step: only that
    step's requests end with it, and the engine serves on."""
    engine = _dp_engine(parallel_checkpoint, data_parallel_size=2, expert_parallel_size=2, collective_timeout_s=120)
    sampler = engine.core.executor.sampler
    step, armed = sampler.step, threading.Event()

    def fails_once_armed(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected sampling fault")
        return step(*args, **kwargs)

    sampler.step = fails_once_armed
    try:
        outputs = _decoding_on_both_ranks(engine, max_tokens=5000)
        armed.set()
        deadline = time.monotonic() + 30
        while not outputs["r0"][-1].finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "injected sampling fault" in (outputs["r0"][-1].error or ""), outputs["r0"][-1]
        assert not engine.unavailable and not outputs["r1"][-1].finished
        later = []
        engine.submit(Sequence("later", [2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True)), later.append)
        while not (later and later[-1].finished) and time.monotonic() < deadline + 30:
            time.sleep(0.01)
        assert later[-1].finish_reason.value == "length", later[-1]
    finally:
        engine.shutdown(timeout=5.0)
    assert not _workers()
