"""`python -m sglang_tokendance.bench_group_chat`: unmodified clients -- no markers, no names --
against stock radix on the same prompts, with a client that marks and names beside them.

Four client shapes. `chat`: an AutoGen-style group chat through /v1/chat/completions: each
agent's request is its own system message (its persona and notes), then the group's
conversation so far as user messages (every agent's turn, in the order spoken), then a short
"your turn" message. `transcript`: the same chat with the conversation and the turn pasted
into one user message. `text`: a plain-text simulation through /v1/completions: the same notes,
conversation and turn concatenated into one prompt. `marked`: the text client written for
TokenDance, the gap an unmodified client leaves: each turn between separators, each round
named with its size. A `--disable-tokendance` server (SGLang's own prefill and radix cache:
stock radix, with markers stripped and segments tokenised as ours does) answers every round
first (each round's requests sent together): its answers make the conversation, and its top
logprobs are the full prefill every other server is compared with. Each TokenDance setting
then gets the same prompts, round by round, each round sent together. Per client, setting and
round: first-token and content-step KL against stock (steps compared while the greedy outputs
agree, as bench_quality's server mode does), continuations identical to stock's, the segments
found and the tokens reused (the server's `metadata["tokendance"]`), the round's latency
over stock's, and the round's peak KV in use beside stock's (sampled from SGLang's /v1/loads:
tokens held by live requests and pinned Masters, not the evictable tree). With `--repeats R`
each further repeat flushes both servers and sends each round to stock and to the setting in
turn, the first of the two alternating, for the spread of the latency ratio per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_tokendance.bench import report
from sglang_tokendance.bench.quality_server import truncated_kl
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache
from sglang_tokendance.bench.workloads import Simulation, WorkloadConfig, make_simulation
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR

SETTINGS: dict[str, tuple[str, ...]] = {
    "default": (),  # chat messages and content-defined chunks as segments, inferred rounds with their leader
    "no-inferred-rounds": ("--tokendance-round-min-shared", "0"),
    "no-chat-segments": ("--no-tokendance-chat-segments",),  # a chat's reuse before: none without markers
    "no-content-chunks": ("--tokendance-content-chunks", "0"),  # a plain prompt's reuse before: none
}
TIMEOUT = 1800


def chat_messages(sim: Simulation, agent: int, conversation: list[str], round_index: int) -> list[dict]:
    return [{"role": "system", "content": sim.agents[agent].history.strip()},
            *({"role": "user", "content": turn} for turn in conversation),
            {"role": "user", "content": f"{sim.agents[agent].name}, it is your turn (round {round_index + 1}). "
                                        f"Answer in two sentences."}]


def chat_body(sim: Simulation, agent: int, conversation: list[str], round_index: int) -> dict:
    return {"messages": chat_messages(sim, agent, conversation, round_index)}


def transcript_body(sim: Simulation, agent: int, conversation: list[str], round_index: int) -> dict:
    """The chat client that pastes the conversation into one user message after its system
    message (as a LangGraph or CAMEL loop that keeps the transcript as a string does)."""
    notes, *turns, turn = (m["content"] for m in chat_messages(sim, agent, conversation, round_index))
    return {"messages": [{"role": "system", "content": notes},
                         {"role": "user", "content": "\n\n".join([*turns, turn])}]}


def text_body(sim: Simulation, agent: int, conversation: list[str], round_index: int, marker: str = "") -> dict:
    """The plain-text simulation: the chat's messages concatenated, as a simulation loop would,
    ending where the agent's turn begins ("Name:"); each turn between `marker`s."""
    notes, *turns, turn = (m["content"] for m in chat_messages(sim, agent, conversation, round_index))
    return {"prompt": "\n\n".join([notes, *(f"{marker}{t}{marker}" for t in turns), turn])
            + f"\n\n{sim.agents[agent].name}:"}


def marked_body(sim: Simulation, agent: int, conversation: list[str], round_index: int) -> dict:
    """The text client written for TokenDance: its turns marked, its round named with its size."""
    size = len(sim.agents)
    return {**text_body(sim, agent, conversation, round_index, DEFAULT_SEPARATOR),
            "tokendance": {"round": f"n{size}-r{round_index}", "round_size": size}}


def ask_chat(url: str, body: dict, max_tokens: int, top: int) -> dict:
    r = requests.post(url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": "default", **body, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": True, "top_logprobs": top})
    r.raise_for_status()
    body = r.json()
    steps = body["choices"][0]["logprobs"]["content"]
    return {"text": body["choices"][0]["message"]["content"], "tokens": [s["token"] for s in steps],
            "tops": [{t["token"]: t["logprob"] for t in s["top_logprobs"]} for s in steps],
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "tokendance": (body.get("metadata") or {}).get("tokendance", {})}


def ask_text(url: str, body: dict, max_tokens: int, top: int) -> dict:
    r = requests.post(url + "/v1/completions", timeout=TIMEOUT, json={
        "model": "default", **body, "max_tokens": max_tokens, "temperature": 0, "logprobs": top})
    r.raise_for_status()
    body = r.json()
    logprobs = body["choices"][0]["logprobs"]
    return {"text": body["choices"][0]["text"], "tokens": logprobs["tokens"], "tops": logprobs["top_logprobs"],
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "tokendance": (body.get("metadata") or {}).get("tokendance", {})}


CLIENTS = {"chat": (chat_body, ask_chat), "transcript": (transcript_body, ask_chat), "text": (text_body, ask_text),
           "marked": (marked_body, ask_text)}


def peak_kv_while(url: str, done: threading.Event, peak: list[int], interval: float = 0.2) -> None:
    """Samples SGLang's KV tokens in use (held by live requests and pinned, not the evictable
    tree) until `done`; the largest sample ends in peak[0]."""
    while True:
        try:
            loads = requests.get(url + "/v1/loads?include=core", timeout=5).json()["loads"]
            peak[0] = max(peak[0], sum(x["num_used_tokens"] for x in loads))
        except (requests.RequestException, KeyError, ValueError):
            pass
        if done.wait(interval):
            return


def send_round(url: str, client: str, prompts: list, args: argparse.Namespace) -> tuple[list[dict], float, int]:
    """The round's requests sent together: their answers, the round's latency and its peak KV."""
    ask = CLIENTS[client][1]
    done, peak = threading.Event(), [0]
    sampler = threading.Thread(target=peak_kv_while, args=(url, done, peak), daemon=True)
    sampler.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda m: ask(url, m, args.max_new_tokens, args.top_logprobs), prompts))
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return answers, seconds, peak[0]


def compare(answer: dict, reference: dict) -> dict:
    """KLs against the reference: the first token's, and each later step's while the greedy
    outputs agree (both sides decoded the same inputs)."""
    agree = 0
    while agree < min(len(answer["tokens"]), len(reference["tokens"])) and \
            answer["tokens"][agree] == reference["tokens"][agree]:
        agree += 1
    steps = [truncated_kl(reference["tops"][t], answer["tops"][t])
             for t in range(1, min(agree + 1, len(answer["tops"]), len(reference["tops"])))]
    info = answer["tokendance"]
    return {"first_kl": truncated_kl(reference["tops"][0], answer["tops"][0]), "step_kls": steps,
            "identical": answer["tokens"] == reference["tokens"], "prompt_tokens": answer["prompt_tokens"],
            "segments": len(info.get("segments", [])), "segment_hits": info.get("segment_hits", 0),
            "reused_tokens": info.get("reused_tokens", 0), "recomputed_tokens": info.get("recomputed_tokens", 0)}


def reference_rounds(url: str, client: str, sim: Simulation, args: argparse.Namespace, progress) -> list[dict]:
    """Stock's rounds: the prompts, its answers (the conversation), its latency per round."""
    conversation = [f"{sim.agents[j].name}: {m}" for j, m in enumerate(sim.seed_messages)]
    rounds = []
    for r in range(args.num_rounds):
        prompts = [CLIENTS[client][0](sim, a, conversation, r) for a in range(len(sim.agents))]
        answers, seconds, peak_kv = send_round(url, client, prompts, args)
        rounds.append({"prompts": prompts, "answers": answers, "seconds": seconds, "peak_kv": peak_kv})
        conversation += [f"{sim.agents[a].name}: {answer['text']}" for a, answer in enumerate(answers)]
        progress.update(1)
    return rounds


def round_row(client: str, setting: str, n: int, r: int, answers: list[dict], seconds: float, peak_kv: int,
              stock: dict, stock_seconds: float, stock_peak_kv: int, repeat: int) -> dict:
    """One round of a setting against stock's answers (`stock`) and stock's timing of the same round."""
    compared = [compare(a, ref) for a, ref in zip(answers, stock["answers"])]
    steps = [kl for c in compared for kl in c["step_kls"]]
    return {"type": "round", "client": client, "setting": setting, "num_agents": n, "round": r, "repeat": repeat,
            "first_kl": statistics.fmean(c["first_kl"] for c in compared),
            "step_kl": statistics.fmean(steps) if steps else None, "steps_compared": len(steps),
            "identical": sum(c["identical"] for c in compared),
            "prompt_tokens": sum(c["prompt_tokens"] for c in compared),
            **{k: sum(c[k] for c in compared) for k in ("segments", "segment_hits", "reused_tokens",
                                                         "recomputed_tokens")},
            "seconds": seconds, "seconds_radix": stock_seconds, "latency_vs_radix": stock_seconds / seconds,
            "peak_kv_tokens": peak_kv, "peak_kv_radix": stock_peak_kv}


def replay(url: str, client: str, setting: str, n: int, rounds: list[dict], args: argparse.Namespace,
           progress) -> list[dict]:
    """The setting's rounds on stock's prompts, timed against stock's reference rounds."""
    rows = []
    for r, stock in enumerate(rounds):
        answers, seconds, peak_kv = send_round(url, client, stock["prompts"], args)
        rows.append(round_row(client, setting, n, r, answers, seconds, peak_kv, stock, stock["seconds"],
                              stock["peak_kv"], 0))
        progress.update(1)
    return rows


def alternating_repeat(stock_url: str, url: str, client: str, setting: str, n: int, rounds: list[dict],
                       args: argparse.Namespace, repeat: int, progress) -> list[dict]:
    """One more repeat: both servers flushed, then each round's prompts sent to stock and to the
    setting's server in turn, the first of the two alternating from one repeat to the next."""
    flush_cache(stock_url)
    flush_cache(url)
    rows = []
    for r, stock in enumerate(rounds):
        timed = {u: send_round(u, client, stock["prompts"], args)
                 for u in ([url, stock_url] if repeat % 2 else [stock_url, url])}
        (answers, seconds, peak_kv), (_, stock_seconds, stock_peak_kv) = timed[url], timed[stock_url]
        rows.append(round_row(client, setting, n, r, answers, seconds, peak_kv, stock, stock_seconds, stock_peak_kv,
                              repeat))
        progress.update(2)
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    agents = [int(n) for n in args.num_agents.split(",")]
    sims = {n: make_simulation(WorkloadConfig(num_agents=n, num_rounds=args.num_rounds, history_words=100,
                                              block_words=60, seed=args.seed)) for n in agents}
    model = ["--model-path", args.model_path] if args.model_path else []
    rows: list[dict] = []
    runs = [(client, n) for client in args.clients for n in agents]
    total = len(runs) * args.num_rounds * (1 + len(args.settings) * (1 + 2 * (args.repeats - 1)))
    with tqdm(total=total, desc="group chat rounds", unit="round") as progress:
        with ServerProcess([*model, "--disable-tokendance"]) as stock:
            references = {}
            for client, n in runs:
                flush_cache(stock.url)
                references[client, n] = reference_rounds(stock.url, client, sims[n], args, progress)
            for setting in args.settings:
                with ServerProcess([*model, *SETTINGS[setting]]) as server:
                    for client, n in runs:
                        flush_cache(server.url)
                        rows += replay(server.url, client, setting, n, references[client, n], args, progress)
                        for repeat in range(1, args.repeats):
                            rows += alternating_repeat(stock.url, server.url, client, setting, n,
                                                       references[client, n], args, repeat, progress)
    return rows


def spread(rows: list[dict]) -> list[dict]:
    """Per client, setting, size and round: stock's latency over the setting's across repeats."""
    runs: dict[tuple, list[float]] = {}
    for row in rows:
        runs.setdefault((row["client"], row["setting"], row["num_agents"], row["round"]), []).append(
            row["latency_vs_radix"])
    return [{"client": c, "setting": s, "num_agents": n, "round": r, "repeats": len(ratios),
             "latency_vs_radix_mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios)}
            for (c, s, n, r), ratios in runs.items()]


def plot(path: Path, rows: list[dict]) -> None:
    def series(key: str, of_rows: list[dict]) -> dict:
        def of(run):
            return [r for r in of_rows if (r["client"], r["setting"], r["num_agents"]) == run]
        return {f"{c} {s}, N={n}": ([r["round"] for r in of((c, s, n))], [r[key] or 0.0 for r in of((c, s, n))])
                for c, s, n in dict.fromkeys((r["client"], r["setting"], r["num_agents"]) for r in of_rows)}

    first = [r for r in rows if r["repeat"] == 0]  # quality: the first repeat's answers
    report.plot_panels(path, "Unmodified clients (no markers or names) against stock radix", [
        report.Panel("content-step KL against stock", "round", "mean truncated KL", series("step_kl", first)),
        report.Panel("tokens reused", "round", "tokens", series("reused_tokens", first)),
        report.Panel("round latency: stock / setting (mean of repeats)", "round", "ratio",
                     series("latency_vs_radix_mean", spread(rows)), hline=1.0, hline_label="stock radix"),
    ])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.bench_group_chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-agents", default="4,8,16", help="comma-separated group sizes")
    p.add_argument("--num-rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--top-logprobs", type=int, default=10, help="K of the truncated KL")
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help=f"from {', '.join(CLIENTS)} (marked: the text client with markers and named rounds)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"from {', '.join(SETTINGS)}")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1,
                   help="timings per round: the first against stock's reference rounds, each further one "
                        "sent to both servers in turn, the first of the two alternating")
    p.add_argument("--model-path", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--output-file", type=Path, default=Path("benchmark/results/group_chat.jsonl"),
                   help="JSONL; the Markdown summary and the PNG plot are written beside it")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.settings, args.clients = args.settings.split(","), args.clients.split(",")
    for name, given, known in (("setting", args.settings, SETTINGS), ("client", args.clients, CLIENTS)):
        unknown = [s for s in given if s not in known]
        if unknown:
            p.error(f"unknown {name}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if not all(n.isdigit() and 2 <= int(n) for n in args.num_agents.split(",")):
        p.error(f"--num-agents must be comma-separated integers >= 2, got {args.num_agents!r}")
    if args.num_rounds < 1 or args.max_new_tokens < 1 or args.repeats < 1 or not 1 <= args.top_logprobs <= 20:
        p.error("--num-rounds, --max-new-tokens and --repeats must be >= 1, --top-logprobs in [1, 20]")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rows = run(args)
    command = report.command_line("sglang_tokendance.bench_group_chat", argv)
    report.write_jsonl(args.output_file, [{"type": "meta", "command": command}, *rows])
    columns = ["client", "setting", "num_agents", "round", "repeat", "first_kl", "step_kl", "steps_compared",
               "identical", "prompt_tokens", "segments", "segment_hits", "reused_tokens", "recomputed_tokens",
               "seconds", "seconds_radix", "latency_vs_radix", "peak_kv_tokens", "peak_kv_radix"]
    report.write_markdown(args.output_file.with_suffix(".md"), "Unmodified clients against stock radix",
                          command, [("Per round (each round's requests sent together)",
                                     report.markdown_table(rows, columns)),
                                    ("Round latency, stock's over the setting's, across repeats",
                                     report.markdown_table(spread(rows), ["client", "setting", "num_agents", "round",
                                                                          "repeats", "latency_vs_radix_mean", "min",
                                                                          "max"]))])
    if not args.no_plot:
        plot(args.output_file.with_suffix(".png"), rows)


if __name__ == "__main__":
    main()
