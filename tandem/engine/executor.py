"""Executor: runs one scheduled step on the target model — SchedulerOutput in, ModelRunnerOutput out.

Per scheduled request it builds a ``SeqChunk`` (the uncomputed tokens, then the drafts, which trail)
and the flat rows whose logits are needed: the k + 1 rows of a request that samples (k = 0 for a
plain decode or the end of a prompt) and, where asked, the prompt-logprob rows. One target forward
(``runner.forward_logits``) covers prefill chunks, decodes and verifies together; it always runs,
since a prefill chunk that samples nothing still has to write its KV.

Sampling (``execute``): each sampled row gets a ``SamplingRow`` with the request's params and its
output so far plus the drafts before that row, so every sampling parameter applies to the target
distribution p at every verified position; ``rejection_sample`` accepts drafts and emits the
recovered / bonus token (requests without drafts are its k = 0 case). When every request of the step
is greedy (and acceptance is not synthetic) ``greedy_verify`` gives the same tokens straight from
the argmax; when every draft is deterministic (no draft distributions q), each row's plain sample
(``sample``) and ``accept_matching`` give the tokens ``rejection_sample`` would (its coupling).
Structured requests' rows are masked by their grammar first (k + 1 masks per verify,
``structured/step_masks.py``), so a draft outside the grammar is rejected. Logprobs come from the raw
logits of the emitted tokens' rows. Nothing here mutates a request: the scheduler and the output processor
apply the ``ModelRunnerOutput``.

Asynchronous decode (``launch``): a steady decode step keeps its tokens on the device
(``InflightStep``): the argmax, or for sampled rows a draw made there (``_sample_on_device``). A
step scheduled while another is in flight decodes placeholders — tokens that step sampled — whose
ids are fed on the device from it (``feed``), never read on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tandem.engine.async_decode import InflightStep, device_greedy
from tandem.outputs import ModelRunnerOutput, PromptLogprobs, SampleLogprobs
from tandem.request import Request
from tandem.sample.grammar_mask import apply_grammar_bitmask
from tandem.sample.logits import probs_from_logits, process_logits
from tandem.sample.logprobs import compute_logprobs
from tandem.sample.rejection import accept_matching, greedy_verify, rejection_sample
from tandem.sample.rows import SamplingRow
from tandem.sample.sampler import sample
from tandem.scheduler import ScheduledRequest, SchedulerOutput
from tandem.structured.step_masks import step_bitmask
from tandem.spec_decode.device_drafts import DeviceDrafts
from tandem.worker.batch import ChainedFrom, FedTokens, SeqChunk
from tandem.worker.runner import ModelRunner


def argmax_only(sched: SchedulerOutput) -> bool:
    """Every row the step samples is a plain argmax (greedy, no logits processing or grammar mask, no
    logprobs) and no prompt logprobs are asked: the runner may return rows that are only good for
    their argmax (``CausalLM.compute_logits``: the CPU's screened LM head)."""
    for s in sched.scheduled:
        r = s.request
        if r.params.prompt_logprobs is not None:
            return False
        if s.samples and not all(device_greedy(r, r.num_output_tokens + j) for j in range(len(s.spec_token_ids) + 1)):
            return False
    return True


def _prompt_positions(s: ScheduledRequest) -> range:
    """Prompt positions whose next-token logprob this step computes (those not recorded before:
    a recompute after preemption skips them)."""
    r = s.request
    lo = max(s.start, len(r.prompt_logprobs) - 1 if r.prompt_logprobs else 0)
    hi = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
    return range(lo, max(lo, hi))


@dataclass(frozen=True)
class LaunchedStep:
    """A synchronous step whose forward is launched and not yet sampled."""

    sched: SchedulerOutput
    logits: torch.Tensor  # [rows, V] float32 (may be a graph's buffer: valid until the next forward)
    fed: bool  # some drafts were fed on the device: their ids are read before sampling
    argmax: bool  # every sampled row is a plain argmax (``argmax_only``)


class Executor:
    def __init__(self, runner: ModelRunner, generator: torch.Generator,
                 synthetic_acceptance_rate: float | None = None) -> None:
        self.runner = runner
        self.generator = generator  # for random rows of requests without their own seed
        # benchmark mode: drafts accepted at this rate whatever the models say (outputs not lossless)
        self.synthetic_acceptance_rate = synthetic_acceptance_rate

    def _forward(self, chunks: list[SeqChunk], rows: Sequence[int], token_ids: torch.Tensor | None = None,
                 argmax: bool = False, fed: FedTokens | None = None, chain: ChainedFrom | None = None
                 ) -> torch.Tensor:
        """The target forward: logits of ``rows`` (``argmax``: only their argmax is read). (An EAGLE
        target's runner writes its features to the feature cache inside the forward.)"""
        return self.runner.forward_logits(chunks, rows, token_ids=token_ids, argmax_only=argmax, fed=fed,
                                          chain=chain)

    # ---- synchronous: sample on the host ---------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish(self.start(sched))

    def start(self, sched: SchedulerOutput, drafts: DeviceDrafts | None = None) -> LaunchedStep:
        """Pack and launch the step's forward (``drafts``: feed those still on the device)."""
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        t = 0
        for s in sched.scheduled:
            r = s.request
            end = s.start + s.num_new_tokens
            # Query = uncomputed tokens, then the drafts (which trail); slice, never copy the history.
            query = r.token_ids[s.start:end] + list(s.spec_token_ids)[: max(0, end - r.num_tokens)]
            chunks.append(SeqChunk(query, s.start, r.block_ids))
            if r.params.prompt_logprobs is not None:
                rows.extend(t + p - s.start for p in _prompt_positions(s))
            if s.samples:
                n = len(s.spec_token_ids) + 1
                rows.extend(range(t + s.num_new_tokens - n, t + s.num_new_tokens))
            t += s.num_new_tokens
        fed = drafts.feed(sched) if drafts is not None else None
        # [len(rows), V] float32
        argmax = self.synthetic_acceptance_rate is None and argmax_only(sched)
        return LaunchedStep(sched, self._forward(chunks, rows, argmax=argmax, fed=fed), fed is not None, argmax)

    def finish(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Sample / verify a launched step on the host (its drafts on the host by now)."""
        sched, logits = step.sched, step.logits
        if step.fed:  # the placeholders' real ids, read since (Speculator.resolve_drafts)
            sched = replace(sched, scheduled=tuple(
                replace(s, spec_token_ids=tuple(s.request.spec_token_ids)) if s.spec_token_ids else s
                for s in sched.scheduled))
        n = len(sched.scheduled)
        prompt_lps: list[PromptLogprobs | None] = [None] * n
        sampling: list[tuple[ScheduledRequest, int]] = []  # (request, its first sampled row)
        where: list[int] = []  # index in the step of each sampling request
        off = 0
        for i, s in enumerate(sched.scheduled):
            if s.request.params.prompt_logprobs is not None:
                prompt_lps[i], off = self._prompt_logprobs(s, logits, off)
            if s.samples:
                sampling.append((s, off))
                where.append(i)
                off += len(s.spec_token_ids) + 1
        tokens: list[tuple[int, ...]] = [()] * n
        accepted = [0] * n
        lps: list[SampleLogprobs | None] = [None] * n
        if sampling:
            for i, (toks, acc, lp) in zip(where, self._sample(sampling, logits, step.argmax)):
                tokens[i], accepted[i], lps[i] = toks, acc, lp
        return ModelRunnerOutput(tuple(tokens), tuple(accepted), tuple(lps), tuple(prompt_lps))

    def _prompt_logprobs(self, s: ScheduledRequest, logits: torch.Tensor, off: int
                         ) -> tuple[PromptLogprobs, int]:
        r = s.request
        pos = _prompt_positions(s)
        if not pos:
            return [], off
        n = len(pos)
        targets = torch.tensor(r.prompt_token_ids[pos.start + 1:pos.stop + 1], device=logits.device)
        return compute_logprobs(logits[off:off + n], targets, [r.params.prompt_logprobs] * n), off + n

    def _sample(self, sampling: list[tuple[ScheduledRequest, int]], logits: torch.Tensor, plain: bool = False
                ) -> list[tuple[tuple[int, ...], int, SampleLogprobs | None]]:
        """Sample / verify the sampling requests: per request (tokens, accepted drafts, logprobs).
        ``plain``: every sampled row is a plain argmax (``argmax_only``): straight to ``greedy_verify``."""
        row_idx: list[int] = []
        srows: list[SamplingRow] = []
        drafts: list[list[int]] = []
        for s, off in sampling:
            r = s.request
            spec = list(s.spec_token_ids)
            row_idx.extend(range(off, off + len(spec) + 1))
            if not plain:  # (a plain argmax row needs no SamplingRow: nothing reads it)
                out = r.output_token_ids
                srows.extend(SamplingRow(r.params, r.prompt_token_ids, out + spec[:j], r.eos_token_ids, r.generator)
                             for j in range(len(spec) + 1))
            drafts.append(spec)
        if len(row_idx) == logits.shape[0] and row_idx == list(range(len(row_idx))):
            raw = logits  # the runner returned exactly the sampled rows (decode / verify steps)
        else:
            raw = logits.index_select(0, torch.tensor(row_idx, device=logits.device))
        if plain:
            result = greedy_verify(raw, drafts)
            return [(tuple(t), a, None) for t, a in zip(result.token_ids, result.num_accepted)]
        synthetic = self.synthetic_acceptance_rate
        greedy = [s.request.params.greedy for s, _ in sampling]
        processed = process_logits(raw, srows)
        masks = step_bitmask([(s.request.grammar, s.spec_token_ids) for s, _ in sampling])
        if masks is not None:  # structured output: tokens outside the grammar get p = 0 at every row
            processed = apply_grammar_bitmask(processed, raw, *masks)
        draft_probs = self._draft_probs(sampling, logits.shape[-1], logits.device)
        if synthetic is None and all(greedy):
            result = greedy_verify(processed, drafts)
        elif synthetic is None and draft_probs is None:
            # Deterministic drafts (or none): each row's plain sample decides (the coupling in
            # sample/rejection.py) — ``sample`` makes exactly the draws ``rejection_sample`` would
            # (same generators, keys and order), in a few ops and one host read.
            probs = probs_from_logits(processed, srows)
            positions = [s.request.num_output_tokens + j for s, _ in sampling for j in range(len(s.spec_token_ids) + 1)]
            result = accept_matching(sample(probs, srows, self.generator, positions=positions).tolist(), drafts)
        else:
            result = rejection_sample(
                probs_from_logits(processed, srows), drafts, draft_probs, greedy,
                [s.request.generator or self.generator for s, _ in sampling],
                synthetic_acceptance_rate=synthetic,
                positions=[s.request.num_output_tokens for s, _ in sampling],
            )
        sampled: list[tuple[tuple[int, ...], int, SampleLogprobs | None]] = []
        base = 0
        for (s, _), toks, acc in zip(sampling, result.token_ids, result.num_accepted):
            r = s.request
            lps = None
            if r.params.logprobs is not None:
                lps = compute_logprobs(raw[base:base + len(toks)], torch.tensor(toks, device=raw.device),
                                       [r.params.logprobs] * len(toks))
            base += len(s.spec_token_ids) + 1
            sampled.append((tuple(toks), acc, lps))
        return sampled

    @staticmethod
    def _draft_probs(sampling: list[tuple[ScheduledRequest, int]], vocab: int, device: torch.device
                     ) -> torch.Tensor | None:
        """[Σ k_i, V] draft distributions q of the step's drafts when some proposer sampled them
        (deterministic drafts among them as one-hot q); None when every draft is deterministic."""
        if not any(s.spec_token_ids and s.request.spec_probs is not None for s, _ in sampling):
            return None
        qs = []
        for s, _ in sampling:
            if s.spec_token_ids:
                q = s.request.spec_probs
                if q is None:
                    q = torch.nn.functional.one_hot(torch.tensor(list(s.spec_token_ids), device=device), vocab).float()
                qs.append(q[: len(s.spec_token_ids)])
        return torch.cat(qs)

    # ---- asynchronous: tokens stay on the device -------------------------------------------------
    def launch(self, sched: SchedulerOutput, feed: InflightStep | None = None,
               drafts: DeviceDrafts | None = None) -> InflightStep:
        """Run a decode step (one token per request: the argmax, or sampled on the device) or a
        greedy verify (every row's argmax: its drafts are checked when read) and leave its tokens
        on the device. With ``feed`` (the step in flight) every request's first query token is its
        placeholder — the token ``feed`` sampled or emitted for it, fed on the device — and when
        ``feed`` verified drafts, this step was packed as if ``feed`` accepted them all and moves
        back by what it rejected, on the device too (the runner's ``chain``: worker/chain.py).
        ``drafts``: drafts still on the device, fed to the rows of their placeholders."""
        reqs = [s.request for s in sched.scheduled]
        greedy = all(r.params.greedy for r in reqs)
        verify = any(s.spec_token_ids for s in sched.scheduled)
        if verify and not greedy:
            raise RuntimeError("only greedy drafts are verified with their tokens left on the device")
        if feed is not None and any(s.start != r.num_tokens - 1 or s.num_new_tokens != 1 + len(s.spec_token_ids)
                                    for s, r in zip(sched.scheduled, reqs)):
            raise RuntimeError("a step fed on the device must start at each request's placeholder")
        chunks = [SeqChunk([r.token_ids[s.start] if feed is None else 0, *s.spec_token_ids], s.start, r.block_ids)
                  for s, r in zip(sched.scheduled, reqs)]  # (a fed placeholder's id is written on the device)
        rows = range(sum(len(c.token_ids) for c in chunks))
        fed = drafts.feed(sched) if drafts is not None else None
        token_ids, chain = None, None
        if feed is not None and feed.verifies:
            chain = feed.chained_from(reqs)
        elif feed is not None and verify:
            raise RuntimeError("a verify is chained on a verify only (its drafts assume that verify's outcome)")
        elif feed is not None:  # a decode on a decode: the tokens straight into the first rows
            token_ids = feed.device_ids(reqs)
        if greedy:  # (the CUDA runner's graphs take the argmax inside the replay)
            ids = self.runner.forward_ids(chunks, rows, token_ids=token_ids, fed=fed, chain=chain)
            return InflightStep.launch(sched, ids, verifies=verify)
        logits = self._forward(chunks, rows, token_ids=token_ids, fed=fed, chain=chain)
        return InflightStep.launch(sched, self._sample_on_device(reqs, logits))

    def _sample_on_device(self, reqs: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
        """[len(reqs)] tokens drawn from each row's distribution, queued without a host sync: the
        same draws as the synchronous path's k = 0 rows (``rejection_sample`` consumes exactly what
        ``sample`` does), so a seeded request gets the same tokens either way. The rows carry only
        params and randomness: nothing reads their histories (``device_sampled``: no logits
        processing), and the seeded streams' positions count the placeholders."""
        rows = [SamplingRow(r.params, (), (), r.eos_token_ids, r.generator) for r in reqs]
        return sample(probs_from_logits(logits, rows), rows, self.generator,
                      positions=[r.num_output_tokens for r in reqs])
