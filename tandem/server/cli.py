"""``tandem serve`` / ``python -m tandem.serve``: start the OpenAI-compatible server.

``tandem serve [MODEL] [--model MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
[--served-model-name NAME ...] [--metrics-prefix tandem|vllm] [--uvicorn-log-level info] [--disable-log-stats] [--disable-log-requests]
[--tool-call-parser hermes] [--enable-auto-tool-choice]``
plus every engine flag of :func:`tandem.engine.args.add_engine_args` (including
``--speculative-config`` and vLLM's deprecated speculation flags, which warn through
:mod:`tandem.config.speculative`). MODEL defaults to the built-in default model; ``--api-key``
defaults to ``$TANDEM_API_KEY`` (read by :mod:`tandem.config.env`). ``--model X`` is vLLM's spelling
of the positional MODEL (both given and different: an error). ``--disable-log-requests`` is accepted
and changes nothing: the engine logs no line per request (uvicorn's access log follows
``--uvicorn-log-level``, as vLLM's follows its own flag). docs/vllm_compat.md maps vLLM's serve flags.

Startup errors a user can cause (bad flags, bad speculative config, missing model, too little KV
memory) print one ``error: ...`` line and exit with status 2; nothing is served.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tandem.errors import ConfigError, TandemError

logger = logging.getLogger("tandem.server")

METRICS_PREFIXES = ("tandem", "vllm")  # = tandem.server.metrics.METRICS_PREFIXES (not imported: keeps --help light)
TOOL_CALL_PARSERS = ("hermes",)  # = tandem.server.tool_parsers.TOOL_PARSERS (not imported: keeps --help light)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags + the shared engine flags."""
    from tandem.engine.args import add_engine_args
    from tandem.loader.registry import DEFAULT_MODEL

    p.add_argument("model", nargs="?", default=None,
                   help=f"model path, Hugging Face directory or built-in alias (default: {DEFAULT_MODEL})")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL (vLLM spelling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $TANDEM_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) the API reports and accepts in 'model' (default: MODEL)")
    p.add_argument("--metrics-prefix", default="tandem", choices=METRICS_PREFIXES,
                   help="prefix of every /metrics series: 'tandem:...' (default) or vLLM's own 'vllm:...', "
                        "so existing vLLM Grafana dashboards work unchanged")
    p.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    p.add_argument("--disable-log-stats", action="store_true",
                   help="do not log throughput / KV usage / acceptance every few seconds")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM launch scripts: the engine never logs individual requests "
                        "(uvicorn's access log follows --uvicorn-log-level)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool calls are read from the model's text (chat 'tools'): 'hermes' = "
                        "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Hermes, Qwen)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto'); needs --tool-call-parser")
    add_engine_args(p)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``tandem`` command's subparsers."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                              description="Serve a model over the OpenAI API (completions, chat, /metrics).")
    add_serve_args(p)
    p.set_defaults(func=run_serve)
    return p


def resolve_model_arg(ns: argparse.Namespace) -> str:
    from tandem.loader.registry import DEFAULT_MODEL

    if ns.model is not None and ns.model_flag is not None and ns.model != ns.model_flag:
        raise TandemError(f"two different models given: {ns.model!r} and --model {ns.model_flag!r}")
    return ns.model or ns.model_flag or DEFAULT_MODEL


def build_server(ns: argparse.Namespace) -> tuple[Any, Any]:
    """(FastAPI app, AsyncEngine) for parsed ``serve`` flags. Raises TandemError on bad config."""
    from tandem.config.env import api_key
    from tandem.engine.args import engine_config, engine_kwargs
    from tandem.engine.llm_engine import LLMEngine
    from tandem.server.api import build_app
    from tandem.server.async_engine import AsyncEngine
    from tandem.server.tools import ToolConfig

    model = resolve_model_arg(ns)
    if getattr(ns, "skip_tokenizer_init", False):
        raise ConfigError("skip_tokenizer_init", "the server needs the tokenizer (text prompts, chat templates, "
                                                 "streamed text); --skip-tokenizer-init works with LLM(...) only")
    tools = ToolConfig(getattr(ns, "tool_call_parser", None), getattr(ns, "enable_auto_tool_choice", False))
    if tools.enable_auto_tool_choice and tools.parser is None:
        raise ConfigError("enable_auto_tool_choice", "--enable-auto-tool-choice needs --tool-call-parser",
                          allowed=TOOL_CALL_PARSERS)
    names = list(ns.served_model_name) if ns.served_model_name else [model]
    engine = LLMEngine(engine_config(model, **engine_kwargs(ns), log_stats=not ns.disable_log_stats))
    async_engine = AsyncEngine(engine, model_name=names[0], metrics_prefix=getattr(ns, "metrics_prefix", "tandem"))
    app = build_app(async_engine, names, ns.api_key or api_key(), model_aliases=[model], tools=tools)
    return app, async_engine


def run_serve(ns: argparse.Namespace) -> int:
    """Build the engine, serve until interrupted. Returns the process exit status."""
    import uvicorn
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # vLLM's choice: no *_created series (process-wide, so only in the CLI)
    try:
        app, async_engine = build_server(ns)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # unreadable files, bad values deep in a loader
        logger.debug("startup failed", exc_info=True)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", ns.served_model_name or resolve_model_arg(ns),
                ns.host, ns.port)
    try:
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level, timeout_keep_alive=30)
    finally:
        async_engine.shutdown()
    return 0


def main(argv: list[str] | None = None, prog: str = "tandem serve") -> int:
    """Entry point of ``python -m tandem.serve``."""
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over the OpenAI API.")
    add_serve_args(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    return run_serve(ns)
