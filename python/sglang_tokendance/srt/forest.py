"""The segment-hash forest: SGLang's radix cache plus segment nodes keyed by content hash.

Registered as the radix-cache backend "tokendance" (our launcher makes it the default).
Private prefixes behave exactly like SGLang's Python RadixCache: this class inherits it.
Besides the tree it keeps a SegmentTable: once a request's prefill is done (SGLang calls
`checkpoint`), each of its shared segments that is not cached yet is copied into slots of
the same KV pool, with K un-rotated (core/rope). Un-rotated K is one canonical form per hash,
whatever context and offset the first copy came from: reuse at any position is then a single
`rotate` to the target positions, and later Master-Mirror diffs compare KV in one frame.
Segment slots count against the same KV budget and share one LRU eviction with the tree's
leaves; `/flush_cache` (reset) drops them with the tree.

Not yet here (the forest issue stays open for them): reusing the segments in a request's
forward, output registration, and the metrics.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_tokendance.core.rope import RopeSpec, unrotate
from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.srt.prompt_interface import carried_spans

logger = logging.getLogger(__name__)

class SegmentForest(RadixCache):
    def __init__(self, params, rope: RopeSpec | None):
        self.rope = rope
        self.segments = SegmentTable()
        super().__init__(params)
        if self.page_size != 1:
            raise ValueError(f"the tokendance radix cache needs --page-size 1, got {self.page_size}")

    # --- tree + segments lifecycle ---------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        for slots in self.segments.clear():
            self.token_to_kv_pool_allocator.free(slots)

    def checkpoint(self, req, *, up_to: int) -> None:
        super().checkpoint(req, up_to=up_to)
        if self.rope is not None and not self.disable:
            self.insert_segments(req, up_to)

    def insert_segments(self, req, up_to: int) -> None:
        """Cache the request's shared segments whose KV is complete (end <= up_to)."""
        done: set[int] = req.__dict__.setdefault("_tokendance_inserted", set())
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        for span in carried_spans(req.sampling_params.custom_params):
            if span.end > up_to or span.start in done:
                continue
            done.add(span.start)
            if span.hash in self.segments:
                self.segments.count_duplicate(span.hash)
                continue
            slots = self.token_to_kv_pool_allocator.alloc(span.end - span.start)
            if slots is None:  # no free slots: a segment copy never evicts live prefixes
                continue
            self._copy_unrotated(row[span.start:span.end].to(torch.int64), slots, span.start)
            self.segments.insert(span.hash, slots)

    def _copy_unrotated(self, src: torch.Tensor, dst: torch.Tensor, start: int) -> None:
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        positions = torch.arange(start, start + src.numel(), device=src.device)
        for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
            k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            k[dst] = unrotate(k[src], positions, self.rope)
            v[dst] = v[src]

    # --- one LRU over tree leaves and segments --------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        total = EvictResult()
        while total.num_tokens_evicted < params.num_tokens:
            segment = self.segments.oldest_evictable()
            leaf = min(self.evictable_leaves, key=lambda n: n.last_access_time, default=None)
            if segment is not None and (leaf is None or segment.last_access_time <= leaf.last_access_time):
                freed = len(segment)
                self.token_to_kv_pool_allocator.free(self.segments.remove(segment))
            elif leaf is not None:
                freed = super().evict(EvictParams(num_tokens=1)).num_tokens_evicted
            else:
                break
            total.num_tokens_evicted += freed
        return total

    def evictable_size(self) -> int:
        return super().evictable_size() + self.segments.evictable_tokens

    def protected_size(self) -> int:
        return super().protected_size() + self.segments.protected_tokens

    def stats(self) -> dict:
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        k = pool.get_key_buffer(pool.start_layer)
        bytes_per_token = 2 * pool.layer_num * k[0].numel() * k.element_size()
        return {**self.segments.stats(bytes_per_token), "tree_evictable_tokens": super().evictable_size()}


def build_forest(ctx: TreeCacheBuildContext) -> SegmentForest:
    """The `register_radix_cache_backend` factory."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("the tokendance radix cache supports full-attention models without HiCache")
    try:
        rope = RopeSpec.from_hf_config(ctx.model_config.hf_config)
    except ValueError as e:
        logger.warning("TokenDance segment caching is off for this model: %s", e)
        rope = None
    return SegmentForest(ctx.params, rope)


def add_forest_stats(result, scheduler, *unused, **unused_kw):
    """AFTER hook on Scheduler.get_internal_state: /server_info shows the forest's counts."""
    if isinstance(scheduler.tree_cache, SegmentForest):
        result.internal_state["tokendance_forest"] = scheduler.tree_cache.stats()
    return result
