"""The engine with its Triton kernels (run by Triton's interpreter on CPU) against the reference model.

The kernel tests check each kernel against its torch reference; this checks the engine's calls into
them — layouts, dtypes, page tables, top-k indices — on real forwards: a chunked prefill crossing
the first HCA boundary and decode steps, in one ragged batch with a second request.
"""

from __future__ import annotations

import pytest

import kernels.attention
import kernels.indexer
import kernels.moe
from backend.request import Sequence

from .harness import EngineHarness, Reference, Tracked, compare
from .test_reference import _prompt


@pytest.fixture
def triton_calls(monkeypatch):
    """Count the calls that reach each Triton wrapper."""
    calls = {}
    for module, name in ((kernels.attention, "sparse_paged_attention_triton"),
                         (kernels.indexer, "indexer_scores_triton"), (kernels.moe, "fused_moe_triton")):
        def counted(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    return calls


def test_engine_with_interpreted_triton_kernels_matches_the_reference(tiny_checkpoint, triton_calls):
    harness = EngineHarness(tiny_checkpoint, kernel_mode="triton")
    bystander = EngineHarness(tiny_checkpoint)  # the kernel choice is per model, not per process
    bystander.step([(Tracked(Sequence("other", _prompt(20, 23))), 20)])
    assert triton_calls == {}
    reference = Reference(tiny_checkpoint)
    long = Tracked(Sequence("long", _prompt(140, 21)))
    short = Tracked(Sequence("short", _prompt(12, 22)))
    harness.step([(long, 61)])
    harness.step([(long, 70), (short, 9)])  # crosses position 128: the first HCA entry
    for _ in range(3):
        harness.step([(long, 3), (short, 1)])
    for tracked in (long, short):
        ref_logits, ref_records = reference.run(tracked.seq.prompt_ids[: tracked.seq.num_computed_tokens])
        result = compare(tracked, ref_logits, ref_records, harness.config.csa_rate, harness.config.index_topk)
        assert result.positions_compared == len(tracked.logits)
        harness.free(tracked)
    harness.kv.check()
    steps, layers = 5, harness.config.num_hidden_layers
    csa_layers = harness.config.layer_types.count("compressed_sparse_attention")
    assert triton_calls == {"sparse_paged_attention_triton": steps * layers, "fused_moe_triton": steps * layers,
                            "indexer_scores_triton": steps * csa_layers}
