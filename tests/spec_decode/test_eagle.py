"""EAGLE / EAGLE-3 speculation in the engine: heads in every public layout load, drafts are
accepted, and output equals the target's without speculation (greedy fp32, batch 1 and 16,
chunked prefill and preemption), sampled distribution included."""

from __future__ import annotations

import pytest

from eagle_heads import write_eagle_head
from engine_utils import greedy, make_llm, random_prompts, tokens_of
from tandem.errors import ConfigError, ModelLoadError
from tiny_models import write_tiny_hf_checkpoint

LAYOUTS = ("eagle", "eagle3", "speculators")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    base = tmp_path_factory.mktemp("eagle")
    return write_tiny_hf_checkpoint(base, "llama", std=0.2, name="target", num_hidden_layers=4)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    base = tmp_path_factory.mktemp("heads")
    return {
        "eagle": write_eagle_head(base, "eagle", target)[0],
        "eagle3": write_eagle_head(base, "eagle3", target, aux=(1, 2, 3), draft_vocab=96)[0],
        "speculators": write_eagle_head(base, "speculators", target, aux=(0, 2, 3), draft_vocab=64)[0],
    }


@pytest.fixture(scope="module")
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(16, 100, lo=2, hi=50, seed=5)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return tokens_of(make_llm(target).generate(prompts, greedy(32), use_tqdm=False))


def _method(layout: str) -> str:
    return "eagle" if layout == "eagle" else "eagle3"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_equals_no_speculation(target, heads, prompts, reference, layout):
    llm = make_llm(target, speculative_config={"method": _method(layout), "model": str(heads[layout]),
                                               "num_speculative_tokens": 3})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference  # batch 16
    for p, want in zip(prompts[:3], reference[:3]):  # batch 1
        assert tokens_of(llm.generate([p], greedy(32), use_tqdm=False)) == [want]
    st = llm.engine.stats.spec
    assert st.num_draft_tokens > 0
    assert llm.engine.pool.all_free()


def test_method_is_inferred_from_the_checkpoint(target, heads, prompts, reference):
    llm = make_llm(target, speculative_config={"model": str(heads["speculators"]), "num_speculative_tokens": 2})
    assert llm.engine.spec.method == "eagle3"
    assert tokens_of(llm.generate(prompts[:4], greedy(32), use_tqdm=False)) == reference[:4]


def test_with_preemption_and_chunking(target, heads, prompts, reference):
    # 4-token blocks: (target 4 layers + head 1) x K,V x (2 kv heads x 16) x 4 B x 4 = 5 KiB per block,
    # and the target's features (3 aux layers x 64) x 4 B x 4 = 3 KiB
    llm = make_llm(target, kv_cache_memory_bytes=36 * (5120 + 3072), max_num_batched_tokens=40, max_model_len=128,
                   speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                       "num_speculative_tokens": 4})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.pool.all_free()


def test_with_prefix_caching(target, heads, prompts, reference):
    llm = make_llm(target, enable_prefix_caching=True,
                   speculative_config={"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3})
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference  # cache hits
    assert llm.engine.stats.prefix_cache_hits > 0


def test_head_that_does_not_fit_is_a_clear_error(tmp_path, heads):
    other = write_tiny_hf_checkpoint(tmp_path, "llama", name="wide", hidden_size=96, num_hidden_layers=4)
    with pytest.raises(ModelLoadError, match="hidden"):
        make_llm(other, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                            "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="eagle3"):
        make_llm(other, speculative_config={"method": "eagle", "model": str(heads["eagle3"]),
                                            "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="draft_sample_method"):
        make_llm(other, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                            "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"})


# ---- the head's drafts against an independent reference ------------------------------------------
def _rms(x, w, eps=1e-6):
    import torch

    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat((f, f), -1).cos()[:, None], torch.cat((f, f), -1).sin()[:, None]
    rot = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos + rot * sin


def _reference_drafts(target_dir, head_dir, layout, tokens, k):
    """Drafts for the accepted ``tokens`` straight from the checkpoint tensors and HF's target
    (EAGLE repo / vLLM semantics, written out without tandem's modules): head position p reads the
    target feature at p and the embedding of token p+1; chain steps feed back the pre-norm output."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    w = load_file(str(Path(head_dir) / "model.safetensors"))
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    pre = "midlayer." if layout == "eagle3" else "layers.0."
    L = lambda n: w[pre + n]  # noqa: E731
    tc = json.loads((Path(target_dir) / "config.json").read_text())
    nh, kvh, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
        hs = [h[0] for h in out.hidden_states]
        embed = hf.model.embed_tokens.weight
        n = len(tokens)
        if layout == "eagle":
            feats = hs[-1][: n - 1]  # final post-norm hidden
        else:
            aux = cfg.get("eagle_aux_hidden_state_layer_ids") or [i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
            feats = torch.cat([hs[i][: n - 1] for i in aux], -1) @ w["fc.weight"].T
        keys, vals = [], []
        hidden, toks, drafts = feats, torch.tensor(tokens[1:]), []
        pos = torch.arange(n - 1)
        for step in range(k):
            e = embed[toks]
            if layout == "eagle":
                x = torch.cat((e, hidden), -1) @ w["fc.weight"].T + w["fc.bias"]
                resid, inp = x, x
            else:
                hn = _rms(hidden, L("hidden_norm.weight"))
                resid = hn if cfg.get("norm_before_residual") else hidden
                inp = torch.cat((_rms(e, L("input_layernorm.weight")), hn), -1)
            q = (inp @ L("self_attn.q_proj.weight").T).view(-1, nh, hd)
            kk = (inp @ L("self_attn.k_proj.weight").T).view(-1, kvh, hd)
            v = (inp @ L("self_attn.v_proj.weight").T).view(-1, kvh, hd)
            q, kk = _rope(q, pos), _rope(kk, pos)
            keys.append(kk)
            vals.append(v)
            K, V = torch.cat(keys), torch.cat(vals)
            K, V = K.repeat_interleave(nh // kvh, 1), V.repeat_interleave(nh // kvh, 1)
            allpos = torch.cat([torch.arange(n - 1)] + [torch.tensor([n - 2 + j]) for j in range(1, step + 1)])
            s = torch.einsum("qhd,khd->hqk", q, K) / hd ** 0.5
            s = s.masked_fill(allpos[None, None, :] > pos[None, :, None], float("-inf"))
            a = torch.einsum("hqk,khd->qhd", s.softmax(-1), V).reshape(len(pos), -1)
            x = resid + a @ L("self_attn.o_proj.weight").T
            m = _rms(x, L("post_attention_layernorm.weight"))
            x = x + (torch.nn.functional.silu(m @ L("mlp.gate_proj.weight").T) * (m @ L("mlp.up_proj.weight").T)) @ L("mlp.down_proj.weight").T
            last = x[-1:]
            if layout == "eagle":
                logits = last @ hf.lm_head.weight.T
                tok = int(logits.argmax())
            else:
                logits = _rms(last, w["norm.weight"]) @ w["lm_head.weight"].T
                d = int(logits.argmax())
                tok = d + int(w["d2t"][d])
            drafts.append(tok)
            hidden, toks, pos = last, torch.tensor([tok]), torch.tensor([n - 1 + step])
    return drafts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafts_equal_an_independent_reference(target, heads, prompts, layout, monkeypatch):
    """Every proposal made while generating (after prefill, after accepted and rejected verifies)
    equals what the checkpoint computes from scratch on the same accepted tokens."""
    from tandem.spec_decode.eagle import EagleProposer

    seen: list[tuple[list[int], list[int]]] = []
    orig = EagleProposer.propose_on_device  # (what the engine calls: the drafts stay on the device)

    def spy(self, reqs, ks):
        out = orig(self, reqs, ks)
        drafts = out.read() if out is not None else {}
        seen.extend((list(r.token_ids), drafts[r.request_id]) for r, kk in zip(reqs, ks) if kk == 3)
        return out

    monkeypatch.setattr(EagleProposer, "propose_on_device", spy)
    llm = make_llm(target, speculative_config={"method": _method(layout), "model": str(heads[layout]),
                                               "num_speculative_tokens": 3})
    llm.generate(prompts[:2], greedy(12), use_tqdm=False)
    assert len(seen) >= 6
    for tokens, drafts in seen[:6]:
        assert drafts == _reference_drafts(target, heads[layout], layout, tokens, 3), tokens


def test_sampled_distribution_matches_target(target, heads):
    """T != 1 with top-k/top-p: the token after the first (drafted by the head, one-hot q) follows
    the target's distribution."""
    from engine_utils import chi2_same, token_counts
    from tandem import SamplingParams

    params = SamplingParams(temperature=1.3, top_k=6, top_p=0.95, max_tokens=3, ignore_eos=True)
    n = 3000
    plain = token_counts(make_llm(target, max_num_seqs=1024), n, params, 1)
    spec = make_llm(target, max_num_seqs=1024, speculative_config={
        "method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 2})
    assert chi2_same(plain, token_counts(spec, n, params, 1)) > 1e-3
    st = spec.engine.stats.spec
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    # (that the test detects a wrong recovery step with one-hot q is shown in test_speculative.py,
    # where the drafts are the target's own argmax: this random head's drafts are rarely likely)


def test_dummy_target_opens_its_head_as_dummy(tmp_path, target, heads):
    """load_format="dummy": the head directory needs only its config.json (random weights)."""
    import shutil

    cfg_only = tmp_path / "cfg_only"
    cfg_only.mkdir()
    shutil.copy(heads["speculators"] / "config.json", cfg_only / "config.json")
    llm = make_llm(target, load_format="dummy", speculative_config={"method": "eagle3", "model": str(cfg_only),
                                                                  "num_speculative_tokens": 3})
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy(8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8 and llm.engine.stats.spec.num_draft_tokens > 0
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        make_llm(target, speculative_config={"method": "eagle3", "model": str(cfg_only), "num_speculative_tokens": 3})


def test_speculation_switched_off_and_on_again(target, heads, prompts, reference):
    """``engine.spec = None`` stops drafting (the runner still writes features: a block computed then
    may serve a later hit); switched back on, the head catches up over what it missed and drafts."""
    cfg = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3,
           "disable_by_acceptance": False}
    llm = make_llm(target, speculative_config=cfg)
    spec = llm.engine.spec
    llm.engine.spec = None
    assert tokens_of(llm.generate(prompts[:4], greedy(32), use_tqdm=False)) == reference[:4]
    assert llm.engine.stats.spec.num_drafts == 0
    llm.engine.spec = spec
    assert tokens_of(llm.generate(prompts[:4], greedy(32), use_tqdm=False)) == reference[:4]
    assert llm.engine.stats.spec.num_drafts > 0


def _features_checker(llm, monkeypatch):
    """Spy on every head step that reads the target's features from the feature cache (a proposal's
    first step); returns a function that checks the rows of those positions, as they were then,
    against the features a fresh forward of the target computes over the same tokens (its own KV)."""
    import torch

    from tandem.kv.kv_cache import allocate_kv_cache
    from tandem.spec_decode.eagle import EagleProposer
    from tandem.worker.batch import SeqChunk
    from tandem.worker.model_runner import TorchRunner

    proposer = llm.engine.speculator.proposer
    assert isinstance(proposer, EagleProposer)
    cache = proposer.runner.features
    reads: list[tuple[list[int], int, int, torch.Tensor]] = []
    tokens_of_blocks: dict[int, list[int]] = {}
    orig_propose, orig_forward = proposer._steps, proposer.runner.forward

    def propose(reqs, ks, verify=None):  # (the chain every proposal path launches; synchronous here)
        assert verify is None
        tokens_of_blocks.update((id(r.block_ids), list(r.token_ids)) for r in reqs)
        return orig_propose(reqs, ks)

    def forward(chunks, rows, hidden, token_ids=None, chain=None):
        if hidden is None:  # the rows this step gathers: the chunks' positions' slots
            for c in chunks:
                lo, hi = c.start, c.start + len(c.token_ids)
                slots = torch.from_numpy(cache.slots(c.block_ids, lo, hi))
                reads.append((tokens_of_blocks[id(c.block_ids)], lo, hi, cache.rows[slots].clone()))
        return orig_forward(chunks, rows, hidden, token_ids, chain)

    monkeypatch.setattr(proposer, "_steps", propose)
    monkeypatch.setattr(proposer.runner, "forward", forward)
    model = llm.engine.model
    layers = llm.engine.runner.feature_layers

    def check() -> list[int]:
        """Checks every read; returns the rows each read."""
        for toks, lo, hi, got in reads:
            ref = TorchRunner(model, allocate_kv_cache(model.arch, 64, 4, torch.float32, torch.device("cpu")),
                              4, torch.device("cpu"), script=False)
            aux = ref.forward([SeqChunk(toks[:hi], 0, list(range(64)))], [hi - 1], aux_layers=layers).aux_hidden
            torch.testing.assert_close(got, torch.cat(aux, dim=-1)[lo:hi], rtol=1e-4, atol=1e-4)
            assert toks[lo + 1:hi + 1]  # (the head's tokens at those positions are known)
        return [hi - lo for _, lo, hi, _ in reads]

    return check


@pytest.mark.parametrize("case", ["prefix-cache", "preemption", "policy-gaps"])
def test_features_read_from_the_cache_equal_a_fresh_forward(target, heads, prompts, reference, case, monkeypatch):
    """The rows the head reads from the feature cache are the target's features of those positions:
    written by prefill chunks, decodes and verifies, by an earlier request into a prefix-cache block
    (the head starts from position 0 on a hit), again after a preemption, and still there after
    steps where the policy let the head idle (it catches up over the gap)."""
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3}
    n, kw = 6, {}
    if case == "prefix-cache":
        kw = {"enable_prefix_caching": True}
    elif case == "preemption":  # as in test_with_preemption_and_chunking
        kw = {"kv_cache_memory_bytes": 36 * (5120 + 3072), "max_num_batched_tokens": 40, "max_model_len": 128}
    else:
        spec["disable_by_acceptance"] = True
        n = 2
    llm = make_llm(target, speculative_config=spec, **kw)
    check = _features_checker(llm, monkeypatch)
    long = greedy(32) if case != "policy-gaps" else greedy(160)
    want = reference[:n] if case != "policy-gaps" else tokens_of(make_llm(target).generate(prompts[:n], long, use_tqdm=False))
    assert tokens_of(llm.generate(prompts[:n], long, use_tqdm=False)) == want
    if case == "prefix-cache":
        assert tokens_of(llm.generate(prompts[:n], long, use_tqdm=False)) == want
        assert llm.engine.stats.prefix_cache_hits > 0
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    widths = check()
    assert widths
    if case == "policy-gaps":  # the head idled between exploration rounds and caught up over the gap
        assert max(widths) > 16
    assert llm.engine.pool.all_free()


def _count_head_forwards(llm) -> list[int]:
    """The EAGLE engine's head forwards from now on (one entry each)."""
    from tandem.spec_decode.eagle import EagleProposer

    proposer = llm.engine.speculator.proposer
    assert isinstance(proposer, EagleProposer)
    calls: list[int] = []
    forward = proposer.runner.forward

    def counting(*a, **kw):
        calls.append(1)
        return forward(*a, **kw)

    proposer.runner.forward = counting
    return calls


def test_no_head_forward_while_the_policy_grants_nothing(target, heads, prompts):
    """Once the policy stops granting drafts (an untrained head: nothing accepted), a step runs no
    head forward: every head forward belongs to a round that drafted."""
    llm = make_llm(target, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                               "num_speculative_tokens": 3, "disable_by_acceptance": True})
    assert llm.engine.speculator.policy is not None
    calls = _count_head_forwards(llm)
    want = tokens_of(make_llm(target).generate(prompts[:1], greedy(190), use_tqdm=False))
    assert tokens_of(llm.generate(prompts[:1], greedy(190), use_tqdm=False)) == want
    drafted = llm.engine.stats.spec.num_draft_tokens
    steps = llm.engine.stats.num_steps
    # exploration rounds draft (k forwards each, one drafted token per forward at batch 1)
    assert 0 < len(calls) <= drafted < steps // 2


def test_an_idle_head_keeps_the_asynchronous_pipeline_chained(target, heads, prompts):
    """While the policy grants no drafts, an asynchronous EAGLE engine launches exactly the steps
    ahead that a plain engine launches and runs no head forward at all: the target's features go to
    the feature cache inside its forward (each drain or forced round cost the H200 ~1-2 % at batch 1,
    docs/performance.md §24a; the per-step hand-off of features ~5 %, §29). Output is the target's."""
    cfg = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3,
           "disable_by_acceptance": True}
    llm = make_llm(target, async_scheduling=True, speculative_config=cfg)
    plain = make_llm(target, async_scheduling=True)
    policy = llm.engine.policy
    assert policy is not None
    policy._steps_since_draft, policy._explore_every = 0, 10**9  # no exploration round ...
    policy.acceptance.optimism = 0.0  # ... and the prior's 0.5 unraised: nobody drafts
    calls = _count_head_forwards(llm)
    long = greedy(200)  # prompts of up to 50 tokens: within the tiny target's 256 positions
    want = tokens_of(plain.generate(prompts[:2], long, use_tqdm=False))
    assert tokens_of(llm.generate(prompts[:2], long, use_tqdm=False)) == want
    assert llm.engine.stats.spec.num_draft_tokens == 0 and not calls
    assert plain.engine.num_chained_steps > 150
    assert llm.engine.num_chained_steps == plain.engine.num_chained_steps
    assert llm.engine.pool.all_free()


def test_drafts_feed_the_verify_on_the_device(target, heads, prompts, reference, monkeypatch):
    """The head's drafts reach the verify step on the device: the packed query carries placeholders
    at the draft rows, the runner is handed the drafts to feed there, and the host reads them only
    after the verify is launched; the output is still the target's, token for token."""
    from tandem.spec_decode.device_drafts import PENDING, DeviceDrafts

    llm = make_llm(target, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                               "num_speculative_tokens": 3, "disable_by_acceptance": False})
    runner = llm.engine.runner
    events: list[str] = []
    fed_tokens: list[int] = []
    orig_forward, orig_read = runner.forward_logits, DeviceDrafts.read

    def forward(chunks, rows, token_ids=None, argmax_only=False, fed=None, chain=None):
        if fed is not None:
            flat = [t for c in chunks for t in c.token_ids]
            fed_tokens.extend(flat[r] for r in fed.rows)
            events.append("verify")
        return orig_forward(chunks, rows, token_ids=token_ids, argmax_only=argmax_only, fed=fed, chain=chain)

    def read(self):
        events.append("read")
        return orig_read(self)

    monkeypatch.setattr(runner, "forward_logits", forward)
    monkeypatch.setattr(DeviceDrafts, "read", read)
    assert tokens_of(llm.generate(prompts[:6], greedy(32), use_tqdm=False)) == reference[:6]
    assert fed_tokens and set(fed_tokens) == {PENDING}
    assert events[:2] == ["verify", "read"] and events.count("verify") == events.count("read")
    assert llm.engine.stats.spec.num_draft_tokens >= len(fed_tokens)


CHAINED_CASES = {
    "every-step": ({"disable_by_acceptance": False}, {}),
    "policy": ({}, {}),
    "preemption": ({"disable_by_acceptance": False, "num_speculative_tokens": 4},  # as test_with_preemption...
                   {"kv_cache_memory_bytes": 36 * (5120 + 3072), "max_num_batched_tokens": 40, "max_model_len": 128}),
    "prefix-cache": ({"disable_by_acceptance": False}, {"enable_prefix_caching": True}),
}


@pytest.mark.parametrize("case", list(CHAINED_CASES))
def test_chained_proposals_give_the_tokens_of_plain_decoding(target, heads, prompts, reference, case):
    """An asynchronous EAGLE engine chains its verifies (engine/async_decode.py): each proposal is
    launched on the device behind the verify in flight and reads its outcome there; no verify
    waits for a host read to be drafted. Output equals the target's at batch 16 and 1, through
    preemption, chunked prefill, prefix-cache hits and the policy's idle stretches."""
    spec, kw = CHAINED_CASES[case]
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3, **spec}
    llm = make_llm(target, async_scheduling=True, speculative_config=spec, **kw)
    eng = llm.engine
    assert eng.speculator.chains
    sync_verifies: list[bool] = []
    start = eng.executor.start
    eng.executor.start = lambda sched, *a: (sync_verifies.append(any(s.spec_token_ids for s in sched.scheduled)),
                                            start(sched, *a))[1]
    assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
    if case == "prefix-cache":
        assert tokens_of(llm.generate(prompts, greedy(32), use_tqdm=False)) == reference
        assert eng.stats.prefix_cache_hits > 0
    for p, want in zip(prompts[:2], reference[:2]):
        assert tokens_of(llm.generate([p], greedy(32), use_tqdm=False)) == [want]
    if case == "preemption":
        assert eng.scheduler.num_preemptions > 0
    if case != "policy":  # (the policy may stop drafting an untrained head at once)
        assert eng.num_chained_verifies > 0 and eng.stats.spec.num_draft_tokens > 0
    if case == "every-step":  # (elsewhere a verify beside a prefill chunk runs synchronously)
        assert not any(sync_verifies)
    assert eng.speculator.device_drafts is None
    assert eng.pool.all_free()


def test_chained_proposals_equal_an_independent_reference(target, heads, prompts, monkeypatch):
    """A chained proposal's drafts (made before the verify it follows was read) equal what the
    checkpoint computes from scratch on the tokens that verify left."""
    from tandem.spec_decode.eagle import EagleProposer

    seen: list[tuple[object, int, int]] = []  # (request, tokens it then had, its drafts' count)
    drafted: list[list[int]] = []
    orig = EagleProposer.propose_chained

    def spy(self, reqs, ks, verify):
        out = orig(self, reqs, ks, verify)
        if out is not None:
            host = out.read()
            rows = verify.row_tokens.tolist()
            for i, r in enumerate(reqs):
                if r.request_id in host:
                    d, off = verify.drafts[i], verify.offsets[i]
                    a = next((j for j in range(len(d)) if d[j] != rows[off + j]), len(d))
                    seen.append((r, len(r.token_ids) + a + 1))
                    drafted.append(host[r.request_id])
        return out

    monkeypatch.setattr(EagleProposer, "propose_chained", spy)
    spec = {"method": "eagle3", "model": str(heads["eagle3"]), "num_speculative_tokens": 3,
            "disable_by_acceptance": False}
    llm = make_llm(target, async_scheduling=True, speculative_config=spec)
    outs = llm.generate(prompts[:2], greedy(12), use_tqdm=False)
    full = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    assert len(seen) >= 6
    for (r, n), drafts in list(zip(seen, drafted))[:6]:
        tokens = full[r.request_id][:n]
        assert drafts == _reference_drafts(target, heads["eagle3"], "eagle3", tokens, len(drafts)), tokens


def test_a_catch_up_over_idle_positions_is_not_timed_as_drafting(target, heads, prompts):
    """The policy prices a head step from the proposals' time; a proposal that first caught the head
    up over positions it had not seen (a prompt, a stretch the policy granted nothing: more than
    k + 1 rows per request) still comes off the step's time but is not counted as draft steps (on
    the H200 such rounds had priced a head step at 1.9-3.8 decodes; docs/performance.md §39)."""
    llm = make_llm(target, speculative_config={"method": "eagle3", "model": str(heads["eagle3"]),
                                               "num_speculative_tokens": 3, "disable_by_acceptance": False})
    spec = llm.engine.speculator
    seen: list[tuple[tuple[int, int], int, int, float]] = []
    timed = spec._timed_drafts

    def spy(t0, ks):
        timed(t0, ks)
        seen.append((spec.proposer.last_catch_up, max(ks), spec._draft_steps, spec._draft_seconds))

    spec._timed_drafts = spy
    llm.generate(prompts[:3], greedy(48), use_tqdm=False)
    gaps = [s for s in seen if s[0][0] > 4 * s[0][1]]
    assert gaps and len(gaps) < len(seen)  # the first round of each request: over its prompt
    for (rows, n), k, steps, seconds in seen:
        assert seconds > 0 and steps == (0 if rows > 4 * n else k)
