"""Masters and the rows that read them: where a segment's KV lives, and how a reusing row gets it.

The forest (srt/forest.py) owns one `MasterStorage` beside its radix tree. It holds the
SegmentTable (one Master per (namespace, content hash)) and every slot operation on the KV
pool that reuse needs (the pool keeps K rotated at each token's position, srt/kv_copy.PoolKeys):

* dense: a Master is a copy, K un-rotated, in slots of its own; a reading row gets the KV
  copied into its own slots, rotated to its positions.
* mirror (srt/pool.RefCountedAllocator): zero copy. A Master takes a reference
  on the writer's (or the tree's) slots; a reading row holds the Master's slots before its
  batch is allocated (`hold_reads`: a reference each, the Master pinned: never evicted while
  read), is allocated only one own slot per reused token it can keep (srt/batch_reuse), points its
  reused positions at the Master's slots (`read_in`), and keeps its own slots aside in its
  ChunkPlan until the forward has run (`settle_row`: each kept token's slot joins the row,
  the Mirror's diff; the rest are freed). The Master's K stays where its author rotated it
  (the slots' frames): readers read it at a shift (core/rope_attention).

Each request's state (srt/reuse.RequestReuse) records the Masters its row reads, so
`release` drops exactly its references and pins.

A round's leader (srt/policy) caches its blocks with `replace`: its exact KV, computed in round
context, supersedes the Master under the same key. A superseded Master that live rows still
read stays held, out of the table, until its last reader lets go (`retired`), so a slot is
never freed under a reader and the pool's accounting holds.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from sglang_tokendance.core.rope_attention import ShiftedReads
from sglang_tokendance.core.segment_table import SegmentEntry, SegmentTable
from sglang_tokendance.srt.kv_copy import PoolKeys, copy_kv
from sglang_tokendance.srt.metrics import StorageCounts
from sglang_tokendance.srt.reuse import ChunkPlan, RequestReuse


class MasterStorage:
    def __init__(self, keys: PoolKeys | None, allocator, req_to_token_pool, evict: Callable[[int], None],
                 zero_copy: bool = False, diff_threshold: float = 0.0):
        self.keys = keys  # None: nothing is cached (a forest without segments)
        self.zero_copy = keys is not None and zero_copy  # mirror storage: rows read Masters' slots in place
        # rows read Masters' slots where their author wrote them, at a shift (slot frames in the allocator)
        self.reads = ShiftedReads(keys.rope, allocator.frames) if self.zero_copy else None
        self.diff_threshold = diff_threshold  # recomputed KV this close to the Master's is not kept (mirror)
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.evict = evict  # the forest's eviction: free at least this many slots if it can
        self.segments = SegmentTable()
        self.retired: list[SegmentEntry] = []  # superseded Masters that live rows still read
        self._settled_free = 0  # own slots settle_row freed since SGLang's last admission pass

    @property
    def pool(self):
        return self.allocator.get_kvcache()

    # --- Masters ----------------------------------------------------------------------------

    def cache(self, key, ids: Sequence[int], row: torch.Tensor, start: int, length: int,
              replace: bool = False, neighbours: tuple = (None, None)) -> int:
        """Row positions [start, start + length) -- the KV of `ids`, exact -- become the
        Master under `key`. Mirror storage: the Master takes a reference on those slots
        themselves (the tree or the request keeps its own). Dense storage: they are copied into
        new slots; a full pool makes room the way a tree insert would find it: by evicting what
        the eviction policy ranks first (never a live request's KV: its prefix is locked and its
        own slots are not evictable); when even that is not enough, the segment is not cached.
        A duplicate is only counted, unless `replace`: then the new KV supersedes the cached
        Master (see the module's notes). `neighbours`: the keys of the segments beside it in
        its author's prompt. Returns the tokens of the Master it superseded."""
        old = self.segments.entries.get(key)
        if old is not None and not (replace and length > 0):
            self.segments.count_duplicate(key)
            return 0
        if old is not None:
            self._supersede(old)
        if self.zero_copy:
            if length > 0:
                slots = row[start:start + length].to(torch.int64, copy=True)
                self.allocator.hold(slots)
                self.segments.insert(key, slots, ids, start, neighbours)
            return 0 if old is None else len(old)
        slots = self._alloc_evicting(length) if length > 0 else None
        if slots is not None:
            positions = torch.arange(start, start + length, device=row.device)
            copy_kv(self.pool, row[start:start + length].to(torch.int64), slots, positions, self.keys.unrotated)
            self.segments.insert(key, slots, ids, start, neighbours)
        return 0 if old is None else len(old)

    def _supersede(self, entry: SegmentEntry) -> None:
        """Take a Master out of the table: freed now, or retired until its last reader goes."""
        self.segments.remove(entry, superseded=True)
        if entry.readers:
            self.retired.append(entry)
        else:
            self._free_master(entry.slots)

    def _alloc_evicting(self, length: int) -> torch.Tensor | None:
        """`length` new slots, evicting what the eviction policy ranks first when the pool is
        short (None: not enough even then). SGLang defers every free of its result processing
        to the end of a free group, where checkpoints cache segments: the evicted slots are
        made free first (the group's other frees with them, as its end would), so they can be
        allocated here."""
        if self.allocator.available_size() < length:
            self.evict(length - self.allocator.available_size())
            if self.allocator.free_group is not None:
                self.allocator.free_group_end()
                self.allocator.free_group_begin()
        return self.allocator.alloc(length)

    def drop(self, entry: SegmentEntry) -> None:
        """Remove a Master (evicted): its references dropped (mirror), or its slots freed (dense)."""
        self._free_master(self.segments.remove(entry))

    def clear(self) -> None:
        """Every Master gone (the cache reset: no live rows, so none is retired)."""
        for slots in self.segments.clear():
            self._free_master(slots)

    def _free_master(self, slots: torch.Tensor) -> None:
        if self.zero_copy:
            self.allocator.unhold(slots)
        else:
            self.allocator.free(slots)

    # --- rows reading Masters ---------------------------------------------------------------

    def hold_reads(self, plan: ChunkPlan) -> None:
        """Before the batch's slots are allocated (zero copy): the plan's row will read its
        Masters in place -- a reference on every slot it reads, every Master pinned, so the
        allocation's eviction cannot take them."""
        plan.request.read_slots[plan.prefix_len] = plan.master_slots()
        self.allocator.read(plan.request.read_slots[plan.prefix_len])
        for run in plan.runs:
            self._pin(run.master)
            plan.request.reading.append(run.master)

    def let_go(self, plan: ChunkPlan) -> None:
        """Undo `hold_reads`: the row reads none of the plan's Masters after all."""
        self.allocator.unread(plan.request.read_slots.pop(plan.prefix_len))
        for run in plan.runs:
            self._stop_reading(plan.request, run.master)

    def read_in(self, plans: list[ChunkPlan], copying: bool) -> None:
        """After the batch's allocation, the planned rows get their Masters' KV: zero copy,
        each row's reused positions (SGLang's padding slot until now, srt/batch_reuse) point at the
        Masters' slots it holds; dense storage, one copy for the whole batch, rotated to the
        readers' positions (`copying` False: nothing reads it, e.g. ratio 1)."""
        src, dst, positions = [], [], []
        for plan in plans:
            if not (self.zero_copy or copying) or not plan.runs:  # (a chunk that only resumes reads none)
                continue
            row = self.req_to_token_pool.req_to_token[plan.pool_index]
            if self.zero_copy:
                row[plan.positions(row.device)] = plan.request.read_slots[plan.prefix_len].to(row.dtype)
                continue
            src.append(plan.master_slots())
            dst += [row[run.start:run.end].to(torch.int64) for run in plan.runs]
            positions.append(plan.positions(row.device))
        if src:
            copy_kv(self.pool, torch.cat(src), torch.cat(dst), torch.cat(positions), self.keys.pooled)

    def read_at(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, masters: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` at one pool layer as a row reading them at `positions` sees them
        (K rotated there): Masters' slots (`masters`; dense storage keeps their K un-rotated) or
        a row's own (dense storage: K at those positions already). Mirror storage: every slot
        at its frame. (Copies: for scratch KV, srt/prompt_selection.py.)"""
        k, v = self.pool.get_key_buffer(layer)[slots], self.pool.get_value_buffer(layer)[slots]
        if self.zero_copy:
            return self.reads.shift_(k, self.reads.shifts(slots, positions)), v
        return (self.keys.pooled(k, positions).to(k.dtype) if masters else k), v

    def settle_row(self, plan: ChunkPlan, kept: torch.Tensor | None) -> torch.Tensor | None:
        """After the blended prefill (zero copy): the reused tokens it kept (`kept`, a mask
        over the plan's reused tokens; None: none) were computed into the row's first own
        slots, one each in run order (core/blend RequestRow.own), which the row takes -- but
        for those within the diff threshold of their Master, which read the Master like the
        others; the own slots left over are freed. A Master none of whose tokens the row still
        reads is unpinned. Returns the mask of the tokens that own a slot now (None: none, or
        dense storage)."""
        own, plan.own = plan.own, None
        if own is None:
            return None
        count = 0 if kept is None else int(kept.sum())
        held, mine = (None, own[:0]) if not count else (kept.nonzero().squeeze(1), own[:count])
        spare = own[count:]
        masters = plan.request.read_slots[plan.prefix_len]
        row = self.req_to_token_pool.req_to_token[plan.pool_index]
        positions = plan.positions(row.device)
        if count and self.diff_threshold > 0:
            close = self._within_threshold(mine, masters[held], positions[held])
            kept = kept.clone()
            kept[held[close]] = False
            spare, held, mine = torch.cat([spare, mine[close]]), held[~close], mine[~close]
        self.allocator.free(spare)
        self._settled_free += spare.numel()
        if held is None or not held.numel():
            return None
        row[positions[held]] = mine.to(row.dtype)
        self.allocator.unread(masters[held])  # the row's references
        plan.request.read_slots[plan.prefix_len] = masters[~kept]
        for run, part in zip(plan.runs, kept.split([len(run) for run in plan.runs])):
            if bool(part.all()):
                self._stop_reading(plan.request, run.master)
        return kept

    def freed_after_forwards(self) -> int:
        """Own slots `settle_row` freed since the last call: KV that came free while no request
        left SGLang's running batch (SGLang's admission waits for one to leave, srt/runtime)."""
        freed, self._settled_free = self._settled_free, 0
        return freed

    def _within_threshold(self, own: torch.Tensor, masters: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Of recomputed tokens (their own slots, the Master slots they read, their row
        positions): those whose K and V lie within the diff threshold of the Master's at every
        layer (relative L2 over heads and dims; the Master's K read at the row's positions)."""
        pool, shift = self.pool, self.reads.shifts(masters, positions)
        worst = torch.zeros(own.numel(), device=own.device)
        for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
            for buffer, turn in ((pool.get_key_buffer(layer), True), (pool.get_value_buffer(layer), False)):
                mine, theirs = buffer[own].float(), buffer[masters].float()  # indexing copies
                if turn:
                    theirs = self.reads.shift_(theirs, shift)
                gap = (mine - theirs).flatten(1).norm(dim=1) / mine.flatten(1).norm(dim=1).clamp_min(1e-12)
                worst = torch.maximum(worst, gap)
        return worst <= self.diff_threshold

    def revert(self, plan: ChunkPlan) -> torch.Tensor | None:
        """Undo the plan's reading before a forward that computes every token itself (or when
        none ran): each reused position gets a slot of the row's own -- those allocated for
        kept tokens, then new ones (evicting if it must; the frames recorded where SGLang's
        forward will write them) -- and drops its Master reference. Returns the row's slots
        at the reused positions (None: nothing was read)."""
        own, plan.own = plan.own, None
        if own is None:
            return None
        row = self.req_to_token_pool.req_to_token[plan.pool_index]
        where = plan.positions(row.device)
        missing = where.numel() - own.numel()
        if missing > 0:
            more = self._alloc_evicting(missing)
            if more is None:
                raise RuntimeError(f"Out of memory: {missing} KV slots are needed to compute reused tokens "
                                   "whose forward cannot blend")
            own = torch.cat([own, more.to(own.dtype)])
        self.allocator.free(own[where.numel():])
        own = own[:where.numel()]
        row[where] = own.to(row.dtype)
        self.allocator.frames.record(own, where)
        self.let_go(plan)
        return own

    def release(self, state: RequestReuse, plans: list[ChunkPlan]) -> None:
        """SGLang released the request and freed its row (the Master references in it): drop
        what the row's reading still holds -- own slots kept aside in unsettled `plans`, the
        read counts, the pins."""
        for plan in plans:
            if plan.own is not None:
                self.allocator.free(plan.own)
        for masters in state.read_slots.values():
            self.allocator.refs.unread(masters)
        state.read_slots.clear()
        for entry in state.reading:
            self._unpin(entry)
        state.reading.clear()

    def _pin(self, entry: SegmentEntry) -> None:
        entry.readers += 1
        self.allocator.refs.pin(entry.slots)

    def _unpin(self, entry: SegmentEntry) -> None:
        entry.readers -= 1
        self.allocator.refs.unpin(entry.slots)
        if not entry.readers and entry in self.retired:
            self.retired.remove(entry)
            self._free_master(entry.slots)

    def _stop_reading(self, state: RequestReuse, entry: SegmentEntry) -> None:
        state.reading.remove(entry)
        self._unpin(entry)

    # --- counts -----------------------------------------------------------------------------

    def master_tokens(self) -> int:
        """Slots Masters hold, each once (mirror storage: O(pool))."""
        return self.allocator.refs.master_slots() if self.zero_copy else self.segments.tokens

    def segment_only_tokens(self) -> int:
        """Slots held by Masters alone (dense storage: all of theirs)."""
        return self.allocator.refs.master_only_slots() if self.zero_copy else self.segments.tokens

    def counts(self, live: Sequence[RequestReuse]) -> StorageCounts:
        """Masters, live Mirror diffs and row references now."""
        return StorageCounts(self.master_tokens(), sum(s.counts.mirror_diff_tokens for s in live),
                             sum(s.shared_tokens for s in live))
