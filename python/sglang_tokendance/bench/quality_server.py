"""Server mode of bench_quality (`--server`): blended prefill quality as users get it, through
real servers, beside the same measure computed in-process.

The All-Gather chat prompts of the in-process harness (same workload builder, same text) go
to TokenDance servers, one per setting (`--tokendance-*` flags), and to one started with
`--disable-tokendance` (same launcher, same prompt interface, KV machinery off: a full
prefill). Before a TokenDance server reads the prompts, every author's context followed by
its message as a marked segment is sent once, so the server caches each message where its
author produced it (QualityRunner.seed_text: the prompt QualityRunner.seed_store prefills
in-process). No `cache_salt`: radix-prefix hits are exact KV and change nothing.

Both servers answer greedily with `top_logprobs` (K per output token). A server cannot be
teacher-forced, so its decode steps compare only while the greedy outputs agree: decode step
t (1-based; output token t) is compared when the first t output tokens are equal, so both
sides decoded the same inputs. The measure is a truncated KL over the reference's top-K
(`truncated_kl`). The in-process side computes the same measure from full logits cut to the
same K, teacher-forced on the reference server's output at the same steps, so the two are
comparable prompt by prompt; it also gives its own greedy agreement, reuse counts, the
full-vocabulary KLs, and the noise floor (reference server vs in-process full prefill).

A workload with `round` sends all N agents' prompts at once as one round (`tokendance.round`)
and measures each of them: `round=lead` under the server's round leader (its leader is
computed exactly and its blocks become the Masters the others read), `round=all` with
`--no-tokendance-round-leader`. Under `round=lead` the in-process side follows the leader the
server chose (the member whose blocks superseded their Masters, `round_master_tokens`): that
member is a full prefill, the others read its blocks (QualityRunner.lead).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import requests
import torch
from tqdm import tqdm

from sglang_tokendance.bench.quality import (CONTENT_ENTROPY, FULL, PLAIN, Lead, QualityRunner, SegmentStore, Setting,
                                             common_prefix, entropy_rows, kl_rows, mean_or_none)
from sglang_tokendance.bench.workloads import PRESETS, Simulation, make_simulation, preset_config
from sglang_tokendance.core.blend_types import BlendOptions
from sglang_tokendance.core.segments import SegmentedPrompt
from sglang_tokendance.bench.server_process import flush_cache

TopK = Mapping[int, float]  # token id -> logprob (normalised over the whole vocabulary)
REQUEST_TIMEOUT = 1800
DEFAULT_PRESET = "generative_agents"
ROUND_MODES = ("", "lead", "all")  # a workload's prompts: one at a time, or one round with or without a leader


@dataclass(frozen=True)
class Workload:
    """One server workload: N agents, message length, the servers' chunked-prefill size,
    whether its prompts go as one round (ROUND_MODES; see the module's notes), and the
    workload preset (bench/workloads.PRESETS) its simulation is drawn from."""

    agents: int
    block_words: int = 60
    chunked_prefill: int = 0  # --chunked-prefill-size of both servers (0: SGLang's default)
    round: str = ""
    preset: str = DEFAULT_PRESET

    def __post_init__(self) -> None:
        if self.round not in ROUND_MODES:
            raise ValueError(f"bad round mode {self.round!r}: one of lead, all")
        if self.preset not in PRESETS:
            raise ValueError(f"bad preset {self.preset!r}: one of {', '.join(sorted(PRESETS))}")

    @property
    def label(self) -> str:
        chunk = f" chunk={self.chunked_prefill}" if self.chunked_prefill else ""
        return (f"N={self.agents} w={self.block_words}{chunk}" + (f" round={self.round}" if self.round else "")
                + (f" preset={self.preset}" if self.preset != DEFAULT_PRESET else ""))

    @property
    def server_flags(self) -> tuple[str, ...]:
        """What a TokenDance server answering this workload is started with, beyond its setting."""
        chunk = ("--chunked-prefill-size", str(self.chunked_prefill)) if self.chunked_prefill else ()
        return chunk + (("--no-tokendance-round-leader",) if self.round == "all" else ())

    @classmethod
    def parse(cls, label: str) -> "Workload":
        """The inverse of `label` ("N=6 w=40", "N=4 w=60 chunk=128", "N=10 round=lead preset=debate")."""
        values = dict(f.split("=", 1) for f in label.split() if "=" in f)
        if len(values) != len(label.split()) or not {"N"} <= set(values) <= {"N", "w", "chunk", "round", "preset"}:
            raise ValueError(f"bad workload {label!r}: write 'N=AGENTS [w=BLOCK_WORDS] [chunk=CHUNKED_PREFILL_SIZE] "
                             "[round=lead|all] [preset=PRESET]'")
        return cls(int(values["N"]), int(values.get("w", 60)), int(values.get("chunk", 0)), values.get("round", ""),
                   values.get("preset", DEFAULT_PRESET))


@dataclass(frozen=True)
class ServerConfig:
    settings: tuple[Setting, ...]
    workloads: tuple[Workload, ...]
    chunked_prefill: int = 128  # the workloads again at settings[0] with this size (0: not)
    prompts_per_n: int = 4
    decode_steps: int = 16
    top_k: int = 20
    options: BlendOptions = BlendOptions()
    history_words: int = 150
    seed: int = 0
    model_path: str | None = None
    max_total_tokens: int = 8192  # each server's KV budget: the prompts are short, the machine may be shared

    def __post_init__(self) -> None:
        if any(s.lead for s in self.settings):
            raise ValueError("a server's round leader is a workload's, not a setting's: write round=lead in "
                             "--server-workloads")

    def cases(self) -> list[tuple[Setting, Workload]]:
        """Every setting on every workload, then the first setting on the chunked workloads."""
        chunked = [Workload(w.agents, w.block_words, self.chunked_prefill) for w in self.workloads
                   if self.chunked_prefill and not w.chunked_prefill and not w.round]
        return [(s, w) for s in self.settings for w in self.workloads] + [(self.settings[0], w) for w in chunked]


# --- the truncated KL ---------------------------------------------------------------------


def truncated_kl(reference: TopK, other: TopK) -> float:
    """KL(reference || other) over K + 1 outcomes: the reference's top-K tokens and "any other
    token", from two top-K logprob lists.

    A reference token missing from `other`'s list has a logprob at most `other`'s K-th
    largest; it is taken at that bound. Each such token displaces one of `other`'s top-K tokens
    of at least that mass, so the other side's K masses still sum to at most its top-K mass,
    "any other token" keeps a non-negative mass on both sides, and the result is a KL of two
    distributions (>= 0). With both lists exact (every
    reference token in `other`'s list) it is the KL of the coarse-grained distributions, a lower
    bound of the full-vocabulary KL; with K = vocabulary size it is that KL."""
    if not reference or not other:
        raise ValueError("truncated_kl needs two non-empty top-K lists")
    floor = min(other.values())
    p = [math.exp(lp) for lp in reference.values()]
    q = [math.exp(other.get(t, floor)) for t in reference]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)
    p_rest, q_rest = max(0.0, 1.0 - sum(p)), max(1.0 - sum(q), 1e-12)
    return kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 1e-12 else 0.0)


def top_k(logits: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Per row of logits [n, vocab]: the top-k tokens' logprobs, as a server reports them."""
    values, indices = logits.float().log_softmax(-1).topk(k, -1)
    return [dict(zip(i.tolist(), v.tolist())) for v, i in zip(values, indices)]


# --- server responses ---------------------------------------------------------------------


@dataclass
class ServerOutput:
    """What one /generate answer tells: greedy ids, their top-K lists, reuse counts."""

    ids: list[int]
    tops: list[dict[int, float]]
    prompt_tokens: int
    spans: list[tuple[int, int]]
    reuse: dict = field(default_factory=dict)  # meta_info["tokendance"] counts (empty: none)

    def to_json(self) -> dict:
        return {"ids": self.ids, "tops": [list(top.items()) for top in self.tops], "prompt_tokens": self.prompt_tokens,
                "spans": self.spans, "reuse": self.reuse}

    @classmethod
    def from_json(cls, d: dict) -> "ServerOutput":
        return cls(d["ids"], [{int(t): lp for t, lp in top} for top in d["tops"]], d["prompt_tokens"],
                   [tuple(span) for span in d["spans"]], d["reuse"])

    @classmethod
    def from_response(cls, response: dict) -> "ServerOutput":
        meta = response["meta_info"]
        tops = [{int(entry[1]): float(entry[0]) for entry in step} for step in meta["output_top_logprobs"]]
        info = meta.get("tokendance") or {}
        if len(tops) != len(response["output_ids"]):
            raise ValueError(f"{len(tops)} top-logprob lists for {len(response['output_ids'])} output tokens")
        return cls(list(response["output_ids"]), tops, meta["prompt_tokens"],
                   [(s["start"], s["end"]) for s in info.get("segments", [])],
                   {k: info[k] for k in ("reused_tokens", "recomputed_tokens", "segment_hits", "round_master_tokens",
                                         "mirror_diff_tokens", "within_threshold_tokens") if k in info})


def compared_steps(reference: Sequence[int], blended: Sequence[int], decode_steps: int) -> range:
    """Decode steps (1-based output indices) at which both sides decoded the same inputs: the
    first t outputs agree, and both have an output t."""
    agree = common_prefix(reference, blended)
    return range(1, min(decode_steps, agree, len(reference) - 1, len(blended) - 1) + 1)


def step_kls(reference: Sequence[TopK], other: Sequence[TopK], steps: Iterable[int]) -> list[float]:
    return [truncated_kl(reference[t], other[t]) for t in steps]


@dataclass
class ServerSample:
    """One agent prompt under one setting: server and in-process side by side."""

    workload: str
    agents: int
    block_words: int
    chunked_prefill: int
    agent: int
    setting: str
    prompt_tokens: int
    same_prompt: bool  # the server tokenised the prompt to the in-process ids' length and spans
    steps_compared: int  # decode steps compared (greedy outputs agreed up to them)
    server_first_tkl: float
    inproc_first_tkl: float
    server_decode_tkl: float | None  # mean over the compared steps (None: none compared)
    inproc_decode_tkl: float | None  # same steps, teacher-forced on the reference server's output
    server_agree: int  # common prefix of the greedy outputs (of decode_steps + 1 tokens)
    inproc_agree: int
    server_reused: int
    server_recomputed: int
    server_hits: int
    inproc_reused: int
    inproc_recomputed: int
    inproc_hits: int
    inproc_first_kl: float  # full vocabulary, for scale
    inproc_decode_kl: float | None  # full vocabulary, every teacher-forced decode step
    noise_first_tkl: float  # reference server vs in-process full prefill
    noise_decode_tkl: float | None
    noise_agree: int  # steps at which the in-process full prefill's greedy token is the reference's
    server_content_tkl: float | None  # the decode measure over the compared content steps only
    inproc_content_kl: float | None  # full vocabulary, every teacher-forced content step
    content_steps: int  # teacher-forced decode steps where the full prefill's entropy exceeds CONTENT_ENTROPY
    server_own: int = 0  # reused positions holding own slots (mirror storage: the Mirror diff)
    server_within_threshold: int = 0  # recomputed, then read from the Master (mirror storage's diff threshold)


def request_body(text: str, config: ServerConfig, max_new_tokens: int, with_logprobs: bool) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if with_logprobs:
        body.update(return_logprob=True, top_logprobs_num=config.top_k)
    return body


def post(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=REQUEST_TIMEOUT)
    r.raise_for_status()
    return r.json()


def server_argv(setting: Setting | None, config: ServerConfig, workload_flags: Sequence[str] = ()) -> list[str]:
    """Launcher flags: a TokenDance server at `setting`, or None: --disable-tokendance (of the
    workload's flags, only its chunk size then)."""
    options = config.options
    argv = ["--model-path", config.model_path] if config.model_path else []
    argv += ["--max-total-tokens", str(config.max_total_tokens)]
    if setting is None:
        return argv + [f for f in workload_flags if f != "--no-tokendance-round-leader"] + ["--disable-tokendance"]
    argv += list(workload_flags)
    if setting.rule == FULL:
        raise ValueError("the full prefill is the --disable-tokendance server")
    argv += ["--tokendance-recompute-ratio", str(setting.ratio),
             "--tokendance-block-head-tokens", str(options.block_head_tokens),
             "--tokendance-selection-granularity", options.granularity,
             "--tokendance-block-size", str(options.block_size),
             "--tokendance-screen-factor", str(options.screen_factor)]
    if setting.rule != PLAIN:
        argv += ["--tokendance-selection", setting.rule, "--tokendance-check-layer", str(setting.check_layer),
                 "--tokendance-screen-layer", str(setting.screen_layer),
                 "--tokendance-group-selection", setting.group, "--tokendance-group-probe", str(setting.probe)]
    if not setting.planned:  # chunked prompts select per chunk, as the in-process setting does
        argv += ["--no-tokendance-planned-selection"]
    if setting.budget is not None:
        argv += ["--tokendance-max-approximate-tokens", str(setting.budget)]
    argv += ["--tokendance-storage", setting.storage]  # named: the launcher's `auto` is mirror on the CPU
    if setting.diff_threshold:
        argv += ["--tokendance-diff-threshold", str(setting.diff_threshold)]
    return argv + ([] if options.sparse_writeback else ["--no-tokendance-sparse-writeback"])


class Prompts:
    """A workload's simulation and its measured agent prompts (text and in-process ids)."""

    def __init__(self, runner: QualityRunner, config: ServerConfig, workload: Workload):
        self.workload = workload
        self.sim: Simulation = make_simulation(preset_config(
            workload.preset, num_agents=workload.agents, num_rounds=1, history_words=config.history_words,
            block_words=workload.block_words, max_new_tokens=config.decode_steps + 1, seed=config.seed))
        measured = workload.agents if workload.round else min(workload.agents, config.prompts_per_n)
        self.texts = [runner.agent_text(self.sim, i, 0, self.sim.seed_messages) for i in range(measured)]
        self.prompts: list[SegmentedPrompt] = [runner.segmented(t) for t in self.texts]
        self.seed_texts = [runner.seed_text(self.sim, j) for j in range(workload.agents)]


class SavedAnswers:
    """Server answers per (server flags, workload, measurement flags), kept in a JSONL file as
    they come, so that a run started again with --resume skips what it already has (a server
    run takes an hour on a shared 2-core machine, and one crash should not cost it all)."""

    def __init__(self, path: Path | None, config: ServerConfig, resume: bool):
        self.path, self.fingerprint = path, [config.prompts_per_n, config.decode_steps, config.top_k,
                                             config.history_words, config.seed]
        self.answers: dict[str, list[ServerOutput]] = {}
        if path is not None and resume and path.exists():
            for line in path.read_text().splitlines():
                d = json.loads(line)
                self.answers[d["key"]] = [ServerOutput.from_json(o) for o in d["outputs"]]
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def key(self, argv: list[str], workload: Workload) -> str:
        return json.dumps([argv, workload.label, self.fingerprint])

    def get(self, argv: list[str], workload: Workload) -> list[ServerOutput] | None:
        return self.answers.get(self.key(argv, workload))

    def put(self, argv: list[str], workload: Workload, outputs: list[ServerOutput]) -> None:
        self.answers[self.key(argv, workload)] = outputs
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": self.key(argv, workload), "outputs": [o.to_json() for o in outputs]}) + "\n")


def serve(argv: list[str], workloads: list[Prompts], config: ServerConfig, seed: bool, desc: str,
          saved: SavedAnswers) -> dict[tuple[str, int], ServerOutput]:
    """Every workload's answers from one server started with `argv` (only if some are not saved
    yet): (workload label, agent) -> output."""
    from sglang_tokendance.bench.server_process import ServerProcess

    todo = [p for p in workloads if saved.get(argv, p.workload) is None]
    if todo:
        with ServerProcess(argv) as server:
            for prompts in todo:
                saved.put(argv, prompts.workload, answer(server.url, prompts, config, seed, desc))
    return {(p.workload.label, i): out for p in workloads for i, out in enumerate(saved.get(argv, p.workload))}


def answer(url: str, prompts: Prompts, config: ServerConfig, seed: bool, desc: str) -> list[ServerOutput]:
    """The workload's prompts after a cache flush, one at a time or (a round workload, on a
    TokenDance server) all at once as one round; with `seed`, each author's message is cached first."""
    flush_cache(url)
    for text in prompts.seed_texts if seed else ():
        post(url, request_body(text, config, 1, with_logprobs=False))
    bodies = [request_body(text, config, config.decode_steps + 1, True) for text in prompts.texts]
    label = prompts.workload.label
    if not (prompts.workload.round and seed):
        return [ServerOutput.from_response(post(url, body)) for body in tqdm(bodies, desc=f"{desc} {label}",
                                                                               unit="prompt")]
    options = {"round": f"quality {label}", "round_size": len(bodies)}
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(tqdm(pool.map(lambda body: post(url, {**body, "tokendance": options}), bodies),
                            total=len(bodies), desc=f"{desc} {label}", unit="prompt"))
    return [ServerOutput.from_response(a) for a in answers]


@dataclass
class InProcess:
    """One prompt's prefill in-process, teacher-forced on the reference server's output."""

    tops: list[dict[int, float]]  # first token, then each forced decode step
    logits: torch.Tensor = field(repr=False)  # the same rows, full vocabulary
    greedy: list[int]
    reused: int = 0
    recomputed: int = 0
    hits: int = 0


@torch.no_grad()
def in_process(runner: QualityRunner, prompt: SegmentedPrompt, store: SegmentStore, setting: Setting,
               config: ServerConfig, reference: Sequence[int]) -> InProcess:
    ids, steps = prompt.input_ids, config.decode_steps
    room = len(ids) + steps + 1
    logits, kv, stats, hits = runner.run_setting(prompt, store, setting, config.options, room)
    forced = runner.forced_inputs(reference, steps)
    rows = torch.cat([logits[None], runner.extend(kv, forced, len(ids))])
    greedy = runner.greedy(kv, len(ids), logits, steps + 1)
    return InProcess(top_k(rows, config.top_k), rows, greedy, stats.reused_tokens - stats.kept_tokens,
                     stats.kept_tokens, hits)


def compare(workload: Workload, agent: int, setting: Setting, prompt: SegmentedPrompt, config: ServerConfig,
            ref: ServerOutput, blended: ServerOutput, full: InProcess, mine: InProcess) -> ServerSample:
    """Server vs in-process on one prompt: the same truncated KL at the same steps."""
    forced = range(1, full.logits.shape[0])  # in-process decode steps (before any special token)
    steps = [t for t in compared_steps(ref.ids, blended.ids, config.decode_steps) if t in forced]
    same = blended.prompt_tokens == len(prompt.input_ids) and blended.spans == [(s.start, s.end) for s in prompt.spans]
    entropy = entropy_rows(full.logits)
    content = [t for t in forced if entropy[t] > CONTENT_ENTROPY]  # the in-process full prefill's, same inputs
    return ServerSample(
        workload.label, workload.agents, workload.block_words, workload.chunked_prefill, agent, setting.label,
        len(prompt.input_ids), same, len(steps),
        truncated_kl(ref.tops[0], blended.tops[0]), truncated_kl(full.tops[0], mine.tops[0]),
        mean_or_none(step_kls(ref.tops, blended.tops, steps)), mean_or_none(step_kls(full.tops, mine.tops, steps)),
        common_prefix(ref.ids, blended.ids), common_prefix(full.greedy, mine.greedy),
        blended.reuse.get("reused_tokens", 0), blended.reuse.get("recomputed_tokens", 0),
        blended.reuse.get("segment_hits", 0), mine.reused, mine.recomputed, mine.hits,
        float(kl_rows(full.logits[0], mine.logits[0])),
        mean_or_none(kl_rows(full.logits[1:], mine.logits[1:]).tolist()),
        truncated_kl(ref.tops[0], full.tops[0]), mean_or_none(step_kls(ref.tops, full.tops, forced)),
        common_prefix(ref.ids, full.greedy),
        mean_or_none(step_kls(ref.tops, blended.tops, [t for t in steps if t in content])),
        mean_or_none(kl_rows(full.logits[content], mine.logits[content]).tolist()), len(content),
        blended.reuse.get("mirror_diff_tokens", 0), blended.reuse.get("within_threshold_tokens", 0))


def run(config: ServerConfig, runner: QualityRunner, saved: SavedAnswers) -> list[ServerSample]:
    """Every case of `config`: servers first (one at a time), then the in-process side."""
    workloads = {w: Prompts(runner, config, w) for _, w in config.cases()}
    reference: dict[tuple[str, int], ServerOutput] = {}
    for chunk in sorted({w.chunked_prefill for w in workloads}):
        group = [p for w, p in workloads.items() if w.chunked_prefill == chunk]
        argv = server_argv(None, config, Workload(1, chunked_prefill=chunk).server_flags)
        reference |= serve(argv, group, config, False, f"full chunk={chunk}", saved)
    blended: dict[tuple[str, str, int], ServerOutput] = {}
    for setting in config.settings:
        for flags in dict.fromkeys(w.server_flags for s, w in config.cases() if s == setting):
            group = [workloads[w] for s, w in config.cases() if s == setting and w.server_flags == flags]
            argv = server_argv(setting, config, flags)
            for (label, i), out in serve(argv, group, config, True, f"{setting.label} {' '.join(flags)}",
                                         saved).items():
                blended[setting.label, label, i] = out
    return compare_all(config, runner, workloads, reference, blended)


def compare_all(config: ServerConfig, runner: QualityRunner, workloads: dict[Workload, Prompts],
                reference: dict[tuple[str, int], ServerOutput],
                blended: dict[tuple[str, str, int], ServerOutput]) -> list[ServerSample]:
    """Server answers (reference: (workload, agent); blended: (setting, workload, agent)) beside
    the in-process blend of the same prompts, one sample per case and agent."""
    samples = []
    by_workload: dict[Workload, list[Setting]] = {}
    for setting, workload in config.cases():
        by_workload.setdefault(workload, []).append(setting)
    for workload, settings in tqdm(by_workload.items(), desc="in-process", unit="workload"):
        prompts = workloads[workload]
        store = runner.seed_store(prompts.sim)
        leads = {setting: server_lead(runner, prompts, store, [blended[setting.label, workload.label, i]
                                                               for i in range(len(prompts.prompts))])
                 for setting in settings}
        for i, prompt in enumerate(prompts.prompts):
            ref = reference[workload.label, i]
            full = in_process(runner, prompt, store, Setting(FULL), config, ref.ids)
            for setting in settings:
                lead = leads[setting]
                mine = full if lead is not None and lead.leader == i else \
                    in_process(runner, prompt, store if lead is None else lead.store, setting, config, ref.ids)
                answer = blended[setting.label, workload.label, i]
                samples.append(compare(workload, i, setting, prompt, config, ref, answer, full, mine))
    return samples


def server_lead(runner: QualityRunner, prompts: Prompts, store: SegmentStore,
                answers: Sequence[ServerOutput]) -> Lead | None:
    """The round's leader as the server chose it (the first member whose blocks superseded their
    Masters), with its Masters in-process; None where no member led (only a led round's leader
    supersedes Masters)."""
    leader = next((i for i, a in enumerate(answers) if a.reuse.get("round_master_tokens", 0) > 0), None)
    return None if leader is None else runner.lead(prompts.sim, store, leader)


def summarize(samples: Iterable[ServerSample]) -> list[dict]:
    """Means over agents per (workload, setting); decode means over the samples with steps compared."""
    groups: dict[tuple[str, str], list[ServerSample]] = {}
    for s in samples:
        groups.setdefault((s.workload, s.setting), []).append(s)
    rows = []
    for (workload, setting), group in groups.items():
        def mean(name: str) -> float | None:
            return mean_or_none(getattr(s, name) for s in group if getattr(s, name) is not None)

        rows.append({"workload": workload, "setting": setting, "agents": group[0].agents, "prompts": len(group),
                     "same_prompts": all(s.same_prompt for s in group),
                     **{name: mean(name) for name in (
                         "server_first_tkl", "inproc_first_tkl", "server_decode_tkl", "inproc_decode_tkl",
                         "steps_compared", "server_agree", "inproc_agree", "server_reused", "inproc_reused",
                         "server_recomputed", "inproc_recomputed", "server_hits", "inproc_hits",
                         "inproc_first_kl", "inproc_decode_kl", "noise_first_tkl", "noise_decode_tkl",
                         "noise_agree", "server_content_tkl", "inproc_content_kl", "content_steps", "server_own",
                         "server_within_threshold")}})
        positions = sum(s.server_reused + s.server_recomputed for s in group)
        rows[-1]["server_compression"] = positions / max(1, sum(s.server_own for s in group))
        # the members that read Masters: a led round's leader (computed exactly, KL 0) left out
        readers = [s for s in group if s.server_hits > 0]
        rows[-1]["readers"] = len(readers)
        rows[-1].update({f"readers_{name}": mean_or_none(getattr(s, name) for s in readers
                                                         if getattr(s, name) is not None)
                         for name in ("server_first_tkl", "inproc_first_tkl", "server_decode_tkl",
                                      "inproc_decode_tkl", "server_content_tkl", "inproc_content_kl",
                                      "server_agree")})
    return rows
