"""Tiny random EAGLE heads on disk in the three public layouts, for loader and engine tests.

``write_eagle_head(dir, layout, target)`` writes ``config.json`` + ``model.safetensors`` as the
producing tools name and shape them (``../shared/research/eagle.md`` §1):

- ``"eagle"``: EAGLE-1/2 (SafeAILab ``cnets1.Model``): a one-layer ``LlamaForCausalLM`` config;
  ``fc.weight`` [H, 2H] (+ ``fc.bias``), ``layers.0.*`` without ``input_layernorm``, and a copy of
  the embeddings (which loaders drop).
- ``"eagle3"``: EAGLE-3 as the EAGLE repo / SpecForge save it (``LlamaForCausalLMEagle3``):
  ``midlayer.*`` with q/k/v over 2H and ``hidden_norm``, ``fc`` [H, 3H], ``norm``, ``lm_head`` over
  ``draft_vocab_size`` rows, ``d2t`` (int64 offsets) and ``t2d`` (bool mask); explicit aux ids under
  ``eagle_config`` in SGLang's "output of layer i" convention.
- ``"speculators"``: ``Eagle3Speculator`` (vLLM speculators): ``transformer_layer_config``,
  ``layers.0.*`` names, top-level flags and aux ids in the "input of layer i" convention.

Returns the directory and the aux layer ids the head should read (input-of-layer convention).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def _layer_config(target: dict[str, Any], **kw: Any) -> dict[str, Any]:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size")
    cfg = {k: target[k] for k in keys if k in target}
    cfg.update({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_act": "silu",
                "model_type": "llama", "tie_word_embeddings": False})
    cfg.update(kw)
    return cfg


def write_eagle_head(base: Path, layout: str, target_dir: Path, *, seed: int = 0, std: float = 0.2,
                     draft_vocab: int | None = None, aux: tuple[int, ...] | None = None,
                     name: str | None = None, norm_before_residual: bool = True,
                     fc_bias: bool = True) -> tuple[Path, tuple[int, ...]]:
    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, v = target["hidden_size"], target["vocab_size"]
    n_layers = target["num_hidden_layers"]
    heads, kvh = target["num_attention_heads"], target["num_key_value_heads"]
    hd = target.get("head_dim") or h // heads
    inter = target["intermediate_size"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn((n,), generator=g)

    eagle3 = layout in ("eagle3", "speculators")
    qkv_in = 2 * h if eagle3 else h
    layer = {
        "self_attn.q_proj.weight": rnd(heads * hd, qkv_in),
        "self_attn.k_proj.weight": rnd(kvh * hd, qkv_in),
        "self_attn.v_proj.weight": rnd(kvh * hd, qkv_in),
        "self_attn.o_proj.weight": rnd(h, heads * hd),
        "mlp.gate_proj.weight": rnd(inter, h),
        "mlp.up_proj.weight": rnd(inter, h),
        "mlp.down_proj.weight": rnd(h, inter),
        "post_attention_layernorm.weight": norm(h),
    }
    out = Path(base) / (name or f"head_{layout}")
    out.mkdir(parents=True, exist_ok=True)
    ids_in = aux if aux is not None else (2, n_layers // 2, n_layers - 3)
    tensors: dict[str, torch.Tensor] = {"embed_tokens.weight": rnd(v, h)}
    if not eagle3:
        tensors.update({f"layers.0.{k}": t for k, t in layer.items()})
        tensors["fc.weight"] = rnd(h, 2 * h)
        if fc_bias:
            tensors["fc.bias"] = rnd(h)
        cfg = _layer_config(target, bias=fc_bias)
        ids_in = ()
    else:
        dv = draft_vocab or v
        layer["input_layernorm.weight"] = norm(h)
        layer["hidden_norm.weight"] = norm(h)
        kept = torch.sort(torch.randperm(v, generator=g)[:dv]).values
        d2t = kept - torch.arange(dv)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[kept] = True
        tensors.update({"fc.weight": rnd(h, 3 * h), "norm.weight": norm(h), "lm_head.weight": rnd(dv, h),
                        "d2t": d2t.to(torch.int64), "t2d": t2d})
        if layout == "eagle3":
            tensors.update({f"midlayer.{k}": t for k, t in layer.items()})
            cfg = _layer_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
            if aux is not None:  # SGLang / SpecForge: "output of layer i" = input of layer i + 1
                cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux],
                                       "use_aux_hidden_state": True}
        else:
            tensors.update({f"layers.0.{k}": t for k, t in layer.items()})
            cfg = {
                "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": "0.2.0", "transformer_layer_config": _layer_config(target),
                "draft_vocab_size": dv, "target_hidden_size": h, "norm_before_residual": norm_before_residual,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
            }
            if aux is not None:
                cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out / "model.safetensors"))
    return out, tuple(ids_in)


def compare_chained_head_steps(chained: Any, sync: Any, blocks: list[list[int]], vocab: int, k: int = 3,
                               tol: float = 1e-5, chain_graph: bool = False, proposal_graph: bool = False) -> int:
    """A proposal chained on a verify still on the device (``HeadChain``) drafts what a proposal
    made after reading that verify drafts: ``chained`` and ``sync`` (head runners over the same
    head and feature cache, KV caches of their own) run the same requests — each verify accepting
    0..k of its drafts, some heads caught up to the verify, some behind — the first through the
    chained catch-up and chain steps (``chain_graph``: steps 2..k in one ``forward_chain``), the
    second through the synchronous ones on the verify's outcome (``proposal_graph``: the whole
    chained proposal in one ``forward_proposal``). Returns the number of head steps compared."""
    from tandem.worker.batch import ChainedFrom, HeadChain, SeqChunk

    dev = chained.device
    n = len(blocks)
    hist = [[(11 * i + 7 * j) % (vocab - 3) + 3 for j in range(64)] for i in range(n)]
    verify_at = [20 + 3 * i for i in range(n)]  # P: the verify's first position (its first token known)
    seen = [p - (3 * i) % 5 for i, p in enumerate(verify_at)]  # the head caught up to here
    accepted = [i % (k + 1) for i in range(n)]
    drafts = [tuple((hist[i][j] + 5) % (vocab - 3) + 3 for j in range(k)) for i in range(n)]
    rows: list[int] = []  # the verify's row argmaxes: the accepted drafts, then another token
    for i in range(n):
        g = list(drafts[i][:accepted[i]]) + [(drafts[i][accepted[i]] + 1) % vocab if accepted[i] < k else 9]
        rows += g + [(t + 2) % vocab for t in range(k - accepted[i])]
    verify = ChainedFrom(torch.tensor(rows, device=dev), tuple(i * (k + 1) for i in range(n)), tuple(drafts))
    real = [hist[i][:verify_at[i] + 1] + rows[i * (k + 1):i * (k + 1) + accepted[i] + 1] for i in range(n)]
    prior = [SeqChunk(hist[i][1:seen[i] + 1], 0, blocks[i]) for i in range(n)]
    for r in (chained, sync):  # both heads see the positions before ``seen``
        r.forward(prior, [sum(s for s in seen[:i + 1]) - 1 for i in range(n)], None)
    last = lambda lens: [sum(lens[:i + 1]) - 1 for i in range(len(lens))]  # noqa: E731
    c_chunks = [SeqChunk(hist[i][seen[i] + 1:verify_at[i] + 1] + [0] * (k + 1), seen[i], blocks[i]) for i in range(n)]
    s_chunks = [SeqChunk(real[i][seen[i] + 1:], seen[i], blocks[i]) for i in range(n)]
    b = sync.forward(s_chunks, last([len(c.token_ids) for c in s_chunks]), None)
    if proposal_graph:
        toks = chained.forward_proposal(c_chunks, last([len(c.token_ids) for c in c_chunks]), k - 1,
                                        HeadChain(verify, True))
        assert toks is not None and tuple(toks.shape) == (k, n)
        for steps in range(1, k + 1):
            assert torch.equal(toks[steps - 1], b.token_ids), steps
            if steps < k:
                b = sync.forward([SeqChunk([0], verify_at[i] + accepted[i] + steps, blocks[i]) for i in range(n)],
                                 range(n), b.feedback.clone(), token_ids=b.token_ids.clone())
        return k
    a = chained.forward(c_chunks, last([len(c.token_ids) for c in c_chunks]), None, chain=HeadChain(verify, True))
    steps = 1
    while True:
        assert torch.equal(a.token_ids, b.token_ids), steps
        assert float((a.feedback - b.feedback).norm() / b.feedback.norm()) < tol, steps  # (CUDA: TF32)
        if steps == k:
            return steps
        tok_a, tok_b, fb_a, fb_b = a.token_ids.clone(), b.token_ids.clone(), a.feedback.clone(), b.feedback.clone()
        if chain_graph:
            toks = chained.forward_chain([SeqChunk([0], verify_at[i] + k + 1, blocks[i]) for i in range(n)], fb_a,
                                         tok_a, k - 1, HeadChain(verify, False))
            assert toks is not None and len(toks) == k - 1
            for t in toks:
                b = sync.forward([SeqChunk([0], verify_at[i] + accepted[i] + steps, blocks[i]) for i in range(n)],
                                 range(n), fb_b, token_ids=tok_b)
                steps += 1
                assert torch.equal(t, b.token_ids), steps
                tok_b, fb_b = b.token_ids.clone(), b.feedback.clone()
            return steps
        a = chained.forward([SeqChunk([0], verify_at[i] + k + steps, blocks[i]) for i in range(n)], range(n), fb_a,
                            token_ids=tok_a, chain=HeadChain(verify, False))
        b = sync.forward([SeqChunk([0], verify_at[i] + accepted[i] + steps, blocks[i]) for i in range(n)], range(n),
                         fb_b, token_ids=tok_b)
        steps += 1


def head_over_features(base: Path, layout: str, dev: torch.device, *, num_blocks: int, block_size: int,
                       aux: tuple[int, ...] | None = (1, 2, 3), draft_vocab: int | None = None,
                       **target_kw: Any) -> tuple[Any, Any, Any, Any]:
    """A tiny head (float32, std 0.1) over a 4-layer tiny target, bound to a random embedding,
    with a feature cache of random rows (the target's features, as the head runners read them) and
    a factory of KV caches for it: ``(head, new_kv_cache, features, target_arch)``."""
    from tandem.kv.feature_cache import FeatureCache
    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.loader.arch import ModelArch
    from tandem.loader.eagle import load_eagle_head, read_eagle_config
    from tiny_models import write_tiny_hf_checkpoint

    tdir = write_tiny_hf_checkpoint(base, "llama", name="t", num_hidden_layers=4, **target_kw)
    hdir, _ = write_eagle_head(base, layout, tdir, **({"aux": aux} if aux else {}), draft_vocab=draft_vocab, std=0.1)
    arch = ModelArch.from_hf(json.loads((tdir / "config.json").read_text()))
    cfg = read_eagle_config(hdir, arch)
    head = load_eagle_head(cfg, 512, torch.float32, dev)
    emb = torch.nn.Embedding(arch.vocab_size, arch.hidden_size).to(dev)
    head.bind_target(emb, None, emb.weight)
    width = len(cfg.feature_layers(arch.num_layers)) * arch.hidden_size
    features = FeatureCache(width, num_blocks, block_size, torch.float32, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    features.rows.copy_(torch.randn(features.rows.shape, generator=g, device=dev))

    def new_kv_cache() -> Any:
        return allocate_kv_cache(cfg.layer, num_blocks, block_size, torch.float32, dev)[0]

    return head, new_kv_cache, features, arch
