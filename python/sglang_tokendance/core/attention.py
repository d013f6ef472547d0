"""Attention for a blended prefill's scattered queries, batched over the extend batch.

When only some tokens of a prompt are computed (the rest reuse cached KV), the queries are no
longer the contiguous suffix SGLang's extend kernels assume. Each query attends to every key
whose position is not after its own, over its request's whole KV row (a token's position is
its index in that row, as in SGLang).

A stage of the blended prefill (a fixed set of computed tokens, used by several layers) lays
its queries out once (`plan_grids`) in at most two padded grids, and every layer then runs
one SDPA call per grid -- no per-request loop, no host sync, GQA inside SDPA:
* requests whose tokens are nearly all computed (all of a plain prefill's) run causal by
  index, each query at its own position in a [B, Lk] grid, as SGLang's torch backend does
  per request (the few rows not computed are padding): SDPA's causal kernel skips the blocks
  above the diagonal;
* the others run packed ([B, max queries]) under an additive position mask, built once.
A dense mask over the flattened batch would cost O(total tokens^2); these grids cost what
per-request attention costs, plus padding.

`attend` also takes the seams the blended prefill needs: `overlay` KV for tokens whose KV
must not reach the pool yet (the probe's, for reused tokens: their cached KV stays there),
keys read at a shift (`KeyReads`: a row reading a slot whose K was rotated at another position,
core/rope_attention), and the attention mass the grid's queries pay chosen keys, from the same
pass's log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F

# Computed share of its row from which a request runs causal by index. SDPA on the CPU costs
# about the same per scored pair either way (masked [q, P] vs causal P^2 / 2, which skips the
# blocks above the diagonal: measured at P = 256..4096, 2 threads), so the grid with fewer
# pairs wins: causal from half the row on.
CAUSAL_SHARE = 1 / 2


class KeyReads(Protocol):
    """How gathered keys reach their reader's positions (core/rope_attention.ShiftedReads)."""

    def shifts(self, slots: torch.Tensor) -> torch.Tensor:
        """[..., Lk] shift of each slot of rows [..., Lk] read at positions 0..Lk-1."""

    def shift_(self, k: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """k [..., heads, d] rotated in place by `shift` [...]."""


@dataclass(frozen=True)
class MassPlan:
    """Which (query, key) pairs of a grid count towards the attention mass: queries `q`
    ([B, Fq] places in Lq) pay keys `k` ([B, Rk] places in Lk) where `visible` ([B, Fq, Rk]);
    key (b, j) is the `rank[flat]`-th marked token of the stage, flat = b * Rk + j."""

    q: torch.Tensor
    k: torch.Tensor
    visible: torch.Tensor
    flat: torch.Tensor
    rank: torch.Tensor


@dataclass(frozen=True)
class Grid:
    """Some requests' queries in a padded [B, Lq] layout over their KV rows [B, Lk]."""

    tokens: torch.Tensor  # [n] the grid's queries, as indices among the stage's tokens
    index: torch.Tensor  # [n] their places in the flat [B * Lq] query grid
    kv_slots: torch.Tensor  # [B, Lk] KV slots of each request's row (padding: slot 0)
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] additive; None: causal by index (Lq == Lk)
    overlay_tokens: torch.Tensor  # [m] stage tokens whose KV is overlaid on the gathered rows
    overlay_index: torch.Tensor  # [m] their places in the flat [B * Lk] key grid
    mass: MassPlan | None

    @property
    def shape(self) -> tuple[int, int, int]:
        rows, lk = self.kv_slots.shape
        return rows, (lk if self.mask is None else self.mask.shape[2]), lk


def plan_grids(request: torch.Tensor, position: torch.Tensor, rows: Sequence[torch.Tensor],
               overlay: torch.Tensor | None = None, mass: bool = False) -> list[Grid]:
    """Grids for a stage's tokens (request index and position of each, sorted by request then
    position) over the requests' KV rows (slots by position). `overlay` marks the tokens whose
    KV the layers give to `attend` instead of the pool; with `mass`, the unmarked tokens' attention
    to the marked ones is planned too (the blended prefill's fresh queries and tracked reused keys)."""
    counts = torch.bincount(request, minlength=len(rows)).tolist()
    causal = [b for b, n in enumerate(counts) if n and n >= CAUSAL_SHARE * rows[b].numel()]
    packed = [b for b, n in enumerate(counts) if n and n < CAUSAL_SHARE * rows[b].numel()]
    marked = torch.zeros_like(request, dtype=torch.bool) if overlay is None else overlay
    rank = torch.cumsum(marked, 0) - 1  # each marked token's rank among the stage's marked ones
    return [_grid(group, by_index, request, position, rows, marked, rank, mass)
            for group, by_index in ((causal, True), (packed, False)) if group]


def _grid(group: list[int], by_index: bool, request: torch.Tensor, position: torch.Tensor,
          rows: Sequence[torch.Tensor], marked: torch.Tensor, rank: torch.Tensor, mass: bool) -> Grid:
    device = request.device
    local = torch.full((len(rows),), -1, dtype=torch.int64, device=device)
    local[torch.tensor(group, device=device)] = torch.arange(len(group), device=device)
    tokens = (local[request] >= 0).nonzero().squeeze(1)
    b, pos = local[request[tokens]], position[tokens]
    lk = max(rows[g].numel() for g in group)
    kv_slots = torch.zeros(len(group), lk, dtype=torch.int64, device=device)
    for i, g in enumerate(group):
        kv_slots[i, :rows[g].numel()] = rows[g]
    if by_index:
        index, mask = b * lk + pos, None
    else:
        place, lq = _ranks(b, len(group))
        index = b * lq + place
        q_pos = torch.full((len(group) * lq,), lk, device=device, dtype=pos.dtype)  # padding sees the row
        q_pos[index] = pos
        visible = torch.arange(lk, device=device) <= q_pos.view(len(group), lq, 1)
        mask = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf")).unsqueeze(1)
    over = marked[tokens]
    plan = _mass_plan(b, index % (lk if by_index else lq), pos, over, rank[tokens], len(group)) if mass else None
    return Grid(tokens, index, kv_slots, mask, tokens[over], (b * lk + pos)[over], plan)


def _ranks(group: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """For items sorted by group (of `size` groups): each one's rank within its group, and the
    largest group's size."""
    count = torch.bincount(group, minlength=size)
    start = torch.cumsum(count, 0) - count
    return torch.arange(group.numel(), device=group.device) - start[group], int(count.max())


def _mass_plan(b: torch.Tensor, place: torch.Tensor, pos: torch.Tensor, marked: torch.Tensor,
               rank: torch.Tensor, size: int) -> MassPlan:
    """Unmarked queries paying marked keys, padded per request (padding is not visible)."""
    q, k = ~marked, marked
    q_rank, fq = _ranks(b[q], size)
    k_rank, rk = _ranks(b[k], size)
    q_place = torch.zeros(size, max(fq, 1), dtype=torch.int64, device=b.device)
    q_pos = torch.full_like(q_place, -1)
    q_place[b[q], q_rank], q_pos[b[q], q_rank] = place[q], pos[q]
    k_place = torch.zeros(size, max(rk, 1), dtype=torch.int64, device=b.device)
    k_pos = torch.full_like(k_place, 1 << 62)
    k_place[b[k], k_rank], k_pos[b[k], k_rank] = pos[k], pos[k]
    visible = k_pos.unsqueeze(1) <= q_pos.unsqueeze(2)
    return MassPlan(q_place, k_place, visible, b[k] * k_place.shape[1] + k_rank, rank[k])


def attend(grid: Grid, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, scale: float, reads: KeyReads | None = None,
           mass_out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [n, heads, d] of the grid's queries. q/k/v: the stage tokens' [tokens,
    heads or kv_heads, d]; keys/values: the KV buffers [slots, kv_heads, d] the rows are read
    from (the overlaid tokens' k/v replace what is there); `reads`: the rows' keys are brought
    to their positions (the overlaid ones are computed there already). With `mass_out` ([marked
    tokens of the stage]), also add to it the attention mass the plan's queries pay its keys
    (softmax weights summed over queries and heads)."""
    rows, lq, lk = grid.shape
    kg, vg = keys[grid.kv_slots], values[grid.kv_slots]  # [B, Lk, kv_heads, d] copies
    if grid.overlay_tokens.numel():  # (in the cache's dtype: what the pool would hold)
        kg.view(rows * lk, *kg.shape[2:])[grid.overlay_index] = k[grid.overlay_tokens].to(kg.dtype)
        vg.view(rows * lk, *vg.shape[2:])[grid.overlay_index] = v[grid.overlay_tokens].to(vg.dtype)
    kg, vg = kg.to(q.dtype), vg.to(q.dtype)  # a KV cache of another dtype is read as SGLang's torch_native does
    if reads is not None:
        shift = reads.shifts(grid.kv_slots)
        shift.view(-1)[grid.overlay_index] = 0
        kg = reads.shift_(kg, shift)
    qg = q.new_zeros(rows * lq, *q.shape[1:])
    qg[grid.index] = q[grid.tokens]
    qg, kg, vg = qg.view(rows, lq, *q.shape[1:]).transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2)
    if mass_out is None:
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=grid.mask, is_causal=grid.mask is None,
                                             scale=scale, enable_gqa=True)
    else:
        out, lse = sdpa_with_lse(qg, kg, vg, grid.mask, scale)
        mass_out[grid.mass.rank] += attention_mass(qg, kg, lse, grid.mass, scale)
    return out.transpose(1, 2).reshape(rows * lq, out.shape[1], out.shape[3])[grid.index]


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA ([B, heads, Lq, d], GQA keys; mask None: causal by index) and its log-sum-exp
    [B, heads, Lq]: on the CPU both from one pass of the flash kernel SDPA runs there; on other
    devices (until a kernel that returns it plugs in here) SDPA, then the log-sum-exp of the
    same logits computed again (`logsumexp_of`)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, mask is None,
                                                                              attn_mask=mask, scale=scale)
        return out, lse
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=True)
    return out, logsumexp_of(q, k, mask, scale)


LSE_BLOCK_ELEMENTS = 1 << 26  # logits held at once by logsumexp_of: 256 MiB in fp32


def logsumexp_of(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 block_elements: int = LSE_BLOCK_ELEMENTS) -> torch.Tensor:
    """[B, heads, Lq] log-sum-exp of the attention logits, mask ([B, 1, Lq, Lk]) applied (None:
    causal by index; GQA: query head h reads key head h // group). Queries go in blocks of at
    most `block_elements` logits, never the whole [B, heads, Lq, Lk] (8k x 8k x 32 heads would
    be 8.6 GB in fp32)."""
    rows, heads, lq, d = q.shape
    step = max(1, block_elements // max(1, rows * heads * k.shape[2]))
    return torch.cat([_logsumexp_block(q, k, mask, scale, start, min(lq, start + step))
                      for start in range(0, lq, step)], dim=2)


def _logsumexp_block(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float, start: int,
                     end: int) -> torch.Tensor:
    """`logsumexp_of` for queries [start, end)."""
    rows, heads, _, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    block = q[:, :, start:end]
    logits = (block.reshape(rows, kv_heads, -1, d) @ k.transpose(-1, -2)).view(rows, heads, end - start, lk) * scale
    if mask is None:
        hidden = torch.ones(end - start, lk, dtype=torch.bool, device=q.device).triu(1 + start)
        logits = logits.masked_fill(hidden, float("-inf"))
    else:
        logits = logits + mask[:, :, start:end]
    return logits.float().logsumexp(-1)


def attention_mass(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, plan: MassPlan,
                   scale: float) -> torch.Tensor:
    """Mass [keys of the plan] from a finished pass: weight = exp(q.k * scale - lse) on the
    planned (query, key) pairs only, summed over queries and heads (GQA: query head h reads
    key head h // group, as in SDPA)."""
    rows, heads, _, d = q.shape
    kv_heads, fq, rk = k.shape[1], plan.q.shape[1], plan.k.shape[1]
    qf = q.gather(2, plan.q[:, None, :, None].expand(rows, heads, fq, d))
    kr = k.gather(2, plan.k[:, None, :, None].expand(rows, kv_heads, rk, d))
    logits = qf.view(rows, kv_heads, -1, d) @ kr.transpose(-1, -2) * scale  # [B, kv_heads, group * Fq, Rk]
    lse_f = lse.gather(2, plan.q[:, None, :].expand(rows, heads, fq)).view(rows, kv_heads, -1, 1)
    weights = (logits - lse_f).exp().view(rows, heads, fq, rk) * plan.visible.unsqueeze(1)
    return weights.sum((1, 2)).flatten()[plan.flat]
