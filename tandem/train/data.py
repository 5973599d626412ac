"""Training data: the target answers prompts, and its own answers are what the head learns.

Prompts come from ShareGPT (first user turns, as ``bench/datasets.py`` reads them) or from a JSONL
file, one row per line: ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered with the chat
template; the target answers), ``{"text": str}`` (raw, no template: the target continues it, as it
continues a code prompt), or ``{"messages": [...]}`` ending with an assistant turn (used as given:
no generation, the head learns the target's distribution along that text). ``sources.py`` writes
such files from ShareGPT; a row's optional ``record`` names the conversation it came from. Rows
are shuffled with the seed and prompts longer than ``max_prompt_tokens`` are skipped; the first
``val_prompts`` usable prompts are held out (never trained on), the next ``num_prompts`` train, and
every given conversation trains. Indices are positions in the source list (and ``records`` the
source records), recorded so a later evaluation can use unseen prompts.

All prompts go through one ``LLM.generate`` call (the engine batches them), or, with
``--gen-procs N``, one call in each of N spawned processes sharing the device. The result is cached in
a file keyed by everything it depends on (``TrainConfig.generation_key``): a resumed run, or a run
with other training flags into the same directory, skips generation.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import time
from dataclasses import dataclass, field
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
    records: list[int] = field(default_factory=list)  # source records (ShareGPT) of the rows used, when rows name one
    num_given: int = 0  # the last ``num_given`` training sequences are given conversations (not generated)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens the target generated for the training prompts (given conversations not counted)."""
        return sum(len(s.generated) for s in self.train[:len(self.train) - self.num_given])

    @property
    def num_given_tokens(self) -> int:
        return sum(len(s.generated) for s in self.train[len(self.train) - self.num_given:])


@dataclass(frozen=True)
class Row:
    """One line of the prompt source: chat messages (the target answers them, or, when they end with
    an assistant turn, they are used as given) or raw text (the target continues it)."""
    messages: tuple[dict[str, Any], ...] | None = None
    text: str | None = None
    record: int | None = None  # the source record it came from (``sources.py``), if known

    @property
    def given(self) -> bool:
        return self.messages is not None and self.messages[-1].get("role") == "assistant"


def _row(obj: Any, where: str) -> Row:
    record = obj.get("record") if isinstance(obj, dict) and isinstance(obj.get("record"), int) else None
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        return Row(messages=({"role": "user", "content": obj["prompt"]},), record=record)
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return Row(text=obj["text"], record=record)
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"] and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in obj["messages"]):
        return Row(messages=tuple(obj["messages"]), record=record)
    raise ConfigError("data", f"{where}: expected {{\"prompt\": str}}, {{\"text\": str}} or {{\"messages\": [...]}}")


def load_prompts(data: str | None) -> tuple[list[Row], str]:
    """Rows to train on and a description of the source."""
    if data is None:
        from tandem.bench.datasets import load_sharegpt_records, sharegpt_pairs

        pairs = sharegpt_pairs(load_sharegpt_records())
        return ([Row(messages=({"role": "user", "content": p},)) for p, _ in pairs],
                "ShareGPT first user turns (indices into bench.datasets.sharegpt_pairs(load_sharegpt_records()))")
    path = Path(data)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: JSON strings may hold U+2028
    except OSError as e:
        raise ConfigError("data", f"cannot read {path}: {e}") from None
    rows: list[Row] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError("data", f"{path}:{n}: not JSON ({e.msg})") from None
        rows.append(_row(obj, f"{path}:{n}"))
    if not rows:
        raise ConfigError("data", f"{path} holds no prompts")
    return rows, f"{path} (indices: 0-based among its non-empty lines)"


def _render(tokenizer: Any, msgs: Any, add_generation_prompt: bool) -> tuple[str, bool]:
    """(text, whether its ids take the tokenizer's special tokens) of chat messages; without a chat
    template the contents joined by newlines. Raises RequestError where the template rejects them."""
    if getattr(tokenizer, "chat_template", None):
        from tandem.loader.tokenizer import render_chat_template

        return render_chat_template(tokenizer, msgs, add_generation_prompt=add_generation_prompt), False
    return "\n".join(str(m["content"]) for m in msgs), True


def _texts(tokenizer: Any, row: Row) -> list[tuple[str, bool]] | None:
    """What to tokenize for ``row``: the prompt; for a given conversation the whole of it, then
    everything before its first reply. None where the chat template rejects the messages."""
    from tandem.errors import RequestError

    if row.text is not None:
        return [(row.text, True)]
    msgs = list(row.messages or ())
    try:
        if not row.given:
            return [_render(tokenizer, msgs, True)]
        first = next(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
        return [_render(tokenizer, msgs, False), _render(tokenizer, msgs[:first], True)]
    except RequestError:
        return None


def encode_rows(tokenizer: Any, rows: list[Row]) -> list[list[list[int]] | None]:
    """Token ids of ``_texts`` per row, tokenized in two batches (with and without special tokens:
    the fast tokenizer spreads a batch over the cores)."""
    texts = [_texts(tokenizer, r) for r in rows]
    flat = [t for ts in texts if ts is not None for t in ts]
    ids: list[list[int]] = [[] for _ in flat]
    for special in (False, True):
        where = [j for j, (_, sp) in enumerate(flat) if sp == special]
        if where:
            enc = tokenizer([flat[j][0] for j in where], add_special_tokens=special)["input_ids"]
            for j, e in zip(where, enc):
                ids[j] = list(e)
    out: list[list[list[int]] | None] = []
    k = 0
    for ts in texts:
        if ts is None:
            out.append(None)
            continue
        out.append(ids[k:k + len(ts)])
        k += len(ts)
    return out


def given_sequence(full: list[int], head: list[int], max_len: int) -> Sequence | None:
    """A conversation used as given (ids ``full``), cut to ``max_len`` tokens; its "prompt" is
    ``head``, everything before the first reply (None when that leaves < 2 tokens to learn)."""
    n = 0
    while n < min(len(head), len(full)) and head[n] == full[n]:
        n += 1
    full = full[:max_len]
    if n < 1 or len(full) - n < 2:
        return None
    return Sequence(torch.tensor(full, dtype=torch.long), n)


@dataclass(frozen=True)
class Selection:
    val: list[list[int]]  # held-out prompt ids (rows the target answers)
    val_idx: list[int]
    train: list[list[int]]  # training prompt ids
    train_idx: list[int]
    given: list[Sequence]  # conversations trained on as given (no generation)
    given_idx: list[int]


ENCODE_CHUNK = 2048  # rows tokenized per batch


def select_prompts(rows: list[Row], tokenizer: Any, cfg: TrainConfig) -> Selection:
    """Rows shuffled by the seed; the first ``val_prompts`` usable rows the target answers are held
    out, the next ``num_prompts`` train; every usable given conversation trains too. Prompts longer
    than ``max_prompt_tokens`` are skipped; given conversations are cut to ``max_prompt_tokens +
    max_tokens`` tokens."""
    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    any_given = any(r.given for r in rows)
    sel = Selection([], [], [], [], [], [])
    full = False
    for c in range(0, len(order), ENCODE_CHUNK):
        if full and not any_given:
            break
        idx = [i for i in order[c:c + ENCODE_CHUNK] if rows[i].given or not full]
        for i, enc in zip(idx, encode_rows(tokenizer, [rows[i] for i in idx])):
            if enc is None:
                continue
            if rows[i].given:
                seq = given_sequence(enc[0], enc[1], cfg.max_prompt_tokens + cfg.max_tokens)
                if seq is not None and seq.prompt_len <= cfg.max_prompt_tokens:
                    sel.given.append(seq)
                    sel.given_idx.append(i)
                continue
            ids = enc[0]
            if full or not ids or len(ids) > cfg.max_prompt_tokens:
                continue
            if len(sel.val) < cfg.val_prompts:
                sel.val.append(ids)
                sel.val_idx.append(i)
            else:
                sel.train.append(ids)
                sel.train_idx.append(i)
                full = len(sel.train) >= cfg.num_prompts
    if not sel.train and not sel.given:
        raise ConfigError("num_prompts", f"no training prompts left after {len(sel.val)} held-out ones "
                          f"(source has {len(rows)}; max_prompt_tokens {cfg.max_prompt_tokens})")
    if len(sel.train) < cfg.num_prompts and not sel.given:
        logger.warning("only %d training prompts available (asked for %d)", len(sel.train), cfg.num_prompts)
    return sel


def _params(cfg: TrainConfig, indices: list[int]) -> Any:
    """Sampling settings for the prompts at ``indices`` (positions among all prompts answered: a
    sampled answer's seed depends on its prompt, not on which process answers it)."""
    from tandem.sampling_params import SamplingParams

    if cfg.temperature == 0:  # token ids are all training reads: no text is made
        return SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, detokenize=False)
    return [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, detokenize=False,
                           seed=cfg.seed * 1_000_003 + i) for i in indices]


def _answer(llm: Any, prompts: list[list[int]], indices: list[int], cfg: TrainConfig,
            use_tqdm: bool) -> list[list[int] | None]:
    """The target's generated tokens for ``prompts`` (None: failed or < 2 tokens), one ``generate``
    call."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(cfg, indices), use_tqdm=use_tqdm)
    answers: list[list[int] | None] = []
    for o in outs:
        gen = list(o.outputs[0].token_ids) if o.outputs else []
        answers.append(gen if not o.error and len(gen) >= 2 else None)
    return answers


@dataclass(frozen=True)
class GenerationEngines:
    """The engines that answer the prompts: ``LLM(target, **kwargs)``, in this process when
    ``procs`` is 1, else one in each of ``procs`` spawned processes sharing the device (for a target
    whose generation is bound by the engine's per-step host work; measured in docs/training.md).
    Each process holds its own copy of the target and its own KV cache of ``kwargs``' size."""

    target: str
    kwargs: dict[str, Any]
    procs: int = 1


def _answer_shard(job: tuple[GenerationEngines, list[list[int]], list[int], TrainConfig, bool]
                  ) -> list[list[int] | None]:
    """One spawned process's share: its own engine answers its prompts."""
    engines, prompts, indices, cfg, use_tqdm = job
    if str(engines.kwargs.get("device", "cpu")).startswith("cpu"):  # share the cores, do not oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // engines.procs))
    from tandem.engine.llm import LLM

    return _answer(LLM(engines.target, **engines.kwargs), prompts, indices, cfg, use_tqdm)


def answer_all(engines: GenerationEngines, prompts: list[list[int]], cfg: TrainConfig,
               llm: Any = None) -> list[Sequence | None]:
    """The target's answers to every prompt, as sequences (None: failed or < 2 tokens). With one
    process, ``llm`` (or a new engine) answers all in one ``generate`` call; with several, prompt
    ``i`` goes to process ``i % procs`` (interleaved, so every share has the same mix of lengths)."""
    indices = list(range(len(prompts)))
    if engines.procs == 1:
        from tandem.engine.llm import LLM

        answers = _answer(llm or LLM(engines.target, **engines.kwargs), prompts, indices, cfg, True)
    else:
        n = min(engines.procs, max(1, len(prompts)))
        jobs = [(engines, prompts[r::n], indices[r::n], cfg, r == 0) for r in range(n)]
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; spawn everywhere for one behaviour
        with ctx.Pool(n) as pool:
            shares = pool.map(_answer_shard, jobs, chunksize=1)
        answers = [None] * len(prompts)
        for r, share in enumerate(shares):
            answers[r::n] = share
    return [Sequence(torch.tensor(p + a, dtype=torch.long), len(p)) if a is not None else None
            for p, a in zip(prompts, answers)]


def cache_path(cfg: TrainConfig) -> Path:
    return Path(cfg.data_cache) if cfg.data_cache else Path(cfg.out) / "cache" / "data.pt"


def _to_state(seqs: list[Sequence]) -> dict[str, Any]:
    """Every sequence in one flat tensor, uint16 when every id fits (vocabularies below 65,536: half
    the bytes of int32; one storage instead of one per sequence), with the lengths."""
    flat = torch.cat([s.tokens for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
    small = not flat.numel() or int(flat.max()) < 1 << 16
    return {"flat": flat.to(torch.uint16 if small else torch.int32),
            "lens": torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64),
            "prompt_lens": [s.prompt_len for s in seqs]}


def _from_state(state: dict[str, Any]) -> list[Sequence]:
    if "flat" not in state:  # caches written before the flat layout: one int32 tensor per sequence
        return [Sequence(t.long(), int(n)) for t, n in zip(state["tokens"], state["prompt_lens"])]
    parts = torch.split(state["flat"].long(), state["lens"].tolist())
    return [Sequence(t, int(n)) for t, n in zip(parts, state["prompt_lens"])]


def load_cached(cfg: TrainConfig) -> DraftData | None:
    path = cache_path(cfg)
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("key") != json.dumps(cfg.generation_key(), sort_keys=True):
        logger.info("generated-data cache %s was made with other data settings: regenerating", path)
        return None
    return DraftData(_from_state(state["train"]), _from_state(state["val"]), list(state["train_indices"]),
                     list(state["val_indices"]), str(state["source"]), 0.0, list(state.get("records", [])),
                     int(state.get("num_given", 0)))


def build_data(cfg: TrainConfig, engines: GenerationEngines) -> DraftData:
    """The cached data if it matches ``cfg``, else generated now by ``engines`` and cached.
    Training sequences: the answered prompts, then the given conversations."""
    cached = load_cached(cfg)
    if cached is not None:
        logger.info("using generated data from %s (%d train / %d held-out sequences)", cache_path(cfg),
                    len(cached.train), len(cached.val))
        return cached
    rows, source = load_prompts(cfg.data)
    t0 = time.perf_counter()
    llm = None
    if engines.procs == 1:  # the engine that answers also tokenizes
        from tandem.engine.llm import LLM

        llm = LLM(engines.target, **engines.kwargs)
        tokenizer = llm.get_tokenizer()
    else:
        from tandem.loader.checkpoint import open_checkpoint

        tokenizer = open_checkpoint(engines.target).load_tokenizer()
    sel = select_prompts(rows, tokenizer, cfg)
    logger.info("%d prompts to answer (%d held out), %d conversations as given", len(sel.val) + len(sel.train),
                len(sel.val), len(sel.given))
    seqs = answer_all(engines, sel.val + sel.train, cfg, llm)
    del llm
    elapsed = time.perf_counter() - t0
    val = list(zip(seqs[:len(sel.val)], sel.val_idx))
    train = list(zip(seqs[len(sel.val):], sel.train_idx)) + list(zip(sel.given, sel.given_idx))
    train_used = [(s, i) for s, i in train if s is not None]
    val_used = [(s, i) for s, i in val if s is not None]
    records = sorted({r for r in (rows[i].record for _, i in train_used + val_used) if r is not None})
    data = DraftData([s for s, _ in train_used], [s for s, _ in val_used], [i for _, i in train_used],
                     [i for _, i in val_used], source, elapsed, records, len(sel.given))
    path = cache_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"key": json.dumps(cfg.generation_key(), sort_keys=True), "source": source,
                "train": _to_state(data.train), "val": _to_state(data.val),
                "train_indices": data.train_indices, "val_indices": data.val_indices, "records": records,
                "num_given": data.num_given}, path)
    n_tok = sum(len(s.generated) for s in seqs if s is not None)
    logger.info("generated %d tokens for %d prompts in %.1f s (%.0f tok/s, %d process%s)", n_tok, len(seqs),
                elapsed, n_tok / max(elapsed, 1e-9), engines.procs, "" if engines.procs == 1 else "es")
    return data
