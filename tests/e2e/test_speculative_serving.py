"""Speculative decoding through a real tritonserver: streams with k = 2 drafts per decode are the tokens the engine
gives without speculation, and the draft counters reach Triton's metrics."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams

from .conftest import CHECKPOINT, _make_repository, _serve
from .triton_helpers import stream_all, wait_for

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def speculative_server(tmp_path_factory):
    repository = _make_repository(tmp_path_factory.mktemp("spec_repo"), f"checkpoint={CHECKPOINT}", "device=cpu",
                                  "num_speculative_tokens=2")
    yield from _serve(repository, tmp_path_factory.mktemp("spec_log"))


def test_speculative_streams_equal_the_tokens_without_speculation(speculative_server):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 70, 200)]
    engine = LLMEngine(EngineConfig(checkpoint=str(CHECKPOINT), device="cpu"))
    try:
        expected = [r["output_ids"] for r in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]
    finally:
        engine.shutdown()
    # The same drafts offline: greedy verifies accept the same drafts however the requests are batched, so the
    # server's counters must come to exactly the offline engine's.
    drafting = LLMEngine(EngineConfig(checkpoint=str(CHECKPOINT), device="cpu", num_speculative_tokens=2))
    try:
        drafting.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        offline = drafting.stats()
    finally:
        drafting.shutdown()
    results = stream_all(speculative_server, prompts, MAX_TOKENS)
    assert [r.error for r in results] == [None] * len(prompts)
    assert [r.ids for r in results] == expected

    def counted(family: str) -> float:
        return sum(speculative_server.metric_values(family).values())

    assert offline["num_draft_tokens"] > 0
    assert wait_for(lambda: counted("dsv4_spec_draft_tokens_total") == offline["num_draft_tokens"]), (
        counted("dsv4_spec_draft_tokens_total"), offline["num_draft_tokens"])
    assert counted("dsv4_spec_accepted_tokens_total") == offline["num_accepted_tokens"]
