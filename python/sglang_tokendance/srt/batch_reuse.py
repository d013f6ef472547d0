"""The reuse of the batch SGLang is building, then forwarding: each reading request's chunk plan.

A reusing request's chunk is planned once (srt/reuse.py, core/plan.py): when SGLang's admission
commits it (`admit`, mirror storage) or when the batch allocates its slots (`restore`, an
AROUND hook on ScheduleBatch.prepare_for_extend). SGLang then allocates the batch's slots
(`allocate_extend` under mirror storage: the rows' fresh tokens and the reused ones they can
keep; dense storage: every extend token, the Masters the plans read evicted last), the rows get
their Masters' KV (srt/storage), the model forward takes the plans (`take_plans`, a chunked
prompt's first blended chunk choosing for the whole prompt: `select_prompts`) and hands them
back after the blended prefill (`settle`). Plans live here from the batch's allocation to its
forward; a request's state across its chunks is its RequestReuse (the forest's `requests`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from sglang_tokendance.core.cost import PrefillCost
from sglang_tokendance.srt.model import PoolKV, SGLangLayers
from sglang_tokendance.srt.prompt_selection import needs_selection, select_prompt
from sglang_tokendance.srt.reuse import ChunkPlan, RequestReuse
from sglang_tokendance.srt.storage import MasterStorage

if TYPE_CHECKING:
    from sglang_tokendance.srt.forest import SegmentForest

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


class BatchReuse:
    def __init__(self, forest: SegmentForest, storage: MasterStorage, allocator, req_to_token_pool,
                 cost: PrefillCost | None = None, max_approximate: int | None = None,
                 planned_selection: bool = True, probe_limit: int | None = None):
        self.forest = forest  # the requests' states, the blend options, the metrics, the tree's evictable size
        self.storage, self.segments, self.zero_copy = storage, storage.segments, storage.zero_copy
        self.allocator, self.req_to_token_pool = allocator, req_to_token_pool
        self.cost = cost  # chunks whose blending would not pay take SGLang's path (None: every match blends)
        self.max_approximate = max_approximate  # each request's fidelity budget (None: the ratio alone)
        self.planned_selection = planned_selection  # a chunked prompt's selection made once (srt/prompt_selection)
        self.probe_limit = probe_limit  # the longest rest of a prompt its probe covers in one step (None: any)
        self.planned: dict[int, ChunkPlan] = {}  # req_pool_idx -> its plan for the coming forward
        self.wanted: set[int] = set()  # ids of the segments the batch being allocated will read (dense)
        # mirror storage: each extend length of the batch being allocated, with its plan where it reads
        self.reading: list[tuple[int, ChunkPlan | None]] | None = None
        self.late: list[ChunkPlan] = []  # those of its plans that hold their Masters since the batch was built

    def reset(self) -> None:
        """The cache was flushed: plans of a forward that never ran are undone."""
        for plan in self.planned.values():
            self.storage.revert(plan)
        self.planned.clear()

    def release(self, state: RequestReuse) -> list[ChunkPlan]:
        """SGLang released the request of `state`: its plans that no forward settled."""
        unsettled = [plan for plan in self.planned.values() if plan.request is state]
        for plan in unsettled:
            del self.planned[plan.pool_index]
        return unsettled

    def kept_aside(self) -> int:
        """Own slots the planned rows hold for the reused tokens they will keep (mirror storage)."""
        return sum(plan.own.numel() for plan in self.planned.values() if plan.own is not None)

    def restore(self, batch, allocate: Callable[[], Any]) -> Any:
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
        self.reset()
        plans, blendable = [], self.forest.caches_segments and all(map(blendable_request, batch.reqs))
        for req in batch.reqs:
            state = self.forest.state_of(req) if blendable else self.forest.requests.get(req)
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
        self.storage.read_in(list(self.planned.values()), copying=not self.forest.blend.keeps_everything)
        return result

    def _plan(self, req, state: RequestReuse) -> ChunkPlan:
        """The plan of `req`'s chunk [prefix_len, extend_end), counted (srt/reuse)."""
        group = self.forest.group_of(req)
        plan = state.plan_chunk(self.segments, req.prefix_len, req.extend_end, group, self.cost,
                                self.max_approximate, self._plans_ahead(req))
        if state.matched is None:  # its first chunk: the node its prefix matched is what it read of the tree
            state.matched = req.last_node
        state.round = group if group is not None else state.round
        self.forest.metrics.count_restore(plan.hits, plan.misses)
        if plan.fell_back:
            self.forest.metrics.count_fallback(plan.fell_back)
        return plan

    def admit(self, req) -> int:
        """SGLang's admission committed `req`'s chunk [prefix_len, extend_end) to the batch it
        is building (mirror storage, srt/runtime): the chunk is planned now, once (the batch's
        `restore` takes this plan), and its row holds the Masters it will read --
        pinned, so admitting the next requests no longer counts their slots evictable.
        Returns the slots SGLang reserved that the row will not allocate: its reused tokens
        but those it can keep."""
        state = self.forest.state_of(req) if self.zero_copy and self.forest.caches_segments else None
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
        if not (self.zero_copy and self.forest.caches_segments):
            return 0
        state = self.forest.requests.get(req) or self.forest.new_state(req)
        if state is None or not state.can_reuse:
            return 0
        plan = state.would_read(self.segments, req.prefix_len, len(req.origin_input_ids), self.forest.group_of(req),
                                self.cost, self.max_approximate, self._plans_ahead(req))
        if not plan.runs:
            return 0
        return plan.reused_tokens - plan.own_slots(self.forest.blend) - self.allocator.refs.evictable_among(
            plan.master_slots())

    def reads_admitted(self, req) -> bool:
        """Whether `req` was admitted to the batch being built holding Masters (`admit`)."""
        state = self.forest.requests.get(req)
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
        """SGLang allocating the `num_tokens` extend slots of the batch `restore` is
        building (`allocate(n)`: its allocation of n slots, evicting as it must): the reused
        positions of rows holding Masters get SGLang's padding slot 0 (`restore` points them
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
        plans, allocator = [plan for _, plan in reading if plan is not None], self.allocator
        for tier in (self.late, plans):
            shared, own = self._extend_layout(reading, num_tokens)
            fresh = num_tokens - int(shared.sum())
            if fresh + sum(n for _, n in own) <= allocator.available_size() + self.forest.evictable_size():
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
            return plan.own_slots(self.forest.blend)
        end, prompt_len = plan.prefix_len + plan.extend_len, len(plan.request.req.origin_input_ids)
        return plan.own_slots(self.forest.blend, plan.runs + plan.request.runs_in(self.segments, end, prompt_len).runs)

    def _give_up(self, plans: list[ChunkPlan]) -> None:
        """The rows of `plans` read no Master after all: their reused tokens are computed."""
        for plan in plans:
            if plan.request.read_slots.get(plan.prefix_len) is None:
                continue
            if plan.own is not None:
                self.allocator.free(plan.own)
                plan.own = None
            self.storage.let_go(plan)
            plan.request.compute_instead(plan, [])

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
            if plan is not None and not blendable:  # (never expected: `restore` plans no such batch)
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
        return self._plans_ahead(plan.request.req) and needs_selection(plan, self.forest.blend)

    def select_prompts(self, plans: list[ChunkPlan], layers: SGLangLayers, pool: PoolKV) -> None:
        """Planned selection (srt/prompt_selection.py): each chunk of the forward that starts its
        chunked prompt's blending chooses the recomputed tokens of the whole prompt."""
        for plan in plans:
            if self._chooses_ahead(plan):
                row = self.req_to_token_pool.req_to_token[plan.pool_index]
                plan.request.selection = select_prompt(plan, self.segments, self.storage, layers, pool, row,
                                                       self.forest.blend, self.forest.rule)

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
        self.forest.metrics.count_reuse(plan.reused_tokens - recomputed, recomputed, own)
        self.forest.metrics.update_held()

