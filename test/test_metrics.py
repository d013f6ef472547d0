"""The forest's Prometheus series: the series alone (fast), and on /metrics of a server run
with SGLang's --enable-metrics (slow)."""

from __future__ import annotations

import pytest
import requests

from conftest import emptied, generate
from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from test_forest import BLOCKS, distinct_blocks_prompt, forest_stats

LABELS = {"cache_type": "SegmentForest", "tp_rank": "0"}


def test_series_count_restores_and_hold_bytes():
    import torch
    from prometheus_client import REGISTRY

    from sglang_tokendance.srt.metrics import PrometheusForestMetrics, StorageCounts

    table = SegmentTable()
    storage = StorageCounts(master_tokens=0, mirror_diff_tokens=0, row_references=0)
    metrics = PrometheusForestMetrics(LABELS, table, bytes_per_token=12, storage=lambda: storage)
    metrics.count_restore(hits=2, misses=1)
    metrics.count_reuse(reused_tokens=30, recomputed_tokens=4, own_tokens=4)
    metrics.count_restore(hits=1, misses=0)
    metrics.count_reuse(reused_tokens=5, recomputed_tokens=0, own_tokens=0)
    table.insert("h", torch.arange(7), list(range(7)))
    storage = StorageCounts(master_tokens=7, mirror_diff_tokens=4, row_references=31)
    metrics.update_held()
    value = lambda name: REGISTRY.get_sample_value(name, LABELS)  # noqa: E731
    assert value("sglang:tokendance_segment_hits_total") == 3
    assert value("sglang:tokendance_segment_misses_total") == 1
    assert value("sglang:tokendance_reused_tokens_total") == 35
    assert value("sglang:tokendance_recomputed_tokens_total") == 4
    assert value("sglang:tokendance_diff_tokens_total") == 4  # 39 restored per 4 own: compression 9.75
    assert value("sglang:tokendance_segment_bytes") == 7 * 12
    assert value("sglang:tokendance_master_tokens") == 7
    assert value("sglang:tokendance_mirror_diff_tokens") == 4
    assert value("sglang:tokendance_row_references") == 31


def test_forest_reports_bytes_held_after_evicting_segments():
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_tokendance.srt.metrics import ForestMetrics
    from test_forest_units import make_forest

    class Recorder(ForestMetrics):
        held_updates = 0

        def update_held(self) -> None:
            self.held_updates += 1

    forest = make_forest()
    forest.metrics = Recorder()
    forest.segments.insert("a", torch.arange(4), [1, 2, 3, 4])
    forest.segments.insert("b", torch.arange(4, 8), [5, 6, 7, 8]).last_access_time += 1.0
    assert forest.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    assert list(forest.segments.entries) == ["b"] and forest.metrics.held_updates == 1


@pytest.fixture(scope="module")
def server(small_pool_server_url):
    """The shared small-pool server (SMALL_POOL KV tokens: small enough that
    test_bytes_held_follow_eviction evicts), emptied."""
    return emptied(small_pool_server_url)


def tokendance_metrics(url: str) -> dict[str, float]:
    """The forest's series on /metrics by sample name, checked to carry the cache's labels (the
    round policy's series carry the scheduler's: test_rounds_server)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=60).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("sglang:tokendance_") and not s.name.startswith("sglang:tokendance_round")]
    assert all(s.labels["cache_type"] == "SegmentForest" and "tp_rank" in s.labels for s in samples)
    values = {s.name: s.value for s in samples}
    assert len(values) == len(samples)  # one series each
    return values


@pytest.mark.slow
def test_hits_misses_reused_tokens_and_bytes_held(server):
    requests.post(server + "/flush_cache", timeout=60)
    before = tokendance_metrics(server)
    first = generate(server, SEP.join(["You are Mira.", BLOCKS[0], BLOCKS[1], " Mira says:"]), 2)  # 2 misses
    second = generate(server, SEP.join(["You are Oskar.", BLOCKS[1], BLOCKS[2], " Oskar says:"]), 2)  # 1 hit, 1 miss
    infos = [out["meta_info"]["tokendance"] for out in (first, second)]
    after = tokendance_metrics(server)
    delta = {name: after[name] - before[name] for name in after}
    assert delta["sglang:tokendance_segment_hits_total"] == 1 == sum(i["segment_hits"] for i in infos)
    assert delta["sglang:tokendance_segment_misses_total"] == 3 == sum(i["segment_misses"] for i in infos)
    reused, recomputed = infos[1]["reused_tokens"], infos[1]["recomputed_tokens"]
    assert reused > 0 and delta["sglang:tokendance_reused_tokens_total"] == reused
    assert recomputed > 0 and delta["sglang:tokendance_recomputed_tokens_total"] == recomputed
    held = forest_stats(server)["segment_bytes"]
    assert held > 0 and after["sglang:tokendance_segment_bytes"] == held

    assert requests.post(server + "/flush_cache", timeout=60).status_code == 200
    assert tokendance_metrics(server)["sglang:tokendance_segment_bytes"] == 0


@pytest.mark.slow
def test_bytes_held_follow_eviction(server):
    requests.post(server + "/flush_cache", timeout=60)
    evicted_before = forest_stats(server)["segments_evicted"]  # a counter over the server's life
    for i in range(10):  # about 2000 tokens of distinct segments into a 1200-token pool
        generate(server, distinct_blocks_prompt(i), 2)
    stats = forest_stats(server)
    assert stats["segments_evicted"] > evicted_before
    assert tokendance_metrics(server)["sglang:tokendance_segment_bytes"] == stats["segment_bytes"] > 0
