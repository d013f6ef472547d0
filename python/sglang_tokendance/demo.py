"""`python -m sglang_tokendance.demo`: what the project is for, in a few minutes on a CPU.

A short All-Gather simulation (4 agents, 2 rounds by default; every agent's prompt is its
private history, then every agent's last message as a shared block, then an instruction;
outputs registered, so the next round's blocks hit cached segments) runs against a
TokenDance server and, in the same run, against the same server with `--disable-tokendance`
(SGLang's own radix cache, same prompts). It prints, per round and side, the prompt tokens,
the tokens taken from the radix prefix, the reused / recomputed tokens and segment hits, and
the round's prefill time (until every agent has its first token), then one sample answer per
side. A one-question chat on each server is the smoke check.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import requests
from tabulate import tabulate
from tqdm import tqdm

from sglang_tokendance.bench.multiagent import Mode, RunResult, run_load
from sglang_tokendance.bench.workloads import preset_config
from sglang_tokendance.bench.server_process import ServerProcess

SIDES = (Mode("tokendance", stock=False, marked=True),
         Mode("--disable-tokendance", stock=False, marked=True, server_args=("--disable-tokendance",)))
QUESTION = "What is the capital of France?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_tokendance.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-agents", type=int, default=4)
    p.add_argument("--num-rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None, help="first port to use (default: free ports)")
    return p.parse_args(argv)


def ask(url: str) -> str:
    r = requests.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "default", "temperature": 0, "max_tokens": 32, "messages": [{"role": "user", "content": QUESTION}]})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def run_side(mode: Mode, args: argparse.Namespace, port: int | None) -> tuple[str, RunResult]:
    config = preset_config("generative_agents", num_agents=args.num_agents, num_rounds=args.num_rounds,
                           history_words=80, block_words=50, max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(f"[demo] starting the server ({mode.name})", flush=True)
    with ServerProcess(list(mode.server_args), port=port) as server:
        answer = ask(server.url)
        with tqdm(total=config.num_rounds, desc=f"rounds ({mode.name})", unit="round") as progress:
            result = asyncio.run(run_load(server.url, mode, config, 1, float("inf"), progress))
    return answer, result


def round_rows(result: RunResult) -> list[dict]:
    rows = []
    for record in sorted(result.rounds, key=lambda r: r.round):
        reqs = [q for q in result.requests if q.round == record.round]
        rows.append({"side": result.mode, "round": record.round + 1,
                     "prompt tokens": sum(q.prompt_tokens for q in reqs),
                     "radix prefix": sum(q.cached_tokens for q in reqs),
                     "reused": sum(q.reused_tokens for q in reqs),
                     "recomputed": sum(q.recomputed_tokens for q in reqs),
                     "segment hits": sum(q.segment_hits for q in reqs),
                     "round prefill s": round(record.prefill, 2), "round s": round(record.latency, 2)})
    return rows


def speed_words(stock_s: float, ours_s: float) -> str:
    """How our time compares with stock's, in words that never call a slowdown "faster"."""
    if ours_s <= stock_s:
        return f"{stock_s / ours_s:.2f}x faster"
    return f"{ours_s / stock_s:.2f}x slower"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    answers, results = {}, {}
    for i, mode in enumerate(SIDES):
        answers[mode.name], results[mode.name] = run_side(mode, args, args.port and args.port + i)
    print(f"\n[demo] Q: {QUESTION}")
    for name, answer in answers.items():
        print(f"[demo] A ({name}): {answer.strip()}")
    rows = [row for result in results.values() for row in round_rows(result)]
    print("\n" + tabulate(rows, headers="keys", tablefmt="github"))
    ours, stock = (results[m.name] for m in SIDES)
    for record, base in zip(sorted(ours.rounds, key=lambda r: r.round), sorted(stock.rounds, key=lambda r: r.round)):
        print(f"[demo] round {record.round + 1}: prefill {speed_words(base.prefill, record.prefill)} with TokenDance")
    for name, result in results.items():
        last = max(q.round for q in result.requests)
        sample = next(q for q in result.requests if q.round == last and q.agent == 0)
        print(f"\n[demo] agent 1, round {last + 1} ({name}):\n{sample.text.strip()}")
    if not all(answers.values()):
        sys.exit("[demo] a server gave an empty answer")


if __name__ == "__main__":
    main()
