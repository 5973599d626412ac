"""Engine counters (what /metrics exports) and the periodic log line.

Counters only ever increase; the server turns them into Prometheus counters by deltas. Speculation
counters follow vLLM's meaning: a *draft* is one proposal of ≥ 1 token for one request in one step;
``accepted_per_pos[i]`` counts drafts whose token at position i was accepted (vLLM's per-position
counter, whose rate divides by all drafts); ``drafted_per_pos[i]`` counts drafts that reached position
i, so ``accepted_per_pos[i] / drafted_per_pos[i]`` is the acceptance of the drafts that tried it (the
same where every draft has k tokens; higher where the policy drafts fewer).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("tandem")


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    # the goodput policy (spec_decode/policy.py): per proposal round, how many requests got k drafts
    chosen_k: list[int] = field(default_factory=list)  # chosen_k[k] = decisions for k, cumulative
    last_drafting: int = 0  # requests given drafts in the latest proposal round
    last_decided: int = 0  # requests decided in it
    num_shadow_drafts: int = 0  # lazy shadow drafts proposed (n-gram while decode runs ahead)
    # chained verifies (engine/async_decode.py): requests' drafts proposed before the verify they
    # follow was read, whose assumption (it accepts everything, emits the expected token) held / failed
    num_assumed_held: int = 0
    num_assumed_failed: int = 0

    def record_choices(self, ks: list[int] | tuple[int, ...], k: int) -> None:
        self._histogram_to(k)
        for x in ks:
            self.chosen_k[min(x, k)] += 1
        self.last_decided = len(ks)
        self.last_drafting = sum(1 for x in ks if x > 0)

    def record_nothing_drafted(self, n: int, k: int) -> None:
        """``record_choices([0] * n, k)``, without the list."""
        self._histogram_to(k)
        self.chosen_k[0] += n
        self.last_decided, self.last_drafting = n, 0

    def _histogram_to(self, k: int) -> None:
        if len(self.chosen_k) < k + 1:
            self.chosen_k.extend([0] * (k + 1 - len(self.chosen_k)))

    @property
    def drafting_share(self) -> float:
        """Share of the policy's decisions (request x proposal round) that drafted, since start."""
        total = sum(self.chosen_k)
        return (total - self.chosen_k[0]) / total if total else 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
            self.drafted_per_pos.extend([0] * (num_draft - len(self.drafted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        for i in range(num_draft):
            self.drafted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """τ = 1 + accepted / drafts (tokens emitted per verify step, bonus included)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def per_position_rates(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_pos), list(self.drafted_per_pos), list(self.chosen_k),
                         self.last_drafting, self.last_decided, self.num_shadow_drafts, self.num_assumed_held,
                         self.num_assumed_failed)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    request_success: dict[str, int] = field(default_factory=dict)  # finish_reason → count
    spec: SpecStats = field(default_factory=SpecStats)
    num_steps: int = 0
    # prefix caching, in tokens (vLLM): prompt tokens looked up / found cached at first admission
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class PeriodicLogger:
    """Logs throughput, queue sizes, KV usage and speculation rates every ``interval`` seconds."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last = time.monotonic()
        self._last_prompt = 0
        self._last_gen = 0
        self._last_spec = SpecStats()
        self._last_pc = (0, 0)  # (queries, hits) at the last log line
        self._pc_rate: float | None = None

    def maybe_log(self, stats: EngineStats, running: int, waiting: int, kv_usage: float) -> None:
        now = time.monotonic()
        dt = now - self._last
        if dt < self.interval:
            return
        spec = stats.spec
        msg = (
            f"Avg prompt throughput: {(stats.prompt_tokens - self._last_prompt) / dt:.1f} tokens/s, "
            f"Avg generation throughput: {(stats.generation_tokens - self._last_gen) / dt:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {100 * kv_usage:.1f}%"
        )
        d_q = stats.prefix_cache_queries - self._last_pc[0]
        if d_q > 0:  # hit rate over the queries since the last line (kept while none arrive)
            self._pc_rate = (stats.prefix_cache_hits - self._last_pc[1]) / d_q
        if self._pc_rate is not None:
            msg += f", Prefix cache hit rate: {100 * self._pc_rate:.1f}%"
        self._last_pc = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        d_drafts = spec.num_drafts - self._last_spec.num_drafts
        if d_drafts:
            d_tok = spec.num_draft_tokens - self._last_spec.num_draft_tokens
            d_acc = spec.num_accepted_tokens - self._last_spec.num_accepted_tokens
            per_pos = [
                (a - (self._last_spec.accepted_per_pos[i] if i < len(self._last_spec.accepted_per_pos) else 0)) / d_drafts
                for i, a in enumerate(spec.accepted_per_pos)
            ]
            msg += (
                f" | SpecDecoding metrics: Mean acceptance length: {1 + d_acc / d_drafts:.2f}, "
                f"Accepted: {d_acc} tokens, Drafted: {d_tok} tokens, "
                f"Draft acceptance rate: {100 * d_acc / max(d_tok, 1):.1f}%, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}"
            )
        d_k = [c - (self._last_spec.chosen_k[i] if i < len(self._last_spec.chosen_k) else 0)
               for i, c in enumerate(spec.chosen_k)]
        if sum(d_k):
            msg += (f" | Policy: drafting {100 * (sum(d_k) - d_k[0]) / sum(d_k):.1f}% of requests, "
                    f"chosen k: {' '.join(f'{k}:{c}' for k, c in enumerate(d_k) if c)}")
        held = spec.num_assumed_held - self._last_spec.num_assumed_held
        failed = spec.num_assumed_failed - self._last_spec.num_assumed_failed
        if held + failed:
            msg += f" | Chained drafts: {held + failed}, assumption held {100 * held / (held + failed):.1f}%"
        logger.info(msg)
        self._last = now
        self._last_prompt = stats.prompt_tokens
        self._last_gen = stats.generation_tokens
        self._last_spec = spec.copy()
