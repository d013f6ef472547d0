"""bench_read_rate: a dense restore and a mirror read timed on a model's KV shape, in-process."""

from __future__ import annotations

import json

import pytest

from sglang_tokendance import bench_read_rate

TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
        "rope_theta": 10000.0, "max_position_embeddings": 256}


def test_cli_writes_each_repeats_ratio_and_the_read_rate_it_implies(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "rate.jsonl"
    bench_read_rate.main(["--model-path", str(tmp_path), "--tokens", "16", "--repeats", "3",
                          "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    samples = [r for r in records if r["type"] == "sample"]
    (row,) = [r for r in records if r["type"] == "summary"]
    assert [s["repeat"] for s in samples] == [0, 1, 2]
    assert all(s["restore_s"] > 0 and s["read_s"] > 0 for s in samples)
    assert row["ratio"] == pytest.approx(sorted(s["ratio"] for s in samples)[1])  # the median of three
    assert row["implied_read_rate"] == pytest.approx(row["ratio"] * row["restore_rate"])
    assert row["layers"] == 2 and row["tokens"] == 16
    assert "python -m sglang_tokendance.bench_read_rate" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000


def test_cli_refuses_no_tokens_or_repeats():
    for argv in (["--tokens", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            bench_read_rate.parse_args(argv)
