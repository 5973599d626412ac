"""``TRAINING.md`` and ``training.json`` next to the head: how it was made and how well it does.

``training.json`` holds everything machine-readable (the full config, prompt indices of the train and
held-out splits in the prompt source, validation history, engine evaluation); ``TRAINING.md`` is the
human summary with the exact command.
"""

from __future__ import annotations

import datetime
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.train.config import TrainConfig
from tandem.train.data import DraftData
from tandem.train.evaluate import EngineEval, format_table
from tandem.train.trainer import TrainResult


@dataclass(frozen=True)
class RunSummary:
    cfg: TrainConfig
    command: str
    device: torch.device
    data: DraftData
    vocab_size: int
    coverage: float
    head_params: int
    result: TrainResult
    evals: list[EngineEval]
    seconds: dict[str, float]  # phase → wall seconds
    # the training.json of the head it started from (``--init-head``; None: none, or it has none)
    init_training: dict[str, Any] | None = None


def read_training(head: str) -> dict[str, Any] | None:
    """A head's ``training.json`` (alias or directory), None where it has none."""
    from tandem.loader.heads import resolve_head

    path = resolve_head(head) / "training.json"
    return json.loads(path.read_text()) if path.is_file() else None


def machine(device: torch.device) -> str:
    where = platform.node() or "unknown host"
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({where}), torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()} ({where}), torch {torch.__version__}"


def write_report(out: Path, s: RunSummary) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    r = s.result
    # a head trained on from another has seen that one's data too: its source records count as used
    # (benchmarks pick held-out prompts outside ``data.records``: eagle_bench.head_prompt_indices)
    before = (s.init_training or {}).get("data", {})
    records = sorted(set(s.data.records) | set(before.get("records") or []))
    info: dict[str, Any] = {
        "command": s.command, "date": now, "machine": machine(s.device), "config": s.cfg.to_dict(),
        "data": {"source": s.data.source, "train_sequences": len(s.data.train), "val_sequences": len(s.data.val),
                 "train_generated_tokens": s.data.num_generated_tokens, "given_conversations": s.data.num_given,
                 "given_tokens": s.data.num_given_tokens, "records": records,
                 "train_prompt_indices": s.data.train_indices, "val_prompt_indices": s.data.val_indices},
        "draft_vocab": {"size": s.vocab_size, "coverage": s.coverage}, "head_parameters": s.head_params,
        "training": {"steps": r.steps, "planned_steps": r.planned_steps, "stopped": r.stopped,
                     "seconds": r.seconds, "history": r.history},
        "final_validation": r.final.to_dict(), "engine_eval": [e.to_dict() for e in s.evals],
        "seconds": s.seconds,
    }
    if s.init_training is not None:
        info["data"]["init_head"] = {"head": s.cfg.init_head, "command": s.init_training.get("command"),
                                     "date": s.init_training.get("date"), "source": before.get("source"),
                                     "num_records": len(before.get("records") or []),
                                     "init_head": before.get("init_head")}
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    acc = ", ".join(f"{a:.3f}" for a in r.final.acceptance)
    lines = [
        f"# {s.cfg.method.upper()} head for `{s.cfg.target}`", "",
        ("Trained with tandem's `train-draft` on the target's own answers (online distillation, "
         "training-time-test unroll; docs/training.md)."), "",
        "## Command", "", "```", s.command, "```", "",
        f"- Date: {now}", f"- Machine: {machine(s.device)}",
        (f"- Data: {s.data.source}; {len(s.data.train) - s.data.num_given} training prompts answered by the "
         f"target ({s.data.num_generated_tokens} generated tokens, max_tokens {s.cfg.max_tokens}, temperature "
         f"{s.cfg.temperature}), {s.data.num_given} conversations used as given ({s.data.num_given_tokens} "
         f"tokens after their first prompt), {len(s.data.val)} held-out prompts never trained on. Prompt indices "
         "are in `training.json` "
         "(`data.train_prompt_indices`, `data.val_prompt_indices`)."),
        f"- Held-out prompt indices: {s.data.val_indices}",
        *([f"- Started from `{s.cfg.init_head}` (trained {s.init_training.get('date')}: "
           f"`{s.init_training.get('command')}`); its source records count as used below "
           f"(`data.init_head`)"] if s.init_training is not None else []),
        *([f"- Source records used (train and held-out{', with the initial head' if before else ''}): "
           f"{len(records)}, from {records[0]} to {records[-1]} (`data.records`)"] if records else []),
        f"- Draft vocabulary: {s.vocab_size} ids covering {100 * s.coverage:.2f} % of generated tokens",
        f"- Head parameters: {s.head_params:,} ({2 * s.head_params / 2**20:.1f} MiB in bf16)",
        (f"- Training: {r.steps} steps ({r.stopped}), TTT steps {s.cfg.ttt_steps}, lr {s.cfg.lr}, "
         f"{r.seconds:.0f} s"),
        "- Phases (wall s): " + ", ".join(f"{k} {v:.1f}" for k, v in s.seconds.items()), "",
        "## Held-out validation (training unroll, teacher-forced greedy agreement)", "",
        f"Acceptance per position: {acc}; expected tau {r.final.tau:.3f}; loss {r.final.loss:.4f}.", "",
    ]
    # what a draft tree branching w wide at a position could accept there (teacher-forced)
    lines += [f"- The target's token among the head's top {w}, per position: {', '.join(f'{a:.3f}' for a in rates)}"
              for w, rates in r.final.top_acceptance.items()]
    lines += [""] if r.final.top_acceptance else []
    if s.evals:
        lines += ["## Engine measurement (held-out prompts, greedy)", "", format_table(s.evals), ""]
    (out / "TRAINING.md").write_text("\n".join(lines))
