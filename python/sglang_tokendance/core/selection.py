"""Which reused tokens a blended prefill recomputes: scoring rules and the top-r choice.

A rule scores each reused token at the check layer c from what the probe pass saw there (the
token's cached KV next to its freshly computed KV, and optionally how much attention the
request's fresh tokens pay it); `select_kept` turns scores into the kept set under a budget of
r x (reused tokens) per request, at token or block granularity (blocks of `block_size` tokens
counted from each reused segment's start), with the first `block_head_tokens` of every
segment always kept. A request with a fidelity budget (at most M of its reused tokens keep
their cached KV: `--tokendance-max-approximate-tokens`) has r raised to 1 - M / reused where
that is more (`kept_share`): the decode error grows with the number of approximate tokens,
not their share, so a fixed r loses fidelity as a round's agents (and blocks) grow.

Rules (`--tokendance-selection`):
* cacheblend-k / cacheblend-v / cacheblend-kv: CacheBlend's deviation of K, V or both at
  layer c (squared L2 over heads) -- the baseline.
* attention-kv: our rule. A reused token's error reaches the output only through the
  attention later tokens pay it, and a single shallow layer's deviation predicts the deep
  deviation poorly. So: the token's K+V deviation summed over every probe layer 1..c (each
  layer's deviations divided by their mean, so no layer dominates), times the square root of
  the attention mass the fresh tokens (private text, suffix, the last prompt token) pay it at
  layer c (a token no fresh token of the forward follows -- in a prefill chunk that ends in
  reused text -- counts as the average seen token). It needs a probe a few layers deep (c >= 3;
  measured best at c = 5); at c = 1 it is worse than CacheBlend's rule (benchmark/results/quality.md).

The metric they optimise: users feel the decode steps' KL on content tokens (the first output
token's KL hides most of the error), and the default is chosen on it: CacheBlend's K+V
deviation checked at c = 8, screened at layer 1 (`bench_quality --fidelity`, four seeds, N = 4,
10 and 16, two workloads: benchmark/results/quality_selection_retune.md and
quality_default_switch.md). The earlier default, attention-kv at c = 5, was chosen on the first
token's KL; its attention factor favours what the prompt's last tokens read, which helps the
first token and not decode. The fidelity budget bounds the decode error whatever the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

import torch

GRANULARITIES = ("token", "block")


@dataclass
class CheckState:
    """What the probe pass (layers 0..c on every token) leaves for a rule, per probe layer:
    the reused tokens' cached and recomputed K/V ([R, kv_heads, d], batch order)."""

    cached_k: list[torch.Tensor] = field(default_factory=list)
    cached_v: list[torch.Tensor] = field(default_factory=list)
    computed_k: list[torch.Tensor] = field(default_factory=list)
    computed_v: list[torch.Tensor] = field(default_factory=list)
    attention_received: torch.Tensor | None = None  # [R] mass fresh queries pay at layer c

    def deviation(self, layer: int, which: str) -> torch.Tensor:
        """Squared L2 deviation per reused token at probe layer `layer` ("k", "v" or "kv")."""
        dev = torch.zeros(self.cached_k[layer].shape[0], device=self.cached_k[layer].device)
        if "k" in which:
            dev += (self.computed_k[layer] - self.cached_k[layer]).float().pow(2).sum((1, 2))
        if "v" in which:
            dev += (self.computed_v[layer] - self.cached_v[layer]).float().pow(2).sum((1, 2))
        return dev


@dataclass(frozen=True)
class SelectionRule:
    name: str
    score: Callable[[CheckState], torch.Tensor]  # [R] higher = recompute first
    needs_attention: bool = False


def _normalised(dev: torch.Tensor) -> torch.Tensor:
    return dev / dev.mean().clamp_min(1e-12)


def _attention_kv(state: CheckState) -> torch.Tensor:
    deviation = sum(_normalised(state.deviation(layer, "kv")) for layer in range(1, len(state.cached_k)))
    return deviation * _seen_or_average(state.attention_received.sqrt())


def _seen_or_average(weight: torch.Tensor) -> torch.Tensor:
    """A reused token that no fresh token of this forward comes after receives no attention
    mass at all (exactly 0): under chunked prefill, the text that will read it (the suffix, the
    last prompt token) is in a later chunk. Such a token is weighted as the average token that
    was seen, so its deviation alone ranks it; 0 would never recompute it. (With no seen token,
    deviation alone ranks them all.)"""
    seen = weight > 0
    average = weight.sum() / seen.sum().clamp_min(1)
    return torch.where(seen, weight, torch.where(seen.any(), average, torch.ones_like(average)))


RULES: dict[str, SelectionRule] = {
    "cacheblend-k": SelectionRule("cacheblend-k", lambda s: s.deviation(-1, "k")),
    "cacheblend-v": SelectionRule("cacheblend-v", lambda s: s.deviation(-1, "v")),
    "cacheblend-kv": SelectionRule("cacheblend-kv", lambda s: s.deviation(-1, "kv")),
    "attention-kv": SelectionRule("attention-kv", _attention_kv, needs_attention=True),
}


def fixed_scores(name: str, scores: torch.Tensor) -> SelectionRule:
    """A rule whose scores are known in advance (the quality harness's oracle)."""
    return SelectionRule(name, lambda state: scores)


def rule_named(name: str) -> SelectionRule:
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown selection rule {name!r}; choose one of {', '.join(RULES)}") from None


@dataclass(frozen=True)
class ReusedSegment:
    """A run of reused tokens restored from one cached segment: [start, end) in the flattened
    batch, whose first token is token `offset` of its segment (blocks and head tokens are
    counted from the segment's start, so a segment split over prefill chunks is cut the same
    way in every chunk). `shared` = (pool, segment): the run is selected in that pool with every
    other run of the same segment, one kept set for all of them (group-aligned selection,
    core/collective.share_runs); None: in its request's own pool."""

    start: int
    end: int
    offset: int = 0
    shared: tuple[Hashable, Hashable] | None = None


def kept_share(ratio: float, reused: int, max_approximate: int | None) -> float:
    """The share of a request's `reused` tokens to recompute: `ratio`, raised where needed so
    that at most `max_approximate` of them keep their cached KV (None: no bound)."""
    if max_approximate is None or reused <= max_approximate:
        return ratio
    return max(ratio, 1.0 - max_approximate / reused)


def credited_allowance(ratio: float, reused: int, credit: int, max_approximate: int | None) -> int | None:
    """The fidelity budget (reused tokens that may keep their cached KV) under which a request
    recomputes round(ratio x (reused + credit)) of its `reused` tokens (all of them at most):
    `credit` counts block tokens it holds exactly that would otherwise be reused too
    (core/recurrence `Recurrence.seen`), so they stay in the pool its share is taken of;
    `max_approximate` its own budget, which wins where it is lower (None: no bound)."""
    if credit <= 0 or ratio <= 0 or reused <= 0:
        return max_approximate
    credited = reused - min(reused, round(ratio * (reused + credit)))
    return credited if max_approximate is None else min(credited, max_approximate)


def most_kept(segments: Sequence[ReusedSegment], share: float, *, granularity: str = "token",
              block_size: int = 16, head_tokens: int = 0) -> int:
    """The most tokens `select_kept` can keep of one request whose runs `segments` form its own
    pool (none `shared`) at `share`: its head tokens, or its budget plus what the last unit
    taken can overshoot it by (a block's tokens but one). Known before the forward, so the
    request's own slots can be allocated for exactly that many (zero-copy storage)."""
    runs = [(seg.offset, seg.end - seg.start) for seg in segments if seg.end > seg.start]
    heads = sum(max(0, min(head_tokens, offset + n) - offset) for offset, n in runs)
    budget = pool_budget((share, n) for _, n in runs)
    unit = block_size if granularity == "block" else 1
    return min(sum(n for _, n in runs), heads if budget <= heads else budget - 1 + unit)


def pool_budget(parts: Iterable[tuple[float, int]]) -> int:
    """Tokens a selection pool keeps: round(sum of ratio x tokens) over its (ratio, tokens)
    parts, the tokens of one ratio summed first. So a pool of one ratio keeps round(ratio x
    its tokens) however its runs are split: `most_kept` (the own slots allocated before the
    forward) and `select_kept` must agree to the token, and a float sum of per-run products
    may not round like the product of the sum (0.1 x 1 + 0.1 x 24 > 2.5)."""
    tokens: dict[float, int] = {}
    for ratio, n in parts:
        tokens[ratio] = tokens.get(ratio, 0) + n
    return round(sum(ratio * n for ratio, n in tokens.items()))


def select_kept(scores: torch.Tensor, requests: Sequence[Sequence[ReusedSegment]], ratios: Sequence[float], *,
                granularity: str = "token", block_size: int = 16, head_tokens: int = 0) -> torch.Tensor:
    """Kept-token mask over the reused tokens (batch order, the order of the segments given),
    `ratios` the share to keep of each request's.

    Tokens are selected in pools, each under a budget of round(sum of ratio x tokens over its
    requests' runs): a request's runs not `shared` form its own pool; shared runs form their
    pool, where the tokens at the same unit of the same segment (in any request) are one unit,
    kept or not as one. Per pool,
    head tokens come first, then the best units (tokens, or whole blocks) ranked by the mean
    score of their tokens, until the budget is covered. A NaN score is no score (a token that
    takes its unit's choice without having been scored); a unit with none ranks last."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if len(ratios) != len(requests):
        raise ValueError(f"one ratio per request: {len(ratios)} ratios for {len(requests)} requests")
    kept = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    pools: dict[Hashable, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}  # (row, unit id, head, ratio)
    segment_index: dict[Hashable, int] = {}  # shared segment -> its index (its units' ids: index, unit)
    next_unit = row = 0
    for index, segments in enumerate(requests):
        for seg in segments:
            if seg.end <= seg.start:
                continue
            within = torch.arange(seg.offset, seg.offset + seg.end - seg.start, device=scores.device)
            per_unit = within // block_size if granularity == "block" else within
            if seg.shared is None:
                unit, pool = per_unit - per_unit[0] + next_unit, ("request", index)
                next_unit += int(per_unit[-1] - per_unit[0]) + 1
            else:  # the same id for the same unit of the segment, in every run of it
                index_of = segment_index.setdefault(seg.shared, len(segment_index))
                unit, pool = per_unit + (index_of << 32), ("shared", seg.shared[0])
            pools.setdefault(pool, []).append((row, unit, within < head_tokens, ratios[index]))
            row += unit.numel()
    for parts in pools.values():
        rows = torch.cat([torch.arange(r, r + u.numel(), device=scores.device) for r, u, _, _ in parts])
        ids, unit = torch.unique(torch.cat([u for _, u, _, _ in parts]), return_inverse=True)
        head = torch.cat([h for _, _, h, _ in parts])
        budget = pool_budget((ratio, u.numel()) for _, u, _, ratio in parts)
        kept[rows] = _top_units(scores[rows].float(), unit, head, ids.numel(), budget)
    return kept


def _top_units(scores: torch.Tensor, unit: torch.Tensor, head: torch.Tensor, units: int,
               budget: int) -> torch.Tensor:
    """The kept mask of one pool's tokens: heads, then whole units by mean score (NaN: not
    scored) until `budget` tokens are taken; ties keep the units' order."""
    scored = ~scores.isnan()
    zeros = scores.new_zeros(units)
    total = zeros.clone().index_add_(0, unit, torch.where(scored, scores, zeros[unit]))
    count = zeros.clone().index_add_(0, unit, scored.float())
    size = zeros.clone().index_add_(0, unit, (~head).float())  # tokens a unit adds beyond heads
    mean = torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, float("-inf")))
    order = torch.argsort(mean, descending=True, stable=True)
    before = torch.cumsum(size[order], 0) - size[order]  # tokens taken before each unit
    chosen = order[int(head.sum()) + before < budget]
    return head | torch.isin(unit, chosen)
