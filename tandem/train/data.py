"""Training data: the target answers prompts, and its own answers are what the head learns.

Prompts come from ShareGPT (first user turns, as ``bench/datasets.py`` reads them) or from a JSONL
file (``{"prompt": str}`` or ``{"messages": [...]}`` per line). They are shuffled with the seed,
rendered with the chat template, and prompts longer than ``max_prompt_tokens`` are skipped; the
first ``val_prompts`` usable ones are held out (never trained on), the next ``num_prompts`` train.
Indices are positions in the source list, recorded so a later evaluation can use unseen prompts.

All prompts go through one ``LLM.generate`` call (the engine batches them). The result is cached in
a file keyed by everything it depends on (``TrainConfig.generation_key``): a resumed run, or a run
with other training flags into the same directory, skips generation.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.errors import ConfigError
from tandem.train.config import TrainConfig

logger = logging.getLogger("tandem.train")


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [len] int64: prompt then generated tokens
    prompt_len: int

    @property
    def generated(self) -> torch.Tensor:
        return self.tokens[self.prompt_len:]


@dataclass(frozen=True)
class DraftData:
    train: list[Sequence]
    val: list[Sequence]
    train_indices: list[int]  # positions in the prompt source
    val_indices: list[int]
    source: str
    generation_s: float  # 0 when read from the cache

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(s.generated) for s in self.train)


def load_prompts(data: str | None) -> tuple[list[list[dict[str, Any]]], str]:
    """Conversations to answer (each a list of chat messages) and a description of the source."""
    if data is None:
        from tandem.bench.datasets import load_sharegpt_records, sharegpt_pairs

        pairs = sharegpt_pairs(load_sharegpt_records())
        return ([[{"role": "user", "content": p}] for p, _ in pairs],
                "ShareGPT first user turns (indices into bench.datasets.sharegpt_pairs(load_sharegpt_records()))")
    path = Path(data)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError("data", f"cannot read {path}: {e}") from None
    convs: list[list[dict[str, Any]]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("data", f"{path}:{n}: not JSON ({e.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            convs.append([{"role": "user", "content": obj["prompt"]}])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and all(
                isinstance(m, dict) and "role" in m and "content" in m for m in obj["messages"]):
            convs.append(list(obj["messages"]))
        else:
            raise ConfigError("data", f"{path}:{n}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}")
    if not convs:
        raise ConfigError("data", f"{path} holds no prompts")
    return convs, f"{path} (indices: 0-based among its non-empty lines)"


def _encode(tokenizer: Any, conv: list[dict[str, Any]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        from tandem.loader.tokenizer import apply_chat_template

        return apply_chat_template(tokenizer, conv, add_generation_prompt=True)
    return list(tokenizer.encode("\n".join(str(m["content"]) for m in conv), add_special_tokens=True))


def select_prompts(convs: list[list[dict[str, Any]]], tokenizer: Any, cfg: TrainConfig
                   ) -> tuple[list[list[int]], list[int], list[list[int]], list[int]]:
    """(val prompt ids, val indices, train prompt ids, train indices), shuffled by the seed."""
    order = list(range(len(convs)))
    random.Random(cfg.seed).shuffle(order)
    val: list[list[int]] = []
    val_idx: list[int] = []
    train: list[list[int]] = []
    train_idx: list[int] = []
    for i in order:
        if len(train) >= cfg.num_prompts:
            break
        ids = _encode(tokenizer, convs[i])
        if not ids or len(ids) > cfg.max_prompt_tokens:
            continue
        if len(val) < cfg.val_prompts:
            val.append(ids)
            val_idx.append(i)
        else:
            train.append(ids)
            train_idx.append(i)
    if not train:
        raise ConfigError("num_prompts", f"no training prompts left after {len(val)} held-out ones "
                          f"(source has {len(convs)}; max_prompt_tokens {cfg.max_prompt_tokens})")
    if len(train) < cfg.num_prompts:
        logger.warning("only %d training prompts available (asked for %d)", len(train), cfg.num_prompts)
    return val, val_idx, train, train_idx


def generate(llm: Any, prompts: list[list[int]], cfg: TrainConfig) -> list[Sequence | None]:
    """The target's answers, one ``generate`` call for all prompts (None: failed or < 2 tokens)."""
    from tandem.sampling_params import SamplingParams

    if cfg.temperature == 0:
        params: Any = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
    else:
        params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=cfg.seed * 1_000_003 + i)
                  for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    seqs: list[Sequence | None] = []
    for p, o in zip(prompts, outs):
        gen = list(o.outputs[0].token_ids) if o.outputs else []
        ok = not o.error and len(gen) >= 2
        seqs.append(Sequence(torch.tensor(p + gen, dtype=torch.long), len(p)) if ok else None)
    return seqs


def cache_path(cfg: TrainConfig) -> Path:
    return Path(cfg.data_cache) if cfg.data_cache else Path(cfg.out) / "cache" / "data.pt"


def _to_state(seqs: list[Sequence]) -> dict[str, Any]:
    return {"tokens": [s.tokens.to(torch.int32) for s in seqs], "prompt_lens": [s.prompt_len for s in seqs]}


def _from_state(state: dict[str, Any]) -> list[Sequence]:
    return [Sequence(t.long(), int(n)) for t, n in zip(state["tokens"], state["prompt_lens"])]


def load_cached(cfg: TrainConfig) -> DraftData | None:
    path = cache_path(cfg)
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("key") != json.dumps(cfg.generation_key(), sort_keys=True):
        logger.info("generated-data cache %s was made with other data settings: regenerating", path)
        return None
    return DraftData(_from_state(state["train"]), _from_state(state["val"]), list(state["train_indices"]),
                     list(state["val_indices"]), str(state["source"]), 0.0)


def build_data(cfg: TrainConfig, llm_factory: Any) -> DraftData:
    """The cached data if it matches ``cfg``, else generated now with ``llm_factory()`` and cached."""
    cached = load_cached(cfg)
    if cached is not None:
        logger.info("using generated data from %s (%d train / %d held-out sequences)", cache_path(cfg),
                    len(cached.train), len(cached.val))
        return cached
    convs, source = load_prompts(cfg.data)
    llm = llm_factory()
    t0 = time.perf_counter()
    val_p, val_idx, train_p, train_idx = select_prompts(convs, llm.get_tokenizer(), cfg)
    seqs = generate(llm, val_p + train_p, cfg)
    elapsed = time.perf_counter() - t0
    val = list(zip(seqs[:len(val_p)], val_idx))
    train = list(zip(seqs[len(val_p):], train_idx))
    data = DraftData([s for s, _ in train if s is not None], [s for s, _ in val if s is not None],
                     [i for s, i in train if s is not None], [i for s, i in val if s is not None], source, elapsed)
    path = cache_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": json.dumps(cfg.generation_key(), sort_keys=True), "source": source,
                "train": _to_state(data.train), "val": _to_state(data.val),
                "train_indices": data.train_indices, "val_indices": data.val_indices}, path)
    n_tok = data.num_generated_tokens + sum(len(s.generated) for s in data.val)
    logger.info("generated %d tokens for %d prompts in %.1f s (%.0f tok/s)", n_tok, len(seqs), elapsed,
                n_tok / max(elapsed, 1e-9))
    return data
