"""``tandem train-draft``: the subcommand's flags → ``TrainConfig`` → ``run.run_train``."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from tandem.errors import ConfigError
from tandem.train.config import TrainConfig


def _ints(key: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ConfigError(key, f"expected comma-separated integers, got {text!r}") from None


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    d = TrainConfig(target="", out="")
    p = subparsers.add_parser("train-draft", help="train an EAGLE / EAGLE-3 draft head for a target model",
                              description="Distil a one-layer EAGLE head from the target's own answers "
                                          "(docs/training.md).")
    p.add_argument("--target", required=True, help="target model (alias or HF directory)")
    p.add_argument("--method", choices=("eagle3", "eagle"), default=d.method)
    p.add_argument("--out", required=True, help="output directory (head, TRAINING.md, checkpoint, data cache)")
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, help="JSONL of rows: {'prompt': ...} or {'messages': [...]} (the "
                   "target answers), {'text': ...} (raw, the target continues), {'messages': [... ending with an "
                   "assistant turn]} (trained on as given); python -m tandem.train.sources writes one from ShareGPT; "
                   "default: ShareGPT first user turns")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts)
    g.add_argument("--val-prompts", type=int, default=d.val_prompts, help="held-out prompts, never trained on")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens the target generates per prompt")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="longer prompts are skipped")
    g.add_argument("--data-cache", default=None, help="generated-data file (default OUT/cache/data.pt)")
    g.add_argument("--gen-procs", type=int, default=d.gen_procs,
                   help="processes that answer the prompts, each with its own engine and KV cache on the device "
                        "(docs/training.md: measured, no gain shown on an H200 once steps admit in groups)")
    h = p.add_argument_group("head shape (defaults: the target's)")
    h.add_argument("--init-head", default=None,
                   help="start from this head (directory or alias): its shape, draft vocabulary and weights "
                        "(the shape flags below must then be left out; --draft-vocab-size is ignored)")
    h.add_argument("--draft-vocab-size", type=int, default=d.draft_vocab_size)
    h.add_argument("--num-heads", type=int, default=None)
    h.add_argument("--num-kv-heads", type=int, default=None)
    h.add_argument("--head-dim", type=int, default=None)
    h.add_argument("--intermediate-size", type=int, default=None)
    h.add_argument("--aux-layers", default=None, help="EAGLE-3 aux layers (inputs of), e.g. 2,15,27")
    h.add_argument("--norm-before-residual", action="store_true")
    h.add_argument("--norm-before-fc", action="store_true",
                   help="EAGLE-3: one RMSNorm over the concatenated aux hidden states before fc")
    h.add_argument("--norm-output", action="store_true")
    t = p.add_argument_group("training")
    t.add_argument("--ttt-steps", type=int, default=d.ttt_steps)
    t.add_argument("--step-decay", type=float, default=d.step_decay, help="loss weight of TTT step j: decay**j")
    t.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per batch (8192 CUDA, 1024 CPU)")
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--warmup", type=float, default=d.warmup, help="warmup fraction of the steps")
    t.add_argument("--weight-decay", type=float, default=d.weight_decay)
    t.add_argument("--grad-clip", type=float, default=d.grad_clip)
    t.add_argument("--epochs", type=int, default=d.epochs)
    t.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    t.add_argument("--val-every", type=int, default=d.val_every)
    t.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    t.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget of the whole command; training stops early to fit it")
    t.add_argument("--eval-reserve-s", type=float, default=d.eval_reserve_s)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.add_argument("--stop-at-step", type=int, default=None, help="stop (and checkpoint) at this step")
    t.add_argument("--device", default=d.device)
    t.add_argument("--seed", type=int, default=d.seed)
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-k", default=",".join(map(str, d.eval_k)),
                   help="num_speculative_tokens values for the engine measurement ('' for none)")
    e.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts to measure (default all)")
    p.set_defaults(func=run_train_command)
    return p


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        target=ns.target, out=ns.out, method=ns.method, data=ns.data, num_prompts=ns.num_prompts,
        val_prompts=ns.val_prompts, max_tokens=ns.max_tokens, temperature=ns.temperature,
        max_prompt_tokens=ns.max_prompt_tokens, data_cache=ns.data_cache, gen_procs=ns.gen_procs,
        init_head=ns.init_head, draft_vocab_size=ns.draft_vocab_size,
        num_heads=ns.num_heads, num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim,
        intermediate_size=ns.intermediate_size,
        aux_layers=_ints("aux_layers", ns.aux_layers) if ns.aux_layers else None,
        norm_before_residual=ns.norm_before_residual, norm_before_fc=ns.norm_before_fc,
        norm_output=ns.norm_output, ttt_steps=ns.ttt_steps,
        step_decay=ns.step_decay, batch_tokens=ns.batch_tokens, lr=ns.lr, warmup=ns.warmup,
        weight_decay=ns.weight_decay, grad_clip=ns.grad_clip, epochs=ns.epochs, max_steps=ns.max_steps,
        val_every=ns.val_every, checkpoint_every=ns.checkpoint_every, time_budget_s=ns.time_budget_s,
        eval_reserve_s=ns.eval_reserve_s, eval_k=_ints("eval_k", ns.eval_k), eval_prompts=ns.eval_prompts,
        device=ns.device, seed=ns.seed, resume=ns.resume,
    )


def run_train_command(ns: argparse.Namespace) -> int:
    from tandem.train.run import run_train

    cfg = config_from_args(ns)
    if ns.stop_at_step is not None and ns.stop_at_step < 0:
        raise ConfigError("stop_at_step", f"must be >= 0, got {ns.stop_at_step}")
    if "train-draft" in sys.argv:  # the exact command line
        command = "tandem " + shlex.join(sys.argv[sys.argv.index("train-draft"):])
    else:  # called as a function (tests, scripts): an equivalent command line
        command = "tandem train-draft " + shlex.join(_argv_of(ns))
    run_train(cfg, command, ns.stop_at_step)
    return 0


def _argv_of(ns: argparse.Namespace) -> list[str]:
    """A command line equivalent to ``ns`` (when not called from the shell)."""
    out: list[str] = []
    for key, value in sorted(vars(ns).items()):
        if key in ("func", "command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out
