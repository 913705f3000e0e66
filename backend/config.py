"""Engine configuration: one dataclass, built from config.pbtxt parameters or CLI flags.

Every deployment knob lives here once. `EngineConfig.from_parameters` takes the string map that
tritonserver hands to `initialize()` (or that `scripts/make_model_repository.py --set` writes) and
raises `ConfigError` naming the parameter on a bad value.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from backend.errors import ConfigError, is_int, is_number

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / "dsv4-tiny"

POLICIES = ("prefill_first", "mixed")
PARALLEL_SIZES = ("tensor_parallel_size", "expert_parallel_size", "data_parallel_size")


NUMERICS = ("auto", "transformers", "deepseek")
LOAD_FORMATS = ("auto", "dummy")
DRAFT_SAMPLING = ("auto", "argmax", "sample")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
MAX_SPECULATIVE_TOKENS = 8
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8")
CUDA_ONLY = ("programmatic_dependent_launch", "side_stream")  # settings only a CUDA device takes
# Parameters the Python backend itself reads from config.pbtxt (python_backend's python_be.cc): a packed environment
# to run the stub in, whether input tensors always arrive on the CPU. The engine leaves them to it.
PYTHON_BACKEND_PARAMETERS = ("EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS")
MAX_TIMEOUT_S = 1e9  # (about 31 years: "never"; more overflows the collectives' timedelta)


@dataclass
class EngineConfig:
    checkpoint: str = str(DEFAULT_CHECKPOINT)
    # Where the weights come from: `auto` reads the checkpoint's safetensors; `dummy` builds random ones on the device,
    # at the config's shapes and in the formats its published checkpoint has (backend/model/dummy_weights.py), and
    # reads no weight file: `checkpoint` may then be a directory holding only config.json, or a config.json file
    # itself (docs/configs/*.config.json). Without a tokenizer there, the built-in checkpoint's is used.
    load_format: str = "auto"
    # A JSON object merged into the checkpoint's config.json (its top-level keys replace config.json's) before
    # anything is planned, e.g. {"num_hidden_layers": 12}; its keys are the config.json keys the engine reads (a key
    # only other software reads, such as torch_dtype, is refused), each value of that key's type.
    hf_overrides: dict | None = None
    # A Jinja chat template file for `messages` requests, in place of the checkpoint's (backend/chat.py; as vLLM's
    # --chat-template): DeepSeek-V4's published checkpoints ship none. Relative paths are taken from the repo root.
    chat_template: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (float32 on cpu, bfloat16 on cuda) | float32 | bfloat16 | float16
    # Quantized checkpoints: `dequantize` expands FP8/MXFP4 at load (exact); `fp8` keeps them as published
    # and runs them through the FP8 GEMM and quantized MoE kernels; auto: fp8 on CUDA, dequantize on CPU.
    weight_format: str = "auto"
    # What the forward computes: `transformers` what transformers' DeepseekV4ForCausalLM computes; `deepseek` also
    # the roundings DeepSeek's own inference applies and its model was trained with: each
    # attention entry's nope values to e4m3 per 64 and the indexer's keys and queries rotated and to e2m1 per 32
    # (kernels/quant_formats.py), the router's logits and the LM head in fp32, the routing weight before the
    # experts' down projection, and on quantized checkpoints the FP8/FP4 linears' inputs act_quant'ed (e4m3 per 128).
    # The mHC mix and the compressors (projections, rings, pooling) are fp32 too (docs/numerics.md).
    # auto (the default): deepseek on a quantized checkpoint the roundings apply to (DeepSeek's published ones),
    # else transformers.
    numerics: str = "auto"
    # How the KV pools store attention entries: `bfloat16`, or `fp8`, DeepSeek's layout (each entry's nope values
    # e4m3 with a power-of-two scale per 64, its rope values bf16: 584 bytes for V4 against 1,024; the indexer's
    # keys rotated and e2m1 with a scale per 32: 68 bytes against 256), which holds exactly what numerics=deepseek
    # rounds the entries to, so it needs those numerics. auto: fp8 where numerics=deepseek runs on CUDA or on a
    # quantized checkpoint and the widths fit the layout, else the model's dtype (docs/numerics.md).
    kv_cache_dtype: str = "auto"
    # Scheduling. `mixed` (stall-free batches) is what keeps a long prompt from starving the requests that are
    # decoding (docs/seed-bug-report.md); `prefill_first` is the historical order, kept for comparison.
    policy: str = "mixed"
    decode_interleave_every: int | None = None
    prefill_chunk_tokens: int | None = None  # None: derived from the window pool
    itl_target_ms: float | None = None
    max_running_requests: int = 16
    max_num_batched_tokens: int = 8192
    # Schedule and launch step N+1 while step N runs (backend/engine.py); off: each step is scheduled, run and
    # reported before the next.
    overlap_scheduling: bool = True
    # Waiting requests age: one priority level is worth this many seconds of waiting (admission order is
    # priority * priority_aging_s + arrival time), so a request of a worse priority is never overtaken by
    # requests that arrive more than (its priority - theirs) * priority_aging_s after it. 0 (or None): strict
    # priority, under which a worse priority can wait for ever.
    priority_aging_s: float | None = 10.0
    # Requests waiting beyond this many are refused at once with UNAVAILABLE instead of queueing without end.
    max_queue_size: int | None = None
    # Memory.
    num_tokens: int = 65536  # positions the compressed pools hold across all requests
    swa_full_tokens_ratio: float = 0.25  # window pool size as a fraction of num_tokens
    page_size: int = 64
    # Observability.
    step_log: str | None = None  # path of a JSON-lines file, one record per step
    # A structured-output request whose grammar is still compiling after this long fails with a message saying so;
    # the compilation's thread is left to finish while the next one takes its place (backend/structured/grammar.py)
    grammar_compile_timeout_s: float | None = 60.0
    # Prefix caching (backend/memory/prefix_cache.py): prompts starting with an already-computed prefix (in
    # blocks of lcm(128, page_size) positions, or a finished request's exact end) reuse its memory; up to
    # prefix_cache_entries cached states, whose compressor-ring snapshots take memory (plan_memory.py); of
    # them at most prefix_cache_end_entries requests' ends, whose snapshots also hold the open HCA window.
    enable_prefix_caching: bool = True
    prefix_cache_entries: int = 256
    prefix_cache_end_entries: int = 64
    # Speculative decoding with the checkpoint's MTP layer (backend/speculative.py): each decode verifies this many
    # draft tokens and emits up to one more than it accepts; 0: off. Steps with speculation run one at a time
    # (the host needs each step's accepted count to place the next).
    num_speculative_tokens: int = 0
    # How a sampled request (temperature > 0) drafts: `argmax`, the draft layer's most likely token, verified as a
    # draft distribution with all its mass there (vLLM's and SGLang's MTP drafts): every greedy or sampled row's drafts
    # then come from one static chain (a CUDA graph) and cost no host work; `sample`, a draw from the draft layer's
    # distribution, pass by pass, the host reading each pass's drafts (accepted more often where both distributions
    # are flat). `auto`: argmax with static decode steps (cuda_graphs), where the chain is a graph, else sample.
    # Either way the emitted tokens are distributed as without speculation.
    draft_sampling: str = "auto"
    # Speculation where it pays (with num_speculative_tokens): at each batch size (a static step's row bucket) the
    # engine times its verify steps and plain decode steps, and drafts while verifying emits more tokens per second
    # than decoding would (backend/engine_core.py SpeculationGate; vLLM's disable_by_batch_size, measured, not set).
    # Greedy outputs are the same either way. Ranks in lock-step (data parallelism over split experts) always draft.
    adaptive_speculation: bool = False
    # What requests' log-probabilities are of (vLLM's logprobs_mode): `raw_logprobs`, the model's own distribution
    # (after an output constraint's mask, before penalties, temperature and the top-k / top-p / min-p cut), as vLLM v1
    # reports them by default; `processed_logprobs`, the distribution the token was drawn from.
    logprobs_mode: str = "raw_logprobs"
    # Limits on requests.
    max_tokens_limit: int = 32768
    use_reference_kernels: bool = False  # force the torch references on CUDA
    # Decode steps at static (bucketed) shapes, replayed from CUDA graphs on CUDA (speculative decoding: verify steps,
    # and the draft passes after one as one chain, backend/speculative.py); on CPU, True runs the same padded steps,
    # a closure recorded where CUDA captures a graph (how the graph path is tested without a GPU). None: on for CUDA
    # with one rank (graphs of several ranks' steps capture their collectives: asked for with True, not yet run on
    # GPUs).
    cuda_graphs: bool | None = None
    # Programmatic dependent launch (kernels/common.py): each Triton kernel is started while the one before it runs and
    # waits on the device for it, so that a decode step's launches (some 800 at V4-Flash's batch 1) overlap the
    # kernels before them instead of following their ends. A CUDA device of compute capability 9.0 or more (Hopper).
    # Off until timed on a GPU (scripts/gpu_check.sh's v4_shapes part compares it with the default).
    programmatic_dependent_launch: bool = False
    # A layer's independent branches on a second CUDA stream (DeepseekV4Model.use_side_stream): the KV pools' writes and
    # the indexer beside q_b's GEMM, the shared expert beside the routed experts (SGLang's alternate stream): at decode
    # sizes each is a few small kernels that leave SMs idle. Off until timed on a GPU (the same gpu_check.sh part).
    side_stream: bool = False
    # Intra-op CPU threads for steps of at least SMALL_STEP_TOKENS tokens (smaller steps, decodes,
    # run on one: docs/host-loop.md#threads). None: torch's count where the engine is built (the cores).
    cpu_threads: int | None = None
    # Parallelism (backend/model/parallel_layout.py): ranks = max of the three; each is 1 or that many. Rank 0 is
    # this engine, ranks 1.. worker processes it starts, one per device. Data-parallel attention (each rank its own
    # requests' attention and pools, the ranks meeting at the MoE layers) combines with expert parallelism only.
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    collective_timeout_s: float = 600.0  # a collective (or a worker) silent this long fails the group
    # When the engine can no longer serve (a rank is gone): ask Triton to unload the model, so that its ready
    # endpoint says not ready (as Triton's vLLM backend does). Needs tritonserver --model-control-mode=explicit.
    unload_when_unavailable: bool = False
    # Once tritonserver stops (or unloads the model), how long the requests still running may go on before each ends
    # with an UNAVAILABLE error (backend/serving/server_stop.py). None: what the server's --exit-timeout-secs leaves
    # after the model's own stop (6 s less), so that tritonserver exits cleanly.
    stop_grace_s: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every rule on the values, cross-field ones included, in one place: raise ConfigError naming
        the parameter. Runs at construction, so a bad deployment fails before any weight loads (and in
        scripts/make_model_repository.py, before a repository is written)."""
        _check(self.device in ("auto", "cpu", "cuda"), "device", self.device, "auto, cpu or cuda")
        _check(self.load_format in LOAD_FORMATS, "load_format", self.load_format, " or ".join(LOAD_FORMATS))
        _check(self.load_format == "dummy" or not str(self.checkpoint).endswith(".json"), "checkpoint",
               self.checkpoint, "a checkpoint directory (a config file holds no weights: serve it with "
               "load_format=dummy)")
        if self.hf_overrides is not None:
            _check_hf_overrides(self.hf_overrides)
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
               "auto, float32, bfloat16 or float16")
        _check(self.policy in POLICIES, "policy", self.policy, " or ".join(POLICIES))
        _check(self.weight_format in ("auto", "dequantize", "fp8"), "weight_format", self.weight_format,
               "auto, dequantize or fp8")
        _check(self.numerics in NUMERICS, "numerics", self.numerics, " or ".join(NUMERICS))
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
               " or ".join(KV_CACHE_DTYPES))
        _check(not (self.kv_cache_dtype == "fp8" and self.numerics == "transformers"), "kv_cache_dtype",
               self.kv_cache_dtype, "bfloat16 or auto with numerics=transformers (the fp8 layout stores DeepSeek's "
               "roundings of the entries and its rotated indexer keys: set numerics=deepseek)")
        _check(not (self.cuda_graphs and self.resolved_device() == "cuda" and self.reference_kernels()),
               "cuda_graphs", self.cuda_graphs, "false or unset with the torch reference kernels on CUDA "
               "(use_reference_kernels): they read values back to the host, which a CUDA graph cannot capture")
        for name in CUDA_ONLY:
            _check(not getattr(self, name) or self.resolved_device() == "cuda", name, getattr(self, name),
                   f"false off a CUDA device (device resolves to {self.resolved_device()!r})")
        _check_int(self, "max_running_requests", 1)
        # Every running request's decode must fit one step, and with one request still in prefill
        # the mixed budget (max_num_batched_tokens - decodes) stays >= 1.
        _check_int(self, "max_num_batched_tokens", self.max_running_requests,
                   f"max_running_requests ({self.max_running_requests})")
        if self.decode_interleave_every is not None:
            _check_int(self, "decode_interleave_every", 1)
            _check(self.policy == "prefill_first", "decode_interleave_every", self.decode_interleave_every,
                   f"unset with policy {self.policy!r} (every mixed step already carries the decodes)")
        if self.prefill_chunk_tokens is not None:
            _check_int(self, "prefill_chunk_tokens", 1)
            _check(self.prefill_chunk_tokens <= self.max_num_batched_tokens, "prefill_chunk_tokens",
                   self.prefill_chunk_tokens, f"at most max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.max_queue_size is not None:
            _check_int(self, "max_queue_size", 1)
        if self.priority_aging_s is not None:
            _check(is_number(self.priority_aging_s) and self.priority_aging_s >= 0, "priority_aging_s",
                   self.priority_aging_s, "a number of seconds >= 0 (0: strict priority)")
        if self.grammar_compile_timeout_s is not None:
            _check(is_number(self.grammar_compile_timeout_s) and self.grammar_compile_timeout_s > 0,
                   "grammar_compile_timeout_s", self.grammar_compile_timeout_s, "a number of seconds > 0")
        if self.step_log is not None:
            _check(isinstance(self.step_log, str) and Path(self.step_log).parent.is_dir()
                   and not Path(self.step_log).is_dir(), "step_log", self.step_log,
                   "a file path in an existing directory (its records are appended)")
        if self.itl_target_ms is not None:
            _check(is_number(self.itl_target_ms) and self.itl_target_ms > 0, "itl_target_ms", self.itl_target_ms,
                   "a number > 0")
        _check_int(self, "num_tokens", 1)
        _check(is_number(self.swa_full_tokens_ratio) and 0.0 < self.swa_full_tokens_ratio <= 1.0,
               "swa_full_tokens_ratio", self.swa_full_tokens_ratio, "in (0, 1]")
        _check(is_int(self.page_size) and self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
               "page_size", self.page_size, "a power of two")
        _check_int(self, "max_tokens_limit", 1)
        if self.cpu_threads is not None:
            _check_int(self, "cpu_threads", 1)
        _check_int(self, "prefix_cache_entries", 1)
        _check_int(self, "prefix_cache_end_entries", 0)
        _check(self.prefix_cache_end_entries <= self.prefix_cache_entries, "prefix_cache_end_entries",
               self.prefix_cache_end_entries, f"at most prefix_cache_entries ({self.prefix_cache_entries}), of which "
               "the request ends are a part")
        for name in PARALLEL_SIZES:
            _check_int(self, name, 1)
        world = self.world_size
        for name in PARALLEL_SIZES:
            _check(getattr(self, name) in (1, world), name, getattr(self, name),
                   f"1 or the number of ranks ({world}): each kind of parallelism spans every rank or none")
        _check(self.data_parallel_size == 1 or self.tensor_parallel_size == 1, "data_parallel_size",
               self.data_parallel_size, "1 with tensor_parallel_size > 1 (data-parallel attention gives each rank "
               "whole attention heads; combine it with expert_parallel_size)")
        _check(is_number(self.collective_timeout_s) and 0 < self.collective_timeout_s <= MAX_TIMEOUT_S,
               "collective_timeout_s", self.collective_timeout_s, f"a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}")
        _check(self.stop_grace_s is None or (is_number(self.stop_grace_s) and 0 <= self.stop_grace_s <= MAX_TIMEOUT_S),
               "stop_grace_s", self.stop_grace_s, f"a number of seconds >= 0 and <= {MAX_TIMEOUT_S:g}")
        _check(is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
               "num_speculative_tokens", self.num_speculative_tokens,
               f"an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0: off)")
        _check(self.draft_sampling in DRAFT_SAMPLING, "draft_sampling", self.draft_sampling,
               " or ".join(DRAFT_SAMPLING))
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode, " or ".join(LOGPROBS_MODES))
        if self.num_speculative_tokens:
            verify = self.max_running_requests * (1 + self.num_speculative_tokens)
            _check(self.max_num_batched_tokens >= verify, "num_speculative_tokens", self.num_speculative_tokens,
                   f"at most what max_num_batched_tokens ({self.max_num_batched_tokens}) holds: every running "
                   f"request's verify (max_running_requests * (1 + num_speculative_tokens) = {verify} tokens) must "
                   "fit one step")

    @property
    def world_size(self) -> int:
        return max(getattr(self, name) for name in PARALLEL_SIZES)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "EngineConfig":
        """Build from string key/values (config.pbtxt parameters); empty strings mean 'unset'; the Python backend's own
        parameters are left to it."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, raw in params.items():
            if key in PYTHON_BACKEND_PARAMETERS:
                continue
            if key not in fields:
                raise ConfigError(f"unknown parameter {key!r}; known: {', '.join(sorted(fields))}")
            value = raw.strip() if isinstance(raw, str) else raw
            if value in ("", None):
                continue
            kwargs[key] = _parse(key, fields[key].type, value)
        for path in ("checkpoint", "chat_template"):
            if path in kwargs:
                kwargs[path] = os.path.expanduser(kwargs[path])
        try:
            return cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_cuda_graphs(self) -> bool:
        if self.cuda_graphs is None:  # (the torch references read values back: no CUDA graph can capture them)
            return self.resolved_device() == "cuda" and self.world_size == 1 and not self.reference_kernels()
        return self.cuda_graphs

    def reference_kernels(self) -> bool:
        """Whether the model runs the kernels' torch references (`use_reference_kernels`, or DSV4_REFERENCE_KERNELS=1:
        kernels/dispatch.py `default_mode`)."""
        from kernels.dispatch import default_mode  # (not at import: scripts that only read the config stay light)

        return default_mode(self.use_reference_kernels) == "reference"

    def resolved_draft_sampling(self) -> str:
        if self.draft_sampling == "auto":
            return "argmax" if self.resolved_cuda_graphs() else "sample"
        return self.draft_sampling

    def resolved_dtype(self):
        import torch

        name = self.dtype
        if name == "auto":
            name = "bfloat16" if self.resolved_device() == "cuda" else "float32"
        return getattr(torch, name)


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"parameter {name!r}: invalid value {value!r} (expected {expected})")


def _check_int(config: "EngineConfig", name: str, minimum: int, minimum_text: str | None = None) -> None:
    value = getattr(config, name)
    _check(is_int(value) and value >= minimum, name, value, f"an integer >= {minimum_text or minimum}")


def _check_hf_overrides(overrides) -> None:
    """A JSON object of the config.json keys this engine reads (backend/model/config.py `config_keys`), each value of
    that key's type."""
    from backend.model.config import config_keys, value_fits

    _check(isinstance(overrides, dict), "hf_overrides", overrides,
           "a JSON object of config.json keys this engine reads")
    keys = config_keys()
    for key, value in overrides.items():
        _check(key in keys, "hf_overrides", overrides, f"config.json keys this engine reads; {key!r} is not one "
               f"(it reads: {', '.join(sorted(keys))})")
        _check(value_fits(value, keys[key]), "hf_overrides", overrides, f"{key!r} of type {keys[key]}, not "
               f"{type(value).__name__}")


def parse_parameter(name: str, value: str):
    """One string parameter (a config.pbtxt value, a command-line flag) as the EngineConfig field `name` takes it."""
    field = {f.name: f for f in dataclasses.fields(EngineConfig)}[name]
    return _parse(name, field.type, value)


def _parse(name: str, type_name: str, value: str):
    """Parse one string parameter by its dataclass annotation (a dict from JSON)."""
    base = type_name.replace(" | None", "")
    if base == "dict":
        try:
            return json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"parameter {name!r}: {value!r} is not JSON ({exc})") from None
    try:
        if base == "int":
            return int(value)
        if base == "float":
            return float(value)
        if base == "bool":
            lowered = str(value).lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return lowered in ("true", "1", "yes")
        return str(value)
    except ValueError:
        raise ConfigError(f"parameter {name!r}: cannot parse {value!r} as {base}") from None
