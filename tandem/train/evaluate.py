"""The real measurement: the engine speculating with the trained head on held-out prompts.

For each ``k``, ``LLM(target, speculative_config={"method": ..., "model": OUT,
"num_speculative_tokens": k, "disable_by_acceptance": False})`` (drafting every step) answers
the held-out prompts greedily; the engine's own counters
(``stats.spec``) give the acceptance rate, per-position acceptance and the mean accepted length τ
(tokens per verify step, bonus token included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.train.device import engine_kwargs, free_memory


@dataclass(frozen=True)
class EngineEval:
    k: int
    acceptance_rate: float
    per_position: tuple[float, ...]
    mean_accepted_length: float
    num_drafts: int
    output_tokens: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "acceptance_rate": self.acceptance_rate, "per_position": list(self.per_position),
                "mean_accepted_length": self.mean_accepted_length, "num_drafts": self.num_drafts,
                "output_tokens": self.output_tokens, "seconds": self.seconds}


def engine_eval(target: str, head_dir: Path, method: str, prompts: list[list[int]], k: int, max_tokens: int,
                device: torch.device, max_model_len: int) -> EngineEval:
    from tandem.engine.llm import LLM
    from tandem.sampling_params import SamplingParams

    # drafting every step: this measures the head, not what the goodput policy makes of it (with the
    # policy, a weak head on a fast GPU drafts only its exploration rounds)
    llm = LLM(target, speculative_config={"method": method, "model": str(head_dir), "num_speculative_tokens": k,
                                          "disable_by_acceptance": False},
              **engine_kwargs(device, max_model_len))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - t0
    st = llm.engine.stats.spec.copy()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
    del llm, outs
    free_memory(device)
    return EngineEval(k, st.acceptance_rate, tuple(st.per_position_rates()), st.mean_acceptance_length,
                      st.num_drafts, n_out, seconds)


def format_table(rows: list[EngineEval]) -> str:
    lines = ["| k | acceptance | per position | mean accepted length (tau) | drafts | seconds |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        pos = " ".join(f"{a:.3f}" for a in r.per_position)
        lines.append(f"| {r.k} | {r.acceptance_rate:.3f} | {pos} | {r.mean_accepted_length:.3f} | {r.num_drafts} "
                     f"| {r.seconds:.1f} |")
    return "\n".join(lines)
