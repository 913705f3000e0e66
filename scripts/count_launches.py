#!/usr/bin/env python
"""Device launches and host synchronisations of one decode step, per step and per layer (a benchmark).

    python scripts/count_launches.py [--checkpoint DIR] [--batch 8] [--steps 4] [--mode triton] [--json FILE]
    python scripts/count_launches.py --device cuda     # the same count on a GPU (bf16, no interpreter)
    python scripts/count_launches.py --checkpoint docs/configs/deepseek-v4-flash.config.json --load-format dummy \
        --hf-overrides '{"hidden_size": 128, ...}' \
        --engine-settings '{"weight_format": "fp8", "numerics": "deepseek", "kv_cache_dtype": "fp8"}'
                                                       # V4 as published: FP8 linears, MXFP4 experts, fp8 KV

Runs `--batch` requests of the checkpoint (default the tiny one; prompts of different lengths, prefilled first), its
model and pools built as the engine builds them (--load-format, --hf-overrides and --engine-settings as the other
benchmarks take them), through
`--steps` decode steps of the model on the GPU code path — the Triton kernels, run by Triton's interpreter
on CPU (TRITON_INTERPRET=1 is set here) — and counts, inside `DeepseekV4Model.forward`:
  launches  torch operators that would launch device work: every ATen op except views and bare
            allocations (empty*), plus every Triton kernel launch (the interpreter's own tensor copies
            inside a launch are not counted);
  syncs     operations that make the host wait for the device: `.item()` / `int(t)` / `bool(t)` / `float(t)`
            / `t.__index__()` (caught at the Python level: under inference_mode they bypass the dispatcher),
            aten._local_scalar_dense, is_nonzero, equal, `.tolist()` / `.numpy()` / `.cpu()`, and ops whose
            output shape depends on data (nonzero, masked_select, unique, bincount, repeat_interleave without
            output_size, boolean-mask indexing).
Launches are attributed to the layer that issued them, or to the step (embedding, rope tables, hyper-head,
lm_head). `--mode reference` counts the torch reference path instead. Prints a table; `--json` writes
{per_step, per_layer, per_layer_kind, syncs_per_step, top_ops, ops_per_layer_kind}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

if "cuda" not in sys.argv[1:]:  # --device cpu (the default): the kernels run under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten
NO_LAUNCH = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
             aten.lift_fresh.default, aten._local_scalar_dense.default}
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.bincount.default}
STEP = "step"  # launches issued outside any layer


def _is_sync(func, args, kwargs) -> bool:
    if func in SYNC_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    if func in (aten._to_copy.default, aten.copy_.default):
        return False  # a host tensor's copy on CPU cannot be told from a device one; .cpu() is caught below
    return False


class LaunchCounter(TorchDispatchMode):
    """Counts launches and syncs by scope (a layer index or STEP) while active and not inside a Triton launch."""

    def __init__(self):
        super().__init__()
        self.launches: Counter = Counter()  # scope -> launches
        self.ops: Counter = Counter()  # (scope, op name) -> launches
        self.syncs: Counter = Counter()  # op name -> syncs
        self.scope = STEP
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            if _is_sync(func, args, kwargs):
                self.syncs[str(func)] += 1
            if not func.is_view and func not in NO_LAUNCH:
                self.launches[self.scope] += 1
                self.ops[self.scope, str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    def triton_launch(self, name: str) -> None:
        if not self.paused:
            self.launches[self.scope] += 1
            self.ops[self.scope, f"triton:{name}"] += 1

    def host_sync(self, name: str) -> None:
        if not self.paused:
            self.syncs[name] += 1


@contextlib.contextmanager
def counting(model):
    """Count launches of `model.forward` (attributed per layer) while the block runs; yields the counter."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counter = LaunchCounter()
    patched = []

    def patch(owner, name, wrapper):
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def counted_once(record):
        """A wrapper that calls record(self, original, kwargs), then the original with counting paused (what it
        does inside is part of the one launch or sync just recorded)."""
        def wrapper(original):
            def call(self, *args, **kwargs):
                record(self, original, kwargs)
                counter.paused += 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    counter.paused -= 1
            return call
        return wrapper

    def triton_launch(self, original, kwargs):
        if not kwargs.get("warmup"):  # JITFunction.warmup compiles without launching (kernels/common.py)
            counter.triton_launch(getattr(self, "__name__", None) or self.fn.__name__)

    def host_read(self, original, kwargs):
        counter.host_sync(f"Tensor.{original.__name__}")

    def layer_scope(original):
        def layer(i, *args, **kwargs):
            outer, counter.scope = counter.scope, i
            try:
                return original(i, *args, **kwargs)
            finally:
                counter.scope = outer
        return layer

    for cls in (InterpretedFunction, JITFunction):
        patch(cls, "run", counted_once(triton_launch))
    # Python-level reads too: under inference_mode (the model's forward) `.item()` does not reach the mode.
    for name in ("tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"):
        patch(torch.Tensor, name, counted_once(host_read))
    patch(model, "_layer", layer_scope)
    try:
        with counter:
            yield counter
    finally:
        for owner, name, original in reversed(patched):
            if owner is model:
                delattr(model, name)  # drop the instance attribute: the class method shows again
            else:
                setattr(owner, name, original)


def _engine_parts(checkpoint, batch: int, mode: str, device: str, engine_settings: dict):
    """The model and pools as the engine builds them (backend/deployment.py), for `batch` requests."""
    from backend.config import EngineConfig
    from backend.deployment import load_model, plan_deployment
    from backend.model.comm import Communicator

    config = EngineConfig(**{"num_tokens": 32768, "swa_full_tokens_ratio": 0.5, "page_size": 16,
                             "enable_prefix_caching": False, **engine_settings},
                          checkpoint=str(checkpoint), device=device, max_running_requests=batch)
    dtype = config.resolved_dtype()
    deployment = plan_deployment(config, device, dtype)
    model = load_model(config, deployment, device, dtype, deployment.layout, Communicator(), kernel_mode=mode)
    return deployment.model_config, model, deployment.kv


def measure(checkpoint, batch: int = 8, steps: int = 4, mode: str = "triton", device: str = "cpu",
            **engine_settings) -> dict:
    """Prefill `batch` prompts (on the reference path, uncounted), then count `steps` decode steps. `engine_settings`:
    more EngineConfig fields (load_format, hf_overrides, weight_format, numerics, kv_cache_dtype, ...)."""
    from backend.model.forward_batch import BatchRow, build_forward_batch
    from backend.request import Sequence

    config, model, kv = _engine_parts(checkpoint, batch, mode, device, engine_settings)
    gen = torch.Generator().manual_seed(0)
    seqs = [Sequence(f"r{b}", torch.randint(2, config.vocab_size, (20 + 37 * b,), generator=gen).tolist())
            for b in range(batch)]

    def forward(rows_of, counter=contextlib.nullcontext):
        rows = []
        for seq, n in rows_of:
            kv.extend(seq, n)
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + n]
            rows.append(BatchRow(seq.pages, tokens, start, True))
        batch = build_forward_batch(rows, kv, device)  # host-side metadata: not part of the count
        with counter():
            logits = model.forward(batch, kv)
        for seq, n in rows_of:
            seq.num_computed_tokens += n
            kv.release_slid_out(seq)
        return logits

    model.kernels.mode = "reference"
    for seq in seqs:
        seq.append_output(int(forward([(seq, len(seq.prompt_ids))]).argmax(-1)[0]))
    model.kernels.mode = mode
    totals, syncs, ops = Counter(), Counter(), Counter()
    for _ in range(steps):
        counters = []

        @contextlib.contextmanager
        def counted():
            with counting(model) as counter:
                counters.append(counter)
                yield

        logits = forward([(seq, 1) for seq in seqs], counted)
        counter = counters[0]
        totals.update(counter.launches)
        syncs.update(counter.syncs)
        ops.update(counter.ops)
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.append_output(token)
    for seq in seqs:
        kv.free(seq)
    kv.check()

    per_layer = {i: totals[i] / steps for i in range(config.num_hidden_layers)}
    kinds: dict[str, list[float]] = {}
    for i, count in per_layer.items():
        kinds.setdefault(config.layer_types[i], []).append(count)
    by_kind: dict[str, Counter] = {}  # layer kind -> op -> launches per layer of that kind per step
    for (scope, op), count in ops.items():
        kind = STEP if scope == STEP else config.layer_types[scope]
        by_kind.setdefault(kind, Counter())[op] += count / steps / (1 if scope == STEP else len(kinds[kind]))
    all_ops = Counter()
    for (_, op), count in ops.items():
        all_ops[op] += count
    return dict(
        checkpoint=str(checkpoint), mode=mode, device=device, batch=batch, steps=steps,
        per_step=sum(totals.values()) / steps, outside_layers_per_step=totals[STEP] / steps,
        per_layer=per_layer, per_layer_mean=sum(per_layer.values()) / len(per_layer),
        per_layer_kind={k: sum(v) / len(v) for k, v in kinds.items()},
        syncs_per_step=sum(syncs.values()) / steps, syncs={k: v / steps for k, v in syncs.items()},
        top_ops={k: v / steps for k, v in all_ops.most_common(25)},
        ops_per_layer_kind={kind: dict(c.most_common()) for kind, c in by_kind.items()},
    )


def _print(result: dict) -> None:
    print(f"device={result['device']} mode={result['mode']} batch={result['batch']} steps={result['steps']} ({result['checkpoint']})")
    print(f"{'scope':<34} {'launches/step':>14}")
    for i, count in result["per_layer"].items():
        print(f"{'layer ' + str(i):<34} {count:>14.1f}")
    print(f"{'outside layers':<34} {result['outside_layers_per_step']:>14.1f}")
    print(f"{'whole step':<34} {result['per_step']:>14.1f}")
    print(f"{'mean per layer':<34} {result['per_layer_mean']:>14.1f}")
    for kind, count in result["per_layer_kind"].items():
        print(f"{'  ' + kind:<34} {count:>14.1f}")
    print(f"host syncs per step: {result['syncs_per_step']:g} {result['syncs'] or ''}")
    print("most launched ops per step: " + ", ".join(f"{k} {v:g}" for k, v in result["top_ops"].items()))
    for kind, ops in result["ops_per_layer_kind"].items():
        print(f"  {kind}: " + ", ".join(f"{k} {v:g}" for k, v in ops.items()))


def main() -> int:
    from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    parser.add_argument("--engine-settings", type=json.loads, default={}, metavar="JSON",
                        help='more EngineConfig fields, e.g. \'{"weight_format": "fp8", "numerics": "deepseek"}\'')
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mode", choices=("triton", "reference"), default="triton")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    torch.set_num_threads(1)
    settings = checkpoint_settings(options)
    result = measure(settings.pop("checkpoint"), options.batch, options.steps, options.mode, options.device,
                     **settings, **options.engine_settings)
    _print(result)
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
