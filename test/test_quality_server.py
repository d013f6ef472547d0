"""bench/quality_server (bench_quality --server) without a server: the truncated KL on known
distributions, response parsing, the steps compared, and the whole comparison on canned
responses made in-process on a tiny random Llama."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from sglang_tokendance.bench.quality import FULL, PLAIN, QualityRunner, Setting, kl_rows
from sglang_tokendance.bench.quality_server import (Prompts, SavedAnswers, ServerConfig, ServerOutput, Workload,
                                                    compare_all, compared_steps, in_process, serve, server_argv,
                                                    summarize, top_k, truncated_kl)
from sglang_tokendance.bench.tiny_models import write_tiny_model

DEFAULT = Setting("attention-kv", 0.3, 2, 1)
CONFIG = ServerConfig(settings=(DEFAULT, Setting(PLAIN)), workloads=(Workload(2, 25),), chunked_prefill=0,
                      prompts_per_n=2, decode_steps=4, top_k=5, history_words=20)


def logprobs(*probs: float) -> dict[int, float]:
    return {i: math.log(p) for i, p in enumerate(probs) if p}


def test_truncated_kl_on_known_distributions():
    same = logprobs(0.5, 0.3)
    assert truncated_kl(same, same) == 0.0
    # K = the whole vocabulary: the exact KL
    p, q = [0.5, 0.3, 0.2], [0.4, 0.4, 0.2]
    exact = sum(a * math.log(a / b) for a, b in zip(p, q))
    assert truncated_kl(logprobs(*p), logprobs(*q)) == pytest.approx(exact)
    # the reference's token 1 is missing from the other list: taken at its smallest logprob (0.4)
    ref, other = {0: math.log(0.6), 1: math.log(0.3)}, {0: math.log(0.5), 2: math.log(0.4)}
    want = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.4) + 0.1 * math.log(0.1 / 0.1)
    assert truncated_kl(ref, other) == pytest.approx(want)
    # a different rest mass counts: reference top-2 holds 0.9, the other's same tokens 0.6
    assert truncated_kl(logprobs(0.6, 0.3), logprobs(0.4, 0.2)) == pytest.approx(
        0.6 * math.log(0.6 / 0.4) + 0.3 * math.log(0.3 / 0.2) + 0.1 * math.log(0.1 / 0.4))
    with pytest.raises(ValueError):
        truncated_kl({}, same)


def test_truncated_kl_is_a_kl_and_bounded_by_the_full_one():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a, b = torch.randn(2, 50, generator=gen) * 2
        full = float(kl_rows(a, b))
        (ref,), (cut,), (whole,) = top_k(a[None], 5), top_k(b[None], 5), top_k(b[None], 50)
        assert truncated_kl(ref, cut) >= 0
        assert truncated_kl(ref, whole) <= full + 1e-9  # exact lists: coarse-grained KL <= the KL
    (all_a,), (all_b,) = top_k(a[None], 50), top_k(b[None], 50)
    assert truncated_kl(all_a, all_b) == pytest.approx(full, rel=1e-5)
    torch.testing.assert_close(torch.tensor(list(top_k(a[None], 3)[0].values())),
                               a.log_softmax(-1).topk(3).values)


def response(ids, tops, prompt_tokens=10, spans=(), **reuse) -> dict:
    """A /generate answer shaped like SGLang's (return_logprob, top_logprobs_num)."""
    return {"text": "", "output_ids": list(ids), "meta_info": {
        "prompt_tokens": prompt_tokens,
        "output_token_logprobs": [[top[t], t, None] for t, top in zip(ids, tops)],
        "output_top_logprobs": [[[lp, t, None] for t, lp in top.items()] for top in tops],
        "tokendance": {"segments": [{"start": a, "end": b, "hash": "0" * 32} for a, b in spans], **reuse}}}


def test_server_output_and_compared_steps():
    tops = [logprobs(0.7, 0.2), logprobs(0.1, 0.8)]
    out = ServerOutput.from_response(response([0, 1], tops, 12, [(2, 8)], reused_tokens=4, recomputed_tokens=2,
                                              segment_hits=1, computed_tokens=6))
    assert out.ids == [0, 1] and out.tops == tops and out.prompt_tokens == 12 and out.spans == [(2, 8)]
    assert out.reuse == {"reused_tokens": 4, "recomputed_tokens": 2, "segment_hits": 1}
    broken = response([0, 1], tops)
    broken["meta_info"]["output_top_logprobs"].pop()
    with pytest.raises(ValueError, match="top-logprob lists"):
        ServerOutput.from_response(broken)
    # step t (output t) compares when outputs 0..t-1 agree and both sides have an output t
    assert list(compared_steps([5, 6, 7, 8, 9], [5, 6, 7, 8, 9], 3)) == [1, 2, 3]
    assert list(compared_steps([5, 6, 7, 8, 9], [5, 6, 1, 8, 9], 4)) == [1, 2]
    assert list(compared_steps([5, 6, 7, 8, 9], [4, 6, 7, 8, 9], 4)) == []
    assert list(compared_steps([5, 6, 7], [5, 6, 7, 8, 9], 4)) == [1, 2]  # the reference ended (EOS)


def test_saved_answers_resume_only_with_the_same_flags(tmp_path):
    out = ServerOutput([1, 2], [logprobs(0.7, 0.2), logprobs(0.1, 0.8)], 12, [(2, 8)], {"segment_hits": 1})
    path, workload = tmp_path / "quality_server.answers.jsonl", Workload(2, 25)
    SavedAnswers(path, CONFIG, resume=False).put(["--x"], workload, [out])
    again = SavedAnswers(path, CONFIG, resume=True)
    assert again.get(["--x"], workload) == [out]
    assert again.get(["--y"], workload) is None and again.get(["--x"], Workload(3, 25)) is None
    assert SavedAnswers(path, replace(CONFIG, top_k=7), resume=True).get(["--x"], workload) is None
    assert SavedAnswers(path, CONFIG, resume=False).get(["--x"], workload) is None and path.read_text() == ""


def test_labels_flags_and_cases():
    for label in ("plain", "attention-kv r=0.3 c=5 s=1", "cacheblend-k r=0.15 c=1"):
        assert Setting.parse(label).label == label
    for bad in ("best r=0.3 c=1", "attention-kv r=0.3", "attention-kv r=0.3 c=5 x=1", "plain r=0"):
        with pytest.raises(ValueError, match="bad setting"):
            Setting.parse(bad)
    assert Workload.parse("N=6 w=40") == Workload(6, 40) and Workload.parse("N=4 w=60 chunk=128").chunked_prefill == 128
    assert Workload.parse(Workload(4, 60, 128).label) == Workload(4, 60, 128)
    assert Workload.parse("N=10 round=all") == Workload(10, round="all")
    debate = Workload.parse("N=10 round=lead preset=debate")
    assert debate.preset == "debate" and Workload.parse(debate.label) == debate and "preset" not in Workload(4).label
    with pytest.raises(ValueError, match="bad preset"):
        Workload.parse("N=4 preset=chess")
    assert Workload(10, round="lead").server_flags == ()
    with pytest.raises(ValueError, match="bad workload"):
        Workload.parse("agents=4")
    with pytest.raises(ValueError, match="bad round mode"):
        Workload.parse("N=4 round=first")
    argv = server_argv(DEFAULT, replace(CONFIG, model_path="/m"), Workload(4, chunked_prefill=128).server_flags)
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--model-path"] == "/m" and flags["--chunked-prefill-size"] == "128"
    assert flags["--max-total-tokens"] == str(CONFIG.max_total_tokens)
    assert (flags["--tokendance-selection"], flags["--tokendance-recompute-ratio"], flags["--tokendance-check-layer"],
            flags["--tokendance-screen-layer"]) == ("attention-kv", "0.3", "2", "1")
    assert "--tokendance-max-approximate-tokens" not in flags
    assert "--no-tokendance-planned-selection" in argv  # a chunked prompt selects per chunk, as in-process
    assert "--no-tokendance-planned-selection" not in server_argv(replace(DEFAULT, planned=True), CONFIG)
    dense = server_argv(DEFAULT, CONFIG)  # named: the launcher's `auto` would be mirror storage on the CPU
    assert dense[dense.index("--tokendance-storage") + 1] == "dense"
    budgeted = server_argv(replace(DEFAULT, budget=200), CONFIG)
    assert budgeted[-4:-2] == ["--tokendance-max-approximate-tokens", "200"]
    mirrored = server_argv(replace(DEFAULT, storage="mirror", diff_threshold=0.05), CONFIG)
    assert mirrored[-4:] == ["--tokendance-storage", "mirror", "--tokendance-diff-threshold", "0.05"]
    assert server_argv(None, CONFIG, Workload(4, round="all").server_flags)[2:] == ["--disable-tokendance"]
    assert server_argv(DEFAULT, CONFIG, Workload(4, round="all").server_flags)[2] == "--no-tokendance-round-leader"
    plain = server_argv(Setting(PLAIN), replace(CONFIG, options=replace(CONFIG.options, sparse_writeback=False)))
    assert plain[2:4] == ["--tokendance-recompute-ratio", "0.0"] and "--tokendance-selection" not in plain
    assert plain[-1] == "--no-tokendance-sparse-writeback"
    with pytest.raises(ValueError):
        server_argv(Setting(FULL), CONFIG)
    cases = replace(CONFIG, workloads=(Workload(2, 25), Workload(3, 20), Workload(3, round="lead")),
                    chunked_prefill=64).cases()
    assert len(cases) == 2 * 3 + 2 and cases[-2:] == [(DEFAULT, Workload(2, 25, 64)), (DEFAULT, Workload(3, 20, 64))]
    cases = replace(CONFIG, workloads=(Workload(2, 25), Workload(3, 20)), chunked_prefill=64).cases()
    assert len(cases) == 2 * 2 + 2 and cases[-2:] == [(DEFAULT, Workload(2, 25, 64)), (DEFAULT, Workload(3, 20, 64))]


@pytest.fixture(scope="module")
def runner(tmp_path_factory, smollm2_path):
    return QualityRunner(str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")))


def canned(runner, prompts: Prompts, store, setting: Setting, i: int, reuse: bool, **more) -> ServerOutput:
    """What a correct server would answer: the greedy output at `setting` with its own top-K."""
    prompt = prompts.prompts[i]
    first = in_process(runner, prompt, store, setting, CONFIG, [])
    own = in_process(runner, prompt, store, setting, CONFIG, first.greedy)  # top-K along its own output
    counts = dict(reused_tokens=own.reused, recomputed_tokens=own.recomputed, segment_hits=own.hits) if reuse else {}
    return ServerOutput.from_response(response(first.greedy, own.tops, len(prompt.input_ids),
                                               [(s.start, s.end) for s in prompt.spans], **counts, **more))


def test_a_led_round_is_compared_with_its_leaders_masters(runner):
    """round=lead: the in-process side follows the leader the server reports (round_master_tokens):
    that member is a full prefill, the others read its blocks -- as a correct server answers."""
    workload = Workload(3, 25, round="lead")
    config = replace(CONFIG, workloads=(workload,), settings=(DEFAULT,))
    prompts = Prompts(runner, config, workload)
    assert len(prompts.prompts) == 3  # a round workload measures every member
    store = runner.seed_store(prompts.sim)
    lead = runner.lead(prompts.sim, store, 1)
    reference = {(workload.label, i): canned(runner, prompts, store, Setting(FULL), i, False) for i in range(3)}
    blended = {(DEFAULT.label, workload.label, i):
               canned(runner, prompts, store, Setting(FULL), i, True, round_master_tokens=7) if i == 1 else
               canned(runner, prompts, lead.store, DEFAULT, i, True) for i in range(3)}
    samples = compare_all(config, runner, {workload: prompts}, reference, blended)
    for s in samples:  # a random model's KLs are ~1e-8: compared relatively
        assert s.server_first_tkl == pytest.approx(s.inproc_first_tkl, rel=1e-3, abs=1e-12)
        assert (s.server_hits, s.server_reused, s.server_recomputed) == (s.inproc_hits, s.inproc_reused,
                                                                         s.inproc_recomputed)
        assert (s.inproc_hits == 0) == (s.agent == 1)
    [row] = summarize(samples)  # the readers' means leave the leader out
    followers = [s for s in samples if s.agent != 1]
    assert row["prompts"] == 3 and row["readers"] == 2
    assert row["readers_server_first_tkl"] == pytest.approx(sum(s.server_first_tkl for s in followers) / 2)
    assert row["server_first_tkl"] == pytest.approx(sum(s.server_first_tkl for s in samples) / 3)
    # answers whose leader went unreported are compared with the authors' Masters: they differ
    blended[DEFAULT.label, workload.label, 1] = canned(runner, prompts, store, Setting(FULL), 1, True)
    unled = compare_all(config, runner, {workload: prompts}, reference, blended)
    assert any(s.server_first_tkl != pytest.approx(s.inproc_first_tkl, rel=1e-3, abs=1e-12)
               for s in unled if s.agent != 1)


def test_comparison_on_canned_responses(runner):
    workload = CONFIG.workloads[0]
    prompts = Prompts(runner, CONFIG, workload)
    assert len(prompts.texts) == 2 and len(prompts.seed_texts) == 2
    store = runner.seed_store(prompts.sim)
    reference = {(workload.label, i): canned(runner, prompts, store, Setting(FULL), i, False) for i in range(2)}
    blended = {(s.label, workload.label, i): canned(runner, prompts, store, s, i, True)
               for s in CONFIG.settings for i in range(2)}
    saved = SavedAnswers(None, CONFIG, resume=False)
    saved.put(["--any"], workload, [reference[workload.label, i] for i in range(2)])
    assert serve(["--any"], [prompts], CONFIG, False, "saved", saved) == reference  # nothing to start
    samples = compare_all(CONFIG, runner, {workload: prompts}, reference, blended)
    assert len(samples) == 4
    for s in samples:  # a server that does what the in-process blend does: the same numbers
        assert s.same_prompt and s.noise_first_tkl < 1e-6 and s.noise_agree == CONFIG.decode_steps + 1
        assert s.server_first_tkl == pytest.approx(s.inproc_first_tkl, rel=1e-3, abs=1e-12)
        assert s.server_agree == s.inproc_agree and s.steps_compared == min(CONFIG.decode_steps, s.server_agree)
        assert 0 < s.content_steps <= CONFIG.decode_steps  # a random model is unsure at every step
        if s.steps_compared:
            assert s.server_decode_tkl == pytest.approx(s.inproc_decode_tkl, rel=1e-3, abs=1e-12)
            assert s.server_content_tkl == pytest.approx(s.server_decode_tkl)  # every step a content step
        else:
            assert s.server_decode_tkl is None and s.inproc_decode_tkl is None
        assert (s.server_hits, s.server_reused, s.server_recomputed) == (s.inproc_hits, s.inproc_reused,
                                                                         s.inproc_recomputed)
        assert s.inproc_hits == len(prompts.prompts[s.agent].spans) > 0
    plain = [s for s in samples if s.setting == PLAIN]
    assert all(s.server_first_tkl > 0 and s.inproc_first_kl > 1e-6 for s in plain)  # reuse from elsewhere
    # a server whose first answer token differs from the reference: no decode step compares
    key = (DEFAULT.label, workload.label, 0)
    wrong = blended[key]
    blended[key] = replace(wrong, ids=[wrong.ids[0] + 1, *wrong.ids[1:]], prompt_tokens=wrong.prompt_tokens + 1)
    bad = compare_all(CONFIG, runner, {workload: prompts}, reference, blended)[0]
    assert bad.server_agree == 0 and bad.steps_compared == 0 and bad.server_decode_tkl is None
    assert not bad.same_prompt and bad.inproc_decode_tkl is None
    rows = summarize(samples)
    assert {(r["workload"], r["setting"]) for r in rows} == {(workload.label, s.label) for s in CONFIG.settings}
    assert all(r["prompts"] == 2 and r["same_prompts"] for r in rows)
