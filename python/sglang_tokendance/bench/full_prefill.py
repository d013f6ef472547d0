"""Greedy outputs against a full prefill of the same prompts (`bench_multiagent --quality`).

Every request a mode served is sent again, with the very text it sent, to a server started with
`--disable-tokendance` (the same launcher and prompt interface, no KV reuse: every prompt token
is computed): one round's requests at once, as the mode served them, greedy, with the same
`max_new_tokens`. A mode's quality is how many of its outputs are the full prefill's token for
token, and how long the common prefix is where they differ. Stock radix reuses only exact KV,
so its disagreements are the noise floor (batching and prefix-cache arithmetic on this machine).

In conversations (`--conversation`) each mode's later prompts carry its own earlier answers, so
the modes' prompts differ; each is compared with the full prefill of its own prompts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

from sglang_tokendance.bench.multiagent import CLIENT_TIMEOUT, RequestRecord
from sglang_tokendance.bench.quality import common_prefix


@dataclass(frozen=True)
class Reference:
    """The full prefill's answer to one request's prompt."""

    output_ids: list[int]
    prompt_tokens: int


async def _generate(http: aiohttp.ClientSession, url: str, prompt: str, max_new_tokens: int) -> Reference:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    async with http.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {await resp.text()}")
        out = await resp.json()
    return Reference(list(out["output_ids"]), out["meta_info"]["prompt_tokens"])


async def _replay(url: str, records: list[RequestRecord], max_new_tokens: int, progress) -> list[Reference]:
    rounds: dict[tuple[int, int], list[int]] = {}
    for i, record in enumerate(records):
        rounds.setdefault((record.session, record.round), []).append(i)
    answers: list[Reference | None] = [None] * len(records)
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as http:
        for indices in rounds.values():
            batch = await asyncio.gather(*(_generate(http, url, records[i].prompt, max_new_tokens) for i in indices))
            for i, answer in zip(indices, batch):
                answers[i] = answer
            progress.update(len(indices))
    return answers


def replay(url: str, records: list[RequestRecord], max_new_tokens: int, progress) -> list[Reference]:
    """Each record's prompt on the full-prefill server at `url`, a round's requests at once."""
    if any(not r.prompt for r in records):
        raise ValueError("a request record without its prompt cannot be replayed")
    return asyncio.run(_replay(url, records, max_new_tokens, progress))


def agreement(mode: str, records: list[RequestRecord], references: list[Reference]) -> dict[str, Any]:
    """One mode's outputs against the full prefill's: identical outputs (all and by round), the
    mean common prefix (tokens, and as a share of the longer output), whether every prompt was
    tokenised to the reference's length (the comparison is of the same prompts), and the share
    of prompt tokens whose KV was reused, not computed (what can make an output differ)."""
    if len(records) != len(references):
        raise ValueError(f"{len(records)} requests but {len(references)} references")
    same = [r.output_ids == ref.output_ids for r, ref in zip(records, references)]
    prefixes = [common_prefix(r.output_ids, ref.output_ids) for r, ref in zip(records, references)]
    shares = [p / max(len(r.output_ids), len(ref.output_ids), 1)
              for p, r, ref in zip(prefixes, records, references)]
    by_round: dict[int, list[bool]] = {}
    for r, s in zip(records, same):
        by_round.setdefault(r.round, []).append(s)
    return {
        "mode": mode,
        "requests": len(records),
        "identical": sum(same),
        "identical_fraction": sum(same) / len(same) if same else float("nan"),
        "mean_common_prefix_tokens": sum(prefixes) / len(prefixes) if prefixes else float("nan"),
        "mean_common_prefix_share": sum(shares) / len(shares) if shares else float("nan"),
        "same_prompt_lengths": all(r.prompt_tokens == ref.prompt_tokens for r, ref in zip(records, references)),
        "reused_share": sum(r.reused_tokens for r in records) / max(sum(r.prompt_tokens for r in records), 1),
        "identical_fraction_by_round": {k: sum(v) / len(v) for k, v in sorted(by_round.items())},
    }
