"""The workload of an online benchmark: the tokenizer to count tokens with, and the requests the dataset flags ask for.

Shared by ``bench serve`` and ``bench compare`` (both send the same sampled requests to servers).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tandem.bench.datasets import SampleRequest, normalize_dataset_name, sample_requests
from tandem.bench.serve import BenchmarkError


def _tandem_tokenizer_loader() -> Any | None:
    """tandem's own loader (local HF dirs, ``.gguf`` files with a cache, built-in aliases), if present."""
    try:
        from tandem.loader import tokenizer as tandem_tok
    except ImportError:
        return None
    return getattr(tandem_tok, "load_tokenizer_for", None) or getattr(tandem_tok, "load_tokenizer", None)


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The benchmark tokenizer for a model id, local directory, ``.gguf`` file or tandem alias.

    Order: tandem's loader first (it resolves aliases such as ``smollm2-135m-instruct`` and caches
    GGUF tokenizers, which transformers rebuilds slowly), then ``transformers.AutoTokenizer`` from
    local files / the HF cache (first when ``--trust-remote-code`` is set), and only for
    ``org/name`` ids the hub itself (offline machines retry for ~45 s before failing). All failing
    is an error that asks for ``--tokenizer``.
    """
    path = Path(name_or_path).expanduser()

    def hf(local_only: bool) -> Any:
        from transformers import AutoTokenizer

        if path.is_file() and path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(
            name_or_path, trust_remote_code=trust_remote_code, local_files_only=local_only
        )

    tandem_loader = _tandem_tokenizer_loader()
    attempts = [lambda: hf(True)]
    if tandem_loader is not None:
        attempts.insert(0 if not trust_remote_code else 1, lambda: tandem_loader(name_or_path))
    if not path.exists() and "/" in name_or_path:  # looks like a hub id ("org/name"): go online last
        attempts.append(lambda: hf(False))
    errors = []
    for attempt in attempts:
        try:
            return attempt()
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; try the next loader
            errors.append(f"{type(exc).__name__}: {exc}")
    raise BenchmarkError(
        f"cannot load a tokenizer for {name_or_path!r} ({'; '.join(errors)}); "
        "pass --tokenizer with a local HF tokenizer directory, model path, .gguf file or tandem alias"
    )


def sample_from_args(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The workload described by the dataset flags."""
    name = normalize_dataset_name(args.dataset_name)
    per_dataset: dict[str, dict[str, Any]] = {
        "sharegpt": {"output_len": args.sharegpt_output_len, "path": args.dataset_path},
        "humaneval": {"output_len": args.humaneval_output_len, "path": args.dataset_path},
        "random": {
            "input_len": args.random_input_len,
            "output_len": args.random_output_len,
            "range_ratio": args.random_range_ratio,
            "prefix_len": args.random_prefix_len,
        },
        "prefix_repetition": {
            "prefix_len": args.prefix_repetition_prefix_len,
            "suffix_len": args.prefix_repetition_suffix_len,
            "num_prefixes": args.prefix_repetition_num_prefixes,
            "output_len": args.prefix_repetition_output_len,
        },
        "custom": {"path": args.dataset_path, "output_len": args.custom_output_len},
        "edit": {"output_len": args.edit_output_len, "path": args.dataset_path},
        "repeated_task": {"output_len": args.edit_output_len, "repeats": args.repeated_task_repeats,
                          "path": args.dataset_path},
    }
    return sample_requests(name, tokenizer, args.num_prompts, seed=args.seed, **per_dataset[name])
