"""Which tokens of a prefill chunk read a cached segment (a Master), and from where: pure.

A prompt's shared segments are spans [start, end) with a content hash. A chunk of the prompt
[prefix_len, extend_end) (the whole prompt, or one piece under chunked prefill) reads, for
every span piece inside it whose segment is cached, the segment's tokens from the piece's
offset in the span: a `PlannedRun`. The server (srt/reuse: Masters are the forest's segment
entries) and the quality benchmark (bench/quality: Masters are dense KV tensors) plan with
this one function, so a benchmark measures the plan the server makes.

Rules: the prompt's last token is always computed (its logits start the answer); a Master
shorter than its span (a registered output lacks its last token's KV) covers only its
length, and the rest of the span is computed.

Under chunked prefill the server may choose a prompt's recomputed tokens once, over all its
chunks (`PromptSelection`, srt/prompt_selection.py): each chunk then reads only the runs that
choice covered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Sequence, TypeVar

import torch

from sglang_tokendance.core.blend_types import ProbeStates
from sglang_tokendance.core.segments import SegmentSpan

Master = TypeVar("Master")


@dataclass(frozen=True)
class PlannedRun(Generic[Master]):
    """Prompt positions [start, end) read from `master`, whose token `segment_offset` is the
    run's first (non-zero when the span began before the chunk)."""

    start: int
    end: int
    segment_offset: int
    master: Master

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class ChunkRuns(Generic[Master]):
    """A chunk's runs in prompt order, and which spans (by index) the lookup found or missed."""

    runs: list[PlannedRun[Master]] = field(default_factory=list)
    found: list[int] = field(default_factory=list)
    missed: list[int] = field(default_factory=list)

    @property
    def reused_tokens(self) -> int:
        return sum(len(run) for run in self.runs)


EXTENSION_MIN_TOKENS = 2  # the shortest run a missed span reads from its found neighbour's neighbour


def plan_chunk(spans: Sequence[SegmentSpan], lookup: Callable[[SegmentSpan], tuple[Master, int] | None],
               prefix_len: int, extend_end: int, prompt_len: int,
               neighbour: Callable[[Master, bool], tuple[Master, Sequence[int], int] | None] | None = None,
               ids: Sequence[int] = ()) -> ChunkRuns[Master]:
    """The runs of chunk [prefix_len, extend_end) of a `prompt_len`-token prompt.
    `lookup(span)` gives a span's cached Master and its cached length, or None; it is
    called only for the spans that overlap the chunk, and for their neighbours.

    With `neighbour` (and the prompt's `ids`), a missed span next to a found one reads the
    tokens it shares with the Master its author cached beside the found one (`neighbour(master,
    before)`: that Master, its ids and cached length; `before`: the one cached right before
    `master`): content-defined chunks cut shared text where the content says, so the text's
    head shares a chunk with whatever preceded it (and its tail with what follows); the chunk
    misses, but its tokens next to the found chunk are the neighbour Master's."""
    plan: ChunkRuns[Master] = ChunkRuns()
    last_fresh = prompt_len - 1
    looked: dict[int, tuple[Master, int] | None] = {}

    def once(index: int) -> tuple[Master, int] | None:  # each span looked up once per plan
        if index not in looked:
            looked[index] = lookup(spans[index])
        return looked[index]

    for index, span in enumerate(spans):
        start, end = max(span.start, prefix_len), min(span.end, extend_end, last_fresh)
        if end <= start:
            continue
        found = once(index)
        if found is None:
            plan.missed.append(index)
            continue
        master, length = found
        plan.found.append(index)
        end = min(end, span.start + length)
        if end > start:
            plan.runs.append(PlannedRun(start, end, start - span.start, master))
    if neighbour is not None:
        plan.runs += _extensions(spans, plan.missed, once, neighbour, ids, prefix_len, min(extend_end, last_fresh))
        plan.runs.sort(key=lambda run: run.start)
    return plan


def _extensions(spans: Sequence[SegmentSpan], missed: list[int], lookup, neighbour, ids: Sequence[int],
                lo: int, hi: int) -> list[PlannedRun]:
    """The runs of the `missed` spans that continue a found neighbour span (`plan_chunk`), within
    positions [lo, hi); `lookup(index)`: a span's Master, by its index."""
    runs = []
    for index in missed:
        span, head, tail = spans[index], None, None
        if index + 1 < len(spans) and spans[index + 1].start == span.end:  # a found span after it
            head = _shared(span, lookup(index + 1), neighbour, ids, before=True)
        if index > 0 and spans[index - 1].end == span.start:  # a found span before it
            tail = _shared(span, lookup(index - 1), neighbour, ids, before=False)
        if head is not None and tail is not None and tail[0] + tail[1] > head[0]:
            tail = None  # they overlap: the run ending where the next found span starts is kept
        for piece in (tail, head):
            if piece is None:
                continue
            start, n, master, offset = piece
            clipped = max(start, lo), min(start + n, hi)
            if clipped[1] - clipped[0] >= EXTENSION_MIN_TOKENS:
                runs.append(PlannedRun(clipped[0], clipped[1], offset + clipped[0] - start, master))
    return runs


def _shared(span: SegmentSpan, found, neighbour, ids: Sequence[int], before: bool):
    """(first position, length, Master, offset in it) of the tokens `span` shares with the
    Master cached `before` (or after) the one `found` for its neighbour span; None: none."""
    near = None if found is None else neighbour(found[0], before)
    if near is None:
        return None
    master, theirs, length = near
    mine = ids[span.start:span.end]
    n = common_run(mine, theirs, at_end=before)
    if before:
        start, offset = span.end - n, len(theirs) - n
    else:
        start, offset = span.start, 0
    n = min(n, length - offset)  # a Master shorter than its ids (a registered output) covers its length
    return None if n < EXTENSION_MIN_TOKENS else (start, n, master, offset)


def common_run(mine: Sequence[int], theirs: Sequence[int], at_end: bool) -> int:
    """How many tokens the two sequences share at their ends (`at_end`) or at their starts."""
    n, most = 0, min(len(mine), len(theirs))
    while n < most and (mine[-1 - n] == theirs[-1 - n] if at_end else mine[n] == theirs[n]):
        n += 1
    return n


@dataclass(frozen=True)
class PromptSelection:
    """Which of a prompt's positions [start, start + len) read a Master (`reused`) and which of
    those are recomputed (`kept`): one selection made before the prompt's chunks ran (host
    bool masks over the positions)."""

    start: int
    reused: torch.Tensor
    kept: torch.Tensor
    states: ProbeStates | None = None  # the probe's states of the computed positions, for the chunks to resume

    def covers(self, run: PlannedRun) -> bool:
        """Whether every position of `run` was planned as reused."""
        lo, hi = run.start - self.start, run.end - self.start
        return 0 <= lo and hi <= self.reused.numel() and bool(self.reused[lo:hi].all())

    def kept_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The kept mask of `positions` (planned reused positions), on their device."""
        return self.kept[positions.cpu() - self.start].to(positions.device)

    def states_for(self, computed: torch.Tensor) -> ProbeStates | None:
        """The carried probe states of a chunk that computes the positions `computed` (host,
        ascending), where they are exactly the positions planned to be computed in its span
        (fresh and kept); None otherwise (a Master evicted since the plan: its run is computed
        in full, from the first layer) or where no states were kept."""
        if self.states is None or not computed.numel():
            return None
        states = self.states.within(int(computed[0]), int(computed[-1]) + 1)
        return states if torch.equal(computed, states.positions) else None

    @classmethod
    def of(cls, start: int, end: int, runs: Sequence[PlannedRun], kept: torch.Tensor,
           states: ProbeStates | None = None) -> "PromptSelection":
        """The selection of positions [start, end) whose reused `runs` (in order) kept `kept`
        (a mask over the runs' tokens), with the probe's `states` of the positions computed."""
        reused, chosen = torch.zeros(end - start, dtype=torch.bool), torch.zeros(end - start, dtype=torch.bool)
        at = torch.cat([torch.arange(run.start, run.end) for run in runs]) - start
        reused[at], chosen[at] = True, kept.cpu()
        return cls(start, reused, chosen, states)
