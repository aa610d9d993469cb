"""vLLM's spec-decode counters: what the reference runtime counts and the vLLM worker reads.

Both backends report the same four counters, so every figure (acceptance length,
per-position acceptance) is computed one way. The worker reads them from vLLM's metrics
(:meth:`SpecDecodeCounters.from_metrics`); they are cumulative per engine, so a job's
counters are the difference of two readings. The reference runtime counts each verify
step itself (:meth:`SpecDecodeCounters.observe`). Pure Python, so that the worker script
can import it beside vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# vLLM metric name -> counter field; the per-position counter is a vector metric.
METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecDecodeCounters:
    """vLLM's spec-decode counters (``vllm:spec_decode_*``) for one run.

    Args:
        num_drafts: verify steps that carried drafts.
        num_draft_tokens: drafted tokens (``K`` per draft).
        num_accepted_tokens: drafted tokens the target accepted.
        accepted_per_pos: ``[K]`` drafts whose token ``i`` was accepted.

    Example: K = 2, two drafts accepting 2 and 0 -> acceptance length 1 + 2/2 = 2.0,
    per position [0.5, 0.5].
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def from_metrics(cls, metrics: Iterable) -> SpecDecodeCounters:
        """The counters in ``LLM.get_metrics()``, summed over engines (their labels differ
        only by engine)."""
        counters = cls()
        for metric in metrics:
            if metric.name in METRICS:
                name = METRICS[metric.name]
                setattr(counters, name, getattr(counters, name) + int(metric.value))
            elif metric.name == PER_POSITION_METRIC:
                values = [int(v) for v in metric.values]
                per_pos = counters.accepted_per_pos
                per_pos = [a + b for a, b in zip(per_pos + [0] * len(values), values, strict=False)]
                counters.accepted_per_pos = per_pos + values[len(per_pos) :]
        return counters

    @classmethod
    def from_prometheus(cls, text: str) -> SpecDecodeCounters:
        """The counters in a vLLM server's ``/metrics`` page (Prometheus text), summed over
        engines; a server that does not draft has none (all zero, no positions).

        Example: ``vllm:spec_decode_num_drafts_total{engine="0"} 3.0`` -> ``num_drafts`` 3.
        """
        from prometheus_client.parser import text_string_to_metric_families

        counters, per_pos = cls(), {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):  # _created: a timestamp
                    continue
                if family.name in METRICS:
                    name = METRICS[family.name]
                    setattr(counters, name, getattr(counters, name) + int(sample.value))
                elif family.name == PER_POSITION_METRIC:
                    pos = int(sample.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
        counters.accepted_per_pos = [per_pos.get(i, 0) for i in range(len(per_pos))]
        return counters

    @classmethod
    def from_histograms(cls, histograms: Iterable[Sequence[int]]) -> SpecDecodeCounters:
        """The counters of requests whose vLLM per-request metrics give ``histogram[j]`` =
        verify steps that accepted ``j`` of the K drafted tokens (``len = K + 1``).

        Example: K = 2, histograms [[1, 0, 1]] -> 2 drafts, 2 accepted, per position [1, 1].
        """
        counters = cls()
        for hist in histograms:
            k = len(hist) - 1
            counters.num_drafts += sum(hist)
            counters.num_draft_tokens += k * sum(hist)
            counters.num_accepted_tokens += sum(j * n for j, n in enumerate(hist))
            per_pos = [sum(hist[i + 1 :]) for i in range(k)]  # accepted i+1 or more
            old = counters.accepted_per_pos + [0] * (k - len(counters.accepted_per_pos))
            per_pos += [0] * (len(old) - k)
            counters.accepted_per_pos = [a + b for a, b in zip(old, per_pos, strict=True)]
        return counters

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        """What was counted since ``before`` (a reading of the same engine)."""
        padded = before.accepted_per_pos + [0] * len(self.accepted_per_pos)
        return SpecDecodeCounters(
            num_drafts=self.num_drafts - before.num_drafts,
            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
            accepted_per_pos=[a - b for a, b in zip(self.accepted_per_pos, padded, strict=False)],
        )

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        """Both runs' counts together (e.g. the pieces of one cell)."""
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine, theirs = (c.accepted_per_pos + [0] * (width - len(c.accepted_per_pos))
                        for c in (self, other))
        return SpecDecodeCounters(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            accepted_per_pos=[a + b for a, b in zip(mine, theirs, strict=True)],
        )

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verify step, as vLLM's ``SpecDecodingStats.observe_draft`` does."""
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_length(self) -> float:
        """Tokens per target forward: ``1 + accepted / drafts`` (1 is the bonus token)."""
        return 1.0 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def per_position(self) -> list[float]:
        """Acceptance rate of draft position ``i``: ``accepted_per_pos[i] / drafts``."""
        return [n / max(self.num_drafts, 1) for n in self.accepted_per_pos]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
        }
