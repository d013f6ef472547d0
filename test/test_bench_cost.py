"""bench_cost: its cases (fast) and its CLI against real servers on a tiny random-weight model (slow)."""

from __future__ import annotations

import json

import pytest

from sglang_tokendance import bench_cost


def test_cases_put_the_share_of_words_in_one_marked_block_the_author_caches_elsewhere():
    cases = bench_cost.make_cases([100, 40], [0.0, 0.25], repeats=2, seed=3)
    assert [(c.words, c.share, c.repeat) for c in cases[:4]] == [(100, 0.0, 0), (100, 0.25, 0), (40, 0.0, 0),
                                                                 (40, 0.25, 0)]
    plain, marked = cases[0], cases[1]
    assert plain.author == [] and len(plain.reader) == 1 and len(plain.reader[0].split()) == 100 + 6
    private, block, instruction = marked.reader
    assert len(block.split()) == 25 and len(private.split()) == 75 and marked.author[1] == block
    assert marked.author[0] != private  # another context: read at another offset, never a radix hit
    assert cases[5].reader[1] != block  # every case its own text


@pytest.mark.slow
def test_cli_times_each_mode_and_counts_blended_and_fallen_back_tokens(tmp_path, tiny_llama):
    out = tmp_path / "cost.jsonl"
    bench_cost.main(["--model-path", tiny_llama, "--prompt-words", "120", "--shares", "0,0.5", "--repeats", "1",
                     "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = {(r["mode"], r["share"]): r for r in records if r["type"] == "summary"}
    assert set(rows) == {(m, s) for m in ("radix", "tokendance", "tokendance-always") for s in (0.0, 0.5)}
    assert all(rows[("radix", s)]["speedup"] == 1.0 for s in (0.0, 0.5))
    always, default = rows[("tokendance-always", 0.5)], rows[("tokendance", 0.5)]
    assert always["block_tokens"] > 0 and always["blended_tokens"] == always["block_tokens"]
    assert always["fallback_tokens"] == 0 and always["estimated_speedup"] > 0
    assert default["blended_tokens"] + default["fallback_tokens"] == default["block_tokens"]
    assert rows[("tokendance", 0.0)]["block_tokens"] == 0
    assert out.with_suffix(".md").exists() and (tmp_path / "cost_speedup.png").stat().st_size > 0
