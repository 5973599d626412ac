"""EAGLE heads shipped with tandem (by alias) and a light check of what a head directory holds.

Shipped heads live in the package (``tandem/heads/<alias>/``: ``config.json`` in the speculators
layout, ``model.safetensors`` in bf16, ``TRAINING.md`` with the command and data that rebuild it),
so they work offline right after install. ``detect_head_kind`` reads only JSON and tensor names,
never weights: configuration code calls it to infer ``method`` from ``model``.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"

# alias → the built-in target alias it was trained for
SHIPPED_HEADS: dict[str, str] = {
    "smollm2-135m-instruct-eagle3": "smollm2-135m-instruct",
    "gemma-3-270m-eagle3": "gemma-3-270m",
}


def shipped_head_path(name: str) -> Path | None:
    """The directory of a shipped head alias (None if ``name`` is not one or is not installed)."""
    if name not in SHIPPED_HEADS:
        return None
    p = HEADS_DIR / name
    return p if (p / "config.json").is_file() else None


def resolve_head(name: str) -> Path:
    """A head alias or directory → its directory (unchanged if it is not an alias)."""
    return shipped_head_path(name) or Path(name)


def _names(path: Path) -> list[str]:
    names: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names.extend(sf.keys())
    return names


def detect_head_kind(name: str) -> str | None:
    """"eagle" / "eagle3" when ``name`` is a shipped alias or a directory holding an EAGLE head."""
    p = resolve_head(name)
    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(cfg, dict):
        return None
    spec_type = cfg.get("speculators_model_type")
    if spec_type in ("eagle", "eagle3"):
        return str(spec_type)
    archs = [str(a) for a in cfg.get("architectures") or []]
    if any("Eagle3" in a for a in archs):
        return "eagle3"
    try:
        names = _names(p)
    except Exception:  # unreadable weights: not for configuration to judge
        return None
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle3" if ("draft_vocab_size" in cfg or "d2t" in names) else "eagle"
    return None
