"""``tandem train-draft`` end to end: data → draft vocabulary → head → training → export → engine
evaluation → report. With ``time_budget_s`` the whole run (generation included) fits the budget:
training stops ``eval_reserve_s`` before it, saves, and the final evaluation runs."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from tandem.errors import ConfigError, ModelLoadError
from tandem.train.config import TrainConfig
from tandem.train.device import (
    default_batch_tokens,
    engine_kwargs,
    free_memory,
    resolve_device,
)
from tandem.train.report import RunSummary

logger = logging.getLogger("tandem.train")


def _verify_export(out: Path, arch: object, head: torch.nn.Module) -> None:
    """Load the written head back through the runtime loader; its weights must be the trained ones
    (to bf16 rounding)."""
    from tandem.loader.eagle import load_eagle_head, read_eagle_config
    from tandem.train.head import trainable_parameters

    ecfg = read_eagle_config(out, arch)  # type: ignore[arg-type]
    loaded = load_eagle_head(ecfg, 64, torch.float32, torch.device("cpu"))
    mine = trainable_parameters(head)  # type: ignore[arg-type]
    for name, p in trainable_parameters(loaded).items():
        want = mine[name].detach().cpu().to(torch.bfloat16).float()
        if not torch.equal(p.detach(), want):
            raise ModelLoadError(f"exported head {out}: {name} does not read back as trained")
    if not torch.equal(loaded.draft_to_target.cpu(), head.draft_to_target.cpu()):  # type: ignore[operator]
        raise ModelLoadError(f"exported head {out}: d2t does not read back as trained")


def run_train(cfg: TrainConfig, command: str, stop_at_step: int | None = None) -> RunSummary:
    from tandem.engine.model_loader import build_model
    from tandem.loader.checkpoint import open_checkpoint
    from tandem.train.data import GenerationEngines, build_data
    from tandem.train.evaluate import engine_eval, format_table
    from tandem.train.export import save_head
    from tandem.train.head import (
        build_head,
        copy_weights,
        count_parameters,
        head_config,
        layer_config,
        load_init_head,
    )
    from tandem.train.report import read_training, write_report
    from tandem.train.target import FrozenTarget
    from tandem.train.trainer import Trainer
    from tandem.train.vocab import build_draft_vocab, full_vocab, given_vocab

    t_start = time.monotonic()
    deadline = t_start + cfg.time_budget_s if cfg.time_budget_s is not None else None
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":  # fp32 matmuls outside autocast (few) may use TF32
        torch.backends.cuda.matmul.allow_tf32 = True

    ckpt = open_checkpoint(cfg.target)
    arch = ckpt.arch
    max_model_len = min(arch.max_position_embeddings, cfg.max_prompt_tokens + cfg.max_tokens + 16)
    data = build_data(cfg, GenerationEngines(cfg.target, engine_kwargs(device, max_model_len), cfg.gen_procs))
    free_memory(device)
    if not data.val or not data.train:
        raise ConfigError("num_prompts", f"generation left {len(data.train)} training and {len(data.val)} "
                          "held-out sequences; both must be non-empty")
    seconds["data"] = time.monotonic() - t_start

    t = time.monotonic()
    batch_tokens = cfg.batch_tokens or default_batch_tokens(device)
    longest = min(batch_tokens, max(len(s.tokens) for s in data.train + data.val))
    max_positions = longest + cfg.ttt_steps + 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(arch, ckpt.weights(), dtype, device, max(max_positions, 16))
    shape_cfg, init, init_training = cfg, None, None
    if cfg.init_head is not None:  # its shape, vocabulary and weights (and what it was trained on)
        init_cfg, init = load_init_head(cfg, arch)
        init_training = read_training(cfg.init_head)
        shape_cfg = cfg.with_shape_of(init_cfg)
    if cfg.method == "eagle3":
        generated = [s.generated for s in data.train]
        vocab = (given_vocab(init.draft_to_target, generated, arch.vocab_size) if init is not None
                 else build_draft_vocab(generated, arch.vocab_size, cfg.draft_vocab_size))
        logger.info("draft vocabulary: %d ids cover %.2f %% of the generated training tokens", vocab.size,
                    100 * vocab.coverage)
    else:
        vocab = full_vocab(arch.vocab_size)
    ecfg = head_config(arch, shape_cfg, vocab)
    head = build_head(ecfg, model, vocab, max_positions, device, cfg.seed)
    if init is not None:
        copy_weights(head, init)
        logger.info("head initialised from %s", cfg.init_head)
        del init
    n_params = count_parameters(head)
    logger.info("head: %s, %d parameters (%.1f MiB in bf16)", ecfg.kind, n_params, 2 * n_params / 2**20)
    target = FrozenTarget(model, ecfg.feature_layers(arch.num_layers))
    trainer = Trainer(cfg, head, target, data, vocab.kept, device, batch_tokens, stop_at_step)
    if cfg.resume and not trainer.load():
        logger.info("--resume: no checkpoint in %s, starting fresh", out)
    seconds["setup"] = time.monotonic() - t

    t = time.monotonic()
    train_deadline = deadline - cfg.eval_reserve_s if deadline is not None else None
    if train_deadline is not None and train_deadline <= time.monotonic():
        logger.warning("time budget already spent before training (data %.0f s, setup %.0f s): the head stays "
                       "untrained; raise --time-budget-s or reuse the data cache", seconds["data"], seconds["setup"])
    result = trainer.train(train_deadline)
    seconds["train"] = time.monotonic() - t

    save_head(out, head, vocab, layer_config(arch, shape_cfg), cfg.target,
              list(ckpt.config.get("architectures") or []), max(cfg.eval_k, default=3))
    _verify_export(out, arch, head)
    logger.info("wrote %s (%s layout), verified through loader/eagle.py", out,
                "speculators" if ecfg.kind == "eagle3" else "EAGLE-1")
    del trainer, target, head, model
    free_memory(device)

    t = time.monotonic()
    prompts = [s.tokens[:s.prompt_len].tolist() for s in data.val][: cfg.eval_prompts or len(data.val)]
    evals = [engine_eval(cfg.target, out, cfg.method, prompts, k, cfg.max_tokens, device, max_model_len)
             for k in cfg.eval_k]
    seconds["eval"] = time.monotonic() - t
    seconds["total"] = time.monotonic() - t_start
    if evals:
        print(f"\nEngine measurement on {len(prompts)} held-out prompts (greedy, {cfg.max_tokens} tokens):")
        print(format_table(evals))
    print("phases (wall s): " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()) + f"; head in {out}")
    summary = RunSummary(cfg, command, device, data, vocab.size, vocab.coverage, n_params, result, evals, seconds,
                         init_training)
    write_report(out, summary)
    return summary
