"""The segment-hash forest: SGLang's radix cache plus segment nodes keyed by content hash.

Registered as the radix-cache backend "tokendance" (our launcher makes it the default).
Private prefixes behave exactly like SGLang's Python RadixCache: this class inherits it
(through srt/shared_slot_tree.py, per-slot tree counts, and srt/kept_mirrors.py, agents' rows).
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

Reuse wraps SGLang's allocation of a batch's slots (`restore_segments`, an AROUND hook on
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

import heapq
import itertools
import logging
import time
from typing import Any, Callable, Hashable

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.radix_cache import TreeNode
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from sglang_tokendance.core.blend import BlendOptions
from sglang_tokendance.core.cost import PrefillCost, serving_cost
from sglang_tokendance.core.recurrence import Sightings
from sglang_tokendance.core.segment_table import SegmentEntry
from sglang_tokendance.core.segments import segment_hash
from sglang_tokendance.core.selection import SelectionRule, rule_named
from sglang_tokendance.served_model import model_salt_from_env
from sglang_tokendance.server_args import TokenDanceArgs
from sglang_tokendance.srt.kept_mirrors import KeptMirrors, is_kept
from sglang_tokendance.srt.kv_copy import PoolKeys, bytes_per_token, serving_rope_spec
from sglang_tokendance.srt.metrics import NO_METRICS, ForestMetrics, PrometheusForestMetrics, StorageCounts
from sglang_tokendance.srt.model import SUPPORTED_ARCHITECTURES, PoolKV, SGLangLayers
from sglang_tokendance.srt.output_registration import output_kv_tokens, output_segment_ids
from sglang_tokendance.srt.pool import RefCountedAllocator
from sglang_tokendance.srt.prompt_selection import needs_selection, select_prompt
from sglang_tokendance.srt.request import RequestOptions, RequestOptionsCache
from sglang_tokendance.srt.reuse import ChunkPlan, RequestReuse, is_lora, may_reuse
from sglang_tokendance.srt.storage import MasterStorage

logger = logging.getLogger(__name__)


class SegmentForest(KeptMirrors):
    metrics: ForestMetrics = NO_METRICS  # replaced under --enable-metrics

    def __init__(self, params, keys: PoolKeys | None, reuse: bool, salt: bytes = b"", zero_copy: bool = False,
                 blend: BlendOptions = BlendOptions(), rule: SelectionRule | None = None,
                 min_segment_tokens: int = 16, options: Callable[[object], RequestOptions] | None = None,
                 group_of: Callable[[object], Hashable | None] = lambda req: None,
                 leads: Callable[[object], bool] = lambda req: False, exact_recurrence: bool = True,
                 cost: PrefillCost | None = None, max_approximate: int | None = None, diff_threshold: float = 0.0,
                 planned_selection: bool = True, probe_limit: int | None = None, keep_rows: bool = True):
        self.options = options or RequestOptionsCache()  # each request's TokenDance options, parsed once
        self.group_of = group_of  # the key of the round group a request is admitted with (srt/policy)
        self.leads = leads  # whether a request is admitted as its round's leader (srt/policy)
        self.keys = keys  # the pool's RoPE; None: no segments are cached (a plain radix cache)
        self.reuse = reuse and keys is not None
        self.salt = salt
        self.blend, self.rule = blend, rule
        self.cost = cost  # chunks whose blending would not pay take SGLang's path (None: every match blends)
        self.max_approximate = max_approximate  # each request's fidelity budget (None: the ratio alone; kept rows too)
        self.planned_selection = planned_selection  # a chunked prompt's selection made once (srt/prompt_selection)
        self.probe_limit = probe_limit  # the longest rest of a prompt its probe covers in one step (None: any)
        self.keeps_unnamed = keep_rows  # mirror storage: unnamed requests' rows kept too (srt/kept_mirrors)
        self.min_segment_tokens = min_segment_tokens
        self.sightings = Sightings() if exact_recurrence else None  # blocks to compute exactly where they recur
        self.requests: dict[object, RequestReuse] = {}  # SGLang's Req -> its reuse, until released
        self.planned: dict[int, ChunkPlan] = {}  # req_pool_idx -> its plan for the coming forward
        self.wanted: set[int] = set()  # ids of the segments the batch being allocated will read (dense)
        # mirror storage: each extend length of the batch being allocated, with its plan where it reads
        self.reading: list[tuple[int, ChunkPlan | None]] | None = None
        self.late: list[ChunkPlan] = []  # those of its plans that hold their Masters since the batch was built
        self.storage = MasterStorage(keys, params.token_to_kv_pool_allocator, params.req_to_token_pool,
                                     lambda tokens: self.evict(EvictParams(num_tokens=tokens)), zero_copy,
                                     diff_threshold)
        self.segments = self.storage.segments  # its Masters' table: planning and eviction read it
        self.zero_copy = self.storage.zero_copy  # set first: SGLang's __init__ resets (counts)
        super().__init__(params)
        if self.page_size != 1:
            raise ValueError(f"the tokendance radix cache needs --page-size 1, got {self.page_size}")
        if self.zero_copy and not isinstance(self.token_to_kv_pool_allocator, RefCountedAllocator):
            raise ValueError("mirror storage needs the reference-counted KV allocator (srt/pool.py), "
                             f"got {type(self.token_to_kv_pool_allocator).__name__}")
        self.reads = self.storage.reads  # the blended prefill reads Masters' slots at a shift (mirror)

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
        for plan in self.planned.values():
            self.storage.revert(plan)
        self.planned.clear()
        self.storage.clear()
        if self.sightings is not None:
            self.sightings.clear()
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
            if self.keeps(state.options) and exact < up_to:
                self.keep_for_agent(req, state.options.agent, up_to)
        self.metrics.update_held()

    def on_release(self, req, *, checkpointed: bool) -> None:
        """SGLang released the request (finished, aborted or retracted): drop its state."""
        super().on_release(req, checkpointed=checkpointed)
        state = self.requests.pop(req, None)
        if state is None:
            return
        unsettled = [plan for plan in self.planned.values() if plan.request is state]
        for plan in unsettled:
            del self.planned[plan.pool_index]
        self.storage.release(state, unsettled)
        self.metrics.update_held()

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
                                            span.start, span.end - span.start, replace=state.leads)
            state.counts.round_master_tokens += superseded
        if state.leads:
            state.publish()

    def register_output(self, req, state: RequestReuse) -> None:
        """Cache a finished request's generated text as a segment (srt/output_registration)."""
        if not self.caches_segments:
            return
        ids = output_segment_ids(req, self.min_segment_tokens)
        if ids is None:
            return
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        output_hash = segment_hash(ids, self.salt)
        self.storage.cache(state.key(output_hash), ids, row, len(req.origin_input_ids), output_kv_tokens(req, len(ids)))
        if self.sightings is not None:
            self.sightings.record_output(state.namespace, req.origin_input_ids, output_hash)

    # --- reuse ------------------------------------------------------------------------------

    def restore_segments(self, batch, allocate: Callable[[], Any]) -> Any:
        """Plan every request's chunk once, let SGLang allocate the batch's slots (`allocate`;
        its result is returned), then give the planned rows their Masters' KV (srt/storage).
        Plans of a forward that never ran are undone first.

        Mirror storage: before the allocation each planned row holds the Masters it will read
        (pinned, never evicted), and the allocation (`allocate_extend`) gives the batch only
        the slots it will write -- its fresh tokens' and one per reused token its row can keep
        -- so a reader's KV is its fresh and kept tokens from its first forward on.
        Dense storage: SGLang allocates every extend token a slot; the Masters the plans read
        are evicted last, only when nothing else is left (SGLang's budget is unchanged: every
        segment stays evictable), and a run whose Master went even so is computed instead;
        then one copy for the batch (none at ratio 1, which never reads it)."""
        for plan in self.planned.values():
            self.storage.revert(plan)
        self.planned.clear()
        plans, blendable = [], self.caches_segments and all(map(blendable_request, batch.reqs))
        for req in batch.reqs:
            state = self._state_of(req) if blendable else self.requests.get(req)
            admitted = None if state is None else state.take_admitted()
            if not blendable:  # (never with a plan admitted: srt/runtime admits no such batch)
                self._give_up([admitted] if admitted else [])
            elif state is not None:
                plan = admitted or self._plan(req, state)
                if plan.forwards:
                    plans.append((req, plan))
        if self.zero_copy:
            result = self._allocate_reading(batch, [plan for _, plan in plans], allocate)
        else:
            self.wanted = {id(run.master) for _, plan in plans for run in plan.runs}
            try:
                result = allocate()
            finally:
                self.wanted = set()
        for req, plan in plans:
            if not self.zero_copy:
                plan.request.drop_evicted(plan, self.segments)
            if plan.forwards:
                plan.pool_index = req.kv.req_pool_idx
                self.planned[plan.pool_index] = plan
        self.storage.read_in(list(self.planned.values()), copying=not self.blend.keeps_everything)
        return result

    def _plan(self, req, state: RequestReuse) -> ChunkPlan:
        """The plan of `req`'s chunk [prefix_len, extend_end), counted (srt/reuse)."""
        plan = state.plan_chunk(self.segments, req.prefix_len, req.extend_end, self.group_of(req), self.cost,
                                self.max_approximate, self._plans_ahead(req))
        self.metrics.count_restore(plan.hits, plan.misses)
        if plan.fell_back:
            self.metrics.count_fallback(plan.fell_back)
        return plan

    def admit(self, req) -> int:
        """SGLang's admission committed `req`'s chunk [prefix_len, extend_end) to the batch it
        is building (mirror storage, srt/runtime): the chunk is planned now, once (the batch's
        `restore_segments` takes this plan), and its row holds the Masters it will read --
        pinned, so admitting the next requests no longer counts their slots evictable.
        Returns the slots SGLang reserved that the row will not allocate: its reused tokens
        but those it can keep."""
        state = self._state_of(req) if self.zero_copy and self.caches_segments else None
        if state is None or not state.can_reuse:
            return 0
        plan = state.admitted = self._plan(req, state)
        if not plan.runs:
            return 0
        self.storage.hold_reads(plan)
        return plan.reused_tokens - self._own_slots(plan)

    def spared_slots(self, req) -> int:
        """What SGLang's admission check of `req` (its whole remaining prompt) asks for beyond
        what its row would take if admitted now (mirror storage): the reused tokens it would
        not keep, less the slots its Masters would stop being evictable (held: `admit`); 0
        for a request that would read none. A look: nothing is counted or kept."""
        state = (self.requests.get(req) or self._new_state(req)) if self.zero_copy and self.caches_segments else None
        if state is None or not state.can_reuse:
            return 0
        plan = state.would_read(self.segments, req.prefix_len, len(req.origin_input_ids), self.group_of(req),
                                self.cost, self.max_approximate, self._plans_ahead(req))
        if not plan.runs:
            return 0
        return plan.reused_tokens - plan.own_slots(self.blend) - self.token_to_kv_pool_allocator.refs.evictable_among(
            plan.master_slots())

    def reads_admitted(self, req) -> bool:
        """Whether `req` was admitted to the batch being built holding Masters (`admit`)."""
        state = self.requests.get(req)
        return state is not None and state.admitted is not None and bool(state.admitted.runs)

    def _allocate_reading(self, batch, plans: list[ChunkPlan], allocate: Callable[[], Any]) -> Any:
        """Mirror storage: SGLang's allocation of `batch` with the planned rows holding their
        Masters (since their admission, or from now on; `allocate_extend` lays the slots out).
        Rows whose allocation did not come through `allocate_extend` (never expected) read
        nothing."""
        reading = [plan for plan in plans if plan.runs]
        self.late = [plan for plan in reading if plan.prefix_len not in plan.request.read_slots]
        for plan in self.late:  # not admitted holding them (a continuing chunk): SGLang charged its whole extend
            self.storage.hold_reads(plan)
        by_req = {id(plan.request.req): plan for plan in reading}
        self.reading = [(req.extend_end - req.prefix_len, by_req.get(id(req))) for req in batch.reqs] \
            if reading else None
        try:
            result = allocate()
        except BaseException:
            self._give_up(reading)
            raise
        finally:
            laid_out, self.reading, self.late = self.reading is None, None, []
        if not laid_out:
            self._give_up(reading)
        return result

    def allocate_extend(self, allocate: Callable[[int], torch.Tensor], num_tokens: int) -> torch.Tensor:
        """SGLang allocating the `num_tokens` extend slots of the batch `restore_segments` is
        building (`allocate(n)`: its allocation of n slots, evicting as it must): the reused
        positions of rows holding Masters get SGLang's padding slot 0 (the forest points them
        at the Masters once the rows are written: nothing of the forward's own writes reaches a
        Master, and no frame is recorded on one), and each such row gets its own slots for the
        tokens it can keep (`ChunkPlan.own`). Where even that would not fit (the Masters pinned,
        so not evictable), the rows that hold their Masters only since the batch was built give
        their reads up first (SGLang's admission charged them their whole extend, and counted
        their Masters evictable), then, if it still would not fit, every row, and SGLang
        allocates as it would."""
        reading, self.reading = self.reading, None
        if reading is None or sum(n for n, _ in reading) != num_tokens:
            self.reading = reading  # not the extend allocation of the batch being built
            return allocate(num_tokens)
        plans, allocator = [plan for _, plan in reading if plan is not None], self.token_to_kv_pool_allocator
        for tier in (self.late, plans):
            shared, own = self._extend_layout(reading, num_tokens)
            fresh = num_tokens - int(shared.sum())
            if fresh + sum(n for _, n in own) <= allocator.available_size() + self.evictable_size():
                break
            self._give_up(tier)
        else:
            return allocate(num_tokens)
        slots = allocate(fresh + sum(n for _, n in own))
        out = torch.zeros(num_tokens, dtype=slots.dtype, device=slots.device)
        out[~shared.to(slots.device)] = slots[:fresh]
        for (plan, _), mine in zip(own, slots[fresh:].split([n for _, n in own])):
            plan.own = mine.to(torch.int64)
        return out

    def _extend_layout(self, reading: list[tuple[int, ChunkPlan | None]], num_tokens: int
                       ) -> tuple[torch.Tensor, list[tuple[ChunkPlan, int]]]:
        """Of the batch's `num_tokens` extend positions, those its rows read from Masters, and
        the own slots each row that reads needs."""
        shared, own, at = torch.zeros(num_tokens, dtype=torch.bool), [], 0
        for extend_len, plan in reading:
            if plan is not None and plan.runs:
                shared[at + plan.positions(shared.device) - plan.prefix_len] = True
                own.append((plan, self._own_slots(plan)))
            at += extend_len
        return shared, own

    def _own_slots(self, plan: ChunkPlan) -> int:
        """The own slots `plan`'s row needs for the reused tokens it can keep (srt/reuse
        `ChunkPlan.own_slots`): a chunk that will choose for the rest of its prompt at its
        forward (planned selection) may keep up to the whole rest's share in it."""
        if not self._chooses_ahead(plan):
            return plan.own_slots(self.blend)
        end, prompt_len = plan.prefix_len + plan.extend_len, len(plan.request.req.origin_input_ids)
        return plan.own_slots(self.blend, plan.runs + plan.request.runs_in(self.segments, end, prompt_len).runs)

    def _give_up(self, plans: list[ChunkPlan]) -> None:
        """The rows of `plans` read no Master after all: their reused tokens are computed."""
        for plan in plans:
            if plan.request.read_slots.get(plan.prefix_len) is None:
                continue
            if plan.own is not None:
                self.token_to_kv_pool_allocator.free(plan.own)
                plan.own = None
            self.storage.let_go(plan)
            plan.request.compute_instead(plan, [])

    def _state_of(self, req) -> RequestReuse | None:
        state = self.requests.get(req)
        if state is None:
            state = self._new_state(req)
            if state is not None:
                self.requests[req] = state
        return state

    def _new_state(self, req) -> RequestReuse | None:
        if is_lora(req):
            return None
        kept = is_kept(req.last_node)
        return RequestReuse.of(req, self.options(req), can_reuse=self.reuse and may_reuse(req),
                               agent_prefix=req.prefix_len if kept else 0,
                               kept_approximate=self.approximate_positions(req.last_node) if kept else 0,
                               sightings=self.sightings, leads=self.reuse and self.leads(req), blend=self.blend)

    def take_plans(self, forward_batch, blendable: bool, attention) -> list[ChunkPlan | None] | None:
        """The plans of an extend batch, in batch order, or None when no request reuses (then
        SGLang's forward runs). A batch the blended prefill cannot serve (`blendable` False)
        runs SGLang's forward too: every reused position gets its own slot back, its tokens
        count as recomputed, and the forward's attention backend (`attention`) builds its
        metadata again on the rows as they are now. A plan whose chunk is not the batch's
        (never expected: the batch was planned as SGLang allocated it) is refused: no forward
        could give the reused positions outside the batch's chunk their KV."""
        if not self.planned:  # the common case: nothing restored for this batch
            return None
        plans, at, in_full = [], 0, []
        for pool_index, prefix, extend in zip(forward_batch.req_pool_indices_cpu.tolist(),
                                              forward_batch.extend_prefix_lens_cpu,
                                              forward_batch.extend_seq_lens_cpu):
            plan = self.planned.pop(pool_index, None)
            if plan is not None and (plan.prefix_len, plan.extend_len) != (prefix, extend):
                raise RuntimeError(f"TokenDance planned the chunk [{plan.prefix_len}, +{plan.extend_len}) of a "
                                   f"request whose forward computes [{prefix}, +{extend})")
            if plan is not None and not blendable:  # (never expected: restore_segments plans no such batch)
                in_full.append((plan, at))
                plan = None
            plans.append(plan)
            at += extend
        for plan in self.planned.values():  # not in this forward (never expected)
            self.storage.revert(plan)
        self.planned.clear()
        if in_full:
            self._compute_in_full(in_full, forward_batch, attention)
        return plans if any(plans) else None

    def _plans_ahead(self, req) -> bool:
        """Whether `req`'s chunk may choose for the rest of its prompt (planned selection): its
        probe runs the check layers over that rest in one step, with their scratch KV outside
        SGLang's pool, so a rest longer than `probe_limit` (as much work as one prefill chunk
        through every layer) selects chunk by chunk instead."""
        rest = len(req.origin_input_ids) - req.prefix_len
        return self.planned_selection and (self.probe_limit is None or rest <= self.probe_limit)

    def _chooses_ahead(self, plan: ChunkPlan) -> bool:
        """Whether `plan`'s chunk chooses for the rest of its prompt at its forward."""
        return self._plans_ahead(plan.request.req) and needs_selection(plan, self.blend)

    def select_prompts(self, plans: list[ChunkPlan], layers: SGLangLayers, pool: PoolKV) -> None:
        """Planned selection (srt/prompt_selection.py): each chunk of the forward that starts its
        chunked prompt's blending chooses the recomputed tokens of the whole prompt."""
        for plan in plans:
            if self._chooses_ahead(plan):
                row = self.req_to_token_pool.req_to_token[plan.pool_index]
                plan.request.selection = select_prompt(plan, self.segments, self.storage, layers, pool, row,
                                                       self.blend, self.rule)

    def settle(self, plans: list[ChunkPlan], kept: torch.Tensor | None, adopted: torch.Tensor | None) -> None:
        """After the blended prefill of `plans` (the batch's reusing requests, in batch order):
        `kept` masks the reused tokens it recomputed, `adopted` those that took their round
        group's choice (both over the plans' reused tokens in order; None: none). Zero copy:
        a kept token's own slot goes back into its row (the Mirror's diff), the others' own
        slots are freed, and a Master none of whose tokens a row still reads is unpinned.
        Then each request's counts; one host sync for the batch."""
        if kept is None:  # ratio 0: nothing recomputed
            for plan in plans:
                self.storage.settle_row(plan, None)
                self._record_recomputed(plan, 0)
            return
        sizes = [plan.reused_tokens for plan in plans]
        masks = kept.split(sizes)
        adopted = adopted if adopted is not None else torch.zeros_like(kept)
        stored = [self.storage.settle_row(plan, mask) for plan, mask in zip(plans, masks)]
        none = torch.zeros((), dtype=torch.int64, device=kept.device)
        counts = torch.stack([torch.stack([mask.sum(), took.sum(), none if own is None else own.sum()])
                              for mask, took, own in zip(masks, adopted.split(sizes), stored)]).tolist()
        for plan, (recomputed, adopted_tokens, own) in zip(plans, counts):
            self._record_recomputed(plan, recomputed, adopted_tokens, own)

    def _compute_in_full(self, plans: list[tuple[ChunkPlan, int]], forward_batch, attention) -> None:
        """SGLang's forward computes the plans' reused tokens, each into its own slot (mirror
        storage: the slots the forward writes, `forward_batch.out_cache_loc` from each plan's
        `at` on, get them, and the attention metadata the backend built on the rows' reads
        before this forward is built again on their own slots)."""
        reverted = False
        for plan, at in plans:
            own = self.storage.revert(plan)
            if own is not None:
                where = plan.positions(own.device) - plan.prefix_len + at
                forward_batch.out_cache_loc[where.to(forward_batch.out_cache_loc.device)] = own.to(
                    forward_batch.out_cache_loc.device, forward_batch.out_cache_loc.dtype)
                reverted = True
            self._record_recomputed(plan, plan.reused_tokens)
        if reverted:
            attention.init_forward_metadata(forward_batch)

    def _record_recomputed(self, plan: ChunkPlan, recomputed: int, adopted: int = 0, own: int | None = None) -> None:
        """After the forward: `recomputed` of the plan's restored tokens were computed again,
        `adopted` of them skipped the probe. Zero copy: `own` of the recomputed hold own slots
        (`settle_row`; the rest were within the diff threshold; None: all); dense storage:
        every reused position holds its own slot."""
        if not self.zero_copy:
            own = plan.reused_tokens
        elif own is None:
            own = recomputed
        within = recomputed - own if self.zero_copy else 0
        plan.request.record_recomputed(plan, recomputed, own, adopted, within)
        self.metrics.count_reuse(plan.reused_tokens - recomputed, recomputed, own)
        self.metrics.update_held()

    # --- one eviction order over tree leaves and segments -----------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """SGLang's leaf eviction with the segments in the same heap: each step frees the item
        the eviction strategy ranks first, leaf or segment (O(log n) per item), until enough
        tokens are free or nothing evictable is left. Segments the batch being allocated will
        read (`restore_segments`) come after everything else; under mirror storage, so does an
        item none of whose slots it alone holds (a leaf whose slots a Master also holds, or the
        Master of a cached prefix): evicting it frees nothing unless its co-owner goes too."""
        if self.disable:
            return EvictResult()
        start_time = time.perf_counter()
        order = itertools.count()  # ties never compare nodes
        priority = self.eviction_strategy.get_priority

        def entry(item, wanted: bool = False) -> tuple:
            return wanted, self._frees_nothing(item), priority(item), next(order), item

        heap = [entry(n) for n in self.evictable_leaves]
        heap += [entry(e, id(e) in self.wanted) for e in self.segments.entries.values() if not e.readers]
        heapq.heapify(heap)
        evicted = 0
        while evicted < params.num_tokens and heap:
            wanted, nothing, *_, item = heapq.heappop(heap)
            if not nothing and self._frees_nothing(item):  # a co-owner's references changed since
                heapq.heappush(heap, entry(item, wanted))
                continue
            if isinstance(item, SegmentEntry):
                evicted += self._freed_by(lambda: self.storage.drop(item), len(item))
                continue
            self.leaves_tree(item)
            evicted += self._freed_by(lambda: self.token_to_kv_pool_allocator.free_segment(item.value, start_pos=0),
                                      len(item.value))
            self._delete_leaf(item)
            if len(item.parent.children) == 0 and item.parent.lock_ref == 0:
                heapq.heappush(heap, entry(item.parent))
            self.kv_events.record_remove(item)
        self.update_eviction_metrics(evicted, start_time)
        self.metrics.update_held()
        return EvictResult(num_tokens_evicted=evicted)

    def _frees_nothing(self, item: TreeNode | SegmentEntry) -> bool:
        """Under mirror storage: every slot of `item` has another owner (evicting it alone
        frees no slot). Dense storage: never."""
        if not self.zero_copy:
            return False
        slots = item.slots if isinstance(item, SegmentEntry) else item.value
        return not bool((self.token_to_kv_pool_allocator.refs.refs[slots] == 1).any())

    def _freed_by(self, release: Callable[[], None], tokens: int) -> int:
        """Slots that `release` (dropping an evicted item's `tokens` references) frees, now or
        when SGLang's free group ends: all of them under dense storage; under mirror storage a
        slot another owner holds stays."""
        if not self.zero_copy:
            release()
            return tokens
        before = self.token_to_kv_pool_allocator.released
        release()
        return self.token_to_kv_pool_allocator.released - before

    def evictable_size(self) -> int:
        """Slots eviction can free, each once: the tree's unlocked ones and the segments'.
        Mirror storage: slots held by unlocked tree nodes and unpinned Masters alone (a slot
        several of them hold, or a live row too, is counted once or not at all), so SGLang
        never admits a prefill on slots eviction cannot free."""
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
        if not self.zero_copy:
            return super().protected_size()
        refs = self.token_to_kv_pool_allocator.refs
        aside = sum(plan.own.numel() for plan in self.planned.values() if plan.own is not None)
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
                "live_requests": len(self.requests), "agent_rows_kept": self.kept_rows,
                **self.storage_counts()._asdict(),
                "segment_only_tokens": self.storage.segment_only_tokens(),
                "pinned_segments": sum(1 for e in self.segments.entries.values() if e.readers)}

    def _tree_tokens(self) -> int:
        """Slots the tree holds, each once (mirror storage: several nodes may hold one)."""
        if self.zero_copy:
            return self.token_to_kv_pool_allocator.refs.tree_slots()
        return super().evictable_size() + super().protected_size()

    def storage_counts(self) -> StorageCounts:
        """Masters, live Mirror diffs and row references now (O(pool) under mirror storage)."""
        return self.storage.counts(list(self.requests.values()))


def build_forest(ctx: TreeCacheBuildContext, options: Callable[[object], RequestOptions],
                 group_of: Callable[[object], Hashable | None], leads: Callable[[object], bool]) -> SegmentForest:
    """The `register_radix_cache_backend` factory (srt/runtime binds the request options and
    the round policy of its scheduler: each request's round group, and whether it leads it)."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("the tokendance radix cache supports full-attention models without HiCache")
    hf_config = ctx.model_config.hf_config
    args = TokenDanceArgs.from_env()
    keys = PoolKeys(serving_rope_spec(hf_config))  # the launcher checked the RoPE
    architectures = list(hf_config.architectures or [])
    reuse = args.kv_enabled and len(architectures) == 1 and architectures[0] in SUPPORTED_ARCHITECTURES
    probes = args.recompute_ratio > 0 or args.approximate_budget is not None
    if reuse and probes and args.check_layer >= hf_config.num_hidden_layers:
        raise ValueError(f"--tokendance-check-layer {args.check_layer} must be below the model's "
                         f"{hf_config.num_hidden_layers} layers")
    blend, rule = args.blend_options(), rule_named(args.selection)
    backend = ctx.server_args.prefill_attention_backend or ctx.server_args.attention_backend
    cost = serving_cost(hf_config.num_hidden_layers, blend, rule.needs_attention, backend) \
        if args.cost_check else None
    return SegmentForest(ctx.params, keys, reuse=reuse, salt=model_salt_from_env(), zero_copy=args.mirror_storage,
                         blend=blend, rule=rule,
                         min_segment_tokens=args.min_segment_tokens, options=options, group_of=group_of, leads=leads,
                         exact_recurrence=args.exact_recurrence, cost=cost,
                         max_approximate=args.approximate_budget, diff_threshold=args.diff_threshold,
                         planned_selection=args.planned_selection,
                         probe_limit=probe_limit(ctx.server_args.chunked_prefill_size, hf_config.num_hidden_layers,
                                                 blend.check_layer),
                         keep_rows=args.keep_rows)


PROBE_FLOOR_TOKENS = 8192  # the chunk a planned probe may always cost, however small SGLang's chunks


def probe_limit(chunked_prefill_size: int | None, num_layers: int, check_layer: int) -> int | None:
    """The longest rest of a prompt a planned selection probes: its layers 0..check_layer over
    that rest cost at most one prefill chunk through every layer (at least PROBE_FLOOR_TOKENS:
    small chunks still plan prompts of ordinary length), and their scratch KV holds at most that
    chunk's KV (None: no chunked prefill, so no chunk ever plans ahead)."""
    if not chunked_prefill_size or chunked_prefill_size < 0:
        return None
    return max(chunked_prefill_size, PROBE_FLOOR_TOKENS) * num_layers // (check_layer + 1)


def blendable_request(req) -> bool:
    """Whether the blended prefill can serve a batch holding `req` (srt/forward_hook.blendable,
    known while SGLang builds the batch): it brings no input embeddings and wants no hidden
    states (SGLang's server-wide hidden-state modes and speculative decoding, which capture
    them in every forward, are refused at launch)."""
    return req.input_embeds is None and not req.return_hidden_states


def allocate_after_reads(alloc_token_slots, tree_cache, num_tokens: int, *args, **kwargs):
    """AROUND hook on SGLang's `alloc_token_slots` (mirror storage): a batch whose rows read
    Masters in place gets the slots they write only (SegmentForest.allocate_extend)."""
    if not isinstance(tree_cache, SegmentForest) or tree_cache.reading is None:
        return alloc_token_slots(tree_cache, num_tokens, *args, **kwargs)
    return tree_cache.allocate_extend(lambda n: alloc_token_slots(tree_cache, n, *args, **kwargs), num_tokens)


def restore_after_allocation(prepare_for_extend, batch, *args, **kwargs):
    """AROUND hook on ScheduleBatch.prepare_for_extend: the batch's chunks are planned, SGLang
    allocates their slots keeping the segments they will read, then (slots final, the forward
    next) the rows get their KV."""
    forest = batch.tree_cache
    if not isinstance(forest, SegmentForest):
        return prepare_for_extend(batch, *args, **kwargs)
    return forest.restore_segments(batch, lambda: prepare_for_extend(batch, *args, **kwargs))


def add_forest_stats(result, scheduler, *unused, **unused_kw):
    """AFTER hook on Scheduler.get_internal_state: /server_info shows the forest's counts."""
    if isinstance(scheduler.tree_cache, SegmentForest):
        result.internal_state["tokendance_forest"] = scheduler.tree_cache.stats()
    return result
