"""Quality of blended prefill against a full prefill: the code behind `python -m
sglang_tokendance.bench_quality`.

It runs our blended prefill (core/blend) in-process on SmolLM2 through HF's modules
(bench/hf_layerwise.py), on All-Gather rounds in chat format (bench/workloads.py): each agent's
prompt is its private history (system turn) and every agent's message block in its own
order (user turn). Each block's KV is cached where its author produced it -- after the
author's own prompt, as the server's output registration caches it -- un-rotated, and rotated
into place on reuse, exactly as the forest does.

Per agent prompt and setting (rule x recompute ratio x check layer) it measures, against the
full prefill of the same ids: KL(full || blended) over the whole vocabulary at the first
output token and, mean over the first `decode_steps` decode steps, with both sides
teacher-forced on the full prefill's greedy continuation and each decoding over its own KV as
the prefill left it (sparse write-back included: the first token's logits still see the
probe's KV at layers 0..c, decoding sees what was written back, so the decode-step KL is the
one users get); top-1 and top-5 agreement, the common-prefix length of greedy continuations,
and the work done (token-layers computed). The probe layers 0..c are computed once per check
layer and shared by every rule and ratio. A multi-round simulation (outputs become the next round's blocks,
registered with their authors' KV) gives the rounds to first divergence per setting.
The oracle rule scores tokens by their true KV deviation from the full prefill (a ceiling).

Round groups (`measure_groups`): every agent's prompt of one round in one extend batch, as the
server's round policy admits them, under per-request selection, group-aligned selection and a
shared probe (core/blend) at the same recompute ratios; the same measures per agent.

Master choice (`measure_master_choice`): a round group leaves one copy of each segment it read
per member (the Master with the member's kept tokens recomputed); the next round's agents read
the segment from the author's copy or from a member's (the medoid of the copies, the first
reader's), and the same measures tell which Master serves them best.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import takewhile
from typing import Iterable, NamedTuple, Sequence

import torch

from sglang_tokendance.bench.hf_layerwise import HFLayerwise
from sglang_tokendance.core.dense_kv import DenseKV
from sglang_tokendance.bench.workloads import Simulation
from sglang_tokendance.core.blend import blended_prefill, carried_states, finish, probe, select
from sglang_tokendance.core.blend_types import BlendOptions, BlendStats, ProbeStates, RequestRow, ReusedRun
from sglang_tokendance.core.plan import plan_chunk
from sglang_tokendance.core.rope import RopeSpec, rotate, unrotate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR, Segmenter, SegmentedPrompt, segment_hash
from sglang_tokendance.core.selection import RULES, fixed_scores, rule_named
from sglang_tokendance.server_args import TokenDanceArgs

ORACLE, PLAIN, FULL = "oracle", "plain", "full"


@dataclass(frozen=True)
class Setting:
    rule: str  # a selection rule, ORACLE, PLAIN (ratio 0) or FULL (the reference)
    ratio: float = 0.0
    check_layer: int = 1
    screen_layer: int = 0  # 0: no screen
    group: str = "per-request"  # group selection (core/blend GROUP_SELECTIONS)
    probe: int = 0  # shared probe: members per shared segment that probe it (0: all)
    budget: int | None = None  # fidelity budget: most reused tokens left approximate (None: no bound)
    storage: str = "dense"  # the server's --tokendance-storage (the in-process blend is the same either way)
    diff_threshold: float = 0.0  # the server's --tokendance-diff-threshold (mirror storage)
    # chunked prefill: the whole prompt's selection made at its first chunk, each chunk recomputing its part
    # unprobed (the server's --tokendance-planned-selection); without it each chunk selects its own
    planned: bool = False
    # a round leader (the server's --tokendance-round-leader, on a round): the round's leader is prefilled
    # exactly first and its blocks' KV, computed in round context, becomes the Masters the others read
    lead: bool = False

    @property
    def label(self) -> str:
        storage = (f" st={self.storage}" if self.storage != "dense" else "") + \
            (f" e={self.diff_threshold:g}" if self.diff_threshold else "") + (" planned" if self.planned else "") + \
            (" lead" if self.lead else "")
        if self.rule in (PLAIN, FULL):
            return self.rule + storage
        screen = f" s={self.screen_layer}" if self.screen_layer else ""
        group = f" g={self.group}" if self.group != "per-request" else ""
        probe = f" k={self.probe}" if self.probe else ""
        budget = f" m={self.budget}" if self.budget is not None else ""
        return f"{self.rule} r={self.ratio:g} c={self.check_layer}{screen}{group}{probe}{budget}{storage}"

    def options(self, base: BlendOptions) -> BlendOptions:
        return replace(base, recompute_ratio=self.ratio, check_layer=self.check_layer, screen_layer=self.screen_layer,
                       group_selection=self.group, group_probe=self.probe)

    @classmethod
    def parse(cls, label: str) -> "Setting":
        """The setting a `label` names ("plain", "attention-kv r=0.3 c=5 s=1 m=100 st=mirror e=0.05",
        "attention-kv r=0.3 c=5 planned", "plain lead"): for command lines."""
        rule, *fields = label.split()
        values = dict(f.split("=", 1) if "=" in f else (f, "") for f in fields)
        storage = values.pop("st", "dense"), float(values.pop("e", 0.0))
        lead = values.pop("lead", None)  # a bare word, like planned
        if rule in (PLAIN, FULL) and not values and lead in (None, ""):
            return cls(rule, storage=storage[0], diff_threshold=storage[1], lead=lead == "")
        if lead not in (None, "") or rule not in RULES or \
                not {"r", "c"} <= set(values) <= {"r", "c", "s", "g", "k", "m", "planned"}:
            raise ValueError(f"bad setting {label!r}: write 'plain' or 'RULE r=RATIO c=CHECK_LAYER [s=SCREEN_LAYER] "
                             f"[g=GROUP_SELECTION] [k=PROBERS] [m=MAX_APPROXIMATE_TOKENS] [planned]', either followed "
                             f"by [st=STORAGE] [e=DIFF_THRESHOLD] [lead], with RULE one of {', '.join(RULES)}")
        return cls(rule, float(values["r"]), int(values["c"]), int(values.get("s", 0)),
                   values.get("g", "per-request"), int(values.get("k", 0)),
                   int(values["m"]) if "m" in values else None, *storage, planned="planned" in values,
                   lead=lead == "")


@dataclass(frozen=True)
class QualityConfig:
    num_agents: tuple[int, ...] = (4, 10)
    prompts_per_n: int = 4  # agents measured per N (the first ones; each prompt is one agent's)
    rules: tuple[str, ...] = ("cacheblend-k", "cacheblend-kv", "attention-kv")
    ratios: tuple[float, ...] = (0.15, 0.3, 0.5, 0.8)
    check_layers: tuple[int, ...] = (1, 5)
    oracle: bool = True
    options: BlendOptions = BlendOptions()  # granularity, block size, head tokens, write-back, screen factor
    screen_layer: int = 1  # the default rule is also run screened at this layer (0: not)
    continuation_tokens: int = 32
    decode_steps: int = 16  # teacher-forced decode steps of the decode-step KL
    refresh_last_token: bool = False  # recompute the last prompt token over the written-back KV
    simulation_agents: int = 4
    simulation_rounds: int = 3
    simulation_settings: tuple[Setting, ...] = ()  # default: see default_simulation_settings
    preset: str = "generative_agents"
    history_words: int = 150
    block_words: int = 60
    seed: int = 0


@dataclass
class Sample:
    """One agent prompt under one setting."""

    agents: int
    agent: int
    setting: str
    rule: str
    ratio: float
    check_layer: int
    screen_layer: int
    prompt_tokens: int
    reused_tokens: int
    kept_tokens: int
    token_layers: int
    full_token_layers: int
    first_kl: float  # KL(full || blended) of the first output token (the prefill's logits)
    decode_kl: float | None  # mean over the decode steps (None: the continuation ended at once)
    top1: bool
    top5: float
    common_prefix: int  # of the greedy continuations, out of continuation_tokens
    continuation_tokens: int  # the full prefill's continuation (shorter if it ended early)
    decode_kls: list[float]  # per decode step (1, 2, ...): fewer than decode_steps if it ended early
    group_selection: str = "per-request"
    group_probe: int = 0
    adopted_tokens: int = 0  # reused tokens that skipped the probe (shared probe)
    master: str = "author"  # whose copy of each segment was read (MASTER_CHOICES)
    chunk: int = 0  # chunked-prefill size the prompt was prefilled in (0: one forward)
    content_kl: float | None = None  # mean decode-step KL over content steps (CONTENT_ENTROPY; None: none)
    content_steps: int = 0
    decisive_top1: float | None = None  # top-1 agreement over decode steps without a near tie (NEAR_TIE)
    block_deviation: list[float] = field(default_factory=list)  # per marked block, in prompt order
    preset: str = ""  # the workload (bench/workloads PRESETS)
    seed: int = 0


SegmentKV = tuple[torch.Tensor, torch.Tensor]  # a cached segment: K un-rotated, V [layers, n, kv_heads, d]


class SegmentStore:
    """Cached segments (Masters): hash -> SegmentKV, the first copy added kept."""

    def __init__(self, spec: RopeSpec):
        self.spec = spec
        self.entries: dict[str, SegmentKV] = {}

    def add(self, segment_hash: str, kv: DenseKV, start: int, n: int) -> None:
        if segment_hash in self.entries or n <= 0:
            return
        self.entries[segment_hash] = self.copy_of(kv, start, n)

    def copy_of(self, kv: DenseKV, start: int, n: int) -> SegmentKV:
        """Slots [start, start + n) of `kv` (slot = position) as a Master keeps them: K un-rotated."""
        at = torch.arange(start, start + n)
        return (torch.stack([unrotate(kv.k[layer, at], at, self.spec) for layer in range(kv.k.shape[0])]),
                kv.v[:, at].clone())

    def replaced(self, masters: dict[str, SegmentKV]) -> "SegmentStore":
        """The same segments with the Masters of `masters` replaced."""
        store = SegmentStore(self.spec)
        store.entries = {**self.entries, **masters}
        return store

    def _lookup(self, span):
        entry = self.entries.get(span.hash)
        return None if entry is None else ((span.hash, entry), entry[0].shape[1])

    def place(self, prompt: SegmentedPrompt, kv: DenseKV) -> list[ReusedRun]:
        """Plan the whole prompt as the server plans a chunk (core/plan), rotate every cached
        segment it reads into its slots, and return the reused runs (each naming its segment
        by hash)."""
        n = len(prompt.input_ids)
        runs = plan_chunk(prompt.spans, self._lookup, 0, n, n).runs
        for run in runs:
            (_, (k, v)), at = run.master, torch.arange(run.start, run.end)
            cached = slice(run.segment_offset, run.segment_offset + len(run))
            for layer in range(kv.k.shape[0]):
                kv.k[layer, at] = rotate(k[layer, cached], at, self.spec)
                kv.v[layer, at] = v[layer, cached]
        return [ReusedRun(run.start, run.end, 0, run.master[0]) for run in runs]

    def chunk_runs(self, prompt: SegmentedPrompt, start: int, end: int) -> list[ReusedRun]:
        """The reused runs of the chunk [start, end) as the server plans them (core/plan),
        relative to the chunk's first token, each from its offset in its segment."""
        runs = plan_chunk(prompt.spans, self._lookup, start, end, len(prompt.input_ids)).runs
        return [ReusedRun(run.start - start, run.end - start, run.segment_offset, run.master[0]) for run in runs]


class Lead(NamedTuple):
    """A round whose leader was prefilled first (QualityRunner.lead)."""

    store: SegmentStore  # the Masters the followers read: the leader's blocks where its prompt has them
    leader: int  # its agent index
    token_layers: int  # the leader's exact prefill
    followers: int  # the round's other members, among whom the leader's prefill is shared


class QualityRunner:
    """The model, tokenizer and chat-prompt building shared by every measurement."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.model = HFLayerwise(lm)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.spec = RopeSpec.from_hf_config(lm.config)
        self.segmenter = Segmenter(self.tokenizer, model_salt=b"quality", vocab_size=lm.config.vocab_size,
                                   special_tokens=self.tokenizer.all_special_tokens)
        self.eos = set(self.tokenizer.all_special_ids)

    # --- prompts ------------------------------------------------------------------------

    def chat_text(self, system: str, user_pieces: Sequence[str]) -> str:
        """The marked text of a chat prompt whose user turn is `user_pieces` joined by
        separators (what a client sends to /generate)."""
        return self.tokenizer.apply_chat_template(
            [{"role": "system", "content": system},
             {"role": "user", "content": DEFAULT_SEPARATOR.join(user_pieces)}],
            tokenize=False, add_generation_prompt=True)

    def segmented(self, text: str) -> SegmentedPrompt:
        return self.segmenter.from_pieces(self.segmenter.split_text(text), add_special_tokens=False)

    def chat(self, system: str, user_pieces: Sequence[str]) -> SegmentedPrompt:
        return self.segmented(self.chat_text(system, user_pieces))

    def agent_text(self, sim: Simulation, agent: int, round_index: int, blocks: Sequence[str]) -> str:
        pieces = sim.prompt_pieces(agent, round_index, blocks)
        return self.chat_text(pieces[0], pieces[1:])

    def agent_prompt(self, sim: Simulation, agent: int, round_index: int, blocks: Sequence[str]) -> SegmentedPrompt:
        return self.segmented(self.agent_text(sim, agent, round_index, blocks))

    def seed_text(self, sim: Simulation, author: int) -> str:
        """The author's round-0 context (its own prompt) followed by its seed message as a
        segment: the prompt that caches the message where its author produced it."""
        context = self.chat_text(sim.agents[author].history, [sim.instruction(author, 0)])
        return DEFAULT_SEPARATOR.join([context, sim.seed_messages[author], ""])

    def segment_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def hash(self, ids: Sequence[int]) -> str:
        return segment_hash(ids, self.segmenter.model_salt)

    # --- forwards -----------------------------------------------------------------------

    def new_kv(self, tokens: int) -> DenseKV:
        return DenseKV(self.model.num_layers, tokens, *self.model.kv_shape())

    @torch.no_grad()
    def prefill(self, ids: list[int], kv: DenseKV, reused: list[tuple[int, int]], options: BlendOptions,
                rule=None, max_approximate: int | None = None):
        t = torch.tensor(ids)
        row = RequestRow(0, len(ids), torch.arange(kv.k.shape[1]), reused=reused, max_approximate=max_approximate)
        hidden, stats = blended_prefill(self.model, kv, t, torch.arange(len(ids)), [row], options, rule)
        return self.model.logits(hidden[-1]), stats

    @torch.no_grad()
    def extend(self, kv: DenseKV, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Logits [len(tokens), vocab] after each of `tokens` placed at positions start.., which
        attend to the KV before them (a decode step per token, run as one extend: with the
        tokens known in advance that is the same computation). Their KV is written to `kv`."""
        n = len(tokens)
        if n == 0:
            return torch.empty(0, self.model.lm.config.vocab_size)
        row = RequestRow(start, n, torch.arange(start + n))
        hidden, _ = blended_prefill(self.model, kv, torch.tensor(tokens), torch.arange(start, start + n), [row],
                                    BlendOptions(), None)
        return self.model.logits(hidden)

    def greedy(self, kv: DenseKV, prompt_len: int, logits: torch.Tensor, steps: int) -> list[int]:
        """Greedy continuation after a prefill whose KV is in `kv` (it needs room for it)."""
        out = []
        for p in range(prompt_len, prompt_len + steps):
            token = int(logits.argmax())
            out.append(token)
            if token in self.eos or p + 1 > kv.k.shape[1]:
                break
            logits = self.extend(kv, [token], p)[-1]
        return out

    def forced_inputs(self, reference: Sequence[int], steps: int) -> list[int]:
        """The decode inputs of teacher forcing on `reference`: its tokens before any end token,
        at most `steps` (input j gives the distribution of decode step j + 1)."""
        return list(takewhile(lambda t: t not in self.eos, reference))[:steps]

    def refresh_last(self, kv: DenseKV, ids: Sequence[int]) -> torch.Tensor:
        """The last prompt token recomputed over the KV as the prefill left it (write-back
        included), so that its logits and KV see what decoding sees; its logits."""
        return self.extend(kv, ids[-1:], len(ids) - 1)[-1]

    def seed_store(self, sim: Simulation) -> SegmentStore:
        """Each seed message's KV as its author produced it: after the author's own prompt."""
        store = SegmentStore(self.spec)
        for j in range(len(sim.agents)):
            seed = self.segmented(self.seed_text(sim, j))
            kv = self.new_kv(len(seed.input_ids))
            self.prefill(seed.input_ids, kv, [], BlendOptions())
            for span in seed.spans:  # none when the message is below the minimum segment length
                store.add(span.hash, kv, span.start, span.end - span.start)
        return store

    def lead(self, sim: Simulation, store: SegmentStore, leader: int) -> Lead:
        """Round 0 of `sim` led by agent `leader`, as the server's round leader runs it: the
        leader's prompt prefilled exactly, and its blocks' KV -- computed in round context, after
        the messages that precede them in its prompt -- superseding their Masters in `store`
        (srt/storage caches a leader's blocks with `replace`)."""
        prompt = self.agent_prompt(sim, leader, 0, sim.seed_messages)
        kv = self.new_kv(len(prompt.input_ids))
        _, stats = self.prefill(prompt.input_ids, kv, [], BlendOptions())
        masters = {span.hash: store.copy_of(kv, span.start, span.end - span.start) for span in prompt.spans}
        return Lead(store.replaced(masters), leader, stats.token_layers, len(sim.agents) - 1)

    def run_led(self, prompt: SegmentedPrompt, lead: Lead, setting: Setting, options: BlendOptions,
                room: int) -> tuple[torch.Tensor, DenseKV, BlendStats, int]:
        """`run_setting` for a member that follows `lead`: it reads the leader's Masters, and its
        stats carry its share of the leader's exact prefill (work and full work alike), so that
        the followers' work ratio is the round's."""
        logits, kv, stats, hits = self.run_setting(prompt, lead.store, setting, options, room)
        share = round(lead.token_layers / lead.followers)
        return logits, kv, replace(stats, token_layers=stats.token_layers + share,
                                   full_token_layers=stats.full_token_layers + share), hits

    def run_setting(self, prompt: SegmentedPrompt, store: SegmentStore, setting: Setting, options: BlendOptions,
                    room: int) -> tuple[torch.Tensor, DenseKV, BlendStats, int]:
        """One prompt's prefill at `setting` (FULL: no reuse) in a KV of `room` slots: its
        last-token logits, KV, stats and segment hits."""
        kv = self.new_kv(room)
        runs = [] if setting.rule == FULL else store.place(prompt, kv)
        rule = None if setting.rule in (PLAIN, FULL) else rule_named(setting.rule)
        logits, stats = self.prefill(prompt.input_ids, kv, runs, setting.options(options) if runs else BlendOptions(),
                                     rule, setting.budget)
        return logits, kv, stats, len(runs)

    @torch.no_grad()
    def run_chunked(self, prompt: SegmentedPrompt, store: SegmentStore, setting: Setting, options: BlendOptions,
                    room: int, chunk: int) -> tuple[torch.Tensor, DenseKV, BlendStats]:
        """`run_setting` (not FULL) with the prompt prefilled in chunks of `chunk` tokens, as
        SGLang's chunked prefill forwards it: each chunk planned as the server plans it and
        blended over the KV the chunks before it left. Stats are summed over the chunks, the
        planning probe's work included."""
        kv, ids = self.new_kv(room), prompt.input_ids
        store.place(prompt, kv)  # every chunk's restore at once: the rotated KV at a position is the same
        rule = None if setting.rule == PLAIN else rule_named(setting.rule)
        total, plan, states = BlendStats(), None, None
        plans = setting.planned and setting.rule != PLAIN  # otherwise each chunk selects for itself
        for start in range(0, len(ids), chunk):
            end = min(len(ids), start + chunk)
            runs = store.chunk_runs(prompt, start, end)
            left = None if setting.budget is None else max(0, setting.budget - total.reused_tokens + total.kept_tokens)
            if plans and plan is None and runs and end < len(ids):  # the first chunk that reads, not the last
                plan, states = self.planned_selection(prompt, store, setting, options, kv, start, left)
                total = replace(total, token_layers=total.token_layers + plan.token_layers)
            # under a planned selection the chunk recomputes its part of it, resuming the probe's states
            part = None if plan is None else \
                plan.kept[total.reused_tokens:total.reused_tokens + sum(r.end - r.start for r in runs)]
            resumed = None if states is None else states.within(start, end)
            row = RequestRow(start, end - start, torch.arange(end), reused=runs, max_approximate=left, kept=part,
                             resumed=resumed)
            blend = setting.options(options) if runs or resumed is not None else BlendOptions()
            hidden, stats = blended_prefill(self.model, kv, torch.tensor(ids[start:end]), torch.arange(start, end),
                                            [row], blend, rule)
            total = BlendStats(total.token_layers + stats.token_layers,
                               total.full_token_layers + stats.full_token_layers,
                               total.reused_tokens + stats.reused_tokens, total.kept_tokens + stats.kept_tokens)
        return self.model.logits(hidden[-1]), kv, total

    def planned_selection(self, prompt: SegmentedPrompt, store: SegmentStore, setting: Setting,
                          options: BlendOptions, kv: DenseKV, start: int, max_approximate: int | None = None
                          ) -> tuple[BlendStats, ProbeStates | None]:
        """For a `planned` setting, the selection of the prompt from `start` on, made before the
        chunk at `start` (the first that reads) over the KV the chunks before it left (`kv`,
        not written): the kept mask of the blended prefill of the rest at `setting` (its `kept`,
        in the order of its reused tokens), within what is left of its fidelity budget
        (`max_approximate`), with the work of the probe that chose it (token_layers), and the
        probe's states that the chunks' computed tokens resume (core/blend `carried_states`), as
        the server's srt/prompt_selection makes it."""
        ids, scratch = prompt.input_ids, kv.clone()
        row = RequestRow(start, len(ids) - start, torch.arange(len(ids)),
                         reused=store.chunk_runs(prompt, start, len(ids)), max_approximate=max_approximate)
        blend_options = setting.options(options)
        checked = probe(self.model, scratch, torch.tensor(ids[start:]), torch.arange(start, len(ids)), [row],
                        rule_named(setting.rule), blend_options)
        kept = select(checked, rule_named(setting.rule), blend_options)
        stats = BlendStats(token_layers=checked.batch.stats.token_layers, kept=kept)
        return stats, carried_states(checked, kept, scratch, blend_options)


CONTENT_ENTROPY = 1.0  # nats: a decode step where the full model is this unsure is a content step
NEAR_TIE = 0.5  # nats between the full model's top two tokens: closer is a near tie, no verdict on agreement


def kl_rows(full: torch.Tensor, blended: torch.Tensor) -> torch.Tensor:
    """KL(full || blended) over the vocabulary, per row of logits [..., vocab]."""
    p, q = full.log_softmax(-1), blended.log_softmax(-1)
    return torch.sum(p.exp() * (p - q), -1)


def kl_top(full: torch.Tensor, blended: torch.Tensor) -> tuple[float, bool, float]:
    """KL(full || blended) of next-token distributions, top-1 agreement, top-5 overlap."""
    kl = float(kl_rows(full, blended))
    top5 = len(set(full.topk(5).indices.tolist()) & set(blended.topk(5).indices.tolist())) / 5
    return kl, bool(full.argmax() == blended.argmax()), top5


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def oracle_scores(full_kv: DenseKV, reused_kv: DenseKV, runs: list[tuple[int, int]]) -> torch.Tensor:
    """True deviation of each reused token's KV from the full prefill's, summed over layers
    (each layer normalised by its mean so that no layer dominates)."""
    at = torch.cat([torch.arange(run.start, run.end) for run in runs])
    dev = ((full_kv.k[:, at] - reused_kv.k[:, at]).pow(2).sum((2, 3))
           + (full_kv.v[:, at] - reused_kv.v[:, at]).pow(2).sum((2, 3)))  # [layers, R]
    return (dev / dev.mean(1, keepdim=True).clamp_min(1e-12)).sum(0)


def entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row's next-token distribution."""
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def top_margin(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the log-probability gap between the top two tokens (small: a near tie)."""
    top = logits.log_softmax(-1).topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def block_deviation(full: DenseKV, blended: DenseKV, prompt: SegmentedPrompt) -> list[float]:
    """Per marked block of `prompt` (prompt order), the relative L2 deviation of its KV from the
    full prefill's, K and V over every layer: where in the prompt the approximation lives."""
    deviations = []
    for span in prompt.spans:
        at = slice(span.start, span.end)
        diff = (full.k[:, at] - blended.k[:, at]).pow(2).sum() + (full.v[:, at] - blended.v[:, at]).pow(2).sum()
        norm = full.k[:, at].pow(2).sum() + full.v[:, at].pow(2).sum()
        deviations.append(float((diff / norm.clamp_min(1e-30)).sqrt()))
    return deviations


@torch.no_grad()
def evaluate_prompt(runner: QualityRunner, prompt: SegmentedPrompt, store: SegmentStore, config: QualityConfig,
                    agents: int, agent: int) -> list[Sample]:
    """Every setting of `config` on one prompt (probe layers shared per check layer)."""
    ids = prompt.input_ids
    room = room_for(prompt, config)
    ref = reference_of(runner, ids, config, room)
    reused_kv = runner.new_kv(room)
    runs = store.place(prompt, reused_kv)
    samples = []

    def record(setting: Setting, logits, kv, stats) -> None:
        samples.append(sample_of(runner, ref, prompt, config, setting, logits, kv, stats, agents, agent))

    kv = reused_kv.clone()
    logits, stats = runner.prefill(ids, kv, runs, BlendOptions())
    record(Setting(PLAIN), logits, kv, stats)
    rules = {name: rule_named(name) for name in config.rules}
    if config.oracle:
        rules[ORACLE] = fixed_scores(ORACLE, oracle_scores(ref.kv, reused_kv, runs))
    t = torch.tensor(ids)
    row = RequestRow(0, len(ids), torch.arange(room), reused=runs)
    for c in config.check_layers:
        probed_kv = reused_kv.clone()
        # no screen: one probe serves every rule (attention-kv's makes it record the attention)
        checked = probe(runner.model, probed_kv, t, torch.arange(len(ids)), [row], rule_named("attention-kv"),
                        replace(config.options, check_layer=c, screen_layer=0))
        for name, rule in rules.items():
            for ratio in config.ratios:
                setting = Setting(name, ratio, c)
                options = setting.options(config.options)
                kv = probed_kv.clone()
                hidden, stats = finish(runner.model, kv, checked, select(checked, rule, options), options)
                record(setting, runner.model.logits(hidden[-1]), kv, stats)
    for setting in filter(None, (screened_setting(config, r) for r in config.ratios)):  # own probes
        logits, kv, stats, _ = runner.run_setting(prompt, store, setting, config.options, room)
        record(setting, logits, kv, stats)
    return samples


@dataclass
class Reference:
    """A prompt's full prefill: last-token logits, the greedy continuation, the teacher-forced
    decode inputs and the logits of those decode steps, and its KV (the prompt's slots as the
    prefill left them)."""

    logits: torch.Tensor
    continuation: list[int]
    forced: list[int]
    decode: torch.Tensor
    kv: DenseKV


def room_for(prompt: SegmentedPrompt, config: QualityConfig) -> int:
    """KV slots a prompt's measures need: the prompt and its continuation."""
    return len(prompt.input_ids) + max(config.continuation_tokens, config.decode_steps)


def reference_of(runner: QualityRunner, ids: list[int], config: QualityConfig, room: int) -> Reference:
    """The full prefill's reference measures, with its KV (in `room` slots)."""
    full_kv = runner.new_kv(room)
    logits, _ = runner.prefill(ids, full_kv, [], BlendOptions())
    continuation = runner.greedy(full_kv, len(ids), logits, max(config.continuation_tokens, config.decode_steps))
    forced = runner.forced_inputs(continuation, config.decode_steps)
    decode = runner.extend(full_kv, forced, len(ids))
    return Reference(logits, continuation[:config.continuation_tokens], forced, decode, full_kv)


def sample_of(runner: QualityRunner, ref: Reference, prompt: SegmentedPrompt, config: QualityConfig,
              setting: Setting, logits: torch.Tensor, kv: DenseKV, stats: BlendStats, agents: int,
              agent: int) -> Sample:
    """One prompt's measures at `setting`: its prefill's last-token logits and KV (decoded
    over, so it is changed) against the reference. `stats` are the prompt's (token-layers
    may be its batch's). Decode steps are teacher-forced on the reference's continuation; the
    content steps are those where the full model's entropy exceeds CONTENT_ENTROPY (a copied
    name or a template token, near-certain, hides the approximation), the decisive ones those
    where its top two tokens are NEAR_TIE or more apart (a near tie's winner is a coin toss)."""
    ids = prompt.input_ids
    if config.refresh_last_token:
        logits = runner.refresh_last(kv, ids)
        stats = replace(stats, token_layers=stats.token_layers + runner.model.num_layers)
    kl, top1, top5 = kl_top(ref.logits, logits)
    deviation = block_deviation(ref.kv, kv, prompt)
    decode = runner.extend(kv, ref.forced, len(ids))
    decode_kls = kl_rows(ref.decode, decode)
    content = entropy_rows(ref.decode) > CONTENT_ENTROPY
    decisive = top_margin(ref.decode) >= NEAR_TIE
    agree = ref.decode.argmax(-1) == decode.argmax(-1)
    cont = runner.greedy(kv, len(ids), logits, config.continuation_tokens)
    return Sample(agents, agent, setting.label, setting.rule, setting.ratio, setting.check_layer,
                  setting.screen_layer, len(ids), stats.reused_tokens, stats.kept_tokens, stats.token_layers,
                  stats.full_token_layers, kl, mean_or_none(decode_kls.tolist()), top1, top5,
                  common_prefix(ref.continuation, cont), len(ref.continuation), decode_kls.tolist(), setting.group,
                  setting.probe, stats.adopted_tokens, content_kl=mean_or_none(decode_kls[content].tolist()),
                  content_steps=int(content.sum()), decisive_top1=mean_or_none(agree[decisive].float().tolist()),
                  block_deviation=deviation, preset=config.preset, seed=config.seed)


def screened_setting(config: QualityConfig, ratio: float) -> Setting | None:
    """The server's default rule at the deepest check layer, screened at config.screen_layer
    (None when that is not below it). A screen's probe depends on the rule and the ratio, so
    these settings do not share probes."""
    deepest = max(config.check_layers)
    if not 1 <= config.screen_layer < deepest:
        return None
    return Setting(TokenDanceArgs().selection, ratio, deepest, config.screen_layer)


def mean_or_none(values: Iterable[float]) -> float | None:
    """The mean, or None for no values (a metric that did not apply)."""
    values = list(values)
    return sum(values) / len(values) if values else None
