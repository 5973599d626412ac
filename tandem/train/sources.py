"""Training rows for ``train-draft`` from ShareGPT conversations: every user turn, whole
conversations as given, and raw code prefixes.

One JSONL row per line, each carrying the index of the ShareGPT record it came from (``record``):

- ``{"messages": [...ending with a user turn]}``: every user turn with the conversation before it
  (earlier replies as ShareGPT holds them); the target answers it, as in serving (chat template);
- ``{"messages": [...ending with an assistant turn]}``: the conversation as given, cut to whole
  messages within ``max_given_chars``; nothing is generated: the head learns the target's next-token
  distribution along that text (the fixed-dataset recipe of EAGLE-1), which costs one target forward
  instead of a generation;
- ``{"text": ...}``: the first third of a fenced code block of a reply (at least two lines), raw, no
  chat template; the target continues it, as it continues a HumanEval prompt.

``python -m tandem.train.sources --records 0:16000 --out mix.jsonl`` writes the rows of records
``[0, 16000)`` of the packaged ShareGPT file (or ``--sharegpt FILE``, JSON array or gzipped;
``--given-records`` narrows the given conversations, which are long, to fewer records); the
records from 16000 on stay unseen for benchmarks. ``train-draft --data mix.jsonl`` trains on it and
records the records it used in ``training.json`` (``data.records``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
MIN_CODE_LINES = 2


def conversation(record: dict[str, Any]) -> list[dict[str, str]]:
    """A ShareGPT record as chat messages (user / assistant), from its first user turn on; turns of
    other roles or without text are dropped."""
    msgs: list[dict[str, str]] = []
    for turn in record.get("conversations") or []:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or not turn["value"].strip():
            continue
        role = _ROLE.get(str(turn.get("from")))
        if role is None or (not msgs and role != "user"):
            continue
        msgs.append({"role": role, "content": turn["value"]})
    return msgs


def code_prefixes(reply: str) -> list[str]:
    """The first third (at least ``MIN_CODE_LINES`` lines) of each fenced code block of ``reply``
    that has more lines than that."""
    out = []
    for block in _FENCE.findall(reply):
        lines = block.rstrip("\n").split("\n")
        if len(lines) <= MIN_CODE_LINES:
            continue
        out.append("\n".join(lines[:max(MIN_CODE_LINES, len(lines) // 3)]) + "\n")
    return out


def sharegpt_rows(records: Sequence[dict[str, Any]], start: int, stop: int, *, turns: bool = True,
                  given: bool = True, code: bool = True, given_span: tuple[int, int] | None = None,
                  max_prompt_chars: int = 6000, max_given_chars: int = 8000) -> Iterator[dict[str, Any]]:
    """Rows of records ``[start, stop)`` (see the module docstring); given conversations only from
    records in ``given_span`` (default: all of them). Prompts longer than ``max_prompt_chars`` are
    skipped (``train-draft`` skips them anyway by their token count)."""
    glo, ghi = given_span or (start, stop)
    for i in range(max(0, start), min(stop, len(records))):
        msgs = conversation(records[i])
        if not msgs:
            continue
        if turns:
            chars = 0
            for j, m in enumerate(msgs):
                chars += len(m["content"])
                if chars > max_prompt_chars:
                    break
                if m["role"] == "user":
                    yield {"messages": msgs[:j + 1], "record": i}
        if given and glo <= i < ghi:
            kept: list[dict[str, str]] = []
            chars = 0
            for m in msgs:
                chars += len(m["content"])
                if chars > max_given_chars and kept:
                    break
                kept.append(m)
            while kept and kept[-1]["role"] != "assistant":
                kept.pop()
            if kept:
                yield {"messages": kept, "record": i}
        if code:
            for m in msgs:
                if m["role"] == "assistant":
                    for text in code_prefixes(m["content"]):
                        yield {"text": text, "record": i}


def read_records(path: str | None) -> list[dict[str, Any]]:
    """ShareGPT records: the packaged file, or a JSON array (optionally gzipped) / JSONL of them."""
    from tandem.bench.datasets import load_sharegpt_records

    if path is None:
        return load_sharegpt_records()
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if path.endswith(".gz") else raw).decode("utf-8")
    if text.lstrip().startswith("["):
        return [r for r in json.loads(text) if isinstance(r, dict)]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _span(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a or 0), int(b) if b else 1 << 62
    except ValueError:
        raise argparse.ArgumentTypeError(f"--records wants START:STOP, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tandem.train.sources", description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=_span, default=(0, 1 << 62), help="START:STOP record indices (default all)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--sharegpt", default=None, help="ShareGPT file (default: the packaged one)")
    ap.add_argument("--no-turns", action="store_true")
    ap.add_argument("--no-given", action="store_true")
    ap.add_argument("--given-records", type=_span, default=None,
                    help="START:STOP: given conversations only from these records (default: --records)")
    ap.add_argument("--no-code", action="store_true")
    args = ap.parse_args(argv)
    records = read_records(args.sharegpt)
    counts = {"messages": 0, "given": 0, "text": 0}
    with open(args.out, "w", encoding="utf-8") as f:
        for row in sharegpt_rows(records, *args.records, turns=not args.no_turns, given=not args.no_given,
                                 code=not args.no_code, given_span=args.given_records):
            kind = "text" if "text" in row else "given" if row["messages"][-1]["role"] == "assistant" else "messages"
            counts[kind] += 1
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{args.out}: {counts['messages']} user turns to answer, {counts['given']} given conversations, "
          f"{counts['text']} code prefixes to continue (records {args.records[0]}:"
          f"{min(args.records[1], len(records))} of {len(records)})")


if __name__ == "__main__":
    main()
