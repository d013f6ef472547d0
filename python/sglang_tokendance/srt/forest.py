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

Reuse: after SGLang allocates a batch's slots (`restore_segments`, an AFTER hook on
ScheduleBatch.prepare_for_extend), every cached segment a request holds after its radix
prefix is rotated to the request's own positions and written into its own slots; the model
forward then runs core/blend's blended prefill (srt/model.py), which finds each request's
reused runs by request id, recomputes the fresh tokens and the selected share of the reused
ones (`--tokendance-recompute-ratio`). A request's approximate KV never enters the tree: it
publishes only the part before its first reused token, and inserts only segments computed
before it. Requests that ask for input-token logprobs take SGLang's path (a blended prefill
has no hidden state at reused tokens).

Output registration: a request sent with `"tokendance": {"register_output": true}` has its
generated text cached as a segment when it finishes, if tokenising that text alone gives back
the generated ids (so the next round's block, which is that text, has the same hash). Its last
token has no KV yet; reuse computes it fresh.

Metrics: under SGLang's `--enable-metrics` the forest reports segment hits, misses, reused
tokens and the bytes its segment nodes hold to /metrics (srt/metrics.py).
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_tokendance.core.blend import BlendOptions, BlendStats, RequestRow, blended_prefill
from sglang_tokendance.core.rope import RopeSpec, rotate, unrotate
from sglang_tokendance.core.segment_table import SegmentTable
from sglang_tokendance.core.selection import SelectionRule, rule_named
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt.metrics import NO_METRICS, ForestMetrics, PrometheusForestMetrics
from sglang_tokendance.srt.model import SUPPORTED_ARCHITECTURES, PoolKV, SGLangLayers
from sglang_tokendance.core.segments import segment_hash
from sglang_tokendance.srt.prompt_interface import REUSE_INFO_KEY, carried_spans, model_salt, wants_output_registered

logger = logging.getLogger(__name__)


class SegmentForest(RadixCache):
    metrics: ForestMetrics = NO_METRICS  # replaced under --enable-metrics

    def __init__(self, params, rope: RopeSpec | None, reuse: bool, outputs: OutputSegments | None = None,
                 blend: BlendOptions = BlendOptions(), rule: SelectionRule | None = None):
        self.rope = rope
        self.reuse = reuse and rope is not None
        self.outputs = outputs
        self.blend, self.rule = blend, rule
        self.segments = SegmentTable()
        self.reused_runs: dict[str, list[tuple[int, int]]] = {}  # rid -> extend-relative reused runs
        self.reuse_info: dict[str, dict] = {}  # rid -> its meta_info counts, completed after the forward
        super().__init__(params)
        if self.page_size != 1:
            raise ValueError(f"the tokendance radix cache needs --page-size 1, got {self.page_size}")

    def init_metrics_collector(self) -> None:
        """SGLang calls this under --enable-metrics: our series take the cache's labels."""
        super().init_metrics_collector()
        self.metrics = PrometheusForestMetrics(self.metrics_collector.labels, self.segments, self.bytes_per_token())

    # --- tree + segments lifecycle ---------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self.reused_runs.clear()
        self.reuse_info.clear()
        for slots in self.segments.clear():
            self.token_to_kv_pool_allocator.free(slots)
        self.metrics.update_held()

    def checkpoint(self, req, *, up_to: int) -> None:
        exact = min(up_to, _first_reused(req))  # reused KV is approximate: keep it out
        super().checkpoint(req, up_to=exact)
        if self.rope is not None and not self.disable:
            self.insert_segments(req, exact)
            if req.finished() and self.outputs is not None and wants_output_registered(req.sampling_params.custom_params):
                self.register_output(req)
            self.metrics.update_held()

    def register_output(self, req) -> None:
        """Cache a finished request's generated text as a segment (see the module doc)."""
        ids = self.outputs.segment_ids(list(req.output_ids))
        if ids is None:
            return
        segment_hash = self.outputs.hash(ids)
        if segment_hash in self.segments:
            self.segments.count_duplicate(segment_hash)
            return
        start = len(req.origin_input_ids)
        with_kv = min(len(ids), len(req.output_ids) - 1)  # the last generated token has no KV
        slots = self.token_to_kv_pool_allocator.alloc(with_kv) if with_kv > 0 else None
        if slots is None:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        self._copy_kv(row[start:start + with_kv].to(torch.int64), slots, start, unrotate)
        self.segments.insert(segment_hash, slots)

    def insert_segments(self, req, up_to: int) -> None:
        """Cache the request's shared segments whose exact KV is complete (end <= up_to).

        SGLang checkpoints a request after every step; its spans are parsed once and only the
        ones still pending are looked at."""
        pending = req.__dict__.get("_tokendance_pending")
        if pending is None:
            pending = carried_spans(req.sampling_params.custom_params)
        req._tokendance_pending = [span for span in pending if span.end > up_to]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        for span in (span for span in pending if span.end <= up_to):
            if span.hash in self.segments:
                self.segments.count_duplicate(span.hash)
                continue
            slots = self.token_to_kv_pool_allocator.alloc(span.end - span.start)
            if slots is None:  # no free slots: a segment copy never evicts live prefixes
                continue
            self._copy_kv(row[span.start:span.end].to(torch.int64), slots, span.start, unrotate)
            self.segments.insert(span.hash, slots)

    def restore_segments(self, batch) -> None:
        """Write cached segments' KV into the slots of the batch's requests that hold them."""
        for req in batch.reqs:
            info = self._restore_one(req)
            if info is not None:  # reaches meta_info["tokendance"] (srt/prompt_interface.py)
                req.customized_info = {**(req.customized_info or {}), REUSE_INFO_KEY: [info]}

    def _restore_one(self, req) -> dict | None:
        if not self.reuse or _wants_input_logprobs(req):
            return None
        spans = carried_spans(req.sampling_params.custom_params)
        if not spans:
            return None
        prefix, extend_end = req.prefix_len, req.extend_end
        last_fresh = len(req.origin_input_ids) - 1  # the last prompt token is always computed
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        runs: list[tuple[int, int]] = []
        hits = misses = 0
        for span in spans:
            if span.start < prefix or min(span.end, extend_end, last_fresh) <= span.start:
                continue
            entry = self.segments.lookup(span.hash)
            if entry is None:
                misses += 1
                continue
            hits += 1
            end = min(span.end, extend_end, last_fresh, span.start + len(entry))
            self._copy_kv(entry.slots[: end - span.start], row[span.start:end].to(torch.int64), span.start, rotate)
            runs.append((span.start - prefix, end - prefix))
        reused = sum(b - a for a, b in runs)
        self.metrics.count_restore(hits, misses)
        info = {"reused_tokens": reused, "recomputed_tokens": 0, "computed_tokens": extend_end - prefix - reused,
                "segment_hits": hits, "segment_misses": misses}
        if reused:
            self.reused_runs[req.rid] = runs
            self.reuse_info[req.rid] = info
            req.tokendance_first_reused = prefix + runs[0][0]
        return info

    def record_recompute(self, rids: list[str], rows: list[RequestRow], stats: BlendStats) -> None:
        """After the forward: move the recomputed reused tokens from `reused_tokens` to
        `computed_tokens` in each request's counts, and count both in the metrics."""
        start = 0
        for rid, row in zip(rids, rows):
            n = sum(b - a for a, b in row.reused)
            kept = 0 if stats.kept is None else int(stats.kept[start:start + n].sum())
            start += n
            info = self.reuse_info.pop(rid, None)
            if info is not None:
                info.update(reused_tokens=n - kept, recomputed_tokens=kept,
                            computed_tokens=info["computed_tokens"] + kept)
            self.metrics.count_reuse(n - kept, kept)

    def take_reuse_rows(self, forward_batch) -> list[RequestRow] | None:
        """The blended prefill's view of an extend batch in which some request reuses, else None."""
        if not self.reused_runs:  # the common case: no request of this batch reuses
            return None
        runs = [self.reused_runs.pop(rid, None) for rid in forward_batch.rids]
        if all(r is None for r in runs):
            return None
        req_to_token = self.req_to_token_pool.req_to_token
        return [
            RequestRow(prefix, extend, req_to_token[pool_index, :prefix + extend], reused=r or ())
            for r, prefix, extend, pool_index in zip(runs, forward_batch.extend_prefix_lens_cpu,
                                                     forward_batch.extend_seq_lens_cpu,
                                                     forward_batch.req_pool_indices.tolist())
        ]

    def _copy_kv(self, src: torch.Tensor, dst: torch.Tensor, start: int, k_transform) -> None:
        """Copy every layer's K and V from slots `src` to `dst`; K passes through
        `k_transform(k, positions, rope)` for positions start.. (rotate or unrotate)."""
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        positions = torch.arange(start, start + src.numel(), device=src.device)
        for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
            k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            k[dst] = k_transform(k[src], positions, self.rope)
            v[dst] = v[src]

    # --- one LRU over tree leaves and segments --------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        total = EvictResult()
        while total.num_tokens_evicted < params.num_tokens:
            segment = self.segments.oldest()
            if segment is None:  # only tree leaves left: SGLang's own eviction, in one go
                rest = params.num_tokens - total.num_tokens_evicted
                total.num_tokens_evicted += super().evict(EvictParams(num_tokens=rest)).num_tokens_evicted
                break
            leaf = min(self.evictable_leaves, key=lambda n: n.last_access_time, default=None)
            if leaf is None or segment.last_access_time <= leaf.last_access_time:
                freed = len(segment)
                self.token_to_kv_pool_allocator.free(self.segments.remove(segment))
            else:
                freed = super().evict(EvictParams(num_tokens=1)).num_tokens_evicted  # one leaf
            total.num_tokens_evicted += freed
        self.metrics.update_held()
        return total

    def evictable_size(self) -> int:
        return super().evictable_size() + self.segments.tokens

    def bytes_per_token(self) -> int:
        """KV bytes of one token over every layer, K and V."""
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        k = pool.get_key_buffer(pool.start_layer)
        return 2 * pool.layer_num * k[0].numel() * k.element_size()

    def stats(self) -> dict:
        return {**self.segments.stats(self.bytes_per_token()), "tree_evictable_tokens": super().evictable_size()}


ACTIVE: SegmentForest | None = None  # the scheduler process's forest, for the model forward


def _first_reused(req) -> int:
    return getattr(req, "tokendance_first_reused", 1 << 62)


def _wants_input_logprobs(req) -> bool:
    return bool(req.return_logprob) and 0 <= req.logprob_start_len < len(req.origin_input_ids) - 1


class OutputSegments:
    """What output registration needs in the scheduler: the tokenizer and the hash salt of
    the tokenizer manager's segments (loaded on first use)."""

    def __init__(self, server_args, min_segment_tokens: int):
        self.server_args = server_args
        self.min_segment_tokens = min_segment_tokens
        self._tokenizer = self._salt = None

    def segment_ids(self, output_ids: list[int]) -> list[int] | None:
        """The output's ids as its text tokenises alone (trailing special tokens such as EOS
        dropped), or None when they differ or are too short to be a segment."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = self.server_args.tokenizer_path or self.server_args.model_path
            self._tokenizer = AutoTokenizer.from_pretrained(path)
        text = self._tokenizer.decode(output_ids, skip_special_tokens=True)
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        special = set(self._tokenizer.all_special_ids)
        if output_ids[: len(ids)] != ids or not set(output_ids[len(ids):]) <= special:
            return None
        return ids if len(ids) >= self.min_segment_tokens else None

    def hash(self, ids: list[int]) -> str:
        if self._salt is None:
            self._salt = model_salt(self.server_args)
        return segment_hash(ids, self._salt)


def build_forest(ctx: TreeCacheBuildContext) -> SegmentForest:
    """The `register_radix_cache_backend` factory."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("the tokendance radix cache supports full-attention models without HiCache")
    hf_config = ctx.model_config.hf_config
    try:
        rope = RopeSpec.from_hf_config(hf_config)
    except ValueError as e:
        logger.warning("TokenDance segment caching is off for this model: %s", e)
        rope = None
    args = TokenDanceArgs.from_env()
    architectures = list(hf_config.architectures or [])
    reuse = args.kv_enabled and len(architectures) == 1 and architectures[0] in SUPPORTED_ARCHITECTURES
    if reuse and args.recompute_ratio > 0 and args.check_layer >= hf_config.num_hidden_layers:
        raise ValueError(f"--tokendance-check-layer {args.check_layer} must be below the model's "
                         f"{hf_config.num_hidden_layers} layers")
    outputs = OutputSegments(ctx.server_args, args.min_segment_tokens)
    forest = SegmentForest(ctx.params, rope, reuse=reuse, outputs=outputs, blend=args.blend_options(),
                           rule=rule_named(args.selection))
    global ACTIVE
    ACTIVE = forest
    return forest


class OutputStreamer(SchedulerOutputStreamer):
    """SGLang's output streamer, sending our per-request reuse counts once per request."""

    def is_request_level_customized_info_key(self, key: str) -> bool:
        return key == REUSE_INFO_KEY or super().is_request_level_customized_info_key(key)


def output_streamer_class(*unused, **unused_kw):
    """REPLACE hook on Scheduler.get_output_streamer_class (an official override point)."""
    return OutputStreamer


def restore_after_allocation(result, batch, *unused, **unused_kw):
    """AFTER hook on ScheduleBatch.prepare_for_extend: slots are final, the forward is next."""
    if isinstance(batch.tree_cache, SegmentForest):
        batch.tree_cache.restore_segments(batch)
    return result


def model_forward(original, model, input_ids, positions, forward_batch, *args, **kwargs):
    """AROUND hook on the decoder forwards of srt/model.py: extend batches with reused
    segments run the blended prefill; every other batch runs SGLang's own forward."""
    rows = None
    if ACTIVE is not None and forward_batch.forward_mode.is_extend():
        rows = ACTIVE.take_reuse_rows(forward_batch)
    if rows is None:
        return original(model, input_ids, positions, forward_batch, *args, **kwargs)
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    layers = SGLangLayers(model, forward_batch)
    hidden, stats = blended_prefill(layers, PoolKV(get_token_to_kv_pool(), layers), input_ids, positions, rows,
                                    ACTIVE.blend, ACTIVE.rule)
    ACTIVE.record_recompute(forward_batch.rids, rows, stats)
    return hidden


def add_forest_stats(result, scheduler, *unused, **unused_kw):
    """AFTER hook on Scheduler.get_internal_state: /server_info shows the forest's counts."""
    if isinstance(scheduler.tree_cache, SegmentForest):
        result.internal_state["tokendance_forest"] = scheduler.tree_cache.stats()
    return result
