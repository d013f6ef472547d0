"""What one prefill chunk costs on the blended path and on SGLang's own, to blend only where it pays.

Work is counted in token-layers (one token through one layer's projections and MLP), with the
other costs of either path converted at measured rates:
* attention: each query-key pair a layer scores costs `pair` token-layers. SGLang's extend
  attention scores n x prefix + n^2 / 2 pairs per layer, except torch_native (its CPU backend),
  which runs every extend causal over the whole row, the prefix's positions as queries too, and
  drops them: (prefix + n)^2 / 2 pairs, so a later chunk of a chunked prefill costs as much
  attention as the whole prompt up to it (measured: a 4,400-token prompt in chunks of 4096
  spent 1.7x the attention of one whose last chunk was blended). A blended stage that computes q of a
  row's P tokens runs causal by index over the whole row when q >= P / 2 (P^2 / 2 pairs, the
  padding included) and packed under a position mask otherwise (q x P pairs): the grid
  core/attention picks, at the share where the two cost the same;
* the attention mass a rule reads (core/selection attention-kv) at the last layer of each probe
  stage: `mass` per (fresh query, reused key) pair;
* restoring a reused token's KV into its slot before the forward (K rotated into place, V):
  `restore` per token and layer (dense storage); under mirror storage nothing is restored, each
  layer gathers a reused token's K from its Master and rotates it by its shift instead: `read`
  per token and layer;
* a blended forward's own fixed work (stage layouts, selection, settling): `fixed` per chunk.

The stages follow core/blend: the probe (layers 0..s on every token, then the screened ones to
c), then the fresh and kept tokens to the last layer. The default rates were measured on the
CPU (2 cores, SmolLM2-135M, prompts of ~1,900 tokens half reused; py-spy over SGLang's forward
and ours); the fixed work was below that measurement's noise (about 0.05 s a request), so it is
0. They price other models and a GPU's kernels only roughly; `--no-tokendance-cost-check` blends
wherever a segment matches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sglang_tokendance.core.attention import CAUSAL_SHARE
from sglang_tokendance.core.blend_types import BlendOptions
from sglang_tokendance.core.selection import kept_share


PREFIX_QUERY_BACKENDS = ("torch_native", "tokendance")  # SGLang's CPU backend, and ours over it
IN_PLACE_BACKEND = "tokendance"  # mirror storage's attention backend (srt/attention.py)


@dataclass(frozen=True)
class WorkRates:
    """Costs beyond a token-layer, in token-layers."""

    pair: float = 4.8e-4  # one query-key pair of one layer's attention
    mass: float = 2.7e-3  # one (fresh query, reused key) pair of a probe stage's attention mass
    restore: float = 0.063  # restoring one reused token's KV at one layer (dense storage)
    # reading one reused token's K at a shift in place at one layer (mirror storage): 0.28x of a
    # restore, timed alike (bench_read_rate: K gathered and rotated vs K and V gathered, K rotated, both written)
    read: float = 0.019
    fixed: float = 0.0  # a blended chunk's fixed work


@dataclass(frozen=True)
class Stage:
    """`layers` consecutive layers computing `tokens` of the chunk; `mass_pairs` (fresh query,
    reused key) pairs of attention mass at its last layer."""

    layers: int
    tokens: int
    mass_pairs: int = 0


@dataclass(frozen=True)
class PrefillCost:
    """The two paths' work for a chunk of `tokens` new tokens after `prefix` in its row, `reused`
    of them restored from segments, under `options` on a `num_layers`-layer model."""

    num_layers: int
    options: BlendOptions
    attention_mass: bool  # the selection rule reads attention mass (core/selection needs_attention)
    rates: WorkRates = WorkRates()
    prefix_queries: bool = False  # SGLang's backend computes the prefix's queries too (torch_native)
    in_place: bool = False  # reused KV read from the Masters' slots at a shift, never restored (mirror storage)

    def stock(self, prefix: int, tokens: int) -> float:
        """SGLang's extend: every token through every layer, causal over the row."""
        pairs = (prefix + tokens) ** 2 / 2 if self.prefix_queries else tokens * prefix + tokens * tokens / 2
        return self.num_layers * (tokens + self.rates.pair * pairs)

    def blended(self, prefix: int, tokens: int, reused: int, max_approximate: int | None = None) -> float:
        """Ours: its stages, the attention over each stage's grid, the mass, the restore and the
        fixed work; `max_approximate` the request's fidelity budget in the chunk (RequestRow)."""
        row = prefix + tokens
        work = sum(stage.layers * (stage.tokens + self.rates.pair * _grid_pairs(stage.tokens, row))
                   + self.rates.mass * stage.mass_pairs for stage in self.stages(tokens, reused, max_approximate))
        restored = 0 if self.options.keeps_everything else reused
        per_token = self.rates.read if self.in_place else self.rates.restore
        return work + per_token * restored * self.num_layers + self.rates.fixed

    def pays(self, prefix: int, tokens: int, reused: int, max_approximate: int | None = None) -> bool:
        """Whether blending the chunk is estimated cheaper than SGLang's own forward of it. A
        chunk that would recompute every reused token (ratio 1, or a spent fidelity budget) keeps
        nothing approximate: it is a full prefill, SGLang's own forward, whatever the estimate
        (our attention skips torch_native's prefix queries; that alone is not reuse)."""
        if reused <= 0 or kept_share(self.options.recompute_ratio, reused, max_approximate) >= 1:
            return False
        return self.blended(prefix, tokens, reused, max_approximate) < self.stock(prefix, tokens)

    def stages(self, tokens: int, reused: int, max_approximate: int | None = None, kept: int | None = None,
               adopted: int = 0) -> list[Stage]:
        """The blended prefill's stages for one chunk (core/blend `blended_prefill`). After a
        forward (benchmarks' work counts) `kept` gives the reused tokens it recomputed and
        `adopted` those that skipped the probe for their round group's choice (shared probe:
        its kept ones catch up through the probe layers)."""
        o = replace(self.options, recompute_ratio=kept_share(self.options.recompute_ratio, reused, max_approximate))
        layers, fresh = self.num_layers, tokens - reused
        if o.recompute_ratio <= 0:
            return [Stage(layers, fresh)]
        if o.keeps_everything:
            return [Stage(layers, tokens)]
        kept = round(o.recompute_ratio * reused) if kept is None else kept
        probed = reused - adopted
        mass = fresh * probed if self.attention_mass else 0
        caught_up = [Stage(o.check_layer + 1, round(kept * adopted / reused))] if adopted else []
        if not o.screened:
            return [Stage(o.check_layer + 1, fresh + probed, mass), *caught_up,
                    Stage(layers - o.check_layer - 1, fresh + kept)]
        passed = round(min(1.0, o.screen_factor * o.recompute_ratio) * probed)
        return [Stage(o.screen_layer + 1, fresh + probed, mass),
                Stage(o.check_layer - o.screen_layer, fresh + passed, fresh * passed if self.attention_mass else 0),
                *caught_up, Stage(layers - o.check_layer - 1, fresh + kept)]


def serving_cost(num_layers: int, options: BlendOptions, attention_mass: bool, backend: str | None,
                 rates: WorkRates = WorkRates()) -> PrefillCost:
    """The cost model of a server whose (prefill) attention backend is `backend`: torch_native
    and the tokendance backend, which runs it for every row that reads no Master, compute the
    prefix's queries; the tokendance backend (mirror storage) reads reused KV in place."""
    return PrefillCost(num_layers, options, attention_mass, rates,
                       prefix_queries=backend in PREFIX_QUERY_BACKENDS, in_place=backend == IN_PLACE_BACKEND)


def _grid_pairs(queries: int, row: int) -> float:
    """Pairs one layer's attention scores for `queries` computed tokens of a `row`-token KV row."""
    return row * row / 2 if queries >= CAUSAL_SHARE * row else queries * row
