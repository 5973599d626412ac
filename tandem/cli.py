"""The ``tandem`` command: ``generate``, ``serve``, ``bench``, ``models``, ``train-draft``.

The engine flags of ``generate`` (and of ``serve`` and the offline benchmarks) come from
:mod:`tandem.engine.args`; ``serve`` and ``bench`` register their own subcommands.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tandem.errors import TandemError


def _generate(ns: argparse.Namespace) -> int:
    from tandem.engine.args import engine_kwargs
    from tandem.engine.llm import LLM
    from tandem.sampling_params import SamplingParams

    llm = LLM(ns.model, **engine_kwargs(ns))
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
    from tandem.engine.args import add_engine_args
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

    from tandem.loader.cli import add_models_parser

    add_models_parser(sub)

    from tandem.train.cli import add_train_parser

    add_train_parser(sub)
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
