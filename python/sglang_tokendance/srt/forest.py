"""The segment-hash forest: SGLang's radix cache plus segment nodes keyed by content hash.

Registered as the radix-cache backend "tokendance" (our launcher makes it the default).
Private prefixes behave exactly like SGLang's Python RadixCache: this class is one, and
composes what it adds -- the Masters' storage (srt/storage.py), the batch being planned and
forwarded (srt/batch_reuse.py), agents' kept rows (srt/kept_mirrors.py), per-slot tree counts
(srt/tree_slot_counts.py) and one eviction order over leaves and segments (srt/eviction.py).
Besides the tree it keeps a SegmentTable keyed by (cache namespace, content hash): when a
request checkpoints (SGLang calls `checkpoint` after every prefill chunk and step), each of
its shared segments whose exact KV is complete becomes a segment (a Master), read at any
offset: a copy with K un-rotated (core/rope) that reuse rotates into place, or (mirror storage)
the author's slots themselves, read where they are at a shift.
Segments never cross SGLang's cache namespace (extra_key, cache_salt), the same isolation as
its tree. They share one eviction order with the tree's leaves under `--radix-eviction-policy`;
`/flush_cache` (reset) drops them with the tree.

Masters and the rows reading them are the composed `MasterStorage` (srt/storage.py); two
storages, over SGLang's pool with K rotated at each token's position (srt/kv_copy.PoolKeys):
* dense: a segment is copied, K un-rotated, into new slots; reuse copies it back into the
  reading request's own slots, rotated to its positions.
* mirror (srt/pool.RefCountedAllocator, every slot's frame recorded): zero copy. A segment takes a
  reference on the request's own (or the tree's) slots; a reading row holds the Masters it
  reads from its admission on (`admit`: a reference on each slot, the Master pinned, not
  evictable while a live row reads it), is allocated only its fresh tokens and one own slot
  per reused token it can keep (`allocate_extend`), and points its reused positions at the
  Master's slots. After the blended prefill (`settle`) each token it recomputed has its own
  slot in the row (the Mirror's diff); own slots no kept token took are freed. Each owner
  frees its own reference. Reading rows see a Master's K at a shift (core/rope_attention):
  the blended prefill through `reads`, later forwards through the `tokendance` attention
  backend (srt/attention.py).

Reuse wraps SGLang's allocation of a batch's slots (`BatchReuse.restore`, an AROUND hook on
ScheduleBatch.prepare_for_extend): each request's chunk is planned first (srt/reuse.py,
core/plan.py; mirror storage: when SGLang's admission commits it), the allocation's eviction
takes the Masters those plans read last (dense) or never (mirror: held), then the
reused positions are restored as above; the model forward (srt/forward_hook.py) runs the
blended prefill on the plans (a chunked prompt's first blended chunk choosing for the whole
prompt first: `select_prompts`, srt/prompt_selection.py) and hands them back (`settle`).
A request's approximate KV never enters the shared tree, in any chunk: it publishes only the
part before its first reused token, and caches only segments that end before it. Under
mirror storage a finished row that holds approximate KV is kept whole for the prompt that
continues it, in a namespace of its agent's (or of unnamed requests with segments) that the
shared tree's readers never match (srt/kept_mirrors.py).

Output registration: srt/output_registration.py. Metrics: srt/metrics.py.
"""


from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Hashable, Protocol

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_tokendance.core.cost import PrefillCost, serving_cost
from sglang_tokendance.core.next_use import NextUse
from sglang_tokendance.core.recurrence import Sightings
from sglang_tokendance.core.segments import segment_hash
from sglang_tokendance.core.selection import rule_named
from sglang_tokendance.served_model import model_salt_from_env
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt import eviction
from sglang_tokendance.srt.batch_reuse import BatchReuse, probe_limit
from sglang_tokendance.srt.hinted_kv import HintedKV
from sglang_tokendance.srt.kept_mirrors import KeptMirrors, is_kept
from sglang_tokendance.srt.kv_copy import PoolKeys, bytes_per_token, serving_rope_spec
from sglang_tokendance.srt.metrics import NO_METRICS, ForestMetrics, PrometheusForestMetrics, StorageCounts
from sglang_tokendance.srt.model import SUPPORTED_ARCHITECTURES, rotary_table
from sglang_tokendance.srt.output_registration import output_kv_tokens, output_segment_ids
from sglang_tokendance.srt.pool import RefCountedAllocator
from sglang_tokendance.srt.request import RequestOptions, RequestOptionsCache
from sglang_tokendance.srt.reuse import RequestReuse, is_lora, may_reuse
from sglang_tokendance.srt.storage import MasterStorage
from sglang_tokendance.srt.tree_slot_counts import TreeSlotCounts

logger = logging.getLogger(__name__)


class RequestFacts(Protocol):
    """What the scheduler knows of a request that the forest asks (srt/runtime.SchedulerRuntime)."""

    options: Callable[[object], RequestOptions]  # its TokenDance options, parsed once (srt/request)

    def group_key(self, req) -> Hashable | None:
        """The key of the round group SGLang admits it with (srt/policy; None: no round)."""

    def leads(self, req) -> bool:
        """Whether SGLang admits it as its round's leader (srt/policy)."""


@dataclass
class NoRounds:
    """Requests outside any round policy (a forest built without SGLang's scheduler)."""

    options: Callable[[object], RequestOptions] = field(default_factory=RequestOptionsCache)

    def group_key(self, req) -> Hashable | None:
        return None

    def leads(self, req) -> bool:
        return False


class SegmentForest(RadixCache):
    metrics: ForestMetrics = NO_METRICS  # replaced under --enable-metrics

    def __init__(self, params, keys: PoolKeys | None, args: TokenDanceArgs = TokenDanceArgs(), *, reuse: bool,
                 requests: RequestFacts | None = None, salt: bytes = b"", cost: PrefillCost | None = None,
                 probe_limit: int | None = None):
        """`args`: the server's TokenDance options; `keys`: the pool's RoPE (None: no segments are
        cached, a plain radix cache); `reuse`: the served model's forward can blend (srt/model);
        `cost`: chunks whose blending would not pay take SGLang's path (None: every match
        blends); `probe_limit`: the longest rest of a prompt a planned selection probes."""
        requests = requests or NoRounds()
        self.options = requests.options  # each request's TokenDance options, parsed once
        self.group_of = requests.group_key  # the key of the round group a request is admitted with (srt/policy)
        self.leads = requests.leads  # whether a request is admitted as its round's leader (srt/policy)
        self.keys = keys
        self.reuse = reuse and keys is not None
        self.salt = salt
        self.blend, self.rule = args.blend_options(), rule_named(args.selection)
        self.min_segment_tokens = args.min_segment_tokens
        self.chunk_rule = args.chunk_rule  # a registered answer's content chunks are cached too (None: off)
        self.sightings = Sightings() if args.exact_recurrence else None  # blocks to compute exactly where they recur
        self.next_use = NextUse() if args.eviction == "next-use" else None  # when rounds will read items again
        self.requests: dict[object, RequestReuse] = {}  # SGLang's Req -> its reuse, until released
        self.evicted_slots: Counter[str] = Counter()  # slots eviction freed: tree, kept_row, master
        allocator = params.token_to_kv_pool_allocator
        if args.mirror_storage and not isinstance(allocator, RefCountedAllocator):
            raise ValueError("mirror storage needs the reference-counted KV allocator (srt/pool.py), "
                             f"got {type(allocator).__name__}")
        self.storage = MasterStorage(keys, allocator, params.req_to_token_pool,
                                     lambda tokens: self.evict(EvictParams(num_tokens=tokens)), args.mirror_storage,
                                     args.diff_threshold)
        self.segments = self.storage.segments  # its Masters' table: planning and eviction read it
        self.zero_copy = self.storage.zero_copy
        self.reads = self.storage.reads  # the blended prefill reads Masters' slots at a shift (mirror)
        self.batch = BatchReuse(self, self.storage, allocator, params.req_to_token_pool, cost,
                                args.approximate_budget, args.planned_selection, probe_limit)
        self.slot_counts = TreeSlotCounts(allocator if self.zero_copy else None)
        self.kept = KeptMirrors(self, self.options, args.keep_rows, args.approximate_budget) \
            if self.zero_copy else None
        # clients' pin / retain / release hints on what finished requests leave cached
        self.hints = HintedKV(self, int(args.max_pinned_share * allocator.size))
        super().__init__(params)
        if self.page_size != 1:
            raise ValueError(f"the tokendance radix cache needs --page-size 1, got {self.page_size}")

    def init_metrics_collector(self) -> None:
        """SGLang calls this under --enable-metrics: our series take the cache's labels."""
        super().init_metrics_collector()
        self.metrics = PrometheusForestMetrics(self.metrics_collector.labels, self.segments, self.bytes_per_token(),
                                               self.storage_counts)

    @property
    def caches_segments(self) -> bool:
        return self.keys is not None and not self.disable

    # --- tree + segments lifecycle ---------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self.batch.reset()
        self.storage.clear()
        if self.sightings is not None:
            self.sightings.clear()
        if self.next_use is not None:
            self.next_use.clear()
        self.hints.clear()
        self.metrics.update_held()

    def checkpoint(self, req, *, up_to: int) -> None:
        state = self.requests.get(req)
        if state is None:
            super().checkpoint(req, up_to=up_to)
            return
        exact = min(up_to, state.first_reused)  # reused KV is approximate: keep it out
        if exact >= req.kv.cache_protected_len:  # (a row continuing its agent's kept Mirror publishes nothing)
            super().checkpoint(req, up_to=exact)  # the row now points at the tree's slots up to `exact`
        self.insert_segments(req, state, state.segments_until(exact, up_to))
        if req.finished():  # before SGLang releases the row's own slots
            if self.sightings is not None and state.can_reuse:
                self.sightings.record_prompt(state.namespace, req.origin_input_ids, state.unpublished_spans(exact))
            if state.options.register_output:
                self.register_output(req, state)
            if self.kept is not None and self.kept.keeps(state.options) and exact < up_to:
                state.kept = self.kept.keep_for_agent(req, state.options.agent, up_to)
        self.metrics.update_held()

    def on_release(self, req, *, checkpointed: bool) -> None:
        """SGLang released the request (finished, aborted or retracted): drop its state."""
        state = self.requests.pop(req, None)
        if self.next_use is not None and not self.disable:
            eviction.record_reads(self, req, state)
        super().on_release(req, checkpointed=checkpointed)
        options = self.options(req)
        if options.hints_what_it_leaves and req.finished() and not self.disable:  # (a retracted one comes back)
            self.hints.on_finished(options, *self.left_cached(req, state))
        if state is None:
            return
        self.storage.release(state, self.batch.release(state))
        self.metrics.update_held()

    def left_cached(self, req, state: RequestReuse | None) -> tuple[list, list]:
        """What a released request leaves cached: the last nodes of its tree path and of its kept
        row, and the Masters of its segments and of its row's reads (srt/hinted_kv)."""
        if state is None:
            return [req.last_node], []
        own = (self.segments.entries.get(state.key(span.hash)) for span in state.options.spans)
        return [req.last_node, state.kept], [entry for entry in own if entry is not None] + state.reading

    def insert_segments(self, req, state: RequestReuse, up_to: int) -> None:
        """Cache the request's shared segments whose exact KV is complete (end <= up_to)."""
        if not self.caches_segments:
            return
        ready = [span for span in state.uninserted if span.end <= up_to]
        if not ready:
            return
        state.uninserted = [span for span in state.uninserted if span.end > up_to]
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        for span in ready:
            superseded = self.storage.cache(state.key(span.hash), req.origin_input_ids[span.start:span.end], row,
                                            span.start, span.end - span.start, replace=state.leads,
                                            neighbours=state.neighbours(span))
            state.counts.round_master_tokens += superseded
        if state.leads:
            state.publish()

    def register_output(self, req, state: RequestReuse) -> None:
        """Cache a finished request's generated text as a segment (srt/output_registration).
        Where content chunks are on, an answer at least two chunks long is also cached as its
        chunks (`ChunkRule.message_chunks`), as a chat message holding the same text is cut:
        another agent quoting it in a user message finds it there."""
        if not self.caches_segments:
            return
        ids = output_segment_ids(req, self.min_segment_tokens)
        if ids is None:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        output_hash = segment_hash(ids, self.salt)
        start, with_kv = len(req.origin_input_ids), output_kv_tokens(req, len(ids))
        self.storage.cache(state.key(output_hash), ids, row, start, with_kv)
        chunks = [] if self.chunk_rule is None else self.chunk_rule.message_chunks(ids)
        if len(chunks) > 1:
            keys = [state.key(segment_hash(ids[a:b], self.salt)) for a, b in chunks]
            for i, (a, b) in enumerate(chunks):
                neighbours = (keys[i - 1] if i else None, keys[i + 1] if i + 1 < len(keys) else None)
                self.storage.cache(keys[i], ids[a:b], row, start + a, max(0, min(b, with_kv) - a),
                                   neighbours=neighbours)
        if self.sightings is not None:
            self.sightings.record_output(state.namespace, req.origin_input_ids, output_hash)

    def state_of(self, req) -> RequestReuse | None:
        """`req`'s reuse, made on its first look (None: a request that never reuses, LoRA)."""
        state = self.requests.get(req)
        if state is None:
            state = self.new_state(req)
            if state is not None:
                self.requests[req] = state
        return state

    def new_state(self, req) -> RequestReuse | None:
        """A reuse for `req`, not remembered (admission's looks use it)."""
        if is_lora(req):
            return None
        kept = is_kept(req.last_node)
        return RequestReuse.of(req, self.options(req), can_reuse=self.reuse and may_reuse(req),
                               agent_prefix=req.prefix_len if kept else 0,
                               kept_approximate=self.kept.approximate_positions(req.last_node) if kept else 0,
                               sightings=self.sightings, leads=self.reuse and self.leads(req), blend=self.blend)

    # --- SGLang's tree, with its slots counted, kept rows matched, segments evicted beside it ---

    def match_prefix(self, params: MatchPrefixParams):
        """SGLang's match; under mirror storage a request that reads kept rows takes its kept
        namespace's row instead when that covers more of its prompt (srt/kept_mirrors)."""
        result = super().match_prefix(params)
        return result if self.kept is None else self.kept.match(params, result)

    def _insert_helper(self, node, key, value, priority: int = 0, inserted_len: int = 0):
        matched, last = super()._insert_helper(node, key, value, priority, inserted_len)
        if matched < len(key):
            self.slot_counts.inserted(last)
        return matched, last

    def inc_lock_ref(self, node):
        opened = [] if self.disable else self.slot_counts.path_at(node, self.root_node, lock_ref=0)
        result = super().inc_lock_ref(node)
        self.slot_counts.locked(opened, 1)
        return result

    def dec_lock_ref(self, node, params=None):
        closing = [] if self.disable else self.slot_counts.path_at(node, self.root_node, lock_ref=1)
        result = super().dec_lock_ref(node, params)
        self.slot_counts.locked(closing, -1)
        return result

    def evict(self, params: EvictParams) -> EvictResult:
        """SGLang's leaf eviction with the segments in one order (srt/eviction.py)."""
        return eviction.evict(self, params)

    def evictable_size(self) -> int:
        """Slots eviction can free, each once: the tree's unlocked ones and the segments'.
        Mirror storage: slots held by unlocked tree nodes and unpinned Masters alone (a slot
        several of them hold, or a live row too, is counted once or not at all), so SGLang
        never admits a prefill on slots eviction cannot free."""
        self.hints.end_pins()
        if self.zero_copy:
            return self.token_to_kv_pool_allocator.refs.evictable_slots()
        return super().evictable_size() + self.segments.tokens

    def protected_size(self) -> int:
        """The tree's locked tokens. Under mirror storage SGLang's pool check (available +
        evictable + protected + every live row position past its tree prefix == total,
        run while busy under SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY) counts a row position
        that reads a Master as the request's own slot, once per reader: this counts the slots
        the tree and the Masters hold that eviction cannot free and the own slots a plan keeps
        aside, and takes those row positions off, so every slot is counted once. At
        quiescence it is the tree's."""
        self.hints.end_pins()
        if not self.zero_copy:
            return super().protected_size()
        refs = self.token_to_kv_pool_allocator.refs
        aside = self.batch.kept_aside()
        return refs.protected_slots() + aside - refs.read_slots()

    @property
    def pool(self):
        return self.token_to_kv_pool_allocator.get_kvcache()

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.pool)

    def stats(self) -> dict:
        """/server_info's view, with the pool's accounting: at quiescence every used slot
        belongs to the tree or to a segment (no leak)."""
        allocator = self.token_to_kv_pool_allocator
        return {**self.segments.stats(self.bytes_per_token()),
                "tree_tokens": self._tree_tokens(),
                "tree_evictable_tokens": super().evictable_size(), "tree_protected_tokens": super().protected_size(),
                "evictable_tokens": self.evictable_size(),
                "pool_tokens": allocator.size, "free_tokens": allocator.available_size(),
                "live_requests": len(self.requests), "agent_rows_kept": 0 if self.kept is None else self.kept.rows,
                **self.storage_counts()._asdict(),
                "segment_only_tokens": self.storage.segment_only_tokens(),
                "pinned_segments": sum(1 for e in self.segments.entries.values() if e.readers),
                **self.hints.stats(),
                **{f"evicted_{kind}_slots": self.evicted_slots[kind] for kind in ("tree", "kept_row", "master")},
                **({} if self.next_use is None else {"next_use_items": len(self.next_use.uses),
                                                     "next_use_periodic_items": self.next_use.periodic()})}

    def _tree_tokens(self) -> int:
        """Slots the tree holds, each once (mirror storage: several nodes may hold one)."""
        if self.zero_copy:
            return self.token_to_kv_pool_allocator.refs.tree_slots()
        return super().evictable_size() + super().protected_size()

    def storage_counts(self) -> StorageCounts:
        """Masters, live Mirror diffs and row references now (O(pool) under mirror storage)."""
        return self.storage.counts(list(self.requests.values()))


def build_forest(ctx: TreeCacheBuildContext, requests: RequestFacts) -> SegmentForest:
    """The `register_radix_cache_backend` factory (srt/runtime passes its scheduler's request
    options and round policy: each request's round group, and whether it leads it)."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("the tokendance radix cache supports full-attention models without HiCache")
    hf_config = ctx.model_config.hf_config
    args = TokenDanceArgs.from_env()
    model = getattr(getattr(ctx.tp_worker, "model_runner", None), "model", None)
    keys = PoolKeys(serving_rope_spec(hf_config, model))  # the config's RoPE, checked against the model's rotary_emb
    logger.info("TokenDance moves cached K with %s (%s)", keys.rope, "the model's rotary_emb agrees"
                if rotary_table(model) is not None else "the model has no rotary_emb table to check")
    architectures = list(hf_config.architectures or [])
    reuse = args.kv_enabled and len(architectures) == 1 and architectures[0] in SUPPORTED_ARCHITECTURES
    probes = args.recompute_ratio > 0 or args.approximate_budget is not None
    if reuse and probes and args.check_layer >= hf_config.num_hidden_layers:
        raise ValueError(f"--tokendance-check-layer {args.check_layer} must be below the model's "
                         f"{hf_config.num_hidden_layers} layers")
    backend = ctx.server_args.prefill_attention_backend or ctx.server_args.attention_backend
    cost = serving_cost(hf_config.num_hidden_layers, args.blend_options(), rule_named(args.selection).needs_attention,
                        backend) if args.cost_check else None
    return SegmentForest(ctx.params, keys, args, reuse=reuse, requests=requests, salt=model_salt_from_env(), cost=cost,
                         probe_limit=probe_limit(ctx.server_args.chunked_prefill_size, hf_config.num_hidden_layers,
                                                 args.check_layer))


def allocate_after_reads(alloc_token_slots, tree_cache, num_tokens: int, *args, **kwargs):
    """AROUND hook on SGLang's `alloc_token_slots` (mirror storage): a batch whose rows read
    Masters in place gets the slots they write only (BatchReuse.allocate_extend)."""
    if not isinstance(tree_cache, SegmentForest) or tree_cache.batch.reading is None:
        return alloc_token_slots(tree_cache, num_tokens, *args, **kwargs)
    return tree_cache.batch.allocate_extend(lambda n: alloc_token_slots(tree_cache, n, *args, **kwargs), num_tokens)


def restore_after_allocation(prepare_for_extend, batch, *args, **kwargs):
    """AROUND hook on ScheduleBatch.prepare_for_extend: the batch's chunks are planned, SGLang
    allocates their slots keeping the segments they will read, then (slots final, the forward
    next) the rows get their KV."""
    forest = batch.tree_cache
    if not isinstance(forest, SegmentForest):
        return prepare_for_extend(batch, *args, **kwargs)
    return forest.batch.restore(batch, lambda: prepare_for_extend(batch, *args, **kwargs))


def add_forest_stats(result, scheduler, *unused, **unused_kw):
    """AFTER hook on Scheduler.get_internal_state: /server_info shows the forest's counts."""
    if isinstance(scheduler.tree_cache, SegmentForest):
        result.internal_state["tokendance_forest"] = scheduler.tree_cache.stats()
    return result
