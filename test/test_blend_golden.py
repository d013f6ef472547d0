"""The blended prefill's outputs are pinned: a mixed batch on two tiny families, at ratio 0,
ratio 1 and several selections, must give the hidden states, kept masks, work counts and
final KV that the first implementation gave (test/data/blend_golden.pt, written by commit
19e66e1's core/blend with `python test/test_blend_golden.py --write`). Rewrites of the
blended prefill's internals (batched attention, scratch KV, one-pass attention mass) must
not change what it computes. Zero-copy reads of Masters written at other positions (read at a
shift, core/rope_attention) must compute the same as the copying run, selections included."""

from __future__ import annotations

import dataclasses

import sys
from pathlib import Path

import pytest
import torch

from sglang_tokendance.bench.hf_layerwise import HFLayerwise, full_prefill
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.blend import blended_prefill, carried_states, probe, select
from sglang_tokendance.core.blend_types import BlendOptions, ReusedRun, RequestRow
from sglang_tokendance.core.rope import RopeSpec, rerotate
from sglang_tokendance.core.rope_attention import ShiftedReads
from sglang_tokendance.core.slot_frames import SlotFrames
from sglang_tokendance.core.selection import rule_named
from sglang_tokendance.bench.tiny_models import tiny_layerwise

GOLDEN = Path(__file__).parent / "data" / "blend_golden.pt"
FAMILIES = ("llama", "qwen3")  # the blend is family-agnostic; Qwen3 adds per-head q/k norms

# (prefix_len, num_tokens, reused runs): a request with a radix prefix and a run starting
# inside its segment, one without hits, one with a single run
REQUESTS = [(5, 35, [ReusedRun(4, 20, 0), ReusedRun(22, 30, 3)]), (0, 25, []), (0, 40, [ReusedRun(10, 28)])]

SCENARIOS = {
    "plain": (BlendOptions(recompute_ratio=0.0), None),
    "ratio-one": (BlendOptions(recompute_ratio=1.0, check_layer=2, screen_layer=1), "attention-kv"),
    "default": (BlendOptions(recompute_ratio=0.3, check_layer=2, screen_layer=1), "attention-kv"),
    "unscreened-dense": (BlendOptions(recompute_ratio=0.3, check_layer=3, sparse_writeback=False), "attention-kv"),
    "blocks": (BlendOptions(recompute_ratio=0.5, check_layer=1, granularity="block", block_size=4,
                            block_head_tokens=2), "cacheblend-k"),
    "screened-dense": (BlendOptions(recompute_ratio=0.3, check_layer=3, screen_layer=1, sparse_writeback=False),
                       "cacheblend-kv"),
}


def tiny(arch: str) -> HFLayerwise:
    return tiny_layerwise(arch)


def batch(model: HFLayerwise) -> tuple[torch.Tensor, torch.Tensor, list[RequestRow], DenseKV]:
    """The mixed batch: ids, positions, rows (slots scattered over a shared pool) and a pool
    holding each prefix's exact KV and each reused run's KV from another context."""
    gen = torch.Generator().manual_seed(7)
    total = sum(p + n for p, n, _ in REQUESTS)
    order = torch.randperm(total, generator=gen)
    kv = DenseKV(model.num_layers, total, *model.kv_shape())
    ids, positions, rows, used = [], [], [], 0
    for prefix, n, runs in REQUESTS:
        seq = torch.randint(3, 512, (prefix + n,), generator=gen)
        other = torch.randint(3, 512, (prefix + n,), generator=gen)
        slots = order[used:used + prefix + n]
        used += prefix + n
        _, exact = full_prefill(model, seq)
        _, elsewhere = full_prefill(model, torch.where(torch.rand(prefix + n, generator=gen) < 0.5, other, seq))
        reused = torch.zeros(prefix + n, dtype=torch.bool)
        for run in runs:
            reused[prefix + run.start:prefix + run.end] = True
        for layer in range(model.num_layers):
            source = torch.where(reused[:, None, None], elsewhere.keys(layer), exact.keys(layer))
            kv.write(layer, slots[:prefix], exact.keys(layer)[:prefix], exact.values(layer)[:prefix])
            kv.write(layer, slots[reused], source[reused],
                     torch.where(reused[:, None, None], elsewhere.values(layer), exact.values(layer))[reused])
        ids.append(seq[prefix:])
        positions.append(torch.arange(prefix, prefix + n))
        rows.append(RequestRow(prefix, n, slots, reused=runs))
    return torch.cat(ids), torch.cat(positions), rows, kv


@torch.no_grad()
def outputs(arch: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every scenario's results."""
    model = tiny(arch)
    ids, positions, rows, pool = batch(model)
    got = {}
    for name, (options, rule) in SCENARIOS.items():
        kv = pool.clone()
        hidden, stats = blended_prefill(model, kv, ids, positions, rows, options, rule and rule_named(rule))
        got[name] = {"hidden": hidden, "k": kv.k, "v": kv.v,
                     "kept": stats.kept if stats.kept is not None else torch.zeros(0, dtype=torch.bool),
                     "work": torch.tensor([stats.token_layers, stats.full_token_layers, stats.reused_tokens,
                                           stats.kept_tokens])}
    return got


@pytest.fixture(scope="module")
def golden():
    return torch.load(GOLDEN)


@pytest.mark.parametrize("arch", FAMILIES)
def test_outputs_match_the_first_implementation(arch, golden):
    got = outputs(arch)
    for name, want in golden[arch].items():
        assert torch.equal(got[name]["kept"], want["kept"]), name
        assert torch.equal(got[name]["work"], want["work"]), name
        for key in ("hidden", "k", "v"):
            torch.testing.assert_close(got[name][key], want[key], atol=2e-5, rtol=2e-5, msg=f"{name} {key}")


AUTHOR_SHIFTS = (9, -3, 40)  # where a Master's author wrote it, relative to where the reader reads it


def zero_copy_batch(rows: list[RequestRow], pool: DenseKV, spec: RopeSpec, options: BlendOptions | None = None
                    ) -> tuple[list[RequestRow], DenseKV, torch.Tensor, ShiftedReads]:
    """The same batch read in place: every reused token's KV moved to a Master slot past the
    pool's, written by its author at another position (run k at the reader's position minus
    AUTHOR_SHIFTS[k % 3], never below 0: K rotated there, the slot's frame), the rows pointing
    there, own slots (left empty) in `own`: as many as `options` let the row keep
    (`BlendOptions.most_kept`; every reused position's, None), the first of the reused
    positions' slots; and the reads at a shift over the slots' frames (every other slot
    written at its position in its row)."""
    masters = torch.cat([row.slots[row.prefix_len + r.start:row.prefix_len + r.end] for row in rows
                         for r in row.reused])
    size = pool.k.shape[1]
    master_slots = torch.arange(size, size + masters.numel())
    out = DenseKV.__new__(DenseKV)
    out.k, out.v = torch.cat([pool.k, pool.k[:, masters]], 1), torch.cat([pool.v, pool.v[:, masters]], 1)
    out.k[:, masters], out.v[:, masters] = 0.0, 0.0  # own slots start empty: nothing may read them unwritten
    frames = SlotFrames(size + masters.numel())
    moved, used, runs = [], 0, 0
    for row in rows:
        frames.record(row.slots, torch.arange(row.slots.numel()))
        slots, own = row.slots.clone(), []
        for r in row.reused:
            n, at = r.end - r.start, torch.arange(row.prefix_len + r.start, row.prefix_len + r.end)
            own.append(slots[at].clone())
            mine = master_slots[used:used + n]
            written = at - AUTHOR_SHIFTS[runs % 3]
            written = written - written.min().clamp(max=0)  # an author's positions are never below 0
            out.k[:, mine] = rerotate(out.k[:, mine].transpose(0, 1), at, written, spec).transpose(0, 1)
            frames.record(mine, written)
            slots[at] = mine
            used, runs = used + n, runs + 1
        own = torch.cat(own) if own else None
        if own is not None and options is not None:
            reused = [ReusedRun(*r) for r in row.reused]
            own = own[:row.kept.sum() if row.kept is not None else
                      options.most_kept(reused, row.max_approximate, row.group is not None)]
        moved.append(dataclasses.replace(row, slots=slots, own=own))
    return moved, out, master_slots, ShiftedReads(spec, frames)


def kept_in_own_slots(rows: list[RequestRow], zero_rows: list[RequestRow], kept: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where zero copy computed the kept tokens (`kept`, a mask over the batch's reused tokens):
    each row's first own slots, one per kept token in run order; where the copying run
    (`rows`) computed them (their row slots); their row positions; and the own slots left over."""
    at, own, copied, held_at, spare = 0, [], [], [], []
    for row, zero in zip(rows, zero_rows):
        positions = torch.cat([torch.arange(r.start, r.end) for r in row.reused]) + row.prefix_len \
            if row.reused else torch.zeros(0, dtype=torch.int64)
        mine = kept[at:at + positions.numel()]
        at += positions.numel()
        if zero.own is None:
            continue
        count = int(mine.sum())
        assert count <= zero.own.numel()
        own.append(zero.own[:count])
        spare.append(zero.own[count:])
        copied.append(row.slots[positions[mine]])
        held_at.append(positions[mine])
    return torch.cat(own).long(), torch.cat(copied).long(), torch.cat(held_at).int(), torch.cat(spare).long()


@pytest.mark.parametrize("arch", FAMILIES)
def test_zero_copy_reads_masters_in_place_and_writes_only_kept_tokens(arch):
    """Mirror storage, zero copy: rows read the reused tokens' KV in Master slots written at
    other positions (shifts up and down) and carry their own slots. The hidden states and kept
    masks equal the copying run's (K rotated into the reader's positions); a kept token's
    KV is written into its own slot (equal to what the copying run wrote at its slot); a token
    not kept reads the Master, whose slots are never written; dense write-back is refused."""
    model = tiny(arch)
    ids, positions, rows, pool = batch(model)
    spec = RopeSpec.from_hf_config(model.lm.config)
    for name, (options, rule) in SCENARIOS.items():
        zero_rows, zero_pool, master_slots, reads = zero_copy_batch(rows, pool, spec, options)
        shifts = torch.cat([reads.shifts(row.slots) for row in zero_rows])
        assert (shifts > 0).any() and (shifts < 0).any()  # Masters read above and below where they were written
        rule = rule and rule_named(rule)
        copied = pool.clone()
        want, want_stats = blended_prefill(model, copied, ids, positions, rows, options, rule)
        kv = zero_pool.clone()
        if not options.sparse_writeback:
            with pytest.raises(ValueError, match="sparse write-back"):
                blended_prefill(model, kv, ids, positions, zero_rows, options, rule, reads)
            continue
        got, stats = blended_prefill(model, kv, ids, positions, zero_rows, options, rule, reads)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        assert (stats.kept is None) == (want_stats.kept is None), name
        assert stats.kept is None or torch.equal(stats.kept, want_stats.kept), name
        assert torch.equal(kv.k[:, master_slots], zero_pool.k[:, master_slots]), name  # Masters untouched
        assert torch.equal(kv.v[:, master_slots], zero_pool.v[:, master_slots]), name
        kept = stats.kept if stats.kept is not None else torch.zeros(master_slots.numel(), dtype=torch.bool)
        own, at, held_at, spare = kept_in_own_slots(rows, zero_rows, kept)
        torch.testing.assert_close(kv.k[:, own], copied.k[:, at], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(kv.v[:, own], copied.v[:, at], atol=1e-5, rtol=1e-5, msg=name)
        assert torch.equal(reads.frames.frame[own], held_at), name  # each recorded where it was computed
        assert not kv.k[:, spare].any(), name  # an own slot no kept token took is never written
        fresh = torch.cat([row.slots[row.prefix_len:] for row in zero_rows])
        fresh = fresh[~torch.isin(fresh, master_slots)]
        torch.testing.assert_close(kv.k[:, fresh], copied.k[:, fresh], atol=1e-5, rtol=1e-5, msg=name)


def runs_without(runs: list[ReusedRun], kept: torch.Tensor) -> list[ReusedRun]:
    """`runs` with the tokens `kept` (a mask over their tokens) taken out: those become fresh."""
    pieces, at = [], 0
    for run in runs:
        mask = kept[at:at + run.end - run.start]
        at += run.end - run.start
        start = None
        for i, taken in enumerate(mask.tolist() + [True]):
            if not taken and start is None:
                start = i
            elif taken and start is not None:
                pieces.append(ReusedRun(run.start + start, run.start + i, run.segment_offset + start))
                start = None
    return pieces


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("scenario", ["default", "unscreened-dense", "plain"])
@torch.no_grad()
def test_a_row_selected_before_its_forward_computes_its_kept_tokens_as_fresh_ones(arch, scenario):
    """A row whose selection was made before the forward (RequestRow.kept: the server's planned
    selection under chunked prefill) is neither probed nor re-selected: it computes exactly what
    the same row computes at ratio 0 with its kept tokens as fresh tokens, whatever the batch's
    options and whatever the other rows select; the other rows compute what they compute
    without it; the kept mask reported is the given one. Zero copy: the kept tokens go into
    their own slots and the outputs equal the copying run's."""
    model = tiny(arch)
    ids, positions, rows, pool = batch(model)
    options, rule = SCENARIOS[scenario]
    rule = rule and rule_named(rule)
    reused = sum(r.end - r.start for r in rows[0].reused)
    given = torch.arange(reused) % 3 == 1
    selected = [dataclasses.replace(rows[0], kept=given), *rows[1:]]
    kv = pool.clone()
    got, stats = blended_prefill(model, kv, ids, positions, selected, options, rule)
    assert torch.equal(stats.kept[:reused], given)

    alone = pool.clone()
    n0 = rows[0].num_tokens
    want0, _ = blended_prefill(model, alone, ids[:n0], positions[:n0],
                               [dataclasses.replace(rows[0], reused=runs_without(rows[0].reused, given))],
                               BlendOptions(recompute_ratio=0.0), None)
    torch.testing.assert_close(got[:n0], want0, atol=1e-5, rtol=1e-5)
    row0 = rows[0].slots[rows[0].prefix_len:]
    torch.testing.assert_close(kv.k[:, row0], alone.k[:, row0], atol=1e-5, rtol=1e-5)
    others = pool.clone()
    want, want_stats = blended_prefill(model, others, ids[n0:], positions[n0:], rows[1:], options, rule)
    torch.testing.assert_close(got[n0:], want, atol=1e-5, rtol=1e-5)
    assert want_stats.kept is None or torch.equal(stats.kept[reused:], want_stats.kept)

    if not options.sparse_writeback:
        return
    spec = RopeSpec.from_hf_config(model.lm.config)
    zero_rows, zero_pool, master_slots, reads = zero_copy_batch(selected, pool, spec, options)
    assert zero_rows[0].own.numel() == int(given.sum())  # a row selected before owns a slot per kept token
    zero_kv = zero_pool.clone()
    zero_got, zero_stats = blended_prefill(model, zero_kv, ids, positions, zero_rows, options, rule, reads)
    torch.testing.assert_close(zero_got, got, atol=1e-5, rtol=1e-5)
    assert torch.equal(zero_stats.kept, stats.kept)
    assert torch.equal(zero_kv.k[:, master_slots], zero_pool.k[:, master_slots])  # Masters untouched
    own, at, _, _ = kept_in_own_slots(selected, zero_rows, zero_stats.kept)
    torch.testing.assert_close(zero_kv.k[:, own], kv.k[:, at], atol=1e-5, rtol=1e-5)


def chunk_row(row: RequestRow, lo: int, hi: int, kept: torch.Tensor) -> tuple[RequestRow, torch.Tensor]:
    """The chunk [lo, hi) of `row`'s extend tokens as a row of its own (its runs clipped, their
    segment offsets moved on), and its part of `kept` (a mask over the row's reused tokens)."""
    runs, parts, at = [], [], 0
    for run in row.reused:
        start, end = max(run.start, lo), min(run.end, hi)
        if start < end:
            runs.append(ReusedRun(start - lo, end - lo, run.segment_offset + start - run.start))
            parts.append(kept[at + start - run.start:at + end - run.start])
        at += run.end - run.start
    part = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    return dataclasses.replace(row, prefix_len=row.prefix_len + lo, num_tokens=hi - lo, reused=runs, kept=part), part


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("scenario", ["default", "blocks", "unscreened-dense"])
@torch.no_grad()
def test_chunks_resuming_the_probes_states_compute_the_unchunked_blended_prefill(arch, scenario):
    """Planned selection with the probe's states carried over (RequestRow.resumed, the server's
    chunked prefill): a prompt probed once over its whole extend, then forwarded in chunks whose
    computed tokens resume after the probe layers, gives the unchunked blended prefill's hidden
    states, KV and work -- a chunk without reused tokens included, and a chunk batched with
    rows that probe and select for themselves. Under dense write-back nothing is carried."""
    model = tiny(arch)
    ids, positions, rows, pool = batch(model)
    options, rule = SCENARIOS[scenario]
    rule = rule_named(rule)
    row, n = rows[0], rows[0].num_tokens
    whole = pool.clone()
    want, want_stats = blended_prefill(model, whole, ids[:n], positions[:n], [row], options, rule)

    scratch = pool.clone()
    checked = probe(model, scratch, ids[:n], positions[:n], [row], rule, options)
    kept = select(checked, rule, options)
    states = carried_states(checked, kept, scratch, options)
    if not options.sparse_writeback:
        assert states is None
        return
    assert torch.equal(kept, want_stats.kept) and len(states) == n - int((~kept).sum())
    kv, got, work = pool.clone(), [], checked.batch.stats.token_layers
    others = slice(n, None)
    for lo, hi in ((0, 3), (3, 14), (14, 26), (26, n)):  # (0, 3): no reused token
        part_row, part = chunk_row(row, lo, hi, kept)
        part_row.resumed = states.within(row.prefix_len + lo, row.prefix_len + hi)
        batch_rows, chunk_ids, chunk_positions = [part_row], ids[lo:hi], positions[lo:hi]
        if lo == 14:  # batched with rows that probe for themselves
            batch_rows += rows[1:]
            chunk_ids, chunk_positions = torch.cat([chunk_ids, ids[others]]), torch.cat([chunk_positions,
                                                                                          positions[others]])
        hidden, stats = blended_prefill(model, kv, chunk_ids, chunk_positions, batch_rows, options, rule)
        assert torch.equal(stats.kept[:part.numel()], part)
        got.append(hidden[:hi - lo])
        if lo == 14:
            alone, alone_stats = blended_prefill(model, pool.clone(), ids[others], positions[others], rows[1:],
                                                 options, rule)
            torch.testing.assert_close(hidden[hi - lo:], alone, atol=1e-5, rtol=1e-5)
            work += stats.token_layers - alone_stats.token_layers
        else:
            work += stats.token_layers
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)
    slots = row.slots[:row.prefix_len + n]
    torch.testing.assert_close(kv.k[:, slots], whole.k[:, slots], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.v[:, slots], whole.v[:, slots], atol=1e-5, rtol=1e-5)
    assert work == want_stats.token_layers  # the probe layers ran once for every token
    early = states.within(row.prefix_len, row.prefix_len + 3)
    wrong = dataclasses.replace(chunk_row(row, 3, 14, kept)[0], resumed=early)
    with pytest.raises(ValueError, match="do not match"):
        blended_prefill(model, pool.clone(), ids[3:14], positions[3:14], [wrong], options, rule)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.parent.mkdir(exist_ok=True)
    torch.save({arch: outputs(arch) for arch in FAMILIES}, GOLDEN)
    print(f"wrote {GOLDEN}")
