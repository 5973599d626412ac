"""``bench compare`` configurations: a JSON dict of ``tandem serve`` options per config, and its server command.

A ``--config`` is a JSON file or the JSON object itself, inline (``--config '{"name": "base"}'``).

Config dict → server command: ``[python, -m, tandem.serve, MODEL, --port, P, ...]`` where each key
becomes ``--key-with-dashes``; dict values are passed as JSON, lists as separate values, ``True``
as a bare flag and ``False`` as ``--no-key``. Prefix caching is OFF (``--no-enable-prefix-caching``)
unless the config sets ``"enable_prefix_caching": true``, so cache hits cannot masquerade as
speculative gains. Keys that are not server options: ``name``, ``model`` (overrides ``--model``),
``cost_c``, ``cost_v``, ``draft_cost_ratio``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config.validate import cli_flag
from tandem.errors import TandemError

META_KEYS = frozenset({"name", "model", "cost_c", "cost_v", "draft_cost_ratio"})
FREE_DRAFT_METHODS = frozenset({"ngram", "suffix", "prompt_lookup"})


class CompareError(TandemError, RuntimeError):
    """A comparison cannot proceed (bad config file, server failed to start…)."""


@dataclass(frozen=True)
class CompareConfig:
    name: str
    options: dict[str, Any]  # tandem serve options, META_KEYS removed
    model: str | None = None
    method: str | None = None
    k: int | None = 0  # num_speculative_tokens; 0 = no speculation; None = not stated (variable)
    cost_c: float | None = None
    cost_v: float = 0.0
    c_source: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], fallback_name: str) -> CompareConfig:
        if not isinstance(d, dict):
            raise CompareError(f"config {fallback_name!r} must be a JSON object of tandem serve options")
        spec = d.get("speculative_config")
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise CompareError(f"config {fallback_name!r}: speculative_config is not JSON: {exc}") from exc
        spec = spec or {}
        method = spec.get("method")
        k: int | None = 0
        if spec:  # None: speculation with a variable/unstated k (taken from the measured positions)
            k = None if spec.get("num_speculative_tokens") is None else int(spec["num_speculative_tokens"])
        if "cost_c" in d:
            cost_c, source = float(d["cost_c"]), "cost_c from config"
        elif k == 0:
            cost_c, source = 0.0, "no speculation"
        elif method in FREE_DRAFT_METHODS:
            cost_c, source = 0.0, f"{method} proposer: drafting cost taken as 0"
        elif "draft_cost_ratio" in d:
            cost_c, source = float(d["draft_cost_ratio"]), "draft_cost_ratio from config"
        else:
            cost_c, source = None, "unknown: give cost_c or draft_cost_ratio"
        return cls(
            name=str(d.get("name") or fallback_name),
            options={k_: v for k_, v in d.items() if k_ not in META_KEYS},
            model=d.get("model"),
            method=method,
            k=k,
            cost_c=cost_c,
            cost_v=float(d.get("cost_v", 0.0)),
            c_source=source,
        )


def load_config(path: str | Path, index: int = 0) -> CompareConfig:
    """A ``--config`` value: a JSON file, or the JSON object itself (a value starting with ``{``).

    An inline config without ``"name"`` is named after its speculative method (``ngram``, ...) or
    ``base`` without speculation; a file's fallback name is its stem. ``index`` only breaks ties in
    neither (``config2``) and never renames a config with its own name.
    """
    text = str(path).strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CompareError(f"--config {text!r} is neither a file nor valid JSON: {exc}") from exc
        return CompareConfig.from_dict(data, _inline_name(data, index))
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CompareError(f"cannot read config {path}: {exc}") from exc
    return CompareConfig.from_dict(data, Path(path).stem)


def _inline_name(data: object, index: int) -> str:
    if not isinstance(data, dict):
        return f"config{index + 1}"
    spec = data.get("speculative_config")
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            spec = None
    if isinstance(spec, dict) and spec.get("method"):
        return str(spec["method"])
    return "base" if not spec else f"config{index + 1}"


def server_command(model: str, port: int, options: dict[str, Any]) -> list[str]:
    """The ``tandem serve`` argv for one config (see module docstring for the mapping)."""
    opts = dict(options)
    opts["enable_prefix_caching"] = bool(opts.get("enable_prefix_caching", False))
    cmd = [sys.executable, "-m", "tandem.serve", model, "--port", str(port)]
    for key, value in opts.items():
        if value is None:
            continue
        if isinstance(value, bool):
            cmd.append(cli_flag(key) if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            cmd += [cli_flag(key), json.dumps(value)]
        elif isinstance(value, list):
            cmd += [cli_flag(key), *map(str, value)]
        else:
            cmd += [cli_flag(key), str(value)]
    return cmd
