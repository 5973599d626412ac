"""Tokenizers for every checkpoint kind, and chat-template rendering to token ids.

``load_tokenizer(source)`` accepts a checkpoint, a built-in alias, an HF directory with tokenizer
files, a ``.gguf`` file, or a directory holding exactly one ``.gguf``, and returns a fast
``transformers`` tokenizer. GGUF tokenizers are rebuilt by transformers from the file's metadata
(the class AutoTokenizer would pick, without the model config it builds to pick it:
``_build_gguf_tokenizer``), which takes seconds for Gemma's 262k vocabulary, so the result is
saved once under ``<cache>/.tokenizers/`` keyed by the file's path, size, mtime and the
transformers version, and reloaded from there next time. Before it is cached it is
checked against the file (``gguf_tokenizer_check``: BOS/EOS flags applied, its vocabulary must
encode back to itself), because some transformers versions build Gemma's wrong. The cache entry is
written to a temporary directory and renamed into place, so a reader never sees a half-written one.

``apply_chat_template`` renders messages to text with the model's template and tokenizes it
*without* adding special tokens: templates that want a BOS write it themselves (Gemma's does), and
adding one again would double it. This matches ``tokenizer.apply_chat_template(tokenize=True)``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.errors import ModelLoadError, RequestError
from tandem.loader.gguf_tokenizer_check import checked_gguf_tokenizer, gguf_architecture
from tandem.loader.registry import cache_dir, is_builtin, resolve_model

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# GGUF general.architecture → the model type transformers' GGUF loader gives it (Gemma 3's GGUF
# holds the text model only).
_GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


def single_gguf_in(directory: Path) -> Path | None:
    """The one ``*.gguf`` in ``directory``; None if there is none; ModelLoadError if several."""
    found = sorted(directory.glob("*.gguf"))
    if len(found) > 1:
        raise ModelLoadError(
            f"{directory} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
            "pass the path of the one to load"
        )
    return found[0] if found else None


def load_tokenizer(source: Any, *, use_cache: bool = True) -> PreTrainedTokenizerBase:
    """A fast HF tokenizer for ``source``: a Checkpoint, alias, HF directory or GGUF path."""
    path_like = getattr(source, "tokenizer_path", source)  # a Checkpoint knows where its tokenizer is
    if path_like is None:
        raise ModelLoadError(
            f"checkpoint {getattr(source, 'source', source)!r} has no tokenizer; "
            "pass tokenizer=<HF directory, .gguf file or alias>"
        )
    name = str(path_like)
    path = Path(resolve_model(name) if is_builtin(name) else name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_tokenizer(path, use_cache=use_cache)
    if path.is_dir():
        if any((path / f).is_file() for f in _TOKENIZER_FILES):
            return _from_pretrained(str(path))
        gguf = single_gguf_in(path)
        if gguf is not None:
            return _load_gguf_tokenizer(gguf, use_cache=use_cache)
        raise ModelLoadError(
            f"no tokenizer in {path} (looked for {', '.join(_TOKENIZER_FILES)} or a .gguf file); "
            "pass tokenizer=<HF directory, .gguf file or alias>"
        )
    if not path.exists():
        raise ModelLoadError(f"tokenizer path {path} does not exist")
    raise ModelLoadError(f"cannot load a tokenizer from {path}: expected a directory or a .gguf file")


def _from_pretrained(
    path: str, *, tokenizer_class: Any = AutoTokenizer, **kwargs: Any
) -> PreTrainedTokenizerBase:
    try:
        tok = tokenizer_class.from_pretrained(path, **kwargs)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, KeyError, …)
        what = f"{path}/{kwargs['gguf_file']}" if "gguf_file" in kwargs else path
        raise ModelLoadError(f"cannot load tokenizer from {what}: {e}") from e
    if not getattr(tok, "is_fast", False):
        logger.warning("tokenizer at %s is a slow (Python) tokenizer", path)
    return tok


def _build_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` builds, without the
    model config it builds first to choose the class.

    transformers 5 makes that config from the file (``AutoConfig.for_model``), and importing the
    config class brings in the model stack (``torch.distributed.tensor``, sympy): ~80 MB more
    resident and ~180 MB at the peak for SmolLM2, on a first run that must stay under 600 MB; for
    Gemma 3 it reads every tensor (15 s, 975 MB peak, against 2.7 s and 590 MB). The class is the
    one AutoTokenizer would pick: the model type's registered tokenizer, else ``TokenizersBackend``
    (its fallback). transformers 4 (no ``TokenizersBackend``) and architectures not listed here
    take AutoTokenizer's own way. ``tests/loader/test_loader.py`` compares both ways.
    """
    model_type = _GGUF_MODEL_TYPES.get(gguf_architecture(path) or "")
    backend = getattr(transformers, "TokenizersBackend", None)
    if model_type is None or backend is None:
        return _from_pretrained(str(path.parent), gguf_file=path.name)
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if TOKENIZER_MAPPING_NAMES.get(model_type) is not None:
        return _from_pretrained(str(path.parent), gguf_file=path.name, tokenizer_type=model_type)
    return _from_pretrained(str(path.parent), gguf_file=path.name, tokenizer_class=backend)


def gguf_tokenizer_dir(gguf_path: str | Path) -> Path:
    """The directory that holds (or will hold) the HF-format tokenizer files of a GGUF file.

    Any ``AutoTokenizer.from_pretrained(dir)`` can load it once it exists; :func:`load_tokenizer`
    writes it on first use. It changes when the file or the transformers version changes.
    """
    return _cache_entry(Path(gguf_path))


def _cache_entry(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    # "checked": entries written before gguf_tokenizer_check existed are rebuilt (and checked)
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|checked"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / ".tokenizers" / f"{gguf_path.stem}-{digest}"


def _load_gguf_tokenizer(path: Path, *, use_cache: bool) -> PreTrainedTokenizerBase:
    entry = _cache_entry(path) if use_cache else None
    if entry is not None and entry.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception as e:  # noqa: BLE001 - a damaged cache entry of any kind: rebuild it
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    tok = checked_gguf_tokenizer(_build_gguf_tokenizer(path), path)
    if entry is not None:
        _save_entry(tok, entry)
    return tok


def _save_entry(tok: PreTrainedTokenizerBase, entry: Path) -> None:
    """Best effort: a cache that cannot be written only costs time, never correctness."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process won the race; its entry is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - caching is an optimisation only
        logger.warning("could not cache tokenizer at %s: %s", entry, e)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (``chat_template`` overrides it).

    Raises RequestError if the model has no chat template or the template rejects the messages
    (e.g. roles that do not alternate).
    """
    text = render_chat_template(tokenizer, messages, add_generation_prompt, chat_template=chat_template,
                                **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """``messages`` rendered with the chat template, as text (its token ids: encode it without
    special tokens, as ``apply_chat_template`` does).

    Raises RequestError if the model has no chat template or the template rejects the messages
    (e.g. roles that do not alternate).
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise RequestError(
            "this model has no chat template (it is probably a base model): send a plain-text "
            "prompt to the completions API instead, or pass a chat_template",
            param="messages",
            code="no_chat_template",
        )
    msgs = list(messages)
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise RequestError(
                f"messages[{i}] must be a mapping with 'role' and 'content'", param="messages"
            )
    try:
        text = tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
            **template_kwargs,
        )
    except Exception as e:  # jinja2 TemplateError and raise_exception() from the template itself
        raise RequestError(f"chat template rejected the messages: {e}", param="messages") from e
    return str(text)
