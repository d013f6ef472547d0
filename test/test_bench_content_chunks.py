"""bench_content_chunks: recall of content-defined chunks on plain prompts, its CLI and report."""

from __future__ import annotations

import json

import pytest

from sglang_tokendance import bench_content_chunks


def test_cli_refuses_bad_spacings_presets_and_rounds_of_one():
    for argv in (["--spacings", "8,6"], ["--presets", "chess"], ["--num-agents", "1"], ["--overhead-prompts", "0"]):
        with pytest.raises(SystemExit):
            bench_content_chunks.parse_args(argv)


def test_recall_counts_the_shared_blocks_found_in_other_prompts(tmp_path):
    """Plain prompts of one round hold the same messages after other notes: most of those
    tokens sit in chunks another prompt holds too; another simulation's round shares little."""
    out = tmp_path / "cc.jsonl"
    bench_content_chunks.main(["--presets", "debate", "--num-agents", "3", "--block-words", "80",
                               "--spacings", "8", "--overhead-repeats", "0", "--output-file", str(out)])
    rows = [r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "recall"]
    assert len(rows) == 1 and rows[0]["default"] and not rows[0]["tuned_on"]
    row = rows[0]
    assert 0.7 < row["recall"] <= 1 and row["found_tokens"] <= row["shared_tokens"]
    assert row["foreign_tokens"] < 0.1 * row["prompt_tokens"] * 3
    assert row["mean_chunk_tokens"] >= 16
    assert "| debate |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000
