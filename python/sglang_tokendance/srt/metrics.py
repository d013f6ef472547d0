"""Prometheus series of the segment-hash forest and the round-group policy, under SGLang's
`--enable-metrics`.

SGLang builds a radix cache's metrics collector (`init_metrics_collector`) only when metrics
are on; the forest then builds these series beside it with the same labels (cache_type,
tp/pp/dp rank), so they sit next to SGLang's own cache series such as
`sglang:evicted_tokens_total`. prometheus_client is imported only then, after SGLang has set
PROMETHEUS_MULTIPROC_DIR: the HTTP server's /metrics reads every process's values from there.
With metrics off the forest keeps `NO_METRICS`, whose calls do nothing. The round-group
policy (srt/policy.py) builds its series the same way, with the scheduler collector's labels.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from sglang_tokendance.core.collective import RoundRecord
from sglang_tokendance.core.segment_table import SegmentTable


class StorageCounts(NamedTuple):
    """Master-Mirror storage at one moment (srt/forest `storage_counts`)."""

    master_tokens: int  # slots held by segments (each once; under mirror storage shared with the tree)
    mirror_diff_tokens: int  # own slots of live reusing requests at their reused positions
    row_references: int  # live rows' positions that read a Master's slot in place


class ForestMetrics:
    """What the forest reports; this base is the no-op used when metrics are off."""

    def count_restore(self, hits: int, misses: int) -> None:
        """One request's segment lookups after its radix prefix (srt/forest `_restore_one`)."""

    def count_fallback(self, tokens: int) -> None:
        """A chunk whose `tokens` matched block tokens were computed: blending would not pay (core/cost)."""

    def count_reuse(self, reused_tokens: int, recomputed_tokens: int, own_tokens: int) -> None:
        """One request's restored tokens after its blended prefill: kept as cached, or
        recomputed; `own_tokens` of them hold the request's own slots (its Mirror diff)."""

    def update_held(self) -> None:
        """Segments or live rows changed: refresh the bytes and slots they hold."""


NO_METRICS = ForestMetrics()


class PrometheusForestMetrics(ForestMetrics):
    def __init__(self, labels: dict[str, Any], segments: SegmentTable, bytes_per_token: int,
                 storage: Callable[[], StorageCounts]) -> None:
        self.segments = segments
        self.bytes_per_token = bytes_per_token
        self.storage = storage
        self.hits = labelled_counter("sglang:tokendance_segment_hits_total",
                                     "Cached segments found after a request's radix prefix and reused.", labels)
        self.misses = labelled_counter("sglang:tokendance_segment_misses_total",
                                       "Shared segments after a request's radix prefix that were not cached.", labels)
        self.fallbacks = labelled_counter(
            "sglang:tokendance_cost_fallbacks_total",
            "Prefill chunks whose matched blocks were computed on SGLang's path: blending them was estimated not "
            "to pay.", labels)
        self.fallback_tokens = labelled_counter(
            "sglang:tokendance_cost_fallback_tokens_total",
            "Matched block tokens computed because blending their chunk was estimated not to pay.", labels)
        self.reused_tokens = labelled_counter(
            "sglang:tokendance_reused_tokens_total",
            "Prompt tokens whose KV was restored from segment nodes and kept, not computed.", labels)
        self.recomputed_tokens = labelled_counter(
            "sglang:tokendance_recomputed_tokens_total",
            "Restored prompt tokens that selective recompute computed again.", labels)
        self.own_tokens = labelled_counter(
            "sglang:tokendance_diff_tokens_total",
            "Restored prompt tokens held in the request's own slots (its Mirror diff: the recomputed ones under "
            "mirror storage, all under dense storage); restored tokens per diff token is the compression.", labels)
        self.held_bytes = labelled_gauge("sglang:tokendance_segment_bytes",
                                         "KV bytes held by segment nodes (all layers, K and V).", labels)
        self.master_tokens = labelled_gauge("sglang:tokendance_master_tokens",
                                            "KV slots held by segments (Masters), each once.", labels)
        self.mirror_diff_tokens = labelled_gauge(
            "sglang:tokendance_mirror_diff_tokens",
            "Own KV slots of live reusing requests at their reused positions.", labels)
        self.row_references = labelled_gauge(
            "sglang:tokendance_row_references",
            "Positions of live requests' rows that read a Master's slot in place (mirror storage).", labels)

    def count_restore(self, hits: int, misses: int) -> None:
        self.hits.inc(hits)
        self.misses.inc(misses)

    def count_fallback(self, tokens: int) -> None:
        self.fallbacks.inc()
        self.fallback_tokens.inc(tokens)

    def count_reuse(self, reused_tokens: int, recomputed_tokens: int, own_tokens: int) -> None:
        self.reused_tokens.inc(reused_tokens)
        self.recomputed_tokens.inc(recomputed_tokens)
        self.own_tokens.inc(own_tokens)

    def update_held(self) -> None:
        self.held_bytes.set(self.segments.tokens * self.bytes_per_token)
        storage = self.storage()
        self.master_tokens.set(storage.master_tokens)
        self.mirror_diff_tokens.set(storage.mirror_diff_tokens)
        self.row_references.set(storage.row_references)


def labelled_counter(name: str, documentation: str, labels: dict[str, Any]):
    from prometheus_client import Counter

    return Counter(name=name, documentation=documentation, labelnames=list(labels)).labels(**labels)


def labelled_gauge(name: str, documentation: str, labels: dict[str, Any]):
    from prometheus_client import Gauge

    return Gauge(name=name, documentation=documentation, labelnames=list(labels),
                 multiprocess_mode="mostrecent").labels(**labels)


class RoundMetrics:
    """What the round-group policy reports; this base is the no-op used when metrics are off."""

    def count_round(self, record: RoundRecord) -> None:
        """A round group was released (complete, or its window expired)."""

    def count_late_member(self) -> None:
        """A request joined a released round behind its leader still prefilling."""

    def count_wait(self, seconds: float) -> None:
        """Requests were held this long in all, for their round's members or its leader."""


NO_ROUND_METRICS = RoundMetrics()


class PrometheusRoundMetrics(RoundMetrics):
    def __init__(self, labels: dict[str, Any]) -> None:
        self.rounds = labelled_counter("sglang:tokendance_rounds_formed_total",
                                       "Round groups released to prefill together.", labels)
        self.members = labelled_counter("sglang:tokendance_round_members_total",
                                        "Requests in released round groups (divided by rounds formed: the mean "
                                        "group size).", labels)
        self.fallbacks = labelled_counter("sglang:tokendance_round_fallbacks_total",
                                          "Round groups released because their window expired before every "
                                          "member arrived.", labels)
        self.led = labelled_counter("sglang:tokendance_rounds_led_total",
                                    "Round groups whose leader was prefilled first, its blocks becoming their "
                                    "Masters.", labels)
        self.wait = labelled_counter("sglang:tokendance_round_wait_seconds_total",
                                     "Time requests were held for their round's other members or its leader.", labels)

    def count_round(self, record: RoundRecord) -> None:
        self.rounds.inc()
        self.members.inc(record.members)
        self.fallbacks.inc(record.fallback)
        self.led.inc(record.led)

    def count_late_member(self) -> None:
        self.members.inc()

    def count_wait(self, seconds: float) -> None:
        self.wait.inc(seconds)
