"""The training loop: online target forwards, the TTT unroll, AdamW, validation and checkpoints.

Each step: one padded batch → the frozen target (no grad) → ``ttt.unroll`` → backward → clip →
AdamW (betas 0.9/0.95; fused on CUDA) at the scheduled learning rate. Every ``val_every`` steps
and at the end the held-out sequences are validated (``validate.py``).

Resumable: ``OUT/checkpoint/train_state.pt`` holds the head (fp32), the optimizer, the step and
the position in the epoch; batches of epoch ``e`` are a fixed function of (seed, e), so a resumed
run sees exactly the batches the stopped one had left. It is written every ``checkpoint_every``
steps and whenever the loop stops (end, ``stop_at_step``, time budget).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.errors import ConfigError
from tandem.models.eagle import EagleHead
from tandem.train.batches import epoch_batches, make_batch
from tandem.train.config import TrainConfig
from tandem.train.data import DraftData
from tandem.train.device import autocast
from tandem.train.head import trainable_parameters
from tandem.train.schedule import fit_total, lr_factor
from tandem.train.target import FrozenTarget
from tandem.train.ttt import unroll
from tandem.train.validate import ValMetrics, validate

logger = logging.getLogger("tandem.train")


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    index: int = 0  # next batch of the epoch
    history: list[dict[str, Any]] = field(default_factory=list)  # validations: step + metrics


@dataclass(frozen=True)
class TrainResult:
    steps: int
    planned_steps: int
    seconds: float
    stopped: str  # "done" | "time budget" | "stop_at_step"
    final: ValMetrics
    history: list[dict[str, Any]]


def state_path(out: Path) -> Path:
    return out / "checkpoint" / "train_state.pt"


def _identity(cfg: TrainConfig, head: EagleHead, kept: torch.Tensor) -> dict[str, Any]:
    """What a checkpoint must match to be resumed."""
    return {"method": cfg.method, "layer": repr(head.cfg.layer), "aux": list(head.cfg.aux_layer_ids),
            "draft_vocab": kept.tolist(), "batch_tokens": cfg.batch_tokens, "seed": cfg.seed}


class Trainer:
    def __init__(self, cfg: TrainConfig, head: EagleHead, target: FrozenTarget, data: DraftData,
                 kept: torch.Tensor, device: torch.device, batch_tokens: int, stop_at_step: int | None = None) -> None:
        self.cfg, self.head, self.target, self.data = cfg, head, target, data
        self.device, self.batch_tokens, self.stop_at_step = device, batch_tokens, stop_at_step
        self.kept = kept
        eagle3 = head.cfg.kind == "eagle3"
        self.columns = kept.to(device) if eagle3 else None
        self.t2d = None
        if eagle3:
            self.t2d = torch.zeros(target.arch.vocab_size, dtype=torch.bool, device=device)
            self.t2d[self.columns] = True
        self.params = list(trainable_parameters(head).values())
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                     **({"fused": True} if device.type == "cuda" else {}))
        self.per_epoch = len(epoch_batches(data.train, batch_tokens, cfg.seed, 0))
        self.planned = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * self.per_epoch
        self.state = TrainState()
        self.out = Path(cfg.out)
        self._epoch_groups: tuple[int, list[list[int]]] = (-1, [])

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self) -> None:
        path = state_path(self.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"identity": _identity(self.cfg, self.head, self.kept),
                    "head": {n: p.detach().cpu() for n, p in trainable_parameters(self.head).items()},
                    "optimizer": self.opt.state_dict(), "state": vars(self.state), "planned": self.planned}, tmp)
        tmp.replace(path)

    def load(self) -> bool:
        path = state_path(self.out)
        if not path.is_file():
            return False
        ck = torch.load(path, map_location="cpu", weights_only=False)
        if ck["identity"] != _identity(self.cfg, self.head, self.kept):
            raise ConfigError("resume", f"{path} was trained with other settings (method, head shape, draft "
                              "vocabulary, batch_tokens or seed); use a new --out or drop --resume")
        params = trainable_parameters(self.head)
        with torch.no_grad():
            for n, t in ck["head"].items():
                params[n].copy_(t)
        self.opt.load_state_dict(ck["optimizer"])
        self.state = TrainState(**ck["state"])
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.state.step, self.state.epoch,
                    self.state.index)
        return True

    # ---- loop --------------------------------------------------------------------------------------
    def validate(self) -> ValMetrics:
        return validate(self.head, self.target, self.data.val, self.batch_tokens, self.t2d, self.columns,
                        self.cfg.ttt_steps, self.cfg.step_decay, self.device)

    def _record(self, metrics: ValMetrics) -> None:
        self.state.history.append({"step": self.state.step, **metrics.to_dict()})
        tqdm.write(f"step {self.state.step}: {metrics.line()}")

    def train(self, deadline: float | None = None) -> TrainResult:
        cfg, st = self.cfg, self.state
        t0 = time.monotonic()
        start_step = st.step
        planned = self.planned
        stopped = "done"
        self.head.train()
        bar = tqdm(total=planned, initial=st.step, desc="train-draft", dynamic_ncols=True,
                   mininterval=2.0)
        while st.step < planned:
            if self.stop_at_step is not None and st.step >= self.stop_at_step:
                stopped = "stop_at_step"
                break
            now = time.monotonic()
            if deadline is not None:
                if now >= deadline:
                    stopped = "time budget"
                    break
                if cfg.max_steps is None:  # --max-steps fixes the schedule: the budget only stops it
                    planned = fit_total(self.planned, st.step - start_step, now - t0, deadline - now) + start_step
                    planned = min(planned, self.planned)
            groups = self._groups(st.epoch)
            if st.index >= len(groups):
                st.epoch, st.index = st.epoch + 1, 0
                continue
            batch = make_batch([self.data.train[i] for i in groups[st.index]], self.batch_tokens).to(self.device)
            loss, acc0 = self._step(batch, lr_factor(st.step, planned, cfg.warmup))
            st.step += 1
            st.index += 1
            bar.total = planned
            bar.update(1)
            if st.step % 10 == 0 or st.step == planned:
                bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc0.item():.3f}")
            if st.step % cfg.val_every == 0 and st.step < planned:
                self._record(self.validate())
            if st.step % cfg.checkpoint_every == 0:
                self.save()
        bar.close()
        if stopped == "done" and planned < self.planned:
            stopped = "time budget"  # the schedule was fitted to the budget and ran to its end
        final = self.validate()
        self._record(final)
        self.save()
        return TrainResult(st.step, planned, time.monotonic() - t0, stopped, final, list(st.history))

    def _groups(self, epoch: int) -> list[list[int]]:
        if self._epoch_groups[0] != epoch:
            self._epoch_groups = (epoch, epoch_batches(self.data.train, self.batch_tokens, self.cfg.seed, epoch))
        return self._epoch_groups[1]

    def _step(self, batch: Any, lr_mult: float) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        with autocast(self.device):
            tout = self.target.run(batch)
            res = unroll(self.head, self.target, tout, batch, self.t2d, self.columns, cfg.ttt_steps,
                         cfg.step_decay, grad=True)
        self.opt.zero_grad(set_to_none=True)
        if res.loss.requires_grad:
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
            for group in self.opt.param_groups:
                group["lr"] = cfg.lr * lr_mult
            self.opt.step()
        acc0 = res.correct[0].float() / res.counted[0].clamp(min=1).float()
        return res.loss.detach(), acc0
