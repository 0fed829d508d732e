"""vLLM's spec-decode counters on /metrics, fed the core's cumulative SpecDecodingStats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from serve.core.spec_decode.stats import SpecDecodingStats


class SpecDecodeCounters:
    """spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, ["model_name", *labels], registry=registry)

        self.model_name = model_name
        self.drafts = counter("spec_decode_num_drafts", "Drafts verified (a request's proposal in one step).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position.", ("position",)
        )
        self._seen = SpecDecodingStats(0)

    def observe(self, stats: SpecDecodingStats) -> None:
        """Add what the core counted since the last call (a restarted core counts from zero again)."""
        seen = self._seen
        if stats.num_drafts < seen.num_drafts:
            seen = SpecDecodingStats(stats.num_spec_tokens)
        name = self.model_name
        self.drafts.labels(name).inc(stats.num_drafts - seen.num_drafts)
        self.draft_tokens.labels(name).inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.accepted.labels(name).inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        before = seen.accepted_per_pos + [0] * (len(stats.accepted_per_pos) - len(seen.accepted_per_pos))
        for pos, (now, was) in enumerate(zip(stats.accepted_per_pos, before)):
            self.per_pos.labels(name, str(pos)).inc(now - was)
        self._seen = SpecDecodingStats(
            stats.num_spec_tokens,
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.accepted_per_pos),
        )
