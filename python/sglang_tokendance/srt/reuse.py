"""A request's reuse, as one object from planning through the forward to the tree.

`RequestReuse` lives from a request's first prefill chunk until SGLang releases it (finish,
abort, retract: `SegmentForest.on_release`), keyed by the Req object itself, so clients that
reuse request ids never see each other's state. For every extend forward (one prefill chunk
under `--chunked-prefill-size`, or the whole prompt) it makes a `ChunkPlan`: which runs of the
chunk's tokens hit which cached segments (a segment that straddles chunks is reused piecewise,
each piece from its offset in the segment). The forward hook reads the plan, the blended
prefill fills in how many reused tokens it recomputed, and the request's counts are the sums
over its chunks. `first_reused` is the request's earliest reused position over all chunks:
nothing from there on is exact, so the tree never receives it. Under planned selection
(srt/prompt_selection.py) the request also holds the choice of recomputed tokens made for its
whole prompt at its first blended chunk (`selection`); its later chunks read only what that
covered and recompute their part of it.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Hashable

import torch
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

from sglang_tokendance.core.blend_types import BlendOptions, ProbeStates, RequestRow, ReusedRun
from sglang_tokendance.core.cost import PrefillCost
from sglang_tokendance.core.segment_table import SegmentEntry, SegmentTable
from sglang_tokendance.core.segments import SegmentSpan
from sglang_tokendance.core.selection import credited_allowance
from sglang_tokendance.core.plan import ChunkRuns, PlannedRun, PromptSelection, plan_chunk
from sglang_tokendance.core.recurrence import Recurrence, Sightings
from sglang_tokendance.srt.prompt_interface import REUSE_INFO_KEY
from sglang_tokendance.srt.request import RequestOptions

NOT_REUSED = 1 << 62  # first_reused of a request that reused nothing (yet)


@dataclass
class ReuseCounts:
    """What meta_info["tokendance"] and the metrics report, summed over a request's chunks."""

    reused_tokens: int = 0  # restored from segments and kept
    recomputed_tokens: int = 0  # restored, then recomputed by the blended prefill
    computed_tokens: int = 0  # every prompt token the forwards computed
    segment_hits: int = 0
    segment_misses: int = 0
    adopted_tokens: int = 0  # restored tokens that skipped the probe, taking their round group's choice
    mirror_diff_tokens: int = 0  # own slots at reused positions: recomputed ones (mirror), all (dense)
    within_threshold_tokens: int = 0  # recomputed, then read from the Master: within --tokendance-diff-threshold
    agent_prefix_tokens: int = 0  # the prompt prefix read from its agent's kept Mirror (srt/kept_mirrors.py)
    exact_recurring_tokens: int = 0  # block tokens computed exactly where they recurred (core/recurrence.py)
    cost_fallback_tokens: int = 0  # matched block tokens computed because blending their chunk would not pay
    round_master_tokens: int = 0  # its round's leader: block tokens whose exact KV replaced their Masters
    planned_tokens: int = 0  # reused tokens whose recompute the whole prompt's selection chose (chunked prefill)

    def compression(self) -> float | None:
        """Reused positions per own slot among them (1.0: a dense copy; None: no own slot)."""
        positions = self.reused_tokens + self.recomputed_tokens
        return positions / self.mirror_diff_tokens if self.mirror_diff_tokens else None


@dataclass
class ChunkPlan:
    """One request's reuse in one extend forward; `group` the key of its round group
    (srt/policy) while the forward runs it with other members (None: no round)."""

    request: "RequestReuse"
    prefix_len: int
    extend_len: int
    runs: list[PlannedRun[SegmentEntry]]
    hits: int = 0
    misses: int = 0
    group: Hashable | None = None
    fell_back: int = 0  # matched tokens computed instead: blending the chunk would not pay (core/cost)
    max_approximate: int | None = None  # what the request's fidelity budget leaves this chunk (None: no bound)
    pool_index: int = -1  # the request's row in SGLang's req_to_token
    own: torch.Tensor | None = None  # zero copy: own slots for the reused tokens it keeps, until settled

    @property
    def reused_tokens(self) -> int:
        return sum(len(run) for run in self.runs)

    @property
    def selected(self) -> bool:
        """Whether its kept tokens come from the request's planned selection (no probe)."""
        return self.request.selection is not None

    @property
    def forwards(self) -> bool:
        """Whether the blended prefill forwards the chunk: it reads Masters, or it resumes the
        probe states of its planned selection (a chunk that reads none, after the first)."""
        return bool(self.runs) or self.resumed_states() is not None

    def positions(self, device: torch.device) -> torch.Tensor:
        """The reused row positions, in run order."""
        return torch.cat([torch.arange(run.start, run.end, device=device) for run in self.runs]) if self.runs \
            else torch.zeros(0, dtype=torch.int64, device=device)

    def kept(self) -> torch.Tensor | None:
        """The planned selection's kept mask over the reused positions (host; None: not selected)."""
        return self.request.selection.kept_at(self.positions(torch.device("cpu"))) if self.selected else None

    def resumed_states(self) -> ProbeStates | None:
        """The planned selection's probe states of the tokens the chunk computes, where those are
        the ones planned (core/plan PromptSelection.states_for)."""
        kept = self.kept()
        if kept is None:
            return None
        computed = torch.ones(self.extend_len, dtype=torch.bool)
        computed[self.positions(torch.device("cpu")) - self.prefix_len] = kept
        return self.request.selection.states_for(computed.nonzero().squeeze(1) + self.prefix_len)

    def master_slots(self) -> torch.Tensor:
        """The Masters' slots its reused positions read, in run order."""
        return master_slots(self.runs)

    def own_slots(self, options: BlendOptions, chooses_for: list[PlannedRun[SegmentEntry]] | None = None) -> int:
        """Own slots its row needs at the reused positions (zero copy): one per token the
        blended prefill can keep -- exactly its planned selection's kept tokens; else the most
        `options` can keep of its runs (core/blend `BlendOptions.most_kept`), or, where the
        chunk chooses for the rest of its prompt (`chooses_for`: the runs from the chunk to the
        prompt's end, srt/prompt_selection), of those, at most its own."""
        kept = self.kept()
        if kept is not None:
            return int(kept.sum())
        most = options.most_kept([ReusedRun(r.start, r.end, r.segment_offset) for r in chooses_for or self.runs],
                                 self.max_approximate, self.group is not None)
        return min(most, self.reused_tokens)

    def request_row(self, slots: torch.Tensor) -> RequestRow:
        """The chunk as core/blend takes it, over the request's KV row `slots`: its runs relative
        to the chunk's first token, its round group, own slots and fidelity budget; under a
        planned selection its kept tokens and the probe states its computed tokens resume."""
        runs = [ReusedRun(r.start - self.prefix_len, r.end - self.prefix_len, r.segment_offset, r.master.key)
                for r in self.runs]
        kept = self.kept()
        return RequestRow(self.prefix_len, self.extend_len, slots, runs, self.group, self.own, self.max_approximate,
                          None if kept is None else kept.to(slots.device), self.resumed_states())


@dataclass
class RequestReuse:
    """One request's reuse, from planning through the forward to storage: its segments, the
    Masters its row reads in place and their slots, what is still to cache, and its counts."""

    req: Any  # SGLang's Req (only read, and its customized_info written, never extended)
    namespace: Hashable  # SGLang's cache namespace: segments never cross it
    options: RequestOptions  # its spans, output registration, agent (parsed once, srt/request)
    can_reuse: bool  # False: SGLang's own forward (input logprobs, hidden states, embeddings)
    reusable: list[SegmentSpan] = field(default_factory=list)  # the spans it may read from Masters
    leads: bool = False  # its round's leader: computed exactly, its blocks replace their Masters
    first_reused: int = NOT_REUSED
    counts: ReuseCounts = field(default_factory=ReuseCounts)
    uninserted: list[SegmentSpan] = field(default_factory=list)  # spans not yet cached
    reading: list[SegmentEntry] = field(default_factory=list)  # Masters the row reads in place (pinned)
    read_slots: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk start -> Master slots its row reads
    selection: PromptSelection | None = None  # the whole prompt's recomputed tokens (planned selection)
    admitted: ChunkPlan | None = None  # its chunk's plan, made at admission, for the batch being built (mirror)
    blend: BlendOptions = BlendOptions()  # the server's blended prefill (its share, whether a chunk chooses ahead)
    credited: tuple[SegmentSpan, ...] = ()  # blocks held exactly that it would otherwise reuse: in its budget
    kept_approximate: int = 0  # approximate positions of the kept row it continues: spent of its fidelity budget
    # the blocks computed exactly because they recur, each with its tokens past the prefix
    recurring: tuple[tuple[SegmentSpan, int], ...] = ()
    # what it read, for eviction by next use (srt/eviction.record_reads), noted when its chunks are planned:
    round: Hashable | None = None  # the round group it was admitted with (srt/policy; None: none)
    matched: Any = None  # the tree node its prefix matched when its first chunk was planned
    kept: Any = None  # the last node of its row kept for its continuation (srt/kept_mirrors), for its hint
    _looked_up: set[int] = field(default_factory=set)  # spans counted as a hit or a miss

    @property
    def shared_tokens(self) -> int:
        """Row positions that read a Master's slot in place."""
        return sum(slots.numel() for slots in self.read_slots.values())

    @classmethod
    def of(cls, req, options: RequestOptions, can_reuse: bool, agent_prefix: int = 0,
           sightings: Sightings | None = None, leads: bool = False,
           blend: BlendOptions = BlendOptions(), kept_approximate: int = 0) -> "RequestReuse | None":
        """The state of a request that carries segments, asks for output registration or
        names its agent (`options`, parsed once). `agent_prefix`: its matched prefix is a kept
        Mirror (its agent's, or an unnamed request's it repeats: srt/kept_mirrors), whose KV is
        approximate past its first reused token, so nothing of this row enters the shared tree
        or becomes a segment (its exact part is there already); the blocks of it that were read
        approximately there stay in its recompute budget, and its `kept_approximate` positions
        read from Masters are spent of its fidelity budget.
        `sightings`: the blocks seen before, each one that recurs at the request's exact
        frontier is computed exactly (core/recurrence.py; None: every block may be reused), and
        the blocks it holds exactly that were read approximately there before are credited to
        its recompute budget (`blend`'s share of them is recomputed in the blocks it reuses).
        `leads`: the request leads its round (srt/policy): it reads no Master, and its blocks'
        exact KV, computed in round context, replaces their Masters for the others to read."""
        if not options.concerns_tokendance:
            return None
        state = cls(req, namespace_of(req), options, can_reuse and bool(options.spans),
                    reusable=list(options.spans), uninserted=list(options.spans), blend=blend)
        if agent_prefix:  # nothing of its kept row's approximate KV is published
            state.first_reused, state.kept_approximate = 0, kept_approximate
            state.counts.agent_prefix_tokens = agent_prefix
            state.uninserted = [span for span in options.spans if span.start >= agent_prefix]
        if leads and state.can_reuse:  # (after its kept row too: its blocks are computed in round context)
            state.reusable, state.leads = [], True
        elif sightings is not None and state.can_reuse:
            recurrence = sightings.recurrence(state.namespace, req.origin_input_ids, options.spans, req.prefix_len)
            if agent_prefix:  # its kept row's blocks read approximately before stay in its budget
                state.credited = tuple(span for span in recurrence.seen if span.end <= agent_prefix)
            else:
                state.compute_recurring(recurrence, req.prefix_len)
        return state

    def segments_until(self, exact: int, up_to: int) -> int:
        """Up to where its spans' KV may become segments, its row computed to `up_to` and exact
        to `exact`: a leader's blocks, computed in full after whatever prefix it has (its kept
        row's included), are its round's Masters."""
        return up_to if self.leads else exact

    def take_admitted(self) -> ChunkPlan | None:
        """The plan made at admission for the batch being built (mirror storage), handed over once."""
        plan, self.admitted = self.admitted, None
        return plan

    def compute_recurring(self, recurrence: Recurrence, prefix_len: int) -> None:
        """The spans that end by its `exact_until` are computed, not reused, so the tree gets
        them exact; those `seen` approximate there before are credited to the recompute budget."""
        exact_until, self.credited = recurrence.exact_until, recurrence.seen
        self.reusable = [span for span in self.options.spans if span.end > exact_until]
        exact = [(span, min(span.end, exact_until) - max(span.start, prefix_len)) for span in self.options.spans]
        self.recurring = tuple((span, tokens) for span, tokens in exact if tokens > 0)

    def unpublished_spans(self, published: int) -> list[SegmentSpan]:
        """The spans whose exact KV did not reach the tree (it holds the row up to `published`)."""
        return [span for span in self.options.spans if span.end > published]

    def key(self, segment_hash: str) -> Hashable:
        return (self.namespace, segment_hash)

    def neighbours(self, span: SegmentSpan) -> tuple[Hashable | None, Hashable | None]:
        """The keys of the spans right before and right after `span` in its prompt (None: text
        that is no span, or the prompt's end, lies there)."""
        spans = self.options.spans  # in prompt order, apart
        at = bisect.bisect_left(spans, span.start, key=lambda s: s.start)
        before = spans[at - 1] if at > 0 and spans[at - 1].end == span.start else None
        after = spans[at + 1] if at + 1 < len(spans) and spans[at + 1].start == span.end else None
        return tuple(None if s is None else self.key(s.hash) for s in (before, after))

    def plan_chunk(self, table: SegmentTable, prefix_len: int, extend_end: int, group: Hashable | None = None,
                   cost: PrefillCost | None = None, max_approximate: int | None = None,
                   plan_ahead: bool = False) -> ChunkPlan:
        """Plan the chunk [prefix_len, extend_end) (core/plan) over the cached segments of the
        request's namespace; counts the chunk's tokens, and each span's hit or miss once.
        With `cost`, a chunk whose blending would not pay reads nothing: SGLang's path computes it.
        `max_approximate`: the server's fidelity budget (the request's own, when it sets one, wins);
        the chunk gets what earlier chunks left of it (their reused tokens not recomputed).
        With `plan_ahead` (planned selection), a chunk that will choose for the rest of the
        prompt (its first that reads, not its last) weighs blending the whole rest, as an
        unchunked prefill would weigh it. Under a planned selection the chunk reads only the runs
        it covered (a span cached since is computed) and recomputes its part of it; its cost was
        weighed when it was made."""
        plan, looked_up = self._chunk_plan(table, prefix_len, extend_end, group, cost, max_approximate, plan_ahead)
        ids = self.req.origin_input_ids
        if self.recurring:  # counted once, where a Master would have been read
            self.counts.exact_recurring_tokens = sum(tokens for span, tokens in self.recurring
                                                     if table.holding(self.key(span.hash), ids[span.start:span.end]))
            self.recurring = ()
        for span in map(self.reusable.__getitem__, set(looked_up) - self._looked_up):
            table.lookup(self.key(span.hash), ids[span.start:span.end])  # read once: its hit, recency or refusal
        self._looked_up.update(looked_up)
        reused = plan.reused_tokens
        if plan.runs:
            self.first_reused = min(self.first_reused, plan.runs[0].start)
            self.credited = ()  # credited once, to the chunk that chose with it
        self.counts.reused_tokens += reused
        self.counts.computed_tokens += plan.extend_len - reused
        self.counts.segment_hits += plan.hits
        self.counts.segment_misses += plan.misses
        self.counts.cost_fallback_tokens += plan.fell_back
        self.publish()
        return plan

    def would_read(self, table: SegmentTable, prefix_len: int, extend_end: int, group: Hashable | None = None,
                   cost: PrefillCost | None = None, max_approximate: int | None = None,
                   plan_ahead: bool = False) -> ChunkPlan:
        """The plan `plan_chunk` would make now, nothing counted or kept (admission's estimate)."""
        return self._chunk_plan(table, prefix_len, extend_end, group, cost, max_approximate, plan_ahead)[0]

    def _chunk_plan(self, table: SegmentTable, prefix_len: int, extend_end: int, group: Hashable | None,
                    cost: PrefillCost | None, max_approximate: int | None, plan_ahead: bool
                    ) -> tuple[ChunkPlan, list]:
        """`plan_chunk`'s plan, and the spans it looked up."""
        allowance = self.allowance(max_approximate)
        runs = self.runs_in(table, prefix_len, extend_end)
        if self.selection is not None:
            runs.runs, cost = [run for run in runs.runs if self.selection.covers(run)], None
        fell_back, prompt_len = 0, len(self.req.origin_input_ids)
        if runs.runs and self.selection is None:
            end, reused = extend_end, runs.reused_tokens
            if plan_ahead and extend_end < prompt_len and self.blend.chooses_per_request(allowance):
                end, reused = prompt_len, reused + self.runs_in(table, extend_end, prompt_len).reused_tokens
            allowance = credited_allowance(self.blend.recompute_ratio, reused, self.credit(table), allowance)
            if cost is not None and not cost.pays(prefix_len, end - prefix_len, reused, allowance):
                fell_back, runs.runs = runs.reused_tokens, []
        plan = ChunkPlan(self, prefix_len, extend_end - prefix_len, runs.runs, group=group, fell_back=fell_back,
                         max_approximate=allowance,
                         hits=len(set(runs.found) - self._looked_up), misses=len(set(runs.missed) - self._looked_up))
        return plan, runs.found + runs.missed

    def credit(self, table: SegmentTable) -> int:
        """Tokens of the blocks it holds exactly that it would otherwise reuse (`credited`: those
        whose Master is cached), for its first chunk that reads to count in its budget."""
        ids = self.req.origin_input_ids
        return sum(span.end - span.start for span in self.credited
                   if table.holding(self.key(span.hash), ids[span.start:span.end]))

    def allowance(self, max_approximate: int | None) -> int | None:
        """What is left of the fidelity budget (`max_approximate`, the server's; the request's
        own wins) after the reused tokens its earlier chunks left approximate and the approximate
        positions of the kept row it continues (None: no bound)."""
        if self.options.max_approximate_tokens is not None:
            max_approximate = self.options.max_approximate_tokens
        spent = self.counts.reused_tokens + self.kept_approximate
        return None if max_approximate is None else max(0, max_approximate - spent)

    def runs_in(self, table: SegmentTable, start: int, end: int) -> ChunkRuns[SegmentEntry]:
        """The runs of prompt positions [start, end) over the cached segments (nothing counted)."""
        if not self.can_reuse:
            return ChunkRuns()
        ids = self.req.origin_input_ids
        neighbour = (lambda master, before: self._neighbour(table, master, before)) if self.options.content_chunks \
            else None  # a marker or a message boundary is the client's: no read crosses it
        return plan_chunk(self.reusable, lambda span: self._lookup(table, span, ids), start, end, len(ids),
                          neighbour, ids)

    def _lookup(self, table: SegmentTable, span: SegmentSpan, ids) -> tuple[SegmentEntry, int] | None:
        entry = table.peek(self.key(span.hash), ids[span.start:span.end])
        return None if entry is None else (entry, len(entry))

    @staticmethod
    def _neighbour(table: SegmentTable, master: SegmentEntry, before: bool
                   ) -> tuple[SegmentEntry, tuple[int, ...], int] | None:
        """The Master cached right before (or after) `master` in its author's prompt, its ids
        and cached length (core/plan extends a found span's read into a missed neighbour)."""
        entry = table.entries.get(master.before if before else master.after)
        return None if entry is None else (entry, entry.ids, len(entry))

    def drop_evicted(self, plan: ChunkPlan, table: SegmentTable) -> None:
        """Runs of `plan` whose Master the batch's allocation evicted after all (nothing else
        was left to free) are computed instead (dense storage)."""
        self.compute_instead(plan, [run for run in plan.runs if table.entries.get(run.master.key) is run.master])

    def compute_instead(self, plan: ChunkPlan, runs: list[PlannedRun[SegmentEntry]]) -> None:
        """`plan` reads only `runs` (some of its own): the others' tokens are computed.
        `first_reused` stays as planned: the tree then receives less than it could, never
        approximate KV."""
        lost = plan.reused_tokens - sum(len(run) for run in runs)
        if lost:
            plan.runs = runs
            self.counts.reused_tokens -= lost
            self.counts.computed_tokens += lost
            self.publish()

    def record_recomputed(self, plan: ChunkPlan, recomputed: int, own: int, adopted: int = 0,
                          within_threshold: int = 0) -> None:
        """After the forward: `recomputed` of the plan's restored tokens were computed again;
        `own` of its reused positions hold the request's own slots (the rest read Masters);
        `adopted` of them skipped the probe (shared probe); `within_threshold` recomputed ones
        read their Master after all (mirror storage's diff threshold)."""
        self.counts.reused_tokens -= recomputed
        self.counts.recomputed_tokens += recomputed
        self.counts.computed_tokens += recomputed
        self.counts.mirror_diff_tokens += own
        self.counts.within_threshold_tokens += within_threshold
        self.counts.adopted_tokens += adopted
        if plan.selected:
            self.counts.planned_tokens += plan.reused_tokens
            if plan.prefix_len + plan.extend_len == len(self.req.origin_input_ids):  # its last chunk ran
                self.selection = dataclasses.replace(self.selection, states=None)
        self.publish()

    def publish(self) -> None:
        """The counts so far reach meta_info["tokendance"] through SGLang's per-request
        customized_info (sent once, when the request's first output or its end is streamed)."""
        if self.can_reuse or self.options.agent is not None:
            info = {**asdict(self.counts), "mirror_compression": self.counts.compression()}
            self.req.customized_info = {**(self.req.customized_info or {}), REUSE_INFO_KEY: [info]}


def master_slots(runs: list[PlannedRun[SegmentEntry]]) -> torch.Tensor:
    """The Masters' slots `runs` read, in run order."""
    return torch.cat([run.master.slots[run.segment_offset:run.segment_offset + len(run)] for run in runs])


def namespace_of(req) -> Hashable:
    """SGLang's radix-tree namespace of a request (its RadixKey's extra_key, which includes a
    LoRA adapter's id, and cache_salt): a segment is reused only inside the namespace that
    computed it."""
    return (req.extra_key, req.cache_salt)


def may_reuse(req) -> bool:
    """Whether the blended prefill may serve the request. The others take SGLang's forward:
    input-token logprobs need hidden states at every prompt token, hidden-state outputs and
    input embeddings are features the blended forward does not reproduce."""
    wants_input_logprobs = bool(req.return_logprob) and 0 <= req.logprob_start_len < len(req.origin_input_ids) - 1
    return not (wants_input_logprobs or req.return_hidden_states or req.input_embeds is not None
                or req.multimodal_inputs is not None)


def is_lora(req) -> bool:
    """LoRA requests take SGLang's own path entirely (the blended forward has no per-request
    adapters): they neither reuse nor cache segments."""
    return req.lora_id is not None


class OutputStreamer(SchedulerOutputStreamer):
    """SGLang's streamer, sending our per-request counts once per request, not sliced per token."""

    def is_request_level_customized_info_key(self, key: str) -> bool:
        return key == REUSE_INFO_KEY or super().is_request_level_customized_info_key(key)


def output_streamer_class(*unused, **unused_kw):
    """REPLACE hook on Scheduler.get_output_streamer_class (an official override point)."""
    return OutputStreamer
