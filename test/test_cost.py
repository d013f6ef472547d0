"""core/cost: the blended path's stages match the work core/blend does; blending is chosen only where it pays."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sglang_tokendance.bench.hf_layerwise import HFLayerwise
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.bench.tiny_models import tiny_layerwise
from sglang_tokendance.core.blend import blended_prefill
from sglang_tokendance.core.blend_types import BlendOptions, RequestRow
from sglang_tokendance.core.cost import PrefillCost, WorkRates
from sglang_tokendance.core.selection import rule_named

OPTIONS = {
    "plain": BlendOptions(),
    "full": BlendOptions(recompute_ratio=1.0, check_layer=2),
    "probe": BlendOptions(recompute_ratio=0.25, check_layer=2),
    "screened": BlendOptions(recompute_ratio=0.25, check_layer=3, screen_layer=1),
}


@pytest.fixture(scope="module")
def model() -> HFLayerwise:
    return tiny_layerwise("llama")


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("prefix, tokens, runs", [(0, 48, [(8, 40)]), (16, 40, [(0, 12), (20, 36)])])
@pytest.mark.parametrize("max_approximate", [None, 4])
@torch.no_grad()
def test_stages_are_the_token_layers_the_blended_prefill_computes(model, name, prefix, tokens, runs, max_approximate):
    options = OPTIONS[name]
    kv = DenseKV(model.num_layers, prefix + tokens, *model.kv_shape())
    kv.k.normal_(generator=torch.Generator().manual_seed(1))
    kv.v.normal_(generator=torch.Generator().manual_seed(2))
    ids = torch.randint(3, 512, (tokens,), generator=torch.Generator().manual_seed(3))
    row = RequestRow(prefix, tokens, torch.arange(prefix + tokens), reused=runs, max_approximate=max_approximate)
    rule = rule_named("attention-kv")
    _, stats = blended_prefill(model, kv, ids, torch.arange(prefix, prefix + tokens), [row], options, rule)
    cost = PrefillCost(model.num_layers, options, rule.needs_attention)
    reused = sum(end - start for start, end in runs)
    assert sum(s.layers * s.tokens for s in cost.stages(tokens, reused, max_approximate)) == stats.token_layers


def test_blending_pays_where_the_saving_outweighs_the_mass_and_never_at_ratio_one():
    options = BlendOptions(recompute_ratio=0.3, check_layer=5, screen_layer=1)
    cost = PrefillCost(30, options, attention_mass=True)
    assert cost.pays(0, 1000, 600) and cost.pays(0, 1000, 20)
    assert not cost.pays(0, 6000, 40)  # the attention mass 6000 fresh tokens pay 40 reused ones outweighs their saving
    assert not cost.pays(0, 1000, 0)
    assert not PrefillCost(30, BlendOptions(recompute_ratio=1.0, check_layer=5), True).pays(0, 1000, 600)
    assert PrefillCost(30, options, attention_mass=False).pays(0, 6000, 40)  # a rule without mass
    assert not PrefillCost(30, options, True, WorkRates(fixed=1e6)).pays(0, 1000, 600)
    assert not cost.pays(0, 1000, 600, max_approximate=0)  # nothing may stay approximate: a full prefill
    assert cost.blended(0, 1000, 600, max_approximate=100) > cost.blended(0, 1000, 600)


def test_torch_natives_prefix_queries_make_sglangs_later_chunks_dearer():
    options = BlendOptions(recompute_ratio=0.3, check_layer=5, screen_layer=1)
    flash = PrefillCost(30, options, attention_mass=True)
    native = PrefillCost(30, options, attention_mass=True, prefix_queries=True)
    assert native.stock(0, 512) == flash.stock(0, 512)  # one chunk: the same pairs
    rates = flash.rates
    assert native.stock(4096, 300) - flash.stock(4096, 300) == pytest.approx(30 * rates.pair * 4096 ** 2 / 2)
    assert not flash.pays(4096, 300, 10) and native.pays(4096, 300, 10)  # a short block in the last chunk


def test_the_servers_backend_prices_sglangs_prefix_queries_and_mirrors_reads_in_place():
    """Before, only torch_native priced SGLang's prefix queries: under mirror storage (the
    tokendance backend, which runs torch_native for every row that reads no Master) SGLang's
    path was underpriced, and ours charged a restore copy mirror storage never makes."""
    from sglang_tokendance.core.cost import serving_cost

    options = BlendOptions(recompute_ratio=0.3, check_layer=5, screen_layer=1)
    native, mirror, flash = (serving_cost(30, options, True, backend)
                             for backend in ("torch_native", "tokendance", "flashinfer"))
    assert native.stock(4096, 300) == mirror.stock(4096, 300) > flash.stock(4096, 300)
    rates = mirror.rates
    assert native.blended(0, 1000, 600) - mirror.blended(0, 1000, 600) == \
        pytest.approx(30 * 600 * (rates.restore - rates.read))
    assert (native.in_place, mirror.in_place, flash.prefix_queries) == (False, True, False)
    # a chunk recomputing every reused token is a full prefill: SGLang's forward, though ours skips
    # torch_native's prefix queries (a short extend after a long prefix)
    assert mirror.blended(4096, 300, 200, max_approximate=0) < mirror.stock(4096, 300)
    assert not mirror.pays(4096, 300, 200, max_approximate=0) and mirror.pays(4096, 300, 200)
    everything = serving_cost(30, BlendOptions(recompute_ratio=1.0, check_layer=5), True, "tokendance")
    assert everything.blended(4096, 300, 200) < everything.stock(4096, 300) and not everything.pays(4096, 300, 200)


@settings(max_examples=200, deadline=None)
@given(prefix=st.integers(0, 4096), tokens=st.integers(1, 4096), share=st.floats(0, 1),
       ratio=st.sampled_from([0.0, 0.15, 0.3, 0.6]), screen=st.booleans())
def test_the_blended_path_never_computes_more_token_layers_than_stock(prefix, tokens, share, ratio, screen):
    options = BlendOptions(recompute_ratio=ratio, check_layer=5, screen_layer=1 if screen else 0)
    reused = min(tokens - 1, int(share * tokens))
    cost = PrefillCost(30, options, attention_mass=True)
    stages = cost.stages(tokens, reused)
    assert sum(s.layers for s in stages) == 30
    assert sum(s.layers * s.tokens for s in stages) <= 30 * tokens
    no_attention = PrefillCost(30, options, True, WorkRates(pair=0, mass=0, restore=0, fixed=0))
    assert no_attention.pays(prefix, tokens, reused) == (reused > 0 and sum(
        s.layers * s.tokens for s in stages) < 30 * tokens)
