"""The quality harness (bench/quality.py, bench_quality CLI) on a tiny random Llama."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from sglang_tokendance.bench.quality import (FULL, ORACLE, PLAIN, QualityConfig, QualityRunner, Setting, common_prefix,
                                             evaluate_prompt, entropy_rows, kl_top, top_margin)
from sglang_tokendance.bench.quality_experiments import (MASTER_CHOICES, GroupBatch, evaluate_group,
                                                         evaluate_master_choice, group_references, group_settings,
                                                         master_stores, measure_chunked, measure_divergence, medoid,
                                                         segment_copies, summarize)
from sglang_tokendance.bench.quality_server import Workload
from sglang_tokendance.bench.workloads import make_simulation, preset_config
from sglang_tokendance.bench.tiny_models import write_tiny_model
from sglang_tokendance.server_args import TokenDanceArgs

RULE = TokenDanceArgs().selection  # the default rule the sweep runs screened and in simulations
CONFIG = QualityConfig(num_agents=(2,), rules=("cacheblend-k", "attention-kv"), ratios=(0.5, 1.0),
                       check_layers=(1, 2), continuation_tokens=6, simulation_agents=2, simulation_rounds=2,
                       history_words=20, block_words=25, decode_steps=5)


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
    assert float(entropy_rows(torch.zeros(2, 8))[1]) == pytest.approx(math.log(8))  # uniform: log V nats
    assert float(entropy_rows(torch.tensor([50.0, 0, 0]))) == pytest.approx(0, abs=1e-6)
    assert float(top_margin(logits)) == pytest.approx(2.0)  # log-probability gap of the top two
    planned = Setting.parse("attention-kv r=0.3 c=5 s=1 planned")
    assert planned.planned and Setting.parse(planned.label) == planned and not Setting.parse("plain").planned
    budgeted = Setting.parse("attention-kv r=0.3 c=5 s=1 m=100")
    assert budgeted.budget == 100 and Setting.parse(budgeted.label) == budgeted
    assert Setting.parse("attention-kv r=0.3 c=5").budget is None
    mirrored = Setting.parse("attention-kv r=0.3 c=5 st=mirror e=0.05")
    assert (mirrored.storage, mirrored.diff_threshold) == ("mirror", 0.05) and Setting.parse(mirrored.label) == mirrored
    assert Setting.parse("plain st=mirror").storage == "mirror" and Setting.parse("plain").storage == "dense"


def test_teacher_forced_decode_steps_are_decode_steps(runner):
    """One extend of the forced tokens gives each decode step's logits, as one-token steps do."""
    import torch

    from sglang_tokendance.core.blend_types import BlendOptions

    ids = runner.segment_ids("The council met on Friday to talk about the flooded mill and the north road.")
    kv = runner.new_kv(len(ids) + 8)
    logits, _ = runner.prefill(ids, kv, [], BlendOptions())
    out = runner.greedy(kv.clone(), len(ids), logits, 8)
    forced = runner.forced_inputs(out, 6)
    assert forced == out[:len(forced)] and len(forced) > 1
    stepwise = kv.clone()
    steps = torch.stack([runner.extend(stepwise, [t], len(ids) + j)[-1] for j, t in enumerate(forced)])
    torch.testing.assert_close(runner.extend(kv, forced, len(ids)), steps, atol=1e-4, rtol=1e-4)
    assert steps.argmax(-1).tolist() == out[1:len(forced) + 1]
    eos = min(runner.eos)
    assert runner.forced_inputs([5, 6, eos, 7], 10) == [5, 6] and runner.forced_inputs([5, 6, 7], 2) == [5, 6]
    assert runner.extend(kv, [], len(ids)).shape[0] == 0
    # over a full prefill's KV, recomputing the last prompt token changes nothing
    torch.testing.assert_close(runner.refresh_last(kv, ids), logits, atol=1e-4, rtol=1e-4)


def test_every_setting_against_the_full_prefill(runner):
    sim = make_simulation(preset_config("generative_agents", num_agents=2, num_rounds=1, history_words=20,
                                        block_words=25, max_new_tokens=6))
    store = runner.seed_store(sim)
    prompt = runner.agent_prompt(sim, 0, 0, sim.seed_messages)
    samples = evaluate_prompt(runner, prompt, store, CONFIG, 2, 0)
    # plain + (2 rules + oracle) x 2 ratios x 2 check layers + the default rule screened at layer 1
    assert len(samples) == 1 + 3 * 2 * 2 + 2
    assert {s.setting for s in samples if s.screen_layer} == {f"{RULE} r=0.5 c=2 s=1", f"{RULE} r=1 c=2 s=1"}
    by = {s.setting: s for s in samples}
    assert by[PLAIN].reused_tokens == sum(s.end - s.start for s in prompt.spans) > 0
    assert by[PLAIN].first_kl > 1e-6  # the blocks' KV came from their authors' contexts
    assert by[PLAIN].decode_kl > 1e-6 and min(by[PLAIN].decode_kls) > 0  # and decoding sees it at every step
    for s in samples:
        assert len(s.decode_kls) == CONFIG.decode_steps
        assert s.decode_kl == pytest.approx(sum(s.decode_kls) / len(s.decode_kls))
        if s.ratio == 1.0:  # a full prefill: same distribution, same continuation, same decoding
            assert s.first_kl < 1e-6 and s.top1 and s.common_prefix == s.continuation_tokens > 0, s.setting
            assert max(s.decode_kls) < 1e-6, s.setting
            assert s.kept_tokens == s.reused_tokens
        assert s.token_layers <= s.full_token_layers + s.prompt_tokens * s.check_layer
    rows = summarize(samples)
    assert {r["setting"] for r in rows} == set(by)
    assert all(r["recomputed_share"] == r["ratio"] for r in rows if r["rule"] == ORACLE)


def test_a_round_leaders_blocks_become_the_masters_its_followers_read(runner):
    """QualityRunner.lead, as the server's round leader: the leader's exact block KV supersedes
    the authors' Masters, so the leader's own prompt read through them is its full prefill; a
    follower reads them and is charged its share of the leader's prefill."""
    import torch

    from sglang_tokendance.core.blend_types import BlendOptions

    sim = make_simulation(preset_config("generative_agents", num_agents=3, num_rounds=1, history_words=20,
                                        block_words=25, max_new_tokens=6))
    store = runner.seed_store(sim)
    lead = runner.lead(sim, store, 2)
    leader = runner.agent_prompt(sim, 2, 0, sim.seed_messages)
    assert (lead.leader, lead.followers) == (2, 2)
    assert lead.token_layers == len(leader.input_ids) * runner.model.num_layers
    blocks = {span.hash for span in leader.spans}
    assert blocks <= set(store.entries) and set(lead.store.entries) == set(store.entries)
    assert all(not torch.allclose(lead.store.entries[h][1], store.entries[h][1]) for h in blocks)
    assert all(lead.store.entries[h] is store.entries[h] for h in set(store.entries) - blocks)
    room, options = len(leader.input_ids) + 4, BlendOptions()
    full, *_ = runner.run_setting(leader, store, Setting(FULL), options, room)
    own, _, _, hits = runner.run_setting(leader, lead.store, Setting(PLAIN), options, room)
    author, *_ = runner.run_setting(leader, store, Setting(PLAIN), options, room)
    assert hits == len(leader.spans) > 0
    torch.testing.assert_close(own, full, atol=1e-4, rtol=1e-4)  # its own blocks, exact
    assert not torch.allclose(author, full, atol=1e-3, rtol=1e-3)  # the authors' are not
    follower = runner.agent_prompt(sim, 0, 0, sim.seed_messages)
    setting = Setting(RULE, 0.3, 2)
    _, _, alone, _ = runner.run_setting(follower, lead.store, setting, options, room)
    _, _, led, _ = runner.run_led(follower, lead, setting, options, room)
    share = round(lead.token_layers / 2)
    assert (led.token_layers - alone.token_layers, led.full_token_layers - alone.full_token_layers) == (share, share)
    assert Setting.parse(f"{RULE} r=0.3 c=2 lead") == replace(setting, lead=True)
    assert Setting.parse("plain lead").lead and Setting.parse("plain lead").label == "plain lead"
    with pytest.raises(ValueError):
        Setting.parse(f"{RULE} r=0.3 c=2 lead=1")


def test_chunked_prefill_plans_each_chunk_as_the_server_does(runner):
    import torch

    sim = make_simulation(preset_config("generative_agents", num_agents=2, num_rounds=1, history_words=20,
                                        block_words=25, max_new_tokens=6))
    store = runner.seed_store(sim)
    prompt = runner.agent_prompt(sim, 1, 0, sim.seed_messages)
    n, room = len(prompt.input_ids), len(prompt.input_ids) + 8
    whole = store.place(prompt, runner.new_kv(room))
    pieces = [(start + r.start, start + r.end, r.segment_offset, r.segment)
              for start in range(0, n, 16) for r in store.chunk_runs(prompt, start, min(n, start + 16))]
    assert len(pieces) > len(whole)  # a block cut by chunk boundaries is read piecewise, from its offsets
    for start, end, offset, segment in pieces:
        run = next(r for r in whole if r.start <= start < r.end)
        assert end <= run.end and offset == start - run.start and segment == run.segment
    assert sum(end - start for start, end, _, _ in pieces) == sum(r.end - r.start for r in whole)
    setting = Setting("attention-kv", 0.5, 2, 1)
    logits, _, stats, _ = runner.run_setting(prompt, store, setting, CONFIG.options, room)
    one, _, one_stats = runner.run_chunked(prompt, store, setting, CONFIG.options, room, n)
    torch.testing.assert_close(one, logits)  # one chunk is the whole prompt's forward
    assert (one_stats.kept_tokens, one_stats.token_layers) == (stats.kept_tokens, stats.token_layers)
    full, _, _, _ = runner.run_setting(prompt, store, Setting("full"), CONFIG.options, room)
    chunked, _, chunked_stats = runner.run_chunked(prompt, store, Setting("attention-kv", 1.0, 2), CONFIG.options,
                                                   room, 16)
    torch.testing.assert_close(chunked, full, atol=1e-4, rtol=1e-4)  # ratio 1 in chunks: a full prefill
    assert chunked_stats.reused_tokens == chunked_stats.kept_tokens == stats.reused_tokens
    planned = Setting("attention-kv", 0.5, 2, 1, planned=True)  # the whole prompt's selection, made first
    planned_logits, _, in_chunks = runner.run_chunked(prompt, store, planned, CONFIG.options, room, 16)
    assert in_chunks.kept_tokens == stats.kept_tokens
    # the chunks resume the probe's states (the tail's chunks, which read nothing, included): the
    # unchunked forward, the probe layers run once per token
    torch.testing.assert_close(planned_logits, logits, atol=1e-4, rtol=1e-4)
    assert in_chunks.token_layers == stats.token_layers
    # within a fidelity budget, as the server's planned selection (before, the plan ignored it)
    budgeted = Setting("attention-kv", 0.5, 2, 1, budget=10)
    _, _, budget_stats, _ = runner.run_setting(prompt, store, budgeted, CONFIG.options, room)
    _, _, planned_stats = runner.run_chunked(prompt, store, replace(budgeted, planned=True), CONFIG.options, room, 16)
    assert planned_stats.kept_tokens == budget_stats.kept_tokens >= stats.reused_tokens - 10 > stats.kept_tokens
    unscreened = Setting("attention-kv", 0.5, 2)
    whole_logits, _, _, _ = runner.run_setting(prompt, store, unscreened, CONFIG.options, room)
    one, _, _ = runner.run_chunked(prompt, store, replace(unscreened, planned=True), CONFIG.options, room, n)
    torch.testing.assert_close(one, whole_logits)  # one chunk plans nothing: the whole prompt's forward
    samples = measure_chunked(runner, replace(CONFIG, num_agents=(2,), prompts_per_n=1, ratios=(0.5,)), (16,))
    assert {(s.setting, s.chunk) for s in samples} == {
        *((label, chunk) for label in (PLAIN, f"{RULE} r=0.5 c=2 s=1") for chunk in (0, 16)),
        (f"{RULE} r=0.5 c=2 s=1 planned", 16)}
    rows = summarize(samples)
    assert {(r["setting"], r["chunk"]) for r in rows} == {(s.setting, s.chunk) for s in samples}


def test_round_group_modes(runner):
    """One round of 3 agents in one batch: per-request, aligned and shared-probe selection at
    the same ratios; ratio 1 is a full prefill in every mode, the shared probe skips probing
    the agents after the first and does less work than aligned selection at the same ratio."""
    sim = make_simulation(preset_config("generative_agents", num_agents=3, num_rounds=1, history_words=20,
                                        block_words=25, max_new_tokens=6))
    store = runner.seed_store(sim)
    prompts = [runner.agent_prompt(sim, i, 0, sim.seed_messages) for i in range(3)]
    config = replace(CONFIG, ratios=(0.3, 1.0), check_layers=(2,))
    settings = group_settings(config, probes=(1,))
    assert [s.label for s in settings[:3]] == [f"{RULE} r=0.3 c=2 s=1", f"{RULE} r=0.3 c=2 s=1 g=aligned",
                                               f"{RULE} r=0.3 c=2 s=1 g=aligned k=1"]
    assert Setting.parse(settings[2].label) == settings[2]
    samples = evaluate_group(runner, prompts, group_references(runner, prompts, config), store, config, settings)
    assert len(samples) == 3 * (1 + len(settings))
    by = {(s.setting, s.agent): s for s in samples}
    for s in samples:
        if s.ratio == 1.0:
            assert s.first_kl < 1e-6 and max(s.decode_kls) < 1e-6, s.setting
    aligned, shared = settings[1].label, settings[2].label
    assert sum(by[(shared, a)].adopted_tokens for a in range(3)) > 0 == by[(shared, 0)].adopted_tokens
    assert by[(shared, 0)].token_layers < by[(aligned, 0)].token_layers  # the batch's work
    rows = {r["setting"]: r for r in summarize(samples)}
    assert rows[shared]["adopted_share"] > 0 == rows[aligned]["adopted_share"]


def test_medoid_of_copies():
    """The copy that is the mean of the others is their medoid, wherever it stands; one copy is its own."""
    import torch

    torch.manual_seed(0)
    others = [(torch.randn(3, 5, 2, 4) * (layer + 1), torch.randn(3, 5, 2, 4)) for layer in range(4)]
    mean = (torch.stack([k for k, _ in others]).mean(0), torch.stack([v for _, v in others]).mean(0))
    for at in range(len(others) + 1):
        assert medoid([*others[:at], mean, *others[at:]]) == at
    assert medoid(others[:1]) == 0


def _round(agents: int, rounds: int = 1):
    return make_simulation(preset_config("generative_agents", num_agents=agents, num_rounds=rounds, history_words=20,
                                         block_words=25, max_new_tokens=6))


def _changed_tokens(copy, master) -> int:
    """Tokens of a segment copy whose K or V differs from the Master's at some layer."""
    return int((((copy[0] - master[0]).abs().amax((0, 2, 3)) > 1e-4)
                | ((copy[1] - master[1]).abs().amax((0, 2, 3)) > 1e-4)).sum())


def test_member_copies_are_mirrors(runner):
    """A round group leaves one copy of every segment per member: the author's Master with exactly
    the member's kept tokens recomputed (none at plain reuse), so each member's diff is its kept
    tokens whichever copy is the Master; the Master choices replace just those Masters."""
    sim = _round(3)
    store = runner.seed_store(sim)
    prompts = [runner.agent_prompt(sim, i, 0, sim.seed_messages) for i in range(3)]
    batch = GroupBatch(runner, prompts, store, CONFIG)
    for setting in (Setting(PLAIN), Setting("attention-kv", 0.5, 2)):
        members = batch.run(runner, setting, CONFIG.options)
        copies = segment_copies(store, members)
        assert set(copies) == set(store.entries) and all(len(c) == 3 for c in copies.values())
        for i, member in enumerate(members):
            changed = sum(_changed_tokens(c[i], store.entries[h]) for h, c in copies.items())
            assert changed == member.stats.kept_tokens, (setting, i)
            assert (changed > 0) == (setting.rule != PLAIN), (setting, i)
    stores = master_stores(store, copies)
    assert list(stores) == list(MASTER_CHOICES) and stores["author"] is store
    for h, c in copies.items():
        assert stores["first-reader"].entries[h] is c[0] and stores["medoid"].entries[h] is c[medoid(c)]


def test_master_choice_rounds(runner):
    """Round 1 reads round 0's segments under each Master choice: with nothing recomputed in round 0
    every member copy is the author's Master, so every choice gives the author's measures; with
    tokens recomputed, plain reuse of a member's copy is another prefill than of the author's."""
    sim = _round(3, rounds=2)
    config = replace(CONFIG, decode_steps=3, continuation_tokens=3)
    for ratio in (0.0, 0.5):
        samples = evaluate_master_choice(runner, sim, config, Setting("attention-kv", ratio, 2))
        assert len(samples) == len(MASTER_CHOICES) * 2 * 3
        by = {(s.master, s.setting, s.agent): s for s in samples}
        author = [s for s in samples if s.master == "author"]
        for master in MASTER_CHOICES[1:]:
            gaps = [abs(by[(master, s.setting, s.agent)].first_kl - s.first_kl) for s in author]
            assert (max(gaps) < 1e-5) == (ratio == 0), (ratio, master, gaps)
    rows = summarize(samples)
    assert {(r["master"], r["setting"]) for r in rows} == {(m, s) for m in MASTER_CHOICES
                                                           for s in (PLAIN, "attention-kv r=0.5 c=2")}


def test_simulation_divergence(runner):
    results = measure_divergence(runner, CONFIG)
    assert [r.setting for r in results] == [PLAIN, "cacheblend-k r=0.3 c=1", "cacheblend-k r=0.3 c=2",
                                            "attention-kv r=0.3 c=2", f"{RULE} r=0.3 c=2 s=1"]
    for r in results:
        assert r.rounds == 2 and len(r.outputs) == 2
        assert r.first_divergence in (None, 1, 2)
    full = measure_divergence(runner, replace(CONFIG, simulation_settings=(Setting("cacheblend-k", 1.0, 1),)))
    assert full[0].first_divergence is None  # ratio 1 never diverges from the full prefill


def test_fidelity_mode_reports_content_steps_budgets_and_block_deviation(tmp_path, tiny_path):
    from sglang_tokendance import bench_quality

    out = tmp_path / "fidelity.jsonl"
    settings = "plain;attention-kv r=0.3 c=2;attention-kv r=0.3 c=2 m=5;attention-kv r=0.3 c=2 m=0;" \
               "attention-kv r=0.3 c=2 lead"
    bench_quality.main(["--model-path", str(tiny_path), "--fidelity", "--num-agents", "2", "--prompts-per-n", "1",
                        "--seeds", "0,1", "--fidelity-settings", settings, "--continuation-tokens", "4",
                        "--decode-steps", "6", "--history-words", "20", "--block-words", "25",
                        "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = {(r["preset"], r["seed"], r["setting"]): r for r in records if r["kind"] == "fidelity_summary"}
    labels = [Setting.parse(s).label for s in settings.split(";")]
    assert set(rows) == {(p, s, label) for p in ("generative_agents", "debate") for s in (0, 1) for label in labels}
    for preset in ("generative_agents", "debate"):
        plain, budgeted, exact = (rows[(preset, 0, label)] for label in (labels[0], labels[2], labels[3]))
        assert plain["approximate_tokens"] == plain["reused_tokens"] > 5
        assert budgeted["approximate_tokens"] <= 5 and exact["approximate_tokens"] == 0
        assert exact["decode_kl"] == pytest.approx(0, abs=1e-6)  # nothing approximate: a full prefill
        assert exact["decisive_top1"] in (None, 1.0)
        # the round's leader (its last agent, unmeasured) caches every block of its prompt, the debate's
        # briefing too (not seeded), and charges its exact prefill to the one follower
        led, alone = rows[(preset, 0, labels[4])], rows[(preset, 0, labels[1])]
        assert led["reused_tokens"] >= alone["reused_tokens"]
    led, alone = rows[("generative_agents", 0, labels[4])], rows[("generative_agents", 0, labels[1])]
    assert led["reused_tokens"] == alone["reused_tokens"] and led["work"] > alone["work"]
    assert rows[("debate", 0, labels[4])]["reused_tokens"] > rows[("debate", 0, labels[1])]["reused_tokens"]
    samples = [r for r in records if r["kind"] == "fidelity_sample"]
    assert all(len(s["block_deviation"]) >= 2 and s["content_steps"] <= len(s["decode_kls"]) for s in samples)
    assert all(d == pytest.approx(0, abs=1e-5) for s in samples if s["setting"] == labels[3]
               for d in s["block_deviation"])
    assert any(d > 0 for s in samples if s["setting"] == labels[0] for d in s["block_deviation"])
    assert {r["seed"] for r in records if r["kind"] == "fidelity_pooled"} == {-1}
    assert any(r["kind"] == "fidelity_deviation" and "block 1" in r for r in records)
    md = out.with_suffix(".md").read_text()
    assert "--fidelity" in md and "content_kl" in md and "by block index" in md
    assert out.with_suffix(".png").stat().st_size > 0
    assert out.with_name("fidelity_frontier_n2.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        bench_quality.parse_args(["--fidelity", "--presets", "town"])
    with pytest.raises(SystemExit):  # a server leads rounds of a workload, not of a setting
        bench_quality.parse_args(["--server", "--server-settings", "plain lead"])
    assert bench_quality.parse_args(["--fidelity"]).num_agents == (4, 10, 16)


def test_diff_gaps_mode_measures_each_reused_tokens_worst_layer_gap(tmp_path, tiny_path):
    from sglang_tokendance import bench_quality

    out = tmp_path / "gaps.jsonl"
    bench_quality.main(["--model-path", str(tiny_path), "--diff-gaps", "--num-agents", "2,3", "--prompts-per-n", "1",
                        "--presets", "debate", "--seeds", "0", "--history-words", "20", "--block-words", "25",
                        "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert [(r["agents"], r["agent"]) for r in prompts] == [(2, 0), (3, 0)]
    for r in prompts:
        layers = json.loads((tiny_path / "config.json").read_text())["num_hidden_layers"]
        assert len(r["worst"]) > 0 and len(r["layer_median"]) == layers
        assert r["layer_median"][0] == pytest.approx(0, abs=1e-5)  # layer 0's KV does not see the context
        assert max(r["worst"]) > 0  # deeper, it does
    summary = [r for r in records if r["kind"] == "summary"]
    shares = [summary[0][f"share <= {e:g}"] for e in bench_quality.GAP_THRESHOLDS]
    assert shares == sorted(shares) and 0 <= shares[0] and shares[-1] <= 1
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0


def test_cli_writes_results(tmp_path, tiny_path):
    from sglang_tokendance import bench_quality

    out = tmp_path / "quality.jsonl"
    bench_quality.main(["--model-path", str(tiny_path), "--num-agents", "2", "--rules", "cacheblend-k",
                        "--ratios", "0.5", "--check-layers", "1,2", "--continuation-tokens", "4",
                        "--simulation-agents", "2",
                        "--simulation-rounds", "1", "--history-words", "20", "--block-words", "25",
                        "--output-file", str(out)])
    kinds = {json.loads(line)["kind"] for line in out.read_text().splitlines()}
    assert kinds == {"sample", "summary", "divergence", "timing"}
    md = out.with_suffix(".md").read_text()
    assert "python -m sglang_tokendance.bench_quality --model-path" in md and "N = 2" in md
    assert "| first_kl | decode_kl |" in md and "Decode-step KL by step" in md
    assert (tmp_path / "quality_n2.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        bench_quality.parse_args(["--rules", "best"])
    for bad in (["--server-settings", "best r=1 c=1"], ["--server-workloads", "agents=3"], ["--decode-steps", "0"]):
        with pytest.raises(SystemExit):
            bench_quality.parse_args(bad)
    groups = tmp_path / "groups.jsonl"
    bench_quality.main(["--model-path", str(tiny_path), "--groups", "--num-agents", "2", "--ratios", "0.5",
                        "--check-layers", "2", "--continuation-tokens", "4", "--decode-steps", "3",
                        "--history-words", "20", "--block-words", "25", "--output-file", str(groups)])
    kinds = {json.loads(line)["kind"] for line in groups.read_text().splitlines()}
    assert kinds == {"group_sample", "group_summary", "group_versus"}
    assert "kl_vs_per_request" in groups.with_suffix(".md").read_text() and groups.with_suffix(".png").stat().st_size
    master = tmp_path / "master.jsonl"
    bench_quality.main(["--model-path", str(tiny_path), "--master-choice", "--num-agents", "1,2", "--check-layers", "2",
                        "--continuation-tokens", "3", "--decode-steps", "2", "--history-words", "20",
                        "--block-words", "25", "--output-file", str(master)])
    records = [json.loads(line) for line in master.read_text().splitlines()]
    assert {r["kind"] for r in records} == {"master_sample", "master_summary", "master_versus"}
    versus = [r for r in records if r["kind"] == "master_versus"]
    assert {(r["agents"], r["master"]) for r in versus} == {(n, m) for n in (1, 2) for m in MASTER_CHOICES[1:]}
    for r in versus:  # a group of one: its only member's copy is the medoid and the first reader's
        if r["agents"] == 1:
            twin = next(v for v in versus if v["agents"] == 1 and v["setting"] == r["setting"] and v is not r)
            assert r["decode_kl"] == twin["decode_kl"]
    md = master.with_suffix(".md").read_text()
    assert "--master-choice" in md and "kl_vs_author" in md and master.with_suffix(".png").stat().st_size
    chunked = tmp_path / "chunked.jsonl"
    bench_quality.main(["--model-path", str(tiny_path), "--chunked", "32", "--num-agents", "2", "--prompts-per-n",
                        "1", "--ratios", "0.5", "--check-layers", "2", "--continuation-tokens", "3",
                        "--decode-steps", "2", "--history-words", "20", "--block-words", "25", "--output-file",
                        str(chunked)])
    rows = [json.loads(line) for line in chunked.read_text().splitlines()]
    assert {(r["setting"], r["chunk"]) for r in rows if r["kind"] == "chunked_summary"} == {
        *((label, chunk) for label in ("plain", f"{RULE} r=0.5 c=2 s=1") for chunk in (0, 32)),
        (f"{RULE} r=0.5 c=2 s=1 planned", 32)}
    assert "kl_vs_whole" in chunked.with_suffix(".md").read_text() and chunked.with_suffix(".png").stat().st_size
    for bad in (["--groups", "--master-choice"], ["--chunked", "64", "--groups"], ["--chunked", "0"]):
        with pytest.raises(SystemExit):
            bench_quality.parse_args(bad)
    server = bench_quality.parse_args(["--server", "--server-workloads", "N=6 w=40;N=3 w=30 chunk=64"])
    assert server.server_workloads == (Workload(6, 40), Workload(3, 30, 64))
    assert server.server_settings[0] == bench_quality.server_default_setting()
    assert bench_quality.server_config_from(server).cases()[0] == (server.server_settings[0], Workload(6, 40))
