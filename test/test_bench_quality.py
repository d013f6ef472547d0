"""The quality harness (bench/quality.py, bench_quality CLI) on a tiny random Llama."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sglang_tokendance.bench.quality import (ORACLE, PLAIN, QualityConfig, QualityRunner, Setting, common_prefix,
                                             evaluate_prompt, kl_top, measure_divergence, summarize)
from sglang_tokendance.bench.workloads import make_simulation, preset_config
from sglang_tokendance.tiny_models import write_tiny_model

CONFIG = QualityConfig(num_agents=(2,), rules=("cacheblend-k", "attention-kv"), ratios=(0.5, 1.0),
                       check_layers=(1, 2), continuation_tokens=6, simulation_agents=2, simulation_rounds=2,
                       history_words=20, block_words=25)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smollm2_path):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def runner(tiny_path):
    return QualityRunner(str(tiny_path))


def test_metrics_helpers():
    import torch

    logits = torch.tensor([3.0, 1.0, 0.5, 0.2, 0.1, -1.0])
    assert kl_top(logits, logits) == (0.0, True, 1.0)
    kl, top1, top5 = kl_top(logits, logits.flip(0))
    assert kl > 0 and not top1 and top5 == 4 / 5
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_every_setting_against_the_full_prefill(runner):
    sim = make_simulation(preset_config("generative_agents", num_agents=2, num_rounds=1, history_words=20,
                                        block_words=25, max_new_tokens=6))
    store = runner.seed_store(sim)
    prompt = runner.agent_prompt(sim, 0, 0, sim.seed_messages)
    samples = evaluate_prompt(runner, prompt, store, CONFIG, 2, 0)
    # plain + (2 rules + oracle) x 2 ratios x 2 check layers + the default rule screened at layer 1
    assert len(samples) == 1 + 3 * 2 * 2 + 2
    assert {s.setting for s in samples if s.screen_layer} == {"attention-kv r=0.5 c=2 s=1", "attention-kv r=1 c=2 s=1"}
    by = {s.setting: s for s in samples}
    assert by[PLAIN].reused_tokens == sum(s.end - s.start for s in prompt.spans) > 0
    assert by[PLAIN].kl > 1e-6  # the blocks' KV came from their authors' contexts
    for s in samples:
        if s.ratio == 1.0:  # a full prefill: same distribution, same continuation
            assert s.kl < 1e-6 and s.top1 and s.common_prefix == s.continuation_tokens > 0, s.setting
            assert s.kept_tokens == s.reused_tokens
        assert s.token_layers <= s.full_token_layers + s.prompt_tokens * s.check_layer
    rows = summarize(samples)
    assert {r["setting"] for r in rows} == set(by)
    assert all(r["recomputed_share"] == r["ratio"] for r in rows if r["rule"] == ORACLE)


def test_simulation_divergence(runner):
    results = measure_divergence(runner, CONFIG)
    assert [r.setting for r in results] == [PLAIN, "cacheblend-k r=0.3 c=1", "cacheblend-k r=0.3 c=2",
                                            "attention-kv r=0.3 c=2", "attention-kv r=0.3 c=2 s=1"]
    for r in results:
        assert r.rounds == 2 and len(r.outputs) == 2
        assert r.first_divergence in (None, 1, 2)
    full = measure_divergence(runner, replace(CONFIG, simulation_settings=(Setting("cacheblend-k", 1.0, 1),)))
    assert full[0].first_divergence is None  # ratio 1 never diverges from the full prefill


def test_cli_writes_results(tmp_path, tiny_path):
    from sglang_tokendance import bench_quality

    out = tmp_path / "quality.jsonl"
    bench_quality.main(["--model-path", str(tiny_path), "--num-agents", "2", "--rules", "cacheblend-k",
                        "--ratios", "0.5", "--check-layers", "1,2", "--continuation-tokens", "4", "--simulation-agents", "2",
                        "--simulation-rounds", "1", "--history-words", "20", "--block-words", "25",
                        "--output-file", str(out)])
    kinds = {json.loads(line)["kind"] for line in out.read_text().splitlines()}
    assert kinds == {"sample", "summary", "divergence", "timing"}
    md = out.with_suffix(".md").read_text()
    assert "python -m sglang_tokendance.bench_quality --model-path" in md and "N = 2" in md
    assert (tmp_path / "quality_n2.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        bench_quality.parse_args(["--rules", "best"])
