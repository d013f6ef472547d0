"""The experiments of `python -m sglang_tokendance.bench_quality` over bench/quality.py's runner.

Round groups (`measure_groups`), Master choice (`measure_master_choice`), chunked prefill
(`measure_chunked`), fidelity per workload (`measure_fidelity`, `reused_kv_gaps`), multi-round
divergence (`measure_divergence`), prefill timing, and the summaries the CLI writes
(`summarize`, `decode_kl_by_step`). Each returns bench/quality.py's samples or plain rows.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch
from tqdm import tqdm

from sglang_tokendance.bench.quality import (FULL, PLAIN, QualityConfig, QualityRunner, Reference, Sample, SegmentKV,
                                             SegmentStore, Setting, evaluate_prompt, mean_or_none, reference_of,
                                             room_for, sample_of, screened_setting)
from sglang_tokendance.bench.workloads import Simulation, make_simulation, message_block, preset_config
from sglang_tokendance.core.blend import blended_prefill
from sglang_tokendance.core.blend_types import BlendOptions, BlendStats, RequestRow, ReusedRun
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.core.segments import SegmentedPrompt
from sglang_tokendance.core.selection import rule_named
from sglang_tokendance.server_args import TokenDanceArgs

def group_settings(config: QualityConfig, probes: Sequence[int]) -> list[Setting]:
    """Per ratio of the sweep, the server's default rule at the deepest check layer (screened at
    config.screen_layer when below it) under per-request selection, aligned selection, and
    aligned selection with each shared probe of `probes`."""
    deepest = max(config.check_layers)
    screen = config.screen_layer if 1 <= config.screen_layer < deepest else 0
    base = [Setting(TokenDanceArgs().selection, ratio, deepest, screen) for ratio in config.ratios]
    return [replace(b, group=group, probe=k) for b in base
            for group, k in (("per-request", 0), ("aligned", 0), *(("aligned", k) for k in probes))]


class Member(NamedTuple):
    """One member of a round group after the group's prefill: its last-token logits, its own KV
    (slot = position), its stats (token-layers: the batch's; reused, kept and adopted tokens and
    masks: its own) and its reused runs."""

    logits: torch.Tensor
    kv: DenseKV
    stats: BlendStats
    runs: list[ReusedRun]


class GroupBatch:
    """A round's prompts in one extend batch of one round group, as the server's round policy
    admits them, every cached segment of `store` placed."""

    def __init__(self, runner: QualityRunner, prompts: Sequence[SegmentedPrompt], store: SegmentStore,
                 config: QualityConfig):
        rooms = [room_for(p, config) for p in prompts]
        self.pooled, self.rows, base = runner.new_kv(sum(rooms)), [], 0
        for prompt, room in zip(prompts, rooms):
            kv = runner.new_kv(room)
            runs = store.place(prompt, kv)
            self.pooled.k[:, base:base + room], self.pooled.v[:, base:base + room] = kv.k, kv.v
            self.rows.append(RequestRow(0, len(prompt.input_ids), torch.arange(base, base + room), runs,
                                        group="round"))
            base += room
        self.ids = torch.tensor([t for p in prompts for t in p.input_ids])
        self.positions = torch.cat([torch.arange(len(p.input_ids)) for p in prompts])
        self.ends = torch.tensor([len(p.input_ids) for p in prompts]).cumsum(0)

    @torch.no_grad()
    def run(self, runner: QualityRunner, setting: Setting, options: BlendOptions) -> list[Member]:
        """The batch's blended prefill at `setting`; every member, in batch order."""
        kv = self.pooled.clone()
        rule = None if setting.rule == PLAIN else rule_named(setting.rule)
        hidden, stats = blended_prefill(runner.model, kv, self.ids, self.positions, self.rows, setting.options(options),
                                        rule)
        logits = runner.model.logits(hidden[self.ends - 1])
        reused = [sum(run.end - run.start for run in row.reused) for row in self.rows]

        def split(mask: torch.Tensor | None) -> Sequence[torch.Tensor | None]:
            return [None] * len(reused) if mask is None else mask.split(reused)

        members = []
        for row, n, kept, adopted, row_logits in zip(self.rows, reused, split(stats.kept), split(stats.adopted),
                                                      logits):
            own = runner.new_kv(row.slots.numel())
            own.k, own.v = kv.k[:, row.slots], kv.v[:, row.slots]
            own_stats = replace(stats, reused_tokens=n, kept=kept, kept_tokens=0 if kept is None else int(kept.sum()),
                                adopted=adopted, adopted_tokens=0 if adopted is None else int(adopted.sum()))
            members.append(Member(row_logits, own, own_stats, list(row.reused)))
        return members


def group_references(runner: QualityRunner, prompts: Sequence[SegmentedPrompt], config: QualityConfig
                     ) -> list[Reference]:
    """Each prompt's full prefill (its reference measures)."""
    return [reference_of(runner, p.input_ids, config, room_for(p, config)) for p in prompts]


@torch.no_grad()
def evaluate_group(runner: QualityRunner, prompts: Sequence[SegmentedPrompt], refs: Sequence[Reference],
                   store: SegmentStore, config: QualityConfig, settings: Sequence[Setting]) -> list[Sample]:
    """A round's prompts prefilled as one batch of one round group, plain reuse and every
    setting; each agent's measures against its own full prefill (`refs`). Token-layers are the batch's."""
    batch = GroupBatch(runner, prompts, store, config)
    return [sample_of(runner, ref, prompt, config, setting, member.logits, member.kv, member.stats,
                      len(prompts), agent)
            for setting in (Setting(PLAIN), *settings)
            for agent, (prompt, ref, member) in enumerate(zip(prompts, refs, batch.run(runner, setting,
                                                                                     config.options)))]


def measure_groups(runner: QualityRunner, config: QualityConfig, probes: Sequence[int] = (1,)) -> list[Sample]:
    """Round groups at every N of the sweep: one round of all N agents (group_settings)."""
    samples = []
    settings = group_settings(config, probes)
    for n in tqdm(config.num_agents, desc="round groups", unit="round"):
        sim = make_simulation(_workload(config, n, rounds=1))
        store = runner.seed_store(sim)
        prompts = [runner.agent_prompt(sim, i, 0, sim.seed_messages) for i in range(n)]
        samples.extend(evaluate_group(runner, prompts, group_references(runner, prompts, config), store, config,
                                      settings))
    return samples


MASTER_CHOICES = ("author", "medoid", "first-reader")


def default_setting(config: QualityConfig) -> Setting:
    """The server's default rule and ratio at the sweep's deepest check layer, with the
    sweep's screen (the server's default setting, in the default sweep)."""
    d = TokenDanceArgs()
    deepest = max(config.check_layers)
    return Setting(d.selection, d.recompute_ratio, deepest, config.screen_layer * (config.screen_layer < deepest))


def segment_copies(store: SegmentStore, members: Sequence[Member]) -> dict[str, list[SegmentKV]]:
    """Each reused segment's member copies, in batch order: a member's KV at the segment's
    positions after its prefill (its Mirror: the Master with its kept tokens recomputed), in
    the Master's position-agnostic form. A run cut short by its prompt's end is no copy."""
    copies: dict[str, list[SegmentKV]] = {}
    for member in members:
        for run in member.runs:
            if run.end - run.start == store.entries[run.segment][0].shape[1]:
                copies.setdefault(run.segment, []).append(store.copy_of(member.kv, run.start, run.end - run.start))
    return copies


def medoid(copies: Sequence[SegmentKV]) -> int:
    """The index of the copy (K, V [layers, n, kv_heads, d]) with the least summed squared
    deviation from the others, K and V over every layer, each layer's deviations normalised by
    their mean so that no layer dominates (squared: the mean of the others, were it a copy, wins)."""
    kv = torch.stack([torch.cat([k.flatten(1), v.flatten(1)], 1) for k, v in copies], 1)  # [layers, copies, D]
    dev = torch.cdist(kv.double(), kv.double()).pow(2)  # [layers, copies, copies]
    dev = dev / dev.mean((1, 2), keepdim=True).clamp_min(1e-30)
    return int(dev.sum((0, 2)).argmin())


def master_stores(author: SegmentStore, copies: dict[str, list[SegmentKV]]
                  ) -> dict[str, SegmentStore]:
    """The segments under each Master choice (MASTER_CHOICES): the author's copy, each
    segment's medoid member copy, its first reader's copy (batch order)."""
    return {"author": author, "medoid": author.replaced({h: c[medoid(c)] for h, c in copies.items()}),
            "first-reader": author.replaced({h: c[0] for h, c in copies.items()})}


@torch.no_grad()
def evaluate_master_choice(runner: QualityRunner, sim: Simulation, config: QualityConfig, setting: Setting
                           ) -> list[Sample]:
    """Which copy of a segment to keep as its Master. Round 0: every agent reads the seed
    messages (Masters: the authors') in one round group at `setting`, leaving a copy of each
    per member. Round 1: the next round's prompts (its orders and instructions) read the same
    messages at other offsets, as one round group under each Master choice, at plain reuse
    and `setting`; each agent against its own full prefill (samples' `master`)."""
    author = runner.seed_store(sim)
    agents = range(len(sim.agents))
    first = [runner.agent_prompt(sim, i, 0, sim.seed_messages) for i in agents]
    members = GroupBatch(runner, first, author, config).run(runner, setting, config.options)
    stores = master_stores(author, segment_copies(author, members))
    prompts = [runner.agent_prompt(sim, i, 1, sim.seed_messages) for i in agents]
    refs = group_references(runner, prompts, config)
    return [replace(s, master=choice)
            for choice, store in tqdm(stores.items(), desc=f"Masters N={len(agents)}", unit="choice", leave=False)
            for s in evaluate_group(runner, prompts, refs, store, config, [setting])]


def measure_master_choice(runner: QualityRunner, config: QualityConfig) -> list[Sample]:
    """evaluate_master_choice at every N of the sweep, at default_setting."""
    return [s for n in tqdm(config.num_agents, desc="master choice", unit="N")
            for s in evaluate_master_choice(runner, make_simulation(_workload(config, n, rounds=2)), config,
                                            default_setting(config))]


def measure_chunked(runner: QualityRunner, config: QualityConfig, chunks: Sequence[int]) -> list[Sample]:
    """Each prompt of the sweep's N prefilled whole and in chunks of each size of `chunks`, at
    plain reuse and at default_setting's rule for every ratio of the sweep (samples' `chunk`),
    selecting per chunk (--no-tokendance-planned-selection) and, in chunks only, `planned` (the
    whole prompt's selection made at the first chunk: the server's default)."""
    blended = [replace(default_setting(config), ratio=r) for r in config.ratios]
    settings = [Setting(PLAIN), *blended, *(replace(s, planned=True) for s in blended)]
    samples = []
    for n, i, prompt, store, _ in agent_prompts(runner, config, "chunked"):
        ids, room = prompt.input_ids, room_for(prompt, config)
        ref = reference_of(runner, ids, config, room)
        for setting in settings:
            for chunk in (*([] if setting.planned else [0]), *chunks):
                logits, kv, stats = runner.run_chunked(prompt, store, setting, config.options, room, chunk or len(ids))
                samples.append(replace(sample_of(runner, ref, prompt, config, setting, logits, kv, stats, n, i),
                                       chunk=chunk))
    return samples


def measure_fidelity(runner: QualityRunner, config: QualityConfig, presets: Sequence[str], seeds: Sequence[int],
                     settings: Sequence[Setting]) -> list[Sample]:
    """Every setting of `settings` (each its own probe) on the first agents' round-0 prompts at
    every N of the sweep, for each workload preset and seed: how fidelity holds as N grows. A
    `lead` setting's round is led by its last agent (prefilled exactly, never measured: the
    first agents follow it, each charged its share of the leader's prefill)."""
    samples, led = [], None  # the round whose lead was computed, with it
    for workload, n, i, prompt, store, sim in preset_prompts(runner, config, presets, seeds, "fidelity"):
        room = room_for(prompt, workload)
        ref = reference_of(runner, prompt.input_ids, workload, room)
        for setting in settings:
            if not setting.lead:
                logits, kv, stats, _ = runner.run_setting(prompt, store, setting, workload.options, room)
            elif i == n - 1:
                continue
            else:
                if led is None or led[0] is not sim:
                    led = sim, runner.lead(sim, store, n - 1)
                logits, kv, stats, _ = runner.run_led(prompt, led[1], setting, workload.options, room)
            samples.append(sample_of(runner, ref, prompt, workload, setting, logits, kv, stats, n, i))
    return samples


def preset_prompts(runner: QualityRunner, config: QualityConfig, presets: Sequence[str], seeds: Sequence[int],
                   desc: str) -> Iterator[tuple[QualityConfig, int, int, SegmentedPrompt, SegmentStore, Simulation]]:
    """`agent_prompts` of each preset and seed (the workload's config first)."""
    for preset in presets:
        for seed in seeds:
            workload = replace(config, preset=preset, seed=seed)
            for item in agent_prompts(runner, workload, f"{desc} {preset} seed={seed}"):
                yield workload, *item


def reused_kv_gaps(runner: QualityRunner, config: QualityConfig, presets: Sequence[str],
                   seeds: Sequence[int]) -> list[dict]:
    """What a diff threshold (--tokendance-diff-threshold) could drop: per reused token of the
    first agents' round-0 prompts, the largest relative L2 gap, over layers and K and V,
    between its exact KV (a full prefill of the reader's prompt) and its Master's placed at the
    reader's positions. One row per preset, seed, N and agent: the tokens' worst gaps and each
    layer's median gap."""
    def gap(exact: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:  # [layers, tokens]
        return (exact - reused).flatten(2).norm(dim=2) / exact.flatten(2).norm(dim=2).clamp_min(1e-12)

    rows = []
    for workload, n, i, prompt, store, _ in preset_prompts(runner, config, presets, seeds, "KV gaps"):
        room = room_for(prompt, workload)
        _, full, _, _ = runner.run_setting(prompt, store, Setting(FULL), workload.options, room)
        cached = runner.new_kv(room)
        at = torch.cat([torch.arange(run.start, run.end) for run in store.place(prompt, cached)])
        gaps = torch.maximum(gap(full.k[:, at], cached.k[:, at]), gap(full.v[:, at], cached.v[:, at]))
        rows.append({"preset": workload.preset, "seed": workload.seed, "agents": n, "agent": i,
                     "worst": gaps.max(0).values.tolist(), "layer_median": gaps.median(1).values.tolist()})
    return rows


def deviation_by_block(samples: Sequence[Sample], setting: str) -> list[dict]:
    """Mean KV deviation from the full prefill of `setting` by block index (prompt order) per
    workload and N: how the approximation grows along the prompt."""
    rows = []
    for key in sorted({(s.preset, s.agents) for s in samples if s.setting == setting}):
        group = [s.block_deviation for s in samples if s.setting == setting and (s.preset, s.agents) == key]
        width = max(map(len, group))
        rows.append({"preset": key[0], "agents": key[1], "setting": setting, **{
            f"block {j}": mean_or_none(d[j] for d in group if j < len(d)) for j in range(width)}})
    return rows


def agent_prompts(runner: QualityRunner, config: QualityConfig, desc: str
                  ) -> Iterator[tuple[int, int, SegmentedPrompt, SegmentStore, Simulation]]:
    """At every N of the sweep, the first agents' round-0 prompts (N, agent, prompt, the seed
    messages' Masters, the round's simulation)."""
    for n in config.num_agents:
        sim = make_simulation(_workload(config, n, rounds=1))
        store = runner.seed_store(sim)
        for i in tqdm(range(min(n, config.prompts_per_n)), desc=f"{desc} N={n}", unit="agent"):
            yield n, i, runner.agent_prompt(sim, i, 0, sim.seed_messages), store, sim


def measure_prompts(runner: QualityRunner, config: QualityConfig) -> list[Sample]:
    return [s for n, i, prompt, store, _ in agent_prompts(runner, config, "quality")
            for s in evaluate_prompt(runner, prompt, store, config, n, i)]


@dataclass
class SimulationResult:
    setting: str
    agents: int
    rounds: int
    first_divergence: int | None  # 1-based round whose outputs first differ from full prefill's
    outputs: list[list[str]] = field(repr=False, default_factory=list)


@torch.no_grad()
def simulate(runner: QualityRunner, sim: Simulation, setting: Setting, options: BlendOptions,
             steps: int) -> list[list[list[int]]]:
    """Every round's outputs (token ids per agent); outputs are registered as segments with
    their authors' KV (all but the last token, as the server does)."""
    store = runner.seed_store(sim)
    blocks, rounds = list(sim.seed_messages), []
    for r in range(sim.config.num_rounds):
        outputs = []
        for i in range(len(sim.agents)):
            prompt = runner.agent_prompt(sim, i, r, blocks)
            logits, kv, _, _ = runner.run_setting(prompt, store, setting, options, len(prompt.input_ids) + steps)
            out = runner.greedy(kv, len(prompt.input_ids), logits, steps)
            outputs.append(out)
            text = runner.tokenizer.decode(out, skip_special_tokens=True)
            ids = runner.segment_ids(text)
            if out[:len(ids)] == ids and len(ids) >= runner.segmenter.min_segment_tokens:
                store.add(runner.hash(ids), kv, len(prompt.input_ids), min(len(ids), len(out) - 1))
        rounds.append(outputs)
        blocks = [message_block(runner.tokenizer.decode(o, skip_special_tokens=True)) for o in outputs]
    return rounds


def measure_divergence(runner: QualityRunner, config: QualityConfig) -> list[SimulationResult]:
    sim = make_simulation(_workload(config, config.simulation_agents, rounds=config.simulation_rounds))
    settings = config.simulation_settings or default_simulation_settings(config)
    steps = config.continuation_tokens
    reference = simulate(runner, sim, Setting(FULL), config.options, steps)
    results = []
    for setting in tqdm(settings, desc="simulations", unit="setting"):
        rounds = simulate(runner, sim, setting, config.options, steps)
        diverged = next((r + 1 for r, (a, b) in enumerate(zip(reference, rounds)) if a != b), None)
        results.append(SimulationResult(setting.label, len(sim.agents), len(rounds), diverged,
                                        [[runner.tokenizer.decode(o) for o in outs] for outs in rounds]))
    return results


def default_simulation_settings(config: QualityConfig) -> tuple[Setting, ...]:
    """Plain reuse, CacheBlend's rule at its own check layer (1), every rule at the deepest
    check layer of the sweep, and the screened default rule, all at the server's default
    recompute ratio."""
    deepest, ratio = max(config.check_layers), TokenDanceArgs().recompute_ratio
    return (Setting(PLAIN), Setting("cacheblend-k", ratio, 1),
            *(Setting(rule, ratio, deepest) for rule in config.rules if (rule, deepest) != ("cacheblend-k", 1)),
            *filter(None, [screened_setting(config, ratio)]))


@torch.no_grad()
def prefill_timing(runner: QualityRunner, config: QualityConfig, setting: Setting, agents: int) -> dict:
    """Wall time of one round's prefills, full vs blended at `setting`, measured in one run."""
    sim = make_simulation(_workload(config, agents, rounds=1))
    store = runner.seed_store(sim)
    options = setting.options(config.options)
    rule = rule_named(setting.rule)
    full = blended = 0.0
    work = [0, 0]
    for i in range(agents):
        prompt = runner.agent_prompt(sim, i, 0, sim.seed_messages)
        ids = prompt.input_ids
        start = time.perf_counter()
        runner.prefill(ids, runner.new_kv(len(ids)), [], BlendOptions())
        full += time.perf_counter() - start
        kv = runner.new_kv(len(ids))
        start = time.perf_counter()
        runs = store.place(prompt, kv)
        _, stats = runner.prefill(ids, kv, runs, options, rule)
        blended += time.perf_counter() - start
        work[0] += stats.token_layers
        work[1] += stats.full_token_layers
    return {"setting": setting.label, "agents": agents, "full_s": full, "blended_s": blended,
            "time_ratio": blended / full, "work_ratio": work[0] / work[1]}


def _workload(config: QualityConfig, agents: int, rounds: int):
    return preset_config(config.preset, num_agents=agents, num_rounds=rounds, history_words=config.history_words,
                         block_words=config.block_words, max_new_tokens=config.continuation_tokens, seed=config.seed)


def summarize(samples: Iterable[Sample]) -> list[dict]:
    """Means over agents per (workload, seed, N, setting, Master choice, chunked-prefill size).
    Content-step KL and decisive agreement pool the steps of all the group's prompts."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.preset, s.seed, s.agents, s.setting, s.master, s.chunk), []).append(s)
    rows = []
    for (preset, seed, agents, setting, master, chunk), group in groups.items():
        n = len(group)
        reused = sum(s.reused_tokens for s in group)
        decode = [s.decode_kl for s in group if s.decode_kl is not None]
        content = [(s.content_kl, s.content_steps) for s in group if s.content_kl is not None]
        steps = sum(c for _, c in content)
        rows.append({
            "preset": preset, "seed": seed, "agents": agents, "setting": setting, "master": master, "chunk": chunk,
            "rule": group[0].rule, "ratio": group[0].ratio,
            "check_layer": group[0].check_layer, "screen_layer": group[0].screen_layer,
            "group_selection": group[0].group_selection, "group_probe": group[0].group_probe,
            "adopted_share": sum(s.adopted_tokens for s in group) / max(reused, 1),
            "first_kl": mean_or_none(s.first_kl for s in group), "first_kl_max": max(s.first_kl for s in group),
            "decode_kl": mean_or_none(decode), "decode_kl_max": max(decode, default=None),
            "content_kl": sum(kl * c for kl, c in content) / steps if steps else None, "content_steps": steps,
            "decisive_top1": mean_or_none(s.decisive_top1 for s in group if s.decisive_top1 is not None),
            "approximate_tokens": sum(s.reused_tokens - s.kept_tokens for s in group) / n,
            "top1": sum(s.top1 for s in group) / n, "top5": sum(s.top5 for s in group) / n,
            "common_prefix": sum(s.common_prefix for s in group) / n,
            "recomputed_share": sum(s.kept_tokens for s in group) / max(reused, 1),
            "work": sum(s.token_layers for s in group) / sum(s.full_token_layers for s in group),
            "prompt_tokens": sum(s.prompt_tokens for s in group) / n, "reused_tokens": reused / n,
        })
    return rows


def decode_kl_by_step(samples: Sequence[Sample], setting: str, windows: Sequence[tuple[int, int]]) -> list[dict]:
    """Mean decode-step KL of `setting` per N over windows [first, last] of decode steps
    (1-based): how the KL evolves along the continuation."""
    rows = []
    for agents in sorted({s.agents for s in samples if s.setting == setting}):
        group = [s for s in samples if s.setting == setting and s.agents == agents]
        rows.append({"agents": agents, "setting": setting, **{
            f"steps {a}-{b}": mean_or_none(kl for s in group for kl in s.decode_kls[a - 1:b]) for a, b in windows}})
    return rows


def sample_dicts(samples: Iterable[Sample]) -> list[dict]:
    return [asdict(s) for s in samples]
