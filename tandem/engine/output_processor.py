"""Output processor: a step's sampled tokens become text, stop decisions and RequestOutputs.

Per request that got tokens (``ModelRunnerOutput``, after the scheduler's rollback), the tokens are
appended one by one (``Request.append_token``: a token read from the device takes the place of its
placeholder) through the request's incremental detokenizer, and after each one the stop rules are
checked in this order: EOS (unless ``ignore_eos``), ``stop_token_ids``, stop strings — all only once
``min_tokens`` outputs exist — then ``max_tokens`` and ``max_model_len``. A stop can land in the
middle of an accepted run: the tokens after it are dropped, so the output equals the one without
speculation. A request with structured output advances its grammar with each token appended here (and
only here: drafts never move it) and stops when the grammar has accepted its stop token. A finished
request is handed to ``finish`` (the engine frees its blocks); its tokens still in flight on the device
are discarded when they arrive.

``process`` is ``apply`` then ``flush``. ``apply`` appends the tokens and decides every stop; a
request whose stops need no text (no stop strings) has its tokens decoded, and its group's output
built, by ``flush``, which the engine may run later — after it has launched the next step, so the
decoding overlaps the device's work (engine/llm_engine.py). A request with stop strings is decoded
as its tokens are appended, since the text decides where it stops.

Requests are grouped as the user sent them: ``n > 1`` fans out into n child Requests, and one
``RequestOutput`` per touched group carries all its children's ``CompletionOutput``s. What a group's
outputs hold follows its ``output_kind``: CUMULATIVE (text, tokens and logprobs so far, every step
it got tokens), DELTA (only what is new since its previous output) or FINAL_ONLY (no output until it
finishes: nothing is built per step). Without ``detokenize`` a child has no detokenizer and its text
stays "". Prompt logprobs arrive per prefill chunk and are appended after a leading None.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.stats import EngineStats
from tandem.outputs import CompletionOutput, ModelRunnerOutput, RequestOutput, SampleLogprobs
from tandem.request import Request, RequestStatus
from tandem.sampling_params import RequestOutputKind
from tandem.scheduler import SchedulerOutput


@dataclass(frozen=True)
class NewRequest:
    """A validated user request: its n child Requests (n = 1: one, with the user's id)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: tuple[Request, ...]


class _Group:
    """The n sequences of one user request, their detokenizers (None: no text) and, for DELTA
    outputs, how much of each child's text / tokens / logprobs earlier outputs carried."""

    def __init__(self, new: NewRequest, detoks: list[IncrementalDetokenizer | None]) -> None:
        self.request_id = new.request_id
        self.prompt = new.prompt
        self.prompt_ids = new.prompt_token_ids
        self.children = new.children
        self.detoks = detoks
        self.kind = new.children[0].params.output_kind
        self.sent = [(0, 0, 0)] * len(new.children)  # DELTA: (chars, tokens, logprob entries) sent

    @property
    def finished(self) -> bool:
        return all(c.status.finished for c in self.children)


class OutputProcessor:
    def __init__(self, decoder: Any, stats: EngineStats, finish: Callable[[Request, RequestStatus], None]) -> None:
        self.decoder = decoder  # what detokenizers call ``decode`` on (detokenizer.fast_decoder)
        self.stats = stats
        self._finish = finish
        self.synthetic = False  # outputs of benchmark-mode speculation (not the target's): labelled
        self.groups: dict[str, _Group] = {}
        self._child: dict[str, tuple[_Group, IncrementalDetokenizer]] = {}
        self._aborted: list[RequestOutput] = []  # outputs of aborted groups, for the next step
        # applied, not yet flushed: tokens to decode (in order) and the groups that got tokens
        self._undecoded: list[tuple[IncrementalDetokenizer, list[int]]] = []
        self._touched: dict[str, _Group] = {}

    def add(self, new: NewRequest) -> None:
        p = new.children[0].params
        detoks: list[IncrementalDetokenizer | None] = [
            IncrementalDetokenizer(self.decoder, new.prompt_token_ids, p.skip_special_tokens, p.stop,
                                   p.include_stop_str_in_output) if p.detokenize else None
            for _ in new.children]
        group = _Group(new, detoks)
        self.groups[new.request_id] = group
        for c, d in zip(new.children, detoks):
            self._child[c.request_id] = (group, d)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups) or bool(self._aborted)

    @property
    def has_unflushed(self) -> bool:
        return bool(self._touched)

    def abort(self, request_id: str) -> None:
        """Finish a group's running children as aborted; its final output comes with the next step."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for c in group.children:
            if not c.status.finished:
                self._finish(c, RequestStatus.FINISHED_ABORTED)
        mine = {id(d) for d in group.detoks if d is not None}
        for detok, toks in self._undecoded:  # its text so far, applied tokens included
            if id(detok) in mine:
                for tok in toks:
                    detok.add_token(tok)
                toks.clear()
        self._aborted.append(self._output(group))
        self._drop(group)

    def take_aborted(self) -> list[RequestOutput]:
        out, self._aborted = self._aborted, []
        return out

    def process(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        """Apply one step's tokens; the outputs of the groups that got tokens (finished ones dropped)."""
        self.apply(sched, out)
        return self.flush()

    def apply(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Append one step's tokens and decide the stops; a request without stop strings has its
        text decoded and its group's output built by the next ``flush`` (the engine runs that while
        the next step computes)."""
        touched = self._touched
        now = time.monotonic()
        for s, toks, lps, plps in zip(sched.scheduled, out.sampled_token_ids, out.logprobs, out.prompt_logprobs):
            r = s.request
            if r.status.finished:  # stopped or aborted while this step was in flight: discarded
                continue
            if plps:
                if not r.prompt_logprobs:
                    r.prompt_logprobs.append(None)  # nothing predicts the first prompt token
                r.prompt_logprobs.extend(plps)
            if not toks:
                continue
            if r.first_token_time is None:
                r.first_token_time = now
                # vLLM semantics: full prompt length once, cached or recomputed tokens included.
                self.stats.prompt_tokens += r.num_prompt_tokens
            group, detok = self._child[r.request_id]
            self._append(r, detok, toks, lps)
            touched[group.request_id] = group

    def flush(self) -> list[RequestOutput]:
        """Decode the text applied since the last flush; the outputs of the groups that got tokens."""
        for detok, toks in self._undecoded:
            for tok in toks:
                detok.add_token(tok)
        self._undecoded.clear()
        touched, self._touched = self._touched, {}
        outputs = []
        for group in touched.values():
            if group.request_id not in self.groups:
                continue  # aborted meanwhile: its final output went out with the abort
            if group.finished:
                outputs.append(self._output(group))
                self._drop(group)
            elif group.kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(group))
        return outputs

    def _append(self, r: Request, detok: IncrementalDetokenizer | None, toks: tuple[int, ...],
                lps: SampleLogprobs | None) -> None:
        p = r.params
        later: list[int] | None = None  # tokens decoded at the next flush (no stop string to look for)
        if detok is not None and not p.stop:
            later = []
            self._undecoded.append((detok, later))
            detok = None
        for j, tok in enumerate(toks):
            r.append_token(tok)
            self.stats.generation_tokens += 1
            if lps is not None:
                entry = lps[j]
                r.logprobs.append(entry)
                if entry is not None and tok in entry:
                    r.cumulative_logprob += entry[tok].logprob
            stop_str = detok.add_token(tok) if detok is not None else None
            if later is not None:
                later.append(tok)
            n_out = len(r.token_ids) - r.num_prompt_tokens  # this token's place among the outputs
            status = None
            if r.grammar is not None and not r.grammar.accept(tok):  # masked out: a bug, not the user's
                r.error = f"structured output: token {tok} does not continue the grammar"
                self._finish(r, RequestStatus.FINISHED_ERROR)
                return
            if n_out >= p.min_tokens:
                if not p.ignore_eos and tok in r.eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif tok in p.stop_token_ids:
                    status, r.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                elif stop_str is not None:
                    status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if status is None and r.grammar is not None and r.grammar.is_terminated:
                status = RequestStatus.FINISHED_STOPPED  # the output is complete (its stop token accepted)
            if status is None and (n_out >= r.max_output_tokens or len(r.token_ids) >= r.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(r, status)
                return

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        delta = group.kind is RequestOutputKind.DELTA
        for i, (c, d) in enumerate(zip(group.children, group.detoks)):
            text = d.text if d is not None else ""
            n_prompt = c.num_prompt_tokens
            chars, toks, lps = group.sent[i] if delta else (0, 0, 0)
            if delta:  # text a stop string may still cut is held back until it cannot be
                end = len(text) if c.status.finished or d is None else d.stable_text_len
                group.sent[i] = (max(chars, end), len(c.token_ids) - n_prompt, len(c.logprobs))
                text = text[chars:end]
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=c.token_ids[n_prompt + toks:],
                cumulative_logprob=c.cumulative_logprob if c.params.logprobs is not None else None,
                logprobs=c.logprobs[lps:] if c.params.logprobs is not None else None,
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
            synthetic=self.synthetic,
        )

    def _drop(self, group: _Group) -> None:
        self.groups.pop(group.request_id, None)
        for c in group.children:
            self._child.pop(c.request_id, None)
