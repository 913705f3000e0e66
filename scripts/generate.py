#!/usr/bin/env python3
r"""Offline generation through the engine: every prompt submitted at once, so they batch.

    .venv/bin/python scripts/generate.py --checkpoint checkpoints/dsv4-tiny --prompts-file prompts.json --max-tokens 32
    .venv/bin/python scripts/generate.py ... --tensor-parallel-size 2 [--expert-parallel-size 2]  # 2 ranks (processes)
    .venv/bin/python scripts/generate.py ... --data-parallel-size 2 --expert-parallel-size 2  # attention by request
    .venv/bin/python scripts/generate.py --checkpoint docs/configs/deepseek-v4-flash.config.json --load-format dummy \
        --hf-overrides '{"num_hidden_layers": 4}' ...     # random weights at V4-Flash's shapes, no weight file

    .venv/bin/python scripts/generate.py ... --chats-file chats.json --chat-template-kwargs '{"thinking": true}'
    .venv/bin/python scripts/generate.py ... --chats-file chats.json --tools-file tools.json  # tools, each chat
    .venv/bin/python scripts/generate.py ... --tools-file tools.json --tool-choice required  # answers: tool calls

Prints a JSON list to stdout, one object per prompt in input order: output_ids, text, finish_reason.
Input files are JSON lists of strings (--prompts-file), of lists of token ids (--input-ids-file), or of chats
(--chats-file: each a list of OpenAI messages, rendered as the server renders a `messages` input: --chat-template's
template, else the checkpoint's, else DeepSeek-V4's own format, with --chat-template-kwargs' options and
--tools-file's tools, a JSON list of OpenAI tools, shown as --tool-choice has them: auto, none, required or a named
function's JSON, as the server's tool_choice input; every chat is rendered before the model loads, so that a bad one
fails at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.chat import chat_format, chat_prompt_ids, checked_options, checked_tools  # noqa: E402
from backend.config import ConfigError, EngineConfig  # noqa: E402
from backend.deployment import check_deployment  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.engine_core import tokenizer_directory  # noqa: E402
from backend.errors import load_json  # noqa: E402
from backend.request import SamplingParams  # noqa: E402
from backend.structured.params import GuidedDecoding  # noqa: E402
from backend.tool_choice import ToolChoice, parse_tool_choice  # noqa: E402
from scripts.checkpoint_flags import add_checkpoint_flags, checkpoint_settings  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(parser)
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--prompts-file", type=Path, help="JSON list of prompt strings")
    inputs.add_argument("--input-ids-file", type=Path, help="JSON list of lists of token ids")
    inputs.add_argument("--chats-file", type=Path, help="JSON list of chats, each a list of OpenAI messages")
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file in place of the checkpoint's")
    parser.add_argument("--chat-template-kwargs", type=_chat_options, default=None, metavar="JSON",
                        help='the chat template\'s options, e.g. \'{"thinking": true}\' (DeepSeek-V4\'s format)')
    parser.add_argument("--tools-file", type=Path, default=None,
                        help='JSON list of OpenAI tools ({"type": "function", "function": {...}}) every chat offers')
    parser.add_argument("--tool-choice", type=_tool_choice, default=None, metavar="CHOICE",
                        help="auto (the default), none, required, or a named function's JSON, as the server's "
                             "tool_choice (required and a function: answers constrained to DeepSeek-V4's tool calls)")
    parser.add_argument("--parallel-tool-calls", action=argparse.BooleanOptionalAction, default=True,
                        help="--no-parallel-tool-calls: --tool-choice required makes one call")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None)
    parser.add_argument("--max-running-requests", type=int, default=16)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--weight-format", choices=["auto", "dequantize", "fp8"], default="auto",
                        help="quantized checkpoints: dequantize at load, or keep FP8/MXFP4 (auto: fp8 on CUDA)")
    parser.add_argument("--numerics", choices=["auto", "transformers", "deepseek"], default=EngineConfig.numerics,
                        help="deepseek: also DeepSeek's roundings of the KV entries and indexer (docs/numerics.md)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "fp8"], default=EngineConfig.kv_cache_dtype,
                        help="fp8: the pools store DeepSeek's layout (584-byte entries, FP4 indexer keys; needs "
                             "--numerics deepseek)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks splitting the attention heads (and, without EP, every expert's columns)")
    parser.add_argument("--expert-parallel-size", type=int, default=1, help="ranks splitting the routed experts")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="ranks each running its own requests' attention (with --expert-parallel-size: the same)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.enable_prefix_caching,
                        help="reuse computed prompt prefixes across the prompts (docs/prefix-caching.md)")
    parser.add_argument("--prefix-cache-entries", type=int, default=EngineConfig.prefix_cache_entries)
    parser.add_argument("--prefix-cache-end-entries", type=int, default=EngineConfig.prefix_cache_end_entries)
    parser.add_argument("--policy", choices=["mixed", "prefill_first"], default=EngineConfig.policy)
    parser.add_argument("--overlap-scheduling", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.overlap_scheduling,
                        help="schedule step N+1 while step N runs (docs/host-loop.md)")
    parser.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens,
                        help="draft tokens per decode from the checkpoint's MTP layer (docs/speculative.md)")
    args = parser.parse_args(argv)
    if args.chats_file is None and (args.chat_template is not None or args.chat_template_kwargs is not None
                                    or args.tools_file is not None or args.tool_choice is not None):
        parser.error("--chat-template, --chat-template-kwargs, --tools-file and --tool-choice render --chats-file's "
                     "chats: give one")
    return args


def _tool_choice(text: str):
    """--tool-choice, read as the server reads a tool_choice input."""
    try:
        return parse_tool_choice(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _chat_options(text: str) -> dict:
    """--chat-template-kwargs, checked as the server checks a chat_template_kwargs input."""
    try:
        return checked_options(load_json(text, "chat_template_kwargs"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: {exc}") from None


def render_chats(args, config: EngineConfig) -> list[tuple[str, GuidedDecoding | None]] | None:
    """--chats-file's chats as prompt texts (the chat format the server would use), each with the output constraint
    its tool choice makes (None: none); None without the flag."""
    if args.chats_file is None:
        return None
    chats = _read_json(args.chats_file)
    if not isinstance(chats, list):
        raise SystemExit(f"{args.chats_file}: expected a JSON list of chats (lists of messages)")
    try:
        chat = chat_format(tokenizer_directory(config), config.chat_template)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    tools = _read_json(args.tools_file) if args.tools_file is not None else None
    try:
        choice = ToolChoice.of(args.tool_choice, checked_tools(tools), parallel=args.parallel_tool_calls)
    except ValueError as exc:
        raise SystemExit(f"--tool-choice: {exc}") from None
    texts = []
    for i, messages in enumerate(chats):
        try:
            text = chat.render(messages, args.chat_template_kwargs, choice.shown_tools)
            texts.append((text, choice.constraint(text, chat.deepseek_v4_format)))
        except ValueError as exc:
            raise SystemExit(f"{args.chats_file}: chat {i}: {exc}") from None
    return texts


def load_prompts(args, tokenizer, chats: list[tuple[str, GuidedDecoding | None]] | None) -> list[list[int]]:
    if args.prompts_file is not None:
        prompts = _read_json(args.prompts_file)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise SystemExit(f"{args.prompts_file}: expected a JSON list of strings")
        return [tokenizer.encode(p).ids for p in prompts]
    if chats is not None:
        prompts = []
        for i, (text, _) in enumerate(chats):
            try:
                prompts.append(chat_prompt_ids(tokenizer, text))
            except ValueError as exc:
                raise SystemExit(f"{args.chats_file}: chat {i}: {exc}") from None
        return prompts
    ids = _read_json(args.input_ids_file)
    if not isinstance(ids, list) or not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in ids):
        raise SystemExit(f"{args.input_ids_file}: expected a JSON list of lists of token ids")
    return ids


def chat_params(params: SamplingParams, chats: list[tuple[str, GuidedDecoding | None]]) -> list[SamplingParams]:
    """Each chat's sampling: `params`, its answer constrained as its tool choice asks (none: unchanged)."""
    return [params if guided is None else dataclasses.replace(params, guided_decoding=guided) for _, guided in chats]


def main(argv=None) -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    try:  # (every setting checked before the model loads, which takes minutes at V4's size)
        config, params = settings(args)
        check_deployment(config)
        chats = render_chats(args, config)
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError) as exc:  # (ConfigError, a checkpoint's errors, a request's: ValueErrors)
        _fail(exc)
    try:
        prompts = load_prompts(args, engine.tokenizer, chats)
        results = engine.generate(prompts, chat_params(params, chats) if chats is not None else params)
    except ValueError as exc:  # (a prompt the engine refuses: empty, out of the vocabulary, too long)
        _fail(exc)
    finally:
        engine.shutdown()  # with several ranks: the workers exit
    json.dump([{k: r[k] for k in ("output_ids", "text", "finish_reason")} for r in results], sys.stdout)
    sys.stdout.write("\n")


def _fail(error: Exception) -> None:
    """A setting or prompt that cannot be served: one line, as argparse reports a bad flag, exit status 2."""
    print(f"generate.py: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def settings(args) -> tuple[EngineConfig, SamplingParams]:
    """The engine's configuration and the requests' sampling the flags give (ValueError naming a bad one)."""
    config = EngineConfig(**checkpoint_settings(args), device=args.device, dtype=args.dtype,
                          weight_format=args.weight_format, numerics=args.numerics,
                          kv_cache_dtype=args.kv_cache_dtype,
                          prefill_chunk_tokens=args.prefill_chunk_tokens,
                          max_running_requests=args.max_running_requests,
                          tensor_parallel_size=args.tensor_parallel_size,
                          expert_parallel_size=args.expert_parallel_size,
                          data_parallel_size=args.data_parallel_size,
                          enable_prefix_caching=args.enable_prefix_caching,
                          prefix_cache_entries=args.prefix_cache_entries,
                          policy=args.policy, overlap_scheduling=args.overlap_scheduling,
                          prefix_cache_end_entries=args.prefix_cache_end_entries,
                          num_speculative_tokens=args.num_speculative_tokens, chat_template=args.chat_template)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    return config, params


if __name__ == "__main__":
    main()
