"""Blended prefill: reuse cached KV for most tokens and recompute the few that matter.

An extend batch's tokens are either fresh (private text, missed segments, the last prompt
token: no KV yet) or reused (their segment's cached KV was rotated into their slots before the
forward). With recompute ratio r > 0:

1. probe: layers 0..c run on every token (a full prefill of those layers; the reused
   tokens' recomputed KV is held aside, their cached KV stays in place) -- optionally with a screen at
   a shallower layer s, after which only the reused tokens the rule ranks best there (a few
   times r) run on to c;
2. check: a selection rule (core/selection.py) scores the reused tokens at layer c and the
   top r of them (per request; more where the request's fidelity budget,
   RequestRow.max_approximate, allows fewer approximate tokens) are kept for recompute;
3. layers c+1..L-1 run on the fresh and kept tokens only; the others keep their cached KV.

With sparse write-back (default) the tokens not kept keep their cached KV at layers 0..c too
(only the kept ones' probe KV is written), so a request's KV differs from the cached segments
only at kept tokens -- what a compact Master-Mirror diff needs; dense write-back writes every
probed token's. The fresh and kept tokens carry on from their probe states.
Round groups (RequestRow.group) that share an extend batch can run it collectively
(`group_selection="aligned"`): the runs of a segment that two or more members read are
selected together (core/collective.share_runs, core/selection.select_kept): each offset's
score is the mean over the members that scored it, and the top r of the group's tokens of
those segments are kept at the same offsets in every member. With a shared probe
(`group_probe` = k > 0) only the first k members reading a shared segment probe it; the
others' tokens of it skip the probe (the probe's tokens read their cached KV) and adopt the
group's choice, and their kept tokens catch up through layers 0..c in a stage of their own
after the check, over the KV as written back: probe work per shared segment is k members'
whatever the group's size. (Under dense write-back the adopted tokens not kept keep their
cached KV: they have no probe KV to write.)
A row whose selection was made before its forward (RequestRow.kept: under chunked prefill the
server selects over the whole prompt at its first chunk, srt/prompt_selection.py) is not
probed: its kept tokens are computed with the fresh ones through every layer (in their own
slots), the rest keep their cached KV. Where that earlier probe's states are carried in as well
(RequestRow.resumed, core/blend `carried_states`: the computed tokens' hidden states after the
check layer and their KV of the probe layers), those tokens skip layers 0..c -- their KV there
is written as the probe computed it -- and resume at c+1: the forward the unchunked prompt
would have run, at its work.
r = 1 is a full prefill (run as one: every token is kept whatever the scores); r = 0
recomputes nothing, not even the probe: only fresh tokens run, attending to the cached KV at
every layer.

Attention is causal by absolute position over each request's whole KV row, batched over the
batch (core/attention.py), so any subset of tokens can be computed. The work is organised in
stages -- sets of computed tokens that several layers share (the probe before and after the
screen, the layers after the check) -- whose indices, position encodings and attention
layouts are built once. The probe never overwrites the reused tokens' cached KV: their
recomputed KV goes to attention as an overlay (scratch) and reaches the pool only where it is
kept; the attention mass a rule needs comes from the check layer's own attention pass.
The model and the KV storage come in through two small protocols, so the same code runs
inside SGLang (srt/model.py) and in the quality harness (bench/). Under zero-copy storage a
row reads Masters' slots in place, whose K was rotated at their author's positions (the slots'
frames, core/slot_frames): the blended prefill is passed `reads` (core/rope_attention), and
attention and the rules see each read key at the reader's position -- the cached K a rule
compares with the recomputed one is rotated by its shift first, so both are in one frame.
Everything the layers compute is written at its own position, as SGLang writes it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_tokendance.core.attention import Grid, attend, plan_grids
from sglang_tokendance.core.blend_types import (BlendOptions, BlendStats, KVStore, LayerwiseModel, ProbeStates,
                                                RequestRow, ReusedRun)
from sglang_tokendance.core.collective import GroupRun, share_runs
from sglang_tokendance.core.rope_attention import ShiftedReads
from sglang_tokendance.core.selection import (CheckState, ReusedSegment, SelectionRule, kept_share, select_kept)


def blended_prefill(model: LayerwiseModel, kv: KVStore, ids: torch.Tensor, positions: torch.Tensor,
                    requests: Sequence[RequestRow], options: BlendOptions, rule: SelectionRule | None,
                    reads: ShiftedReads | None = None) -> tuple[torch.Tensor, BlendStats]:
    """Final normed hidden states [tokens, hidden] (zeros at rows not computed: reused tokens
    not kept) for the flattened extend tokens of `requests`; `reads` when rows read slots at a
    shift (zero-copy storage)."""
    batch = _Batch(requests, positions, ids, reads, options)
    if not batch.stats.reused_tokens or max(batch.kept_shares(options)) <= 0:
        computed, stats = batch.tokens(batch.preselected), batch.stats
        if batch.selected_before:
            stats = dataclasses.replace(stats, kept=batch.preselected, kept_tokens=int(batch.preselected.sum()))
        if batch.resumed.any():  # the others run the probe layers first, then all go on together
            rows = (computed & ~batch.resumed).nonzero().squeeze(1)
            stats.token_layers += rows.numel() * (options.check_layer + 1)
            return _resume(model, kv, batch, rows, _catch_up(model, kv, batch, rows, options.check_layer), computed,
                           options.check_layer, stats)
        return _run_layers(model, kv, batch, model.embed(ids[computed]), computed, 0, stats)
    if rule is None:
        raise ValueError("a recompute ratio above 0 needs a selection rule")
    if options.keeps_everything:  # no rule can change the outcome: a full prefill
        kept = torch.ones(batch.stats.reused_tokens, dtype=torch.bool, device=ids.device)
        stats = dataclasses.replace(batch.stats, kept=kept, kept_tokens=batch.stats.reused_tokens)
        return _run_layers(model, kv, batch.with_own_slots(kept), model.embed(ids), torch.ones_like(batch.reused), 0,
                           stats)
    checked = probe(model, kv, ids, positions, requests, rule, options, reads)
    return finish(model, kv, checked, select(checked, rule, options), options)


@dataclass
class Probe:
    """The state after the probe layers (shareable by several selections): hidden states of
    the batch tokens `rows`, and the CheckState of the reused tokens still tracked (`tracked`:
    a mask over all reused tokens; all of them unless a screen dropped some or a shared probe
    left some out: `batch.adopted`). The tracked tokens' recomputed KV is in the CheckState
    only: the KV store still holds their cached KV."""

    batch: "_Batch"
    check_layer: int
    rows: torch.Tensor
    hidden: torch.Tensor
    state: CheckState
    tracked: torch.Tensor

    def tracked_rows(self) -> torch.Tensor:
        """Batch indices of the tracked reused tokens (the CheckState's order)."""
        return self.batch.reused.nonzero().squeeze(1)[self.tracked]


def probe(model: LayerwiseModel, kv: KVStore, ids: torch.Tensor, positions: torch.Tensor,
          requests: Sequence[RequestRow], rule: SelectionRule, options: BlendOptions,
          reads: ShiftedReads | None = None) -> Probe:
    """Layers 0..c on every token: the fresh tokens' KV written, the reused tokens' recomputed
    KV kept next to their cached KV in the CheckState (for scoring, and for `finish` to write
    where it is kept).

    With a screen (1 <= options.screen_layer = s < c), `rule` first scores the reused tokens
    at layer s and only the best min(1, screen_factor x r) of each request's go (r its kept share)
    on through layers s+1..c with the fresh tokens: a deep check at little more than a
    shallow one's cost.

    With a shared probe (options.group_probe), the reused tokens `batch.adopted` -- shared
    segments' tokens of the members beyond the first group_probe that read them -- skip the
    probe: the probe's tokens read their cached KV, and `finish` computes the ones kept."""
    c, s = options.check_layer, options.screen_layer if options.screened else 0
    if not 1 <= c < model.num_layers:
        raise ValueError(f"check layer must be in [1, {model.num_layers - 1}], got {c}")
    batch = _Batch(requests, positions, ids, reads, options)
    if batch.own_locs is not None and not options.sparse_writeback:
        raise ValueError("dense write-back would write the probe's KV into shared Master slots: "
                         "zero-copy reuse needs sparse write-back")
    if batch.unprobed.any() or batch.resumed.any():
        rows = (batch.tokens(~batch.unprobed | batch.preselected) & ~batch.resumed).nonzero().squeeze(1)
        checked = Probe(batch, c, rows, model.embed(ids[rows]), CheckState(), ~batch.unprobed)
    else:
        checked = Probe(batch, c, torch.arange(ids.shape[0], device=ids.device), model.embed(ids), CheckState(),
                        torch.ones(batch.stats.reused_tokens, dtype=torch.bool, device=ids.device))
    if s:
        _probe_layers(model, kv, checked, range(s + 1), rule.needs_attention)
        shares = [min(1.0, options.screen_factor * share) for share in batch.kept_shares(options)]
        passed = select_kept(_scores(checked, rule), batch.reused_segments(), shares,
                             granularity=options.granularity, block_size=options.block_size,
                             head_tokens=options.block_head_tokens)
        _drop_tracked(kv, checked, ~passed[checked.tracked], options.sparse_writeback)
    _probe_layers(model, kv, checked, range(s + 1 if s else 0, c + 1), rule.needs_attention)
    return checked


def _probe_layers(model, kv, checked: Probe, layers: range, with_attention: bool) -> None:
    """`layers` on the probe's tokens (one stage); the reused ones are all tracked and their KV
    is scratch; with `with_attention`, the last layer's attention also yields the mass the
    fresh tokens pay them."""
    batch, state = checked.batch, checked.state
    stage = _Stage(model, batch, checked.rows, scratch=batch.tokens(checked.tracked, fresh=False)[checked.rows],
                   mass=with_attention)
    for layer in layers:
        state.cached_k.append(stage.read_at_rows(kv.keys(layer)[stage.scratch_locs]))  # indexing copies
        state.cached_v.append(kv.values(layer)[stage.scratch_locs])
        mass = stage.new_mass() if with_attention and layer == layers[-1] else None
        checked.hidden, k, v = _layer(model, kv, stage, layer, checked.hidden, mass)
        state.computed_k.append(k[stage.scratch_tokens])
        state.computed_v.append(v[stage.scratch_tokens])
        if mass is not None:
            state.attention_received = mass
    batch.stats.token_layers += checked.rows.numel() * len(layers)


def _write_probe_kv(kv, checked: Probe, which: torch.Tensor, layers: range, batch: "_Batch") -> None:
    """The tracked reused tokens `which` (a mask over the tracked ones) get their recomputed
    KV of `layers` into the store, at their slots in `batch`."""
    locs = batch.locs[checked.tracked_rows()[which]]
    for layer in layers:
        kv.write(layer, locs, checked.state.computed_k[layer][which], checked.state.computed_v[layer][which])


def _drop_tracked(kv, checked: Probe, drop: torch.Tensor, sparse_writeback: bool) -> None:
    """Stop tracking the tracked reused tokens `drop` (a mask over the tracked ones); they keep
    their cached KV, or under dense write-back the probe's."""
    state = checked.state
    if not sparse_writeback:
        _write_probe_kv(kv, checked, drop, range(len(state.cached_k)), checked.batch)
    dropped_rows = checked.tracked_rows()[drop]
    keep = ~drop
    for arrays in (state.cached_k, state.cached_v, state.computed_k, state.computed_v):
        arrays[:] = [a[keep] for a in arrays]
    still = ~torch.isin(checked.rows, dropped_rows)
    checked.rows, checked.hidden = checked.rows[still], checked.hidden[still]
    tracked = checked.tracked.clone()
    tracked[checked.tracked] = keep
    checked.tracked = tracked


def select(checked: Probe, rule: SelectionRule, options: BlendOptions) -> torch.Tensor:
    """The kept mask over the reused tokens under `options` (only tracked tokens, and adopted
    ones that take their group's choice, can be kept; rows selected before keep their choice)."""
    batch = checked.batch
    return select_kept(_scores(checked, rule), batch.reused_segments(), batch.kept_shares(options),
                       granularity=options.granularity, block_size=options.block_size,
                       head_tokens=options.block_head_tokens) & (checked.tracked | batch.adopted) | batch.preselected


def _scores(checked: Probe, rule: SelectionRule) -> torch.Tensor:
    """The rule's scores over all reused tokens: -inf where dropped by a screen, NaN (no
    score: the group's choice) where adopted."""
    scores = torch.full(checked.tracked.shape, float("-inf"), device=checked.tracked.device)
    scores[checked.batch.adopted] = float("nan")
    scores[checked.tracked] = rule.score(checked.state).float()
    return scores


def finish(model: LayerwiseModel, kv: KVStore, checked: Probe, kept: torch.Tensor,
           options: BlendOptions) -> tuple[torch.Tensor, BlendStats]:
    """The kept tokens' probe KV written (under dense write-back every tracked token's), the
    kept adopted tokens (shared probe) caught up through layers 0..c over the KV as written,
    then layers c+1..L-1 on the fresh and kept tokens (zero copy: the kept ones in their own
    slots). Leaves `checked` as it was."""
    batch, c = checked.batch.with_own_slots(kept), checked.check_layer
    written = kept if options.sparse_writeback else checked.tracked
    _write_probe_kv(kv, checked, written[checked.tracked], range(c + 1), batch)
    computed = batch.tokens(kept)
    rows, hidden = checked.rows, checked.hidden
    caught = batch.reused.nonzero().squeeze(1)[kept & batch.adopted]
    token_layers = batch.stats.token_layers
    if caught.numel():
        rows, hidden = torch.cat([rows, caught]), torch.cat([hidden, _catch_up(model, kv, batch, caught, c)])
        token_layers += caught.numel() * (c + 1)
    stats = dataclasses.replace(batch.stats, kept=kept, kept_tokens=int(kept.sum()), token_layers=token_layers,
                                adopted=batch.adopted, adopted_tokens=int(batch.adopted.sum()))
    return _resume(model, kv, batch, rows, hidden, computed, c, stats)


def _resume(model, kv, batch: "_Batch", rows: torch.Tensor, hidden: torch.Tensor, computed: torch.Tensor,
            check_layer: int, stats: BlendStats) -> tuple[torch.Tensor, BlendStats]:
    """Layers c+1..L-1 on the computed tokens: the batch tokens `rows` with their `hidden`
    states after layer c, and the tokens whose probe states were carried in (their KV of
    layers 0..c written first)."""
    carried = batch.resumed.nonzero().squeeze(1)
    if carried.numel():
        states = [r.resumed for r in batch.requests if r.resumed is not None]
        locs = batch.locs[carried]
        for layer in range(check_layer + 1):
            kv.write(layer, locs, torch.cat([s.keys[layer] for s in states]),
                     torch.cat([s.values[layer] for s in states]))
        rows, hidden = torch.cat([rows, carried]), torch.cat([hidden, *(s.hidden for s in states)])
    where = torch.full((computed.numel(),), -1, dtype=torch.int64, device=computed.device)
    where[rows] = torch.arange(rows.numel(), device=computed.device)
    return _run_layers(model, kv, batch, hidden[where[computed]], computed, check_layer + 1, stats)


def _catch_up(model, kv, batch: "_Batch", rows: torch.Tensor, check_layer: int) -> torch.Tensor:
    """Layers 0..c on the batch tokens `rows` (one stage, KV written; kept tokens that skipped
    the probe, or the tokens of rows that resume carried states' neighbours in the batch):
    their hidden states for the layers after the check. They read the KV the probe and its
    write-back left: the kept tokens' recomputed KV, the others' cached KV."""
    hidden = model.embed(batch.ids[rows])
    if not rows.numel():
        return hidden
    stage = _Stage(model, batch, rows)
    for layer in range(check_layer + 1):
        hidden, _, _ = _layer(model, kv, stage, layer, hidden)
    return hidden


def carried_states(checked: Probe, kept: torch.Tensor, kv: KVStore, options: BlendOptions) -> ProbeStates | None:
    """The states the probe `checked` (of one request) leaves for its computed tokens under the
    selection `kept` (fresh and kept ones, in position order), for a later forward to resume:
    the fresh tokens' KV as the probe wrote it into `kv`, the kept ones' as it recomputed it.
    None under dense write-back, where the probe's KV of the tokens not kept is written too."""
    if not options.sparse_writeback:
        return None
    batch = checked.batch
    if len(batch.requests) != 1:
        raise ValueError(f"carried states are one request's, the probe held {len(batch.requests)}")
    rows = batch.tokens(kept).nonzero().squeeze(1)
    where = torch.full((batch.ids.shape[0],), -1, dtype=torch.int64, device=rows.device)
    where[checked.rows] = torch.arange(checked.rows.numel(), device=rows.device)
    if bool((where[rows] < 0).any()):
        raise ValueError("a computed token was not probed (adopted, or selected before the probe): nothing to carry")
    fresh = ~batch.reused[rows]
    mine = kept[checked.tracked]

    def layer_kv(cached: torch.Tensor, computed: torch.Tensor) -> torch.Tensor:
        out = cached.new_empty(rows.numel(), *cached.shape[1:])
        out[fresh] = cached[batch.locs[rows[fresh]]]
        out[~fresh] = computed[mine]
        return out

    state, layers = checked.state, range(checked.check_layer + 1)
    return ProbeStates(batch.positions[rows].cpu(), checked.hidden[where[rows]],
                       tuple(layer_kv(kv.keys(layer), state.computed_k[layer]) for layer in layers),
                       tuple(layer_kv(kv.values(layer), state.computed_v[layer]) for layer in layers))


def _run_layers(model, kv, batch: "_Batch", hidden, computed: torch.Tensor, first_layer: int,
                stats: BlendStats) -> tuple[torch.Tensor, BlendStats]:
    """Layers first_layer..L-1 on the tokens `computed` (one stage, KV written), final norm.
    None computed (a prefill chunk inside reused text at ratio 0): no layer runs."""
    stage = _Stage(model, batch, computed.nonzero().squeeze(1))
    for layer in range(first_layer, model.num_layers) if stage.rows.numel() else ():
        hidden, _, _ = _layer(model, kv, stage, layer, hidden)
    stats = dataclasses.replace(stats, full_token_layers=computed.numel() * model.num_layers,
                                token_layers=stats.token_layers + stage.rows.numel() * (model.num_layers - first_layer))
    out = hidden.new_zeros(computed.numel(), hidden.shape[1])
    out[stage.rows] = model.final_norm(hidden)
    return out, stats


def _layer(model, kv, stage: "_Stage", layer: int, hidden: torch.Tensor, mass: torch.Tensor | None = None):
    """One layer for the stage's tokens: the KV of those not scratch written, one batched
    attention per grid (the scratch tokens' KV overlaid), `mass` filled when given."""
    q, k, v = model.qkv(layer, hidden, stage.rotary)
    if stage.final is None:
        kv.write(layer, stage.locs, k, v)
    else:
        kv.write(layer, stage.final_locs, k[stage.final], v[stage.final])
    keys, values, scale = kv.keys(layer), kv.values(layer), model.attention_scale(layer)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for grid in stage.grids:
        out[grid.tokens] = attend(grid, q, k, v, keys, values, scale, reads=stage.reads, mass_out=mass)
    return model.finish_layer(layer, hidden, out.flatten(1)), k, v


class _Stage:
    """A set of computed tokens (batch indices `rows`) shared by consecutive layers, with what
    every one of those layers would otherwise rebuild: pool slots, position encoding,
    attention grids. `scratch` (a mask over the rows) marks tokens whose KV must not reach the
    pool (attention reads it from an overlay); with `mass`, the grids also plan the attention
    mass the other tokens pay them."""

    def __init__(self, model, batch: "_Batch", rows: torch.Tensor, scratch: torch.Tensor | None = None,
                 mass: bool = False):
        self.reads = batch.reads
        self.rows = rows
        self.locs = batch.locs[rows]
        self.positions = batch.positions[rows]
        self.rotary = model.rotary(self.positions)
        scratch = torch.zeros_like(rows, dtype=torch.bool) if scratch is None else scratch
        self.scratch_tokens = scratch.nonzero().squeeze(1)
        self.scratch_locs = self.locs[self.scratch_tokens]
        self.scratch_shifts = None if self.reads is None else \
            self.reads.shifts(self.scratch_locs, self.positions[self.scratch_tokens])
        self.final = (~scratch).nonzero().squeeze(1) if self.scratch_tokens.numel() else None  # None: all
        self.final_locs = None if self.final is None else self.locs[self.final]
        self.grids: list[Grid] = plan_grids(batch.request[rows], self.positions, batch.kv_rows,
                                            overlay=scratch, mass=mass)

    def read_at_rows(self, cached_k: torch.Tensor) -> torch.Tensor:
        """The scratch tokens' cached K (gathered) at their positions in their rows."""
        return cached_k if self.reads is None else self.reads.shift_(cached_k, self.scratch_shifts)

    def new_mass(self) -> torch.Tensor:
        return torch.zeros(self.scratch_tokens.numel(), device=self.rows.device)


class _Batch:
    """Index bookkeeping of a flattened extend batch, built once, and how its rows read slots
    written at other positions."""

    def __init__(self, requests: Sequence[RequestRow], positions: torch.Tensor, ids: torch.Tensor,
                 reads: ShiftedReads | None, options: BlendOptions):
        self.requests = list(requests)
        self.reads = reads
        self.positions = positions
        self.ids = ids
        counts = [r.num_tokens for r in self.requests]
        self.starts = [sum(counts[:i]) for i in range(len(counts))]
        if sum(counts) != ids.shape[0]:
            raise ValueError(f"the requests hold {sum(counts)} extend tokens but {ids.shape[0]} ids were given")
        device = ids.device
        self.request = torch.repeat_interleave(torch.arange(len(counts), device=device),
                                               torch.tensor(counts, device=device))
        self.kv_rows = [r.slots[:r.prefix_len + r.num_tokens].to(torch.int64) for r in self.requests]
        self.locs = torch.cat([row[r.prefix_len:] for row, r in zip(self.kv_rows, self.requests)])
        self.reused = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
        self.runs = [[ReusedRun(*run) for run in r.reused] for r in self.requests]
        self.shared, adopted_runs = self._share(options)
        adopted = torch.zeros_like(self.reused)
        for first, runs, adopts in zip(self.starts, self.runs, adopted_runs):
            for run, adopt in zip(runs, adopts):
                self.reused[first + run.start:first + run.end] = True
                adopted[first + run.start:first + run.end] = adopt
        self.adopted = adopted[self.reused]  # a mask over the reused tokens: they skip the probe
        self.stats = BlendStats(reused_tokens=int(self.reused.sum()))
        self.own_locs = self._own_locs()
        # rows selected before this forward (RequestRow.kept), as masks over the reused tokens:
        # theirs all skip the probe, the kept ones are computed (in their own slots) from the start
        self.selected_before = any(r.kept is not None for r in self.requests)
        self.unprobed, self.preselected = self.adopted, torch.zeros_like(self.adopted)
        if self.selected_before:
            sizes = [sum(run.end - run.start for run in runs) for runs in self.runs]
            self.unprobed = self.adopted | torch.cat([torch.full((n,), r.kept is not None, device=device)
                                                      for n, r in zip(sizes, self.requests)])
            self.preselected = torch.cat([torch.zeros(n, dtype=torch.bool, device=device) if r.kept is None
                                          else r.kept.to(device=device, dtype=torch.bool)
                                          for n, r in zip(sizes, self.requests)])
            if self.own_locs is not None:
                self._move_to_own(self.preselected)
        self.resumed = self._resumed()  # batch tokens whose probe states were carried in

    def _resumed(self) -> torch.Tensor:
        """The mask of batch tokens that resume carried probe states (RequestRow.resumed): each
        such row's computed tokens, which must be exactly the states' positions."""
        resumed = torch.zeros_like(self.reused)
        if all(r.resumed is None for r in self.requests):
            return resumed
        computed = self.tokens(self.preselected)
        for first, r in zip(self.starts, self.requests):
            if r.resumed is None:
                continue
            if r.kept is None:
                raise ValueError("carried probe states need the row's selection made before the forward (kept)")
            mine = computed[first:first + r.num_tokens]
            positions = self.positions[first:first + r.num_tokens][mine].cpu()
            if not torch.equal(positions, r.resumed.positions):
                raise ValueError(f"carried probe states of {len(r.resumed)} tokens do not match the row's "
                                 f"{positions.numel()} computed tokens")
            resumed[first:first + r.num_tokens] = mine
        return resumed

    def tokens(self, reused: torch.Tensor, fresh: bool = True) -> torch.Tensor:
        """A mask over the batch tokens: the reused ones `reused` (a mask over them) and, with
        `fresh`, every token not reused."""
        mask = ~self.reused if fresh else torch.zeros_like(self.reused)
        mask[self.reused] = reused
        return mask

    def _own_locs(self) -> list[torch.Tensor] | None:
        """Each request's own slots for the reused tokens it keeps (None: no request reads a
        Master in place); a request without `own` owns the slots its row holds there."""
        if all(r.own is None for r in self.requests):
            return None
        reused_locs = self.locs[self.reused].split([sum(run.end - run.start for run in runs) for runs in self.runs])
        return [mine if r.own is None else r.own.to(torch.int64) for r, mine in zip(self.requests, reused_locs)]

    def with_own_slots(self, kept: torch.Tensor) -> "_Batch":
        """This batch with the kept reused tokens (a mask over the reused ones) in their own
        slots, in `locs` and in the KV rows attention reads; itself when no token moves."""
        if self.own_locs is None or not bool(kept.any()):
            return self
        moved = copy.copy(self)
        moved._move_to_own(kept)
        return moved

    def _move_to_own(self, kept: torch.Tensor) -> None:
        """Point the kept reused tokens' `locs` and KV row entries at their own slots (copies):
        each request's i-th kept token at its i-th own slot, its frame recorded (zero copy)."""
        rows = self.reused.nonzero().squeeze(1)[kept]
        request = self.request[rows]
        counts = torch.bincount(request, minlength=len(self.requests))
        first = torch.cumsum(counts, 0) - counts  # each request's first kept token among `rows`
        rank = torch.arange(rows.numel(), device=rows.device) - first[request]
        short = [(b, int(counts[b]), mine.numel()) for b, mine in enumerate(self.own_locs) if counts[b] > mine.numel()]
        if short:
            raise ValueError("a request keeps more reused tokens than it has own slots for (request, kept, "
                             f"own slots): {short}")
        starts = torch.tensor([0] + [mine.numel() for mine in self.own_locs], device=rows.device).cumsum(0)
        self.locs = self.locs.clone()
        self.locs[rows] = torch.cat(self.own_locs)[starts[request] + rank]
        if self.reads is not None:
            self.reads.frames.record(self.locs[rows], self.positions[rows])
        self.kv_rows = list(self.kv_rows)
        for b in self.request[rows].unique().tolist():
            mine = rows[self.request[rows] == b]
            self.kv_rows[b] = self.kv_rows[b].clone()
            self.kv_rows[b][self.positions[mine]] = self.locs[mine]

    def _share(self, options: BlendOptions):
        """Per run: its shared-segment tag for group-aligned selection, and whether it adopts
        the group's choice without probing (core/collective.share_runs)."""
        if options.group_selection != "aligned":
            return [[None] * len(runs) for runs in self.runs], [[False] * len(runs) for runs in self.runs]
        return share_runs([r.group if r.kept is None else None for r in self.requests],
                          [[GroupRun(run.segment, run.segment_offset, run.end - run.start) for run in runs]
                           for runs in self.runs], options.group_probe)

    def kept_shares(self, options: BlendOptions) -> list[float]:
        """Each request's share of its reused tokens to recompute (its fidelity budget applied;
        0 for a row selected before this forward: nothing more is chosen there)."""
        return [0.0 if r.kept is not None else
                kept_share(options.recompute_ratio, sum(run.end - run.start for run in runs), r.max_approximate)
                for r, runs in zip(self.requests, self.runs)]

    def reused_segments(self) -> list[list[ReusedSegment]]:
        return [[ReusedSegment(start + run.start, start + run.end, run.segment_offset, tag)
                 for run, tag in zip(runs, tags)]
                for start, runs, tags in zip(self.starts, self.runs, self.shared)]
