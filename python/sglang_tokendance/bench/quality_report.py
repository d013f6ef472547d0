"""The reports of `python -m sglang_tokendance.bench_quality`: what each measure means, the
comparisons against a baseline setting, and the plots (matplotlib PNG) of each mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sglang_tokendance.bench import quality_server, report
from sglang_tokendance.bench.quality import PLAIN, QualityConfig
from sglang_tokendance.bench.quality_experiments import MASTER_CHOICES

GROUP_METRICS = """

Round groups: every agent of one round at each N is prefilled in one batch as one round group.
`per-request`: each agent selects its own top r of its reused tokens. `g=aligned`: the segments
two or more agents read are selected together, each offset scored by the mean over the agents,
the same offsets recomputed in every agent (budget: r of the group's tokens of those segments).
`k=K`: only the first K agents reading a segment probe it; the others adopt the group's choice
and compute only their kept tokens through the probe layers (`adopted_share`: share of reused
tokens that skipped the probe). `work`: the whole batch's token-layers / a full prefill's."""


def group_versus(rows: list[dict]) -> list[dict]:
    """Each group mode's decode-step KL and work beside per-request selection's at the same N
    and ratio: a group mode may become the default only within 10% of per-request's KL."""
    base = {(r["agents"], r["ratio"]): r for r in rows
            if r["rule"] != PLAIN and r["group_selection"] == "per-request"}
    out = []
    for r in rows:
        own = base.get((r["agents"], r["ratio"]))
        if r["rule"] == PLAIN or r["group_selection"] == "per-request" or own is None:
            continue
        mode = "aligned" + (f" k={r['group_probe']}" if r["group_probe"] else "")
        ratio = r["decode_kl"] / own["decode_kl"] if own["decode_kl"] else None
        out.append({"agents": r["agents"], "ratio": r["ratio"], "mode": mode, "decode_kl": r["decode_kl"],
                    "per_request_decode_kl": own["decode_kl"], "kl_vs_per_request": ratio,
                    "within_10pct": ratio is not None and ratio <= 1.1, "work": r["work"],
                    "per_request_work": own["work"]})
    return out


def plot_groups(path: Path, rows: list[dict], config: QualityConfig) -> None:
    """Decode-step KL and work vs recompute ratio, one line per group mode, a panel per N."""
    panels = []
    for n in config.num_agents:
        mine = [r for r in rows if r["agents"] == n]
        plain = next((r["decode_kl"] for r in mine if r["rule"] == PLAIN), None)
        for metric, ylabel, logy in (("decode_kl", "mean decode-step KL (log)", True),
                                     ("work", "token-layers / full prefill's", False)):
            series: dict[str, tuple[list[float], list[float]]] = {}
            for r in sorted(mine, key=lambda r: r["ratio"]):
                if r["rule"] == PLAIN:
                    continue
                mode = r["group_selection"] + (f" k={r['group_probe']}" if r["group_probe"] else "")
                xs, ys = series.setdefault(mode, ([], []))
                xs.append(r["ratio"])
                ys.append(r[metric])
            panels.append(report.Panel(f"N={n}: {metric}", "recompute ratio", ylabel, series,
                                       hline=plain if metric == "decode_kl" else None,
                                       hline_label="plain reuse (r=0)", logy=logy))
    report.plot_panels(path, f"Round groups (first {config.decode_steps} decode steps)", panels)


def setting_family(label: str) -> str:
    """A setting's label without its recompute ratio: the settings one frontier line joins."""
    return " ".join(f for f in label.split() if not f.startswith("r="))


def plot_frontier(path: Path, rows: list[dict], presets: Sequence[str], agents: int) -> None:
    """Content-step decode KL against work at one N, one panel per workload: one line per
    setting family over its recompute ratios (plain reuse, a budget, a single setting: a point)."""
    panels = []
    for preset in presets:
        series: dict[str, tuple[list[float], list[float]]] = {}
        for r in sorted((r for r in rows if r["preset"] == preset and r["content_kl"]), key=lambda r: r["work"]):
            xs, ys = series.setdefault(setting_family(r["setting"]), ([], []))
            xs.append(r["work"])
            ys.append(r["content_kl"])
        panels.append(report.Panel(preset, "work: token-layers / full prefill's", "content-step decode KL (log)",
                                   series, logy=True))
    report.plot_panels(path, f"Fidelity / work frontier, N={agents}", panels)


FIDELITY_METRICS = """

Fidelity: `content_kl` (the headline): the decode-step KL over content steps only, those where
the full prefill's next-token entropy exceeds 1 nat (a copied name or a template token is
near-certain and hides the approximation; `content_steps` counts them). `decisive_top1`: top-1
agreement over the decode steps where the full model's top two tokens are at least 0.5 nat
apart (a near tie's winner is a coin toss). `approximate_tokens`: reused tokens that kept their
cached KV (mean per prompt). `m=M`: a fidelity budget (--tokendance-max-approximate-tokens M):
at most M approximate tokens per request, more recomputed where the ratio would leave more."""


CHUNKED_METRICS = """

Chunked: each prompt is prefilled in chunks of `chunk` tokens, as SGLang's chunked prefill
forwards it (each chunk planned as the server plans it, blended over the KV the chunks before it
left); `chunk` 0 is the whole prompt in one forward, through the same code. `kl_vs_whole`: the
decode-step KL over the whole prompt's at the same N and setting; the target is within 1.2x.
`planned`: the server's planned selection -- at the first chunk that reads Masters, a probe of
the rest of the prompt chooses for all of it, and each chunk resumes the probe's states of its
computed tokens after the probe layers; its `work` counts the planning probe."""


def chunked_versus(rows: list[dict]) -> list[dict]:
    """Every row with its decode-step KL over the whole-prompt row's at the same N and setting
    (a planned setting's: the same setting's, which selects over the whole prompt anyway)."""
    whole = {(r["agents"], r["setting"]): r["decode_kl"] for r in rows if r["chunk"] == 0}
    out = []
    for r in sorted(rows, key=lambda r: (r["agents"], r["setting"], r["chunk"])):
        base = whole.get((r["agents"], r["setting"].removesuffix(" planned")))
        ratio = r["decode_kl"] / base if base and r["decode_kl"] is not None else None
        out.append({**r, "kl_vs_whole": ratio, "within_1.2x": ratio is not None and ratio <= 1.2})
    return out


MASTER_METRICS = """

Round 0: the N agents of one All-Gather round read the seed messages (each cached after its
author's own prompt: the author's Master) in one round group at {setting}; each member's
prefill leaves a copy of every message (the Master with the member's kept tokens recomputed).
Round 1: the next round's prompts (their own orders and instructions) read the same messages at
other offsets, in one round group, with each message's Master `author` (the author's copy),
`medoid` (the member copy with the least summed squared K and V deviation from the other
members' copies, each layer normalised) or `first-reader` (the first member's copy in batch
order); `plain` rows isolate the Master's own quality. Every member recomputes r of its reused
tokens whichever copy is kept, so storage is equal: quality decides. `wins_10pct`: decode KL
more than 10% below the author's."""


def master_versus(rows: list[dict]) -> list[dict]:
    """Each member-copy choice's KL beside the author's at the same N and setting."""
    author = {(r["agents"], r["setting"]): r for r in rows if r["master"] == "author"}
    out = []
    for r in rows:
        own = author.get((r["agents"], r["setting"]))
        if r["master"] == "author" or own is None:
            continue
        ratio = r["decode_kl"] / own["decode_kl"] if own["decode_kl"] else None
        out.append({"agents": r["agents"], "setting": r["setting"], "master": r["master"],
                    "decode_kl": r["decode_kl"], "author_decode_kl": own["decode_kl"], "kl_vs_author": ratio,
                    "first_kl": r["first_kl"], "author_first_kl": own["first_kl"],
                    "wins_10pct": ratio is not None and ratio < 0.9})
    return out


def plot_master_choice(path: Path, rows: list[dict], config: QualityConfig) -> None:
    """Decode-step and first-token KL vs N, one line per Master choice and setting."""
    panels = []
    for metric, what in (("decode_kl", f"first {config.decode_steps} decode steps"),
                         ("first_kl", "first output token")):
        series: dict[str, tuple[list[float], list[float]]] = {}
        for master in MASTER_CHOICES:
            for r in sorted((r for r in rows if r["master"] == master), key=lambda r: r["agents"]):
                xs, ys = series.setdefault(f"{master}, {r['setting']}", ([], []))
                xs.append(r["agents"])
                ys.append(r[metric])
        panels.append(report.Panel(what, "agents N", "mean KL (log)", series, logy=True))
    report.plot_panels(path, "Round 1 read the segments' Masters: author's copy vs a member's", panels)


SERVER_MEASURES = """Truncated KL (`tkl`): KL(reference || blended) over the reference's top-{k} tokens plus "any other
token", from top-{k} logprob lists; a reference token missing from the blended list is taken at
the blended list's smallest logprob (an upper bound of its true value). `first`: the first
output token. `decode`: mean over decode steps 1..{steps} at which the greedy outputs still
agreed (both sides decoded the same inputs; `steps` = how many, mean over prompts). `server_*`:
the TokenDance server vs the --disable-tokendance server. `inproc_*`: the same measure in-process
at the same steps, teacher-forced on the reference server's output (same prompts, settings,
cached KV). `agree`: common prefix of the greedy outputs ({n} tokens). `reused`/`recomputed`/`hits`:
meta_info["tokendance"] vs the in-process prefill. `inproc_first_kl`/`inproc_decode_kl`:
full-vocabulary KL in-process (decode: every teacher-forced step). `noise_*`: the reference server
vs the in-process full prefill (the floor of any difference). `content`: the decode measures over
content steps only, those where the in-process full prefill's next-token entropy exceeds 1 nat
(`content_steps`: how many, of every teacher-forced step). `server_own`: reused positions holding
the request's own slots (mirror storage: its Mirror diff), `server_within_threshold`: recomputed
tokens that read their Master after all (--tokendance-diff-threshold), `server_compression`:
reused positions per own slot. Chunked rows: both servers at that --chunked-prefill-size, the
in-process side unchunked (which never uses mirror storage: `st=`/`e=` change the server alone)."""


def plot_server(path: Path, samples: list[quality_server.ServerSample]) -> None:
    """Server vs in-process truncated KL per prompt, first token and decode steps, one colour per setting."""
    panels = []
    for what, key in (("first output token", "first_tkl"), ("decode steps (while greedy agrees)", "decode_tkl")):
        series: dict[str, tuple[list[float], list[float]]] = {}
        for s in samples:
            x, y = getattr(s, "inproc_" + key), getattr(s, "server_" + key)
            if x and y:  # log axes: no zeros, no steps compared
                label = s.setting + (" (chunked)" if s.chunked_prefill else "")
                xs, ys = series.setdefault(label, ([], []))
                xs.append(x)
                ys.append(y)
        panels.append(report.Panel(what, "in-process truncated KL", "server truncated KL", series, logy=True,
                                   lines=False, diagonal=True))
    report.plot_panels(path, "Truncated KL per prompt: server vs in-process", panels)


METRICS = """`first_kl`: KL(full || blended) over the vocabulary at the first output token (the prefill's own
logits). `decode_kl`: mean KL(full || blended) over the first {steps} decode steps, both sides
teacher-forced on the full prefill's greedy continuation, each decoding over its own KV as its
prefill left it (sparse write-back included) -- the quality users get. `_max`: the worst agent.
`work`: token-layers computed / a full prefill's. `common_prefix`: of 32-token greedy continuations."""


def plot_kl(path: Path, rows: list[dict], agents: int, decode_steps: int, x: str = "recomputed_share") -> None:
    """First-token, decode-step and content-step KL vs `x` (recomputed share of reused tokens, or
    work: the fidelity / work frontier), side by side, one line per rule and check layer."""
    xlabel = {"recomputed_share": "recomputed share of reused tokens",
              "work": "token-layers computed / full prefill's"}[x]
    panels = []
    for metric, what in (("first_kl", "first output token"), ("decode_kl", f"first {decode_steps} decode steps"),
                         ("content_kl", f"content steps of the first {decode_steps}")):
        series: dict[str, tuple[list[float], list[float]]] = {}
        plain = next((r[metric] for r in rows if r["rule"] == PLAIN), None)
        for r in sorted(rows, key=lambda r: r[x]):
            if r["rule"] == PLAIN or r[metric] is None:
                continue
            screen = f" s={r['screen_layer']}" if r.get("screen_layer") else ""
            xs, ys = series.setdefault(f"{r['rule']} c={r['check_layer']}{screen}", ([], []))
            xs.append(r[x])
            ys.append(r[metric])
        panels.append(report.Panel(what, xlabel, "mean KL (log)", series, hline=plain,
                                   hline_label="plain reuse (r=0)", logy=True))
    report.plot_panels(path, f"KL(full || blended), N={agents}", panels)
