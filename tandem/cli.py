"""The ``tandem`` command: ``generate``, ``serve``, ``bench``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from tandem.errors import TandemError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by generate, serve and offline benchmarks (vLLM spellings)."""
    from tandem.config.speculative import add_speculative_cli_args

    p.add_argument("--tokenizer", default=None)
    p.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    p.add_argument("--revision", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="queue the next decode step before reading this one's tokens "
                        "(default: on with CUDA, off on CPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached full blocks of shared prefixes (default: on, as in vLLM)")
    add_speculative_cli_args(p)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, object]:
    from tandem.config.speculative import speculative_config_from_args

    return dict(
        tokenizer=ns.tokenizer, dtype=ns.dtype, device=ns.device, seed=ns.seed, load_format=ns.load_format,
        revision=ns.revision, max_model_len=ns.max_model_len, gpu_memory_utilization=ns.gpu_memory_utilization,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes, max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens, async_scheduling=ns.async_scheduling,
        block_size=ns.block_size,
        enable_prefix_caching=ns.enable_prefix_caching,
        speculative_config=speculative_config_from_args(ns),
    )


def _generate(ns: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    llm = LLM(ns.model, **engine_kwargs(ns))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.sampling_seed, stop=ns.stop or None)
    if ns.chat:
        outs = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(ns.prompt, params, use_tqdm=False)
    out = outs[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    c = out.outputs[0]
    if ns.verbose and c.num_draft_tokens:
        print(f"[speculation] drafted {c.num_draft_tokens}, accepted {c.num_accepted_tokens}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tandem.loader.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt and print it")
    g.add_argument("prompt")
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("-v", "--verbose", action="store_true")
    add_engine_args(g)
    g.set_defaults(func=_generate)

    try:
        from tandem.server.cli import add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)

    try:
        from tandem.bench.cli import add_bench_subparsers
    except ImportError:
        pass
    else:
        b = sub.add_parser("bench", help="benchmarks (vLLM-compatible)")
        add_bench_subparsers(b.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
