"""What the blended prefill (core/blend.py) runs on, takes and returns.

The model and the KV storage come in through two small protocols (`LayerwiseModel`, `KVStore`),
so the same code runs inside SGLang (srt/model.py) and in the quality harness (bench/). Each
request of the batch is a `RequestRow` (its slots, the `ReusedRun`s it reads, its round group,
fidelity budget, a selection made before its forward and the `ProbeStates` carried with it);
`BlendOptions` are the server's recompute settings; `BlendStats` is what the forward reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple, Protocol, Sequence

import torch

from sglang_tokendance.core.selection import ReusedSegment, kept_share, most_kept

class LayerwiseModel(Protocol):
    """A decoder-only transformer driven one layer at a time."""

    num_layers: int

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def rotary(self, positions: torch.Tensor) -> Any:
        """The position encoding (cos/sin) of tokens at `positions`: built once per stage and
        handed to every layer's `qkv`."""

    def qkv(self, layer: int, hidden: torch.Tensor, rotary: Any
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, d] and k, v [n, kv_heads, d], q and K rotated by `rotary`."""

    def attention_scale(self, layer: int) -> float: ...

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output given its input and the attention output [n, heads * d]."""

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...


class KVStore(Protocol):
    """Per-layer KV buffers indexed by slot ([slots, kv_heads, d])."""

    def keys(self, layer: int) -> torch.Tensor: ...

    def values(self, layer: int) -> torch.Tensor: ...

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class BlendOptions:
    recompute_ratio: float = 0.0
    check_layer: int = 1
    block_head_tokens: int = 0
    granularity: str = "token"
    block_size: int = 16
    sparse_writeback: bool = True
    screen_layer: int = 0  # a screen runs when 1 <= screen_layer < check_layer (see `probe`)
    screen_factor: float = 2.0  # min(1, factor x recompute_ratio) of the reused tokens pass it
    group_selection: str = "per-request"  # or "aligned": one kept set per segment a round group shares
    group_probe: int = 0  # > 0 (aligned only): members per shared segment that probe it; the others adopt

    def __post_init__(self) -> None:
        if self.group_selection not in GROUP_SELECTIONS:
            raise ValueError(f"group selection must be one of {GROUP_SELECTIONS}, got {self.group_selection!r}")
        if self.group_probe < 0 or (self.group_probe and self.group_selection != "aligned"):
            raise ValueError(f"a shared probe ({self.group_probe} members) needs aligned group selection")

    @property
    def screened(self) -> bool:
        return 1 <= self.screen_layer < self.check_layer

    def chooses_per_request(self, max_approximate: int | None = None) -> bool:
        """Whether each request chooses its own kept tokens: the ratio (or a fidelity budget)
        leaves a choice, and no round group chooses together."""
        return ((self.recompute_ratio > 0 or max_approximate is not None) and not self.keeps_everything
                and self.group_selection == "per-request")

    def most_kept(self, runs: Sequence[ReusedRun], max_approximate: int | None, grouped: bool = False) -> int:
        """The most of one request's reused tokens (its `runs`) a blended prefill under these
        options can keep -- compute into slots of the request's own -- known before the forward:
        all of them at ratio 1 or where its round group may select shared segments together
        (`grouped`, aligned selection), else what `select_kept` can keep at its share."""
        reused = sum(run.end - run.start for run in runs)
        if self.keeps_everything or (grouped and self.group_selection == "aligned"):
            return reused
        segments = [ReusedSegment(run.start, run.end, run.segment_offset) for run in runs]
        return most_kept(segments, kept_share(self.recompute_ratio, reused, max_approximate),
                         granularity=self.granularity, block_size=self.block_size, head_tokens=self.block_head_tokens)

    @property
    def keeps_everything(self) -> bool:
        """Ratio 1 keeps every reused token whatever the scores (unless a screen passes fewer):
        a full prefill, which never reads the reused tokens' cached KV."""
        screen_share = min(1.0, self.screen_factor * self.recompute_ratio) if self.screened else 1.0
        return self.recompute_ratio >= 1.0 and screen_share >= 1.0


GROUP_SELECTIONS = ("per-request", "aligned")


class ReusedRun(NamedTuple):
    """Reused tokens [start, end), relative to the request's first extend token, restored from
    one cached segment whose token `segment_offset` is the run's first (non-zero when the
    segment began in an earlier prefill chunk or inside the radix prefix); `segment` names
    that segment (equal for equal cached KV; None: never shared with other requests)."""

    start: int
    end: int
    segment_offset: int = 0
    segment: Hashable | None = None


@dataclass(frozen=True)
class ProbeStates:
    """Computed tokens' states after the probe layers 0..c, for a later forward to resume them
    at layer c+1: their row `positions` (host, ascending), their hidden states entering layer
    c+1 ([n, hidden]) and their KV of layers 0..c (per layer [n, kv_heads, d], K rotated at
    each token's position)."""

    positions: torch.Tensor
    hidden: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return self.positions.numel()

    def within(self, start: int, end: int) -> "ProbeStates":
        """The states of the tokens at positions [start, end) (views)."""
        lo, hi = (int(i) for i in torch.searchsorted(self.positions, torch.tensor([start, end])))
        return ProbeStates(self.positions[lo:hi], self.hidden[lo:hi], tuple(k[lo:hi] for k in self.keys),
                           tuple(v[lo:hi] for v in self.values))


@dataclass
class RequestRow:
    """One request of the batch: its `num_tokens` extend tokens follow `prefix_len` tokens
    already in its KV row `slots` ([prefix_len + num_tokens]); `reused` lists its runs of
    reused tokens (ReusedRun, or a plain (start, end) pair for a run from a segment's start);
    `group` its round group (None: none), for group-aligned selection; `max_approximate` its
    fidelity budget in this forward: at most that many of its reused tokens keep their cached
    KV, more are recomputed than the recompute ratio says where needed (None: no bound).

    `own` (zero copy, Master-Mirror storage): the row's reused positions hold the cached
    segments' slots themselves (Masters, shared with other readers, never written here), and
    `own` the request's own slots for the reused tokens it keeps, at least as many as it can
    keep (`BlendOptions.most_kept`): its i-th kept token, in run order, is computed into
    own[i] (whose frame the forward records) and reads from there; the others read the
    Master. None: the row's slots are the request's own everywhere.

    `kept` (a mask over its reused tokens, run order): the selection was made before this
    forward. None of its reused tokens is probed or scored; the kept ones are computed with
    the fresh tokens, the others keep their cached KV, whatever the recompute ratio.
    `resumed` (with `kept`): the states that earlier probe left for exactly the row's computed
    tokens (fresh and kept, `ProbeStates`): they skip the probe layers and resume after them."""

    prefix_len: int
    num_tokens: int
    slots: torch.Tensor
    reused: Sequence[ReusedRun | tuple[int, int]] = ()
    group: Hashable | None = None
    own: torch.Tensor | None = None
    max_approximate: int | None = None
    kept: torch.Tensor | None = None
    resumed: ProbeStates | None = None


@dataclass
class BlendStats:
    """Work done, in token-layers, and what was kept (for reports and tests)."""

    token_layers: int = 0
    full_token_layers: int = 0
    reused_tokens: int = 0
    kept_tokens: int = 0
    adopted_tokens: int = 0  # reused tokens that skipped the probe (shared probe)
    adopted: torch.Tensor | None = field(default=None, repr=False)  # mask over the reused tokens
    kept: torch.Tensor | None = field(default=None, repr=False)  # mask over the reused tokens
