"""core/attention: a stage's scattered queries, batched over requests, attend causally by position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_tokendance.core.attention import CAUSAL_SHARE, attend, plan_grids

HEADS, KV_HEADS, D = 6, 2, 8
SCALE = D ** -0.5


def full_causal(q, k, v):
    """Reference: one request's plain causal attention, GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=SCALE)
    return out.transpose(0, 1)


class Batch:
    """Requests of given lengths, KV rows scattered over one pool, each request's computed
    tokens given by a mask over its row."""

    def __init__(self, computed: list[torch.Tensor], seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        total = sum(c.numel() for c in computed)
        self.keys = torch.randn(total + 1, KV_HEADS, D, generator=gen)
        self.values = torch.randn(total + 1, KV_HEADS, D, generator=gen)
        order = torch.randperm(total, generator=gen) + 1
        self.rows, self.q_full, used = [], [], 0
        for c in computed:
            self.rows.append(order[used:used + c.numel()])
            self.q_full.append(torch.randn(c.numel(), HEADS, D, generator=gen))
            used += c.numel()
        self.computed = computed
        self.request = torch.cat([torch.full((int(c.sum()),), b) for b, c in enumerate(computed)])
        self.position = torch.cat([c.nonzero().squeeze(1) for c in computed])
        self.slots = torch.cat([row[c] for row, c in zip(self.rows, computed)])
        self.q = torch.cat([qf[c] for qf, c in zip(self.q_full, computed)])

    def run(self, overlay=None, mass=False, **kw):
        grids = plan_grids(self.request, self.position, self.rows, overlay=overlay, mass=mass)
        k, v = self.keys[self.slots], self.values[self.slots]
        out = torch.empty_like(self.q)
        for grid in grids:
            out[grid.tokens] = attend(grid, self.q, k, v, self.keys, self.values, SCALE, **kw)
        return out, grids

    def reference(self) -> torch.Tensor:
        return torch.cat([full_causal(qf, self.keys[row], self.values[row])[c]
                          for qf, row, c in zip(self.q_full, self.rows, self.computed)])


def mask(n: int, computed: list[int]) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[computed] = True
    return m


def test_scattered_queries_of_several_requests_equal_their_rows_of_causal_attention():
    dense = mask(12, list(range(3, 12)))  # a radix prefix of 3, then every token: causal by index
    sparse = mask(20, [0, 4, 5, 11, 19])  # a blended request: packed under a position mask
    batch = Batch([dense, sparse, mask(7, [6])])
    out, grids = batch.run()
    assert [g.mask is None for g in grids] == [True, False]
    assert 9 >= CAUSAL_SHARE * 12 and 5 < CAUSAL_SHARE * 20
    torch.testing.assert_close(out, batch.reference(), atol=1e-6, rtol=1e-6)


def test_keys_after_the_query_position_are_ignored():
    batch = Batch([mask(3, [0])])
    out, _ = batch.run()
    expected = batch.values[batch.rows[0][0]].repeat_interleave(HEADS // KV_HEADS, 0)
    torch.testing.assert_close(out[0], expected)  # only key 0 is visible


@pytest.mark.parametrize("computed", [list(range(16)), [1, 2, 9, 15]])
def test_overlaid_kv_replaces_the_stored_kv(computed):
    batch = Batch([mask(16, computed)])
    overlay = torch.zeros(len(computed), dtype=torch.bool)
    overlay[::2] = True
    fresh_k = torch.randn(len(computed), KV_HEADS, D)
    fresh_v = torch.randn(len(computed), KV_HEADS, D)
    grids = plan_grids(batch.request, batch.position, batch.rows, overlay=overlay)
    k = torch.where(overlay[:, None, None], fresh_k, batch.keys[batch.slots])
    v = torch.where(overlay[:, None, None], fresh_v, batch.values[batch.slots])
    out = attend(grids[0], batch.q, k, v, batch.keys, batch.values, SCALE)
    stored_k, stored_v = batch.keys.clone(), batch.values.clone()
    stored_k[batch.slots[overlay]], stored_v[batch.slots[overlay]] = fresh_k[overlay], fresh_v[overlay]
    want = full_causal(batch.q_full[0], stored_k[batch.rows[0]], stored_v[batch.rows[0]])[batch.computed[0]]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    assert not torch.equal(stored_k, batch.keys)  # the store itself was not written


@pytest.mark.parametrize("computed", [list(range(2, 14)), [0, 3, 4, 5, 10, 13]])
def test_attention_mass_is_what_the_unmarked_queries_pay_the_marked_keys(computed):
    batch = Batch([mask(14, computed), mask(9, list(range(9)))], seed=3)
    marked = torch.tensor([i % 3 == 1 for i in range(batch.q.shape[0])])
    mass = torch.zeros(int(marked.sum()))
    out, _ = batch.run()
    grids = plan_grids(batch.request, batch.position, batch.rows, overlay=marked, mass=True)
    k, v = batch.keys[batch.slots], batch.values[batch.slots]
    for grid in grids:
        torch.testing.assert_close(attend(grid, batch.q, k, v, batch.keys, batch.values, SCALE, mass_out=mass),
                                   out[grid.tokens], atol=1e-6, rtol=1e-6)
    want = torch.zeros_like(mass)
    token = 0
    for b, (qf, row, c) in enumerate(zip(batch.q_full, batch.rows, batch.computed)):
        group = HEADS // KV_HEADS
        logits = torch.einsum("qhd,khd->hqk", qf, batch.keys[row].repeat_interleave(group, 1)) * SCALE
        logits = logits.masked_fill(torch.ones(row.numel(), row.numel(), dtype=torch.bool).triu(1), float("-inf"))
        weights = logits.softmax(-1).sum(0)  # [q, k] summed over heads
        positions = c.nonzero().squeeze(1)
        mine = marked[token:token + positions.numel()]
        paid = weights[positions[~mine]].sum(0)[positions[mine]]
        rank = int(marked[:token].sum())
        want[rank:rank + paid.numel()] = paid
        token += positions.numel()
    torch.testing.assert_close(mass, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_the_log_sum_exp_of_other_devices_equals_the_cpu_kernels(masked):
    """Off the CPU the attention mass's log-sum-exp is computed from the logits again
    (logsumexp_of); it must equal the one the CPU flash kernel returns with its output."""
    from sglang_tokendance.core.attention import logsumexp_of, sdpa_with_lse

    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, HEADS, 5, D, generator=gen), torch.randn(2, KV_HEADS, 5, D, generator=gen), \
        torch.randn(2, KV_HEADS, 5, D, generator=gen)
    attn_mask = None
    if masked:
        visible = torch.rand(2, 1, 5, 5, generator=gen) > 0.4
        visible[..., 0] = True  # every query sees a key
        attn_mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    out, lse = sdpa_with_lse(q, k, v, attn_mask, SCALE)
    torch.testing.assert_close(logsumexp_of(q, k, attn_mask, SCALE), lse.float(), atol=1e-5, rtol=1e-5)
    for block in (1, 2 * HEADS * 5, 3 * 2 * HEADS * 5):  # queries one, two or three at a time
        torch.testing.assert_close(logsumexp_of(q, k, attn_mask, SCALE, block_elements=block), lse.float(),
                                   atol=1e-5, rtol=1e-5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=not masked, scale=SCALE,
                                              enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
