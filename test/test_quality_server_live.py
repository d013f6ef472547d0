"""bench_quality --server's path against one real TokenDance server (SmolLM2, small prompts):
the server's blended answers carry the same truncated KL and reuse counts as the in-process
blend on the same prompt. The reference is the same server before any segment is cached (no
hit: SGLang's own full prefill), with one measured prompt, so nothing it caches is reused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import emptied
from sglang_tokendance.bench.quality import QualityRunner
from sglang_tokendance.bench.quality_server import Prompts, ServerConfig, Workload, answer, compare_all
from sglang_tokendance.bench_quality import server_default_setting

pytestmark = pytest.mark.slow

SETTING = server_default_setting()
CONFIG = ServerConfig(settings=(SETTING,), workloads=(Workload(3, 30),), chunked_prefill=0, prompts_per_n=1,
                      decode_steps=6, top_k=10, history_words=40)


@pytest.fixture(scope="module")
def server_url(default_server_url):
    return emptied(default_server_url)


def test_server_blend_matches_in_process(server_url, smollm2_path):
    runner = QualityRunner(str(smollm2_path))
    workload = CONFIG.workloads[0]
    prompts = Prompts(runner, CONFIG, workload)
    reference = {(workload.label, 0): answer(server_url, prompts, CONFIG, seed=False, desc="full")[0]}
    blended = {(SETTING.label, workload.label, 0): answer(server_url, prompts, CONFIG, True, "blended")[0]}
    assert reference[workload.label, 0].reuse.get("segment_hits", 0) == 0
    (sample,) = compare_all(CONFIG, runner, {workload: prompts}, reference, blended)
    assert sample.same_prompt and sample.server_hits == sample.inproc_hits == workload.agents
    assert (sample.server_reused, sample.server_recomputed) == (sample.inproc_reused, sample.inproc_recomputed)
    assert sample.noise_first_tkl < 1e-4 and sample.server_first_tkl > 1e-5  # reuse from elsewhere shows
    assert sample.server_first_tkl == pytest.approx(sample.inproc_first_tkl, rel=0.05, abs=1e-4)
    if sample.steps_compared:
        assert sample.server_decode_tkl == pytest.approx(sample.inproc_decode_tkl, rel=0.05, abs=1e-4)


def test_a_round_goes_leader_first_and_the_others_read_its_blocks(server_url, smollm2_path):
    """Under the server's round leader (the default): one member of a round of three is computed
    exactly (the same answer as with nothing cached), its blocks' KV replaces the seeded
    Masters, and the other two, admitted after its prefill, read them."""
    import requests

    from sglang_tokendance.bench.quality_server import truncated_kl

    runner = QualityRunner(str(smollm2_path))
    workload = Workload(3, 30, round="lead")
    prompts = Prompts(runner, CONFIG, workload)
    rounds = lambda: requests.get(server_url + "/server_info", timeout=60).json()["internal_states"][0]  # noqa: E731
    led_before = rounds()["tokendance_rounds"]["led_rounds"]
    outputs = answer(server_url, prompts, CONFIG, seed=True, desc="round")
    infos = [out.reuse for out in outputs]
    [leader] = [i for i, info in enumerate(infos) if info["round_master_tokens"] > 0]
    assert infos[leader]["reused_tokens"] == infos[leader]["recomputed_tokens"] == 0
    block_tokens = sum(end - start for start, end in outputs[leader].spans)
    assert infos[leader]["round_master_tokens"] == block_tokens  # every seeded Master superseded
    for i, info in enumerate(infos):
        if i != leader:
            assert info["round_master_tokens"] == 0 and info["segment_hits"] == workload.agents
            assert info["reused_tokens"] > 0
    state = rounds()
    [record] = [r for r in state["tokendance_rounds"]["recent_rounds"] if r["round_id"] == f"quality {workload.label}"]
    assert record["led"] and record["admitted"] == [1, 2]
    assert state["tokendance_rounds"]["led_rounds"] == led_before + 1
    assert state["tokendance_forest"]["segments_superseded"] >= workload.agents
    alone = Prompts(runner, CONFIG, Workload(3, 30))  # each prompt with nothing cached: a full prefill
    exact = []
    for text in prompts.texts:
        alone.texts = [text]
        exact += answer(server_url, alone, CONFIG, seed=False, desc="alone")
    assert all(out.reuse.get("segment_hits", 0) == 0 for out in exact)
    assert truncated_kl(exact[leader].tops[0], outputs[leader].tops[0]) < 1e-3  # a blended answer is ~1e-2 off
    # the in-process side follows the same leader: the followers' answers are its blend over the leader's blocks
    samples = compare_all(replace(CONFIG, workloads=(workload,)), runner, {workload: prompts},
                          {(workload.label, i): out for i, out in enumerate(exact)},
                          {(SETTING.label, workload.label, i): out for i, out in enumerate(outputs)})
    for sample in samples:
        assert sample.same_prompt and (sample.inproc_hits == 0) == (sample.agent == leader)
        assert (sample.server_hits, sample.server_reused, sample.server_recomputed) == (
            sample.inproc_hits, sample.inproc_reused, sample.inproc_recomputed)
        assert sample.server_first_tkl == pytest.approx(sample.inproc_first_tkl, rel=0.05, abs=1e-4)
