"""LLMEngine: requests in, RequestOutputs out, one ``step()`` at a time.

step():  schedule → build the flat batch (prefill chunks, decodes, k+1-token verifies together)
         → one target forward → sample / rejection-sample → update requests (append accepted
         tokens, roll back rejected drafts by count, check stop conditions) → propose drafts for
         the next step → RequestOutputs.

Speculation is inside the continuous batch: a request with drafts contributes k+1 sampled rows,
one without contributes 1, and both ride in the same forward. With n-gram speculation on CUDA an acceptance gate
(spec_decode/gate.py) lets a request draft only while that pays; steps in which no request drafts run
asynchronously (engine/async_decode.py), as they do without speculation. A request's failure (prompt too long,
bad token ids) is reported for that request only; the engine and the other requests go on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.config import EngineConfig, resolve_device, resolve_dtype, resolve_max_model_len
from tandem.engine.async_decode import InflightDecode, chain_requests, launchable
from tandem.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from tandem.engine.model_loader import build_model
from tandem.engine.stats import EngineStats, PeriodicLogger
from tandem.errors import ConfigError, PromptTooLongError, RequestError
from tandem.kv.block_pool import BlockPool, ResetResult
from tandem.kv.kv_cache import allocate_kv_cache, bytes_per_block, kv_budget_bytes
from tandem.loader.checkpoint import open_checkpoint
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.request import Request, RequestStatus
from tandem.sample.logits import probs_from_logits, process_logits, validate_for_vocab
from tandem.sample.logprobs import compute_logprobs
from tandem.sample.rejection import greedy_verify, rejection_sample
from tandem.sample.rows import SamplingRow
from tandem.sampling_params import SamplingParams
from tandem.scheduler import ScheduledRequest, Scheduler
from tandem.config.speculative import SpeculativeConfig, validate_against_target
from tandem.spec_decode.gate import AcceptanceGate
from tandem.spec_decode.proposers import build_proposer, shadow_drafter
from tandem.worker.batch import SeqChunk
from tandem.config.runner import with_debug_overrides
from tandem.worker.runner import ModelRunner, make_runner

logger = logging.getLogger("tandem")




def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


class _Group:
    """The n sequences of one user request (n > 1 fans out into child Requests)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], children: list[Request],
                 detoks: list[IncrementalDetokenizer]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.children = children
        self.detoks = detoks

    @property
    def finished(self) -> bool:
        return all(c.status.finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model, cache, scheduler, speculative = config.model, config.cache, config.scheduler, config.speculative
        log_stats = config.log_stats
        runner_cfg = with_debug_overrides(config.runner)
        self.device = resolve_device(model.device)
        ckpt = open_checkpoint(model.model, load_format=model.load_format, tokenizer=model.tokenizer,
                               revision=model.revision)
        self.arch = ckpt.arch
        self.tokenizer = ckpt.load_tokenizer()
        self._decoder = fast_decoder(self.tokenizer)  # what detokenizers decode with
        self.dtype = resolve_dtype(model.dtype, self.device, ckpt.arch.torch_dtype)
        self.max_model_len = resolve_max_model_len(model.max_model_len, ckpt.arch.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        self.block_size = cache.block_size
        torch.manual_seed(model.seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model.seed)
        self.model = build_model(ckpt.arch, ckpt.weights(), self.dtype, self.device, self.max_model_len)

        self.spec = speculative
        k = speculative.num_speculative_tokens if speculative else 0
        draft_arch = draft_weights = None
        if speculative is not None and speculative.method == "draft_model":
            # The draft follows the target's load format when that is "dummy" (benchmarks at real
            # shapes without weights), as in vLLM; otherwise it is detected from its own files.
            dckpt = open_checkpoint(speculative.model, revision=speculative.revision,
                                    load_format="dummy" if model.load_format == "dummy" else "auto")
            draft_arch = dckpt.arch
            validate_against_target(
                speculative, target_vocab_size=self.arch.vocab_size, draft_vocab_size=draft_arch.vocab_size,
                target_max_model_len=self.max_model_len, draft_max_model_len=draft_arch.max_position_embeddings,
            )
            draft_weights = dckpt.weights()

        # ---- KV cache sizing: target (+ draft) share one block table --------------------------
        bpb = bytes_per_block(self.arch, self.block_size, self.dtype)
        if draft_arch is not None:
            bpb += bytes_per_block(draft_arch, self.block_size, self.dtype)
        budget, source = kv_budget_bytes(self.device, cache.gpu_memory_utilization, cache.kv_cache_memory_bytes)
        num_blocks = budget // bpb
        lookahead = k if draft_arch is not None else 0
        need = -(-(self.max_model_len + lookahead) // self.block_size)
        if num_blocks < need:
            raise ConfigError(
                "kv_cache_memory_bytes" if cache.kv_cache_memory_bytes is not None else "gpu_memory_utilization",
                f"KV cache of {_fmt_bytes(budget)} ({source}) holds {num_blocks} blocks of "
                f"{self.block_size} tokens, but one request of max_model_len={self.max_model_len} needs "
                f"{need} blocks ({_fmt_bytes(need * bpb)}; {_fmt_bytes(need * bpb - budget)} missing). "
                "Give more memory or lower max_model_len.",
            )
        logger.info("KV cache sized by %s: %d blocks × %d tokens = %d tokens (%.1f MiB)",
                    source, num_blocks, self.block_size, num_blocks * self.block_size, num_blocks * bpb / 2**20)
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, enable_caching=cache.enable_prefix_caching)
        kv = allocate_kv_cache(self.arch, num_blocks, self.block_size, self.dtype, self.device)
        self.runner = make_runner(self.model, kv, self.block_size, self.device, runner_cfg)
        draft_runner = None
        if draft_arch is not None:
            draft_model = build_model(draft_arch, draft_weights, self.dtype, self.device,
                                      speculative.max_model_len or self.max_model_len)
            dkv = allocate_kv_cache(draft_arch, num_blocks, self.block_size, self.dtype, self.device)
            draft_runner = make_runner(draft_model, dkv, self.block_size, self.device,
                                       speculative.draft_runner_config(runner_cfg))
        self.proposer = build_proposer(speculative, draft_runner, self.generator)
        # Per-request drafting off while it does not pay (spec_decode/gate.py); n-gram only.
        self.gate: AcceptanceGate | None = None
        drafter = shadow_drafter(self.proposer)
        gate_on = speculative.disable_by_acceptance if speculative is not None else False
        if gate_on is None:
            gate_on = self.device.type == "cuda"
        if gate_on and drafter is not None:
            self.gate = AcceptanceGate(drafter)
        self._capture_graphs([self.runner] + ([draft_runner] if draft_runner else []),
                             scheduler.max_num_seqs, k)
        self.scheduler = Scheduler(self.pool, self.block_size, scheduler.token_budget(k),
                                   scheduler.max_num_seqs, self.max_model_len, lookahead=lookahead,
                                   enable_prefix_caching=cache.enable_prefix_caching)
        self.stats = EngineStats()
        self._log = PeriodicLogger() if log_stats else None
        self._groups: dict[str, _Group] = {}
        self._child_group: dict[str, _Group] = {}
        self._failed: list[RequestOutput] = []
        # Requests that sampled in the last step: drafted at the start of the next one, so their
        # outputs (e.g. a first token) reach callers before a draft model's catch-up prefill runs.
        self._to_propose: set[str] = set()
        self._ids = itertools.count()
        # Asynchronous decode (engine/async_decode.py): a launched step whose tokens are unread.
        use_async = scheduler.async_scheduling
        if use_async is None:
            use_async = self.device.type == "cuda"
        # Used for steps without drafts while no request will draft next (drafts need read tokens).
        self.async_scheduling = bool(use_async)
        self._inflight: InflightDecode | None = None
        self._step_verified: bool | None = None  # this step verified drafts / only decoded / neither
        self.num_chained_steps = 0  # decode steps launched before the previous step's tokens were read

    @staticmethod
    def _capture_graphs(runners: list[ModelRunner], max_num_seqs: int, k: int) -> None:
        """On CUDA, compile the step kernels' variants and capture the small-batch decode/verify graphs
        now rather than on first use (a capture costs ~0.1 s, a compile up to ~1 s). Larger batch
        buckets are captured lazily."""
        sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
        for runner in runners:
            runner.warm_up(sizes, range(1, k + 2))

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.arch.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    # ---- requests ------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None, params: SamplingParams,
                    prompt_token_ids: Sequence[int] | None = None) -> None:
        """Queue a request. Raises RequestError (or a subclass) if this request cannot be served."""
        if request_id in self._groups:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = prompt
            else:
                raise RequestError("a prompt or prompt_token_ids is required", param="prompt")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {self.arch.vocab_size}): {bad[:5]}",
                               param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        validate_for_vocab(params, self.arch.vocab_size)
        children, detoks = [], []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed + i)
            child = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(ids), params=params, eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len, prompt=text, generator=gen,
            )
            children.append(child)
            detoks.append(IncrementalDetokenizer(
                self._decoder, ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output))
        group = _Group(request_id, text, ids, children, detoks)
        self._groups[request_id] = group
        for c in children:
            self._child_group[c.request_id] = group
            self.scheduler.add(c)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            for c in group.children:
                if not c.status.finished:
                    self._finish(c, RequestStatus.FINISHED_ABORTED)
            self._failed.append(self._output(group))
            self._drop(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or bool(self._failed)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> ResetResult:
        """Forget every cached block no request holds (prefix caching; thread-safe: the pool locks).

        ``complete`` (vLLM's success) iff no block was in use; otherwise the blocks held by running
        requests keep their hashes and the result says how many.
        """
        result = self.pool.reset_prefix_cache()
        logger.info("prefix cache reset: %d cached free blocks dropped, %d blocks in use (%d still cached)",
                    result.evicted_blocks, result.held_blocks, result.held_cached_blocks)
        return result

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._failed = self._failed, []
        pending, self._inflight = self._inflight, None
        if pending is not None and all(r.status.finished for r in pending.requests):
            pending = None  # every request of the step in flight finished or was aborted meanwhile
        self._step_verified = False if pending is not None else None
        if pending is None:
            pending = self._scheduled_step(outputs)
        if pending is not None:
            # The next decode step goes to the GPU before this one's tokens are read (one sync).
            self._inflight = self._chain(pending)
            touched = self._collect(pending)
            if self.proposer is not None:
                self._to_propose |= touched
            outputs.extend(self._emit(touched))
        if self.gate is not None and self._step_verified is not None:
            self.gate.record_step(time.perf_counter() - t0, self._step_verified)
        return outputs

    def _scheduled_step(self, outputs: list[RequestOutput]) -> InflightDecode | None:
        """Schedule and run one step. Returns it unread when it can run asynchronously; otherwise
        samples, updates the requests and appends their outputs to ``outputs``."""
        self._propose(self._to_propose)
        self._to_propose = set()
        sched = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        pc = self.scheduler.prefix_cache.stats  # prefix caching: token counts, cumulative
        self.stats.prefix_cache_queries, self.stats.prefix_cache_hits = pc.queries, pc.hits
        if sched.empty:
            return None
        self.stats.num_steps += 1
        # what the gate times this step as: a verify, a plain decode, or neither (a prefill chunk)
        if any(s.spec_token_ids for s in sched.scheduled):
            self._step_verified = True
        elif all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled):
            self._step_verified = False
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        t = 0
        for s in sched.scheduled:
            r = s.request
            # Query = uncomputed tokens, then the drafts (which trail); slice, never copy the history.
            end = s.start + s.num_new_tokens
            query = r.token_ids[s.start:end] + list(s.spec_token_ids)[: max(0, end - r.num_tokens)]
            chunks.append(SeqChunk(query, s.start, r.block_ids))
            if r.params.prompt_logprobs is not None:
                rows.extend(self._prompt_rows(s, t))
            if s.samples:
                n = len(s.spec_token_ids) + 1
                rows.extend(range(t + s.num_new_tokens - n, t + s.num_new_tokens))
            t += s.num_new_tokens
        # Always run the forward: a prefill chunk that samples nothing still has to write its KV.
        logits = self.runner.forward_logits(chunks, rows)
        if self.async_scheduling and (self.spec is None or self.gate is not None) and launchable(sched):
            return InflightDecode.launch([s.request for s in sched.scheduled], [s.start for s in sched.scheduled],
                                         logits)
        touched: set[str] = set()
        off = 0
        sampling: list[tuple[ScheduledRequest, int]] = []
        for s in sched.scheduled:
            r = s.request
            if r.params.prompt_logprobs is not None:
                off = self._record_prompt_logprobs(s, logits, off)
            if s.samples:
                sampling.append((s, off))
                off += len(s.spec_token_ids) + 1
            else:
                r.num_computed_tokens = s.start + s.num_new_tokens
        if sampling:
            self._sample_and_update(sampling, logits, touched)
        self._to_propose = touched
        outputs.extend(self._emit(touched))
        return None

    def _emit(self, touched: set[str]) -> list[RequestOutput]:
        """Outputs of the groups whose requests got tokens; finished groups are dropped."""
        outputs = []
        for rid in touched:
            group = self._child_group.get(rid)
            if group is not None and group.request_id in self._groups:
                outputs.append(self._output(group))
                if group.finished:
                    self._drop(group)
        if self._log is not None:
            self._log.maybe_log(self.stats, self.num_running, self.num_waiting, self.kv_usage)
        return outputs

    # ---- asynchronous decode -------------------------------------------------------------------
    def _chain(self, pending: InflightDecode) -> InflightDecode | None:
        """Launch the decode step after ``pending`` with its tokens fed on the device, if every
        running request continues with a steady decode; None otherwise."""
        live = chain_requests(pending, self.scheduler.running, len(self.scheduler.waiting), self.max_model_len)
        if live is None or not self._none_drafts_next(live):
            return None
        for r in live:  # the pending token sits at position num_tokens: its KV slot must exist
            if not self.scheduler.reserve(r, r.num_tokens + 1):
                return None
        toks = pending.token_ids
        if len(live) != len(pending.requests):
            keep = [i for i, r in enumerate(pending.requests) if not r.status.finished]
            toks = toks.index_select(0, torch.tensor(keep, device=toks.device))
        starts = tuple(r.num_tokens for r in live)
        chunks = [SeqChunk((0,), start, r.block_ids) for r, start in zip(live, starts)]  # ids fed on device
        self.stats.num_steps += 1
        self.num_chained_steps += 1
        logits = self.runner.forward_logits(chunks, list(range(len(live))), token_ids=toks)
        return InflightDecode.launch(live, starts, logits)

    def _none_drafts_next(self, live: Sequence[Request]) -> bool:
        """No request of a chained step would draft (each holding its pending token)."""
        if self.spec is None:
            return True
        return self.gate is not None and not any(self.gate.wants(r.request_id, r.num_tokens + 1) for r in live)

    def _collect(self, pending: InflightDecode) -> set[str]:
        """Read a launched step's tokens (the host sync) and append them."""
        touched: set[str] = set()
        for r, start, tok in zip(pending.requests, pending.starts, pending.read()):
            if r.status.finished:  # stopped at the step before, or aborted: this token is discarded
                continue
            r.num_computed_tokens = start + 1
            self._append_tokens(r, [tok], None)
            self._observe(r)
            touched.add(r.request_id)
        return touched

    def _observe(self, r: Request) -> None:
        """Score the gate's shadow drafts of a request that is not drafting against its new tokens."""
        if self.gate is not None and self.spec is not None and not r.status.finished:
            self.gate.observe(r.request_id, r.token_ids, self.spec.num_speculative_tokens)

    def _prompt_rows(self, s: ScheduledRequest, t: int) -> list[int]:
        r = s.request
        lo = max(s.start, len(r.prompt_logprobs) - 1 if r.prompt_logprobs else 0)
        hi = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
        return [t + p - s.start for p in range(lo, hi)]

    def _record_prompt_logprobs(self, s: ScheduledRequest, logits: torch.Tensor | None, off: int) -> int:
        r = s.request
        lo = max(s.start, len(r.prompt_logprobs) - 1 if r.prompt_logprobs else 0)
        hi = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
        if hi <= lo or logits is None:
            return off
        if not r.prompt_logprobs:
            r.prompt_logprobs.append(None)
        n = hi - lo
        targets = torch.tensor(r.prompt_token_ids[lo + 1:hi + 1], device=logits.device)
        lps = compute_logprobs(logits[off:off + n], targets, [r.params.prompt_logprobs] * n)
        r.prompt_logprobs.extend(lps)
        return off + n

    def _sample_and_update(self, sampling: list[tuple[ScheduledRequest, int]], logits: torch.Tensor,
                           touched: set[str]) -> None:
        row_idx: list[int] = []
        srows: list[SamplingRow] = []
        drafts: list[list[int]] = []
        draft_probs: list[torch.Tensor] = []
        has_q = False
        for s, off in sampling:
            r = s.request
            spec = list(s.spec_token_ids)
            out = r.output_token_ids
            for j in range(len(spec) + 1):
                row_idx.append(off + j)
                srows.append(SamplingRow(r.params, r.prompt_token_ids, out + spec[:j], r.eos_token_ids,
                                         r.generator))
            drafts.append(spec)
            if spec and r.spec_probs is not None:
                has_q = True
        if has_q:
            for s, _ in sampling:
                r = s.request
                if s.spec_token_ids:
                    q = r.spec_probs
                    if q is None:  # deterministic draft among probabilistic ones: one-hot q
                        q = torch.nn.functional.one_hot(
                            torch.tensor(list(s.spec_token_ids), device=logits.device), logits.shape[-1]).float()
                    draft_probs.append(q[: len(s.spec_token_ids)])
        if len(row_idx) == logits.shape[0] and row_idx == list(range(len(row_idx))):
            raw = logits  # the runner returned exactly the sampled rows (decode / verify steps)
        else:
            raw = logits.index_select(0, torch.tensor(row_idx, device=logits.device))
        synthetic = self.spec.synthetic_acceptance_rate if self.spec is not None and self.spec.is_synthetic else None
        greedy = [s.request.params.greedy for s, _ in sampling]
        if synthetic is None and all(greedy):
            result = greedy_verify(process_logits(raw, srows), drafts)
        else:
            result = rejection_sample(
                probs_from_logits(process_logits(raw, srows), srows), drafts,
                torch.cat(draft_probs) if has_q else None, greedy,
                [s.request.generator or self.generator for s, _ in sampling],
                synthetic_acceptance_rate=synthetic,
            )
        now = time.monotonic()
        base = 0
        for (s, _), toks, acc in zip(sampling, result.token_ids, result.num_accepted):
            r = s.request
            nspec = len(s.spec_token_ids)
            self.stats.spec.record(nspec, acc)
            if self.gate is not None:
                self.gate.record_verify(r.request_id, nspec, acc)
            r.num_drafts += 1 if nspec else 0
            r.num_draft_tokens += nspec
            r.num_accepted_tokens += acc
            r.num_computed_tokens = s.start + s.num_new_tokens - (nspec - acc)
            r.spec_token_ids = []
            r.spec_probs = None
            if r.first_token_time is None:
                r.first_token_time = now
                # vLLM semantics: full prompt length once, cached or recomputed tokens included.
                self.stats.prompt_tokens += r.num_prompt_tokens
            want_lp = r.params.logprobs is not None
            lps = None
            if want_lp:
                lps = compute_logprobs(raw[base:base + len(toks)], torch.tensor(toks, device=raw.device),
                                       [r.params.logprobs] * len(toks))
            base += nspec + 1
            self._append_tokens(r, toks, lps)
            self._observe(r)
            touched.add(r.request_id)

    def _append_tokens(self, r: Request, toks: list[int], lps: list[Any] | None) -> None:
        group = self._child_group[r.request_id]
        detok = group.detoks[group.children.index(r)]
        p = r.params
        for j, tok in enumerate(toks):
            r.token_ids.append(tok)
            self.stats.generation_tokens += 1
            if lps is not None:
                entry = lps[j]
                r.logprobs.append(entry)
                if entry is not None and tok in entry:
                    r.cumulative_logprob += entry[tok].logprob
            stop_str = detok.add_token(tok)
            n_out = r.num_output_tokens
            status = None
            if n_out >= p.min_tokens:
                if not p.ignore_eos and tok in r.eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif tok in p.stop_token_ids:
                    status, r.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                elif stop_str is not None:
                    status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is None and (n_out >= r.max_output_tokens or r.num_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(r, status)
                return

    def _finish(self, r: Request, status: RequestStatus) -> None:
        self.scheduler.finish(r, status)
        if self.gate is not None:
            self.gate.forget(r.request_id)
        self.stats.request_success[status.value] = self.stats.request_success.get(status.value, 0) + 1

    # ---- speculation ---------------------------------------------------------------------------
    def _propose(self, sampled: set[str]) -> None:
        """Draft for the requests that sampled this step (their lookahead slots are reserved)."""
        if self.proposer is None or self.spec is None:
            return
        k = self.spec.num_speculative_tokens
        reqs, ks = [], []
        for r in self.scheduler.running:
            if r.request_id not in sampled or not r.is_decoding:
                continue
            room = min(r.max_output_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            kr = max(0, min(k, room))
            if kr and self.gate is not None and not self.gate.wants(r.request_id, r.num_tokens):
                kr = 0  # not paying for this request now: shadow drafts only
            reqs.append(r)
            ks.append(kr)
        if not reqs:
            return
        proposal = self.proposer.propose_requests(reqs, ks)
        off = 0
        for r, toks in zip(reqs, proposal.token_ids):
            r.spec_token_ids = list(toks)
            if proposal.probs is not None and toks:
                r.spec_probs = proposal.probs[off:off + len(toks)]
            off += len(toks)

    # ---- outputs -------------------------------------------------------------------------------
    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        for i, (c, d) in enumerate(zip(group.children, group.detoks)):
            outs.append(CompletionOutput(
                index=i, text=d.text, token_ids=c.output_token_ids,
                cumulative_logprob=c.cumulative_logprob if c.params.logprobs is not None else None,
                logprobs=list(c.logprobs) if c.params.logprobs is not None else None,
                finish_reason=c.status.value if c.status.finished else None,
                stop_reason=c.stop_reason,
                num_draft_tokens=c.num_draft_tokens, num_accepted_tokens=c.num_accepted_tokens,
            ))
        first = group.children[0]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_ids,
            outputs=outs, finished=group.finished,
            prompt_logprobs=list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None,
            num_cached_tokens=first.num_cached_tokens,
            metrics={"arrival_time": first.arrival_time, "first_token_time": first.first_token_time or 0.0},
            synthetic=bool(self.spec is not None and self.spec.is_synthetic),
        )

    def _drop(self, group: _Group) -> None:
        self._groups.pop(group.request_id, None)
        for c in group.children:
            self._child_group.pop(c.request_id, None)
