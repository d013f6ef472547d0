"""bench_never_worse: the per-shape comparison (fast) and, on a tiny random-weight model, every
shape run end to end with TokenDance serving at least radix's exact tokens, the conversation
shape on SmolLM2 (slow)."""

from __future__ import annotations

import json

import pytest

from conftest import emptied
from sglang_tokendance import bench_never_worse


def summary(mode: str, prefill: list[float], latency: list[float], cached: list[int], reused: list[int],
            kept: list[int] | None = None) -> dict:
    by_round = lambda values: {str(i): v for i, v in enumerate(values)}  # noqa: E731 (JSON keys)
    return {"mode": mode, "round_prefill_by_round_s": by_round(prefill), "round_latency_by_round_s": by_round(latency),
            "cached_tokens_by_round": by_round(cached), "prompt_tokens_by_round": by_round([1000] * len(cached)),
            "reused_tokens_by_round": by_round(reused), "kept_tokens_by_round": by_round(kept or [0] * len(cached)),
            "errors": 0}


def test_shape_row_compares_the_rounds_after_the_first():
    row = bench_never_worse.shape_row(bench_never_worse.SHAPES["static"], {
        "radix": [summary("radix", [9.0, 4.0, 6.0], [20.0, 8.0, 12.0], [0, 300, 500], [0, 0, 0])],
        "tokendance": [summary("tokendance", [1.0, 2.0, 3.0], [2.0, 5.0, 5.0], [0, 200, 500], [50, 60, 0])],
    })
    assert row["prefill_speedup"] == pytest.approx(5.0 / 2.5) and row["latency_speedup"] == pytest.approx(10 / 5)
    assert row["prefill_speedup_worst"] == row["prefill_speedup"] and row["repeats"] == 1
    assert (row["exact_tokens_radix"], row["exact_tokens"], row["approximate_tokens"]) == (800, 700, 60)
    assert row["prompt_tokens"] == row["prompt_tokens_radix"] == 2000
    assert (row["last_round_exact_tokens_radix"], row["last_round_exact_tokens"]) == (500, 500)
    assert row["exact_ratio"] == pytest.approx(700 / 800)
    assert row["prefill_speedup_by_round"] == {"0": 9.0, "1": 2.0, "2": 2.0}
    assert row["latency_speedup_by_round"] == {"0": 10.0, "1": 1.6, "2": 2.4}
    assert row["latency_speedup_cumulative"] == pytest.approx(40 / 12)
    same = summary("radix", [1.0, 1.0], [1.0, 1.0], [0, 40], [0, 0])
    unmarked = bench_never_worse.shape_row(bench_never_worse.SHAPES["unmarked"], {
        "radix": [same], "tokendance-unmarked": [{**same, "mode": "tokendance-unmarked"}]})
    assert unmarked["mode"] == "tokendance-unmarked" and unmarked["exact_ratio"] == 1.0


def test_repeats_pool_their_rounds_and_keep_the_worst_ratio():
    radix = [summary("radix", [9.0, 4.0, 4.0], [9.0, 8.0, 8.0], [0, 300, 300], [0, 0, 0]),
             summary("radix", [9.0, 6.0, 6.0], [9.0, 8.0, 8.0], [0, 300, 300], [0, 0, 0])]
    ours = [summary("tokendance", [9.0, 2.0, 2.0], [9.0, 16.0, 16.0], [0, 300, 300], [10, 0, 0]),
            summary("tokendance", [9.0, 8.0, 8.0], [9.0, 4.0, 4.0], [0, 300, 300], [0, 20, 0])]
    row = bench_never_worse.shape_row(bench_never_worse.SHAPES["all-gather"], {"radix": radix, "tokendance": ours})
    assert row["repeats"] == 2
    assert row["prefill_speedup"] == pytest.approx(5.0 / 5.0)  # mean round 5 s on both sides
    assert row["prefill_speedup_worst"] == pytest.approx(6.0 / 8.0)  # the second repeat's
    assert row["latency_speedup"] == pytest.approx(8.0 / 10.0) and row["latency_speedup_worst"] == pytest.approx(0.5)
    assert (row["exact_tokens_radix"], row["exact_tokens"], row["approximate_tokens"]) == (1200, 1200, 20)
    assert (row["last_round_exact_tokens_radix"], row["last_round_exact_tokens"]) == (600, 600)


def test_cli_refuses_unknown_shapes_and_single_rounds():
    for argv in (["--shapes", "all-gather,spiral"], ["--num-rounds", "1"], ["--repeats", "0"],
                 ["--radix-url", "http://x"], ["--shapes", "chunked", "--radix-url", "u", "--tokendance-url", "v"]):
        with pytest.raises(SystemExit):
            bench_never_worse.parse_args(argv)


@pytest.mark.slow
def test_every_shape_serves_at_least_radixs_exact_tokens(tmp_path, tiny_llama):
    out = tmp_path / "never_worse.jsonl"
    shapes = ("all-gather", "static", "unmarked", "chunked", "static-cached")  # conversations: on SmolLM2 below
    bench_never_worse.main(["--model-path", tiny_llama, "--num-agents", "3", "--num-rounds", "2",
                            "--max-new-tokens", "24", "--repeats", "1", "--shapes", ",".join(shapes),
                            "--output-file", str(out)])
    rows = {r["shape"]: r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "shape"}
    assert set(rows) == set(shapes)
    assert all(row["errors"] == 0 for row in rows.values())
    # In the last round TokenDance computes nothing radix serves from its tree: it serves those
    # tokens exactly too, or (mirror storage, the CPU's default) reads them from the agent's kept
    # row of the round before (its own earlier KV). Left out: conversations and static-cached on
    # this random model (its answers differ between the two servers and do not survive the text
    # round trip, so the two sides' prompts share different prefixes; pinned on SmolLM2 below).
    # (Chunked on SmolLM2 once fell one token short of radix in its last round, 2102 of 2104 in
    # benchmark/results/never_worse.md; it holds here.)
    assert rows["static-cached"]["kept_tokens"] > 0  # the rounds after the first continue kept rows
    for shape, row in rows.items():
        if shape == "static-cached":
            continue
        assert row["last_round_exact_tokens"] + row["last_round_kept_tokens"] >= \
            row["last_round_exact_tokens_radix"] > 0, shape
    # every shape reuses (unmarked prompts: their content-defined chunks; static: its rotated
    # statements, its briefing being exact), so the check above cannot pass with reuse off. (Static
    # and chunked once read nothing in one of two full runs, before an unnamed arrival waited
    # for a prefilling request's blocks; five runs of both beside a CPU hog read 17 and 100 tokens.)
    assert all(row["approximate_tokens"] > 0 for shape, row in rows.items() if shape != "static-cached"), rows
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_a_conversation_serves_at_least_radixs_exact_tokens_in_its_last_round(tmp_path, default_server_url,
                                                                                stock_server_url):
    """The conversation shape on SmolLM2, whose answers survive the text round trip, with round
    0's blocks cached before it (so round 0 reads them approximately and round 1, the last, is
    the round after an approximate read): each transcript continues its agent's last prompt and
    answer, so the last round computes nothing radix serves (it reads its kept row of the round
    before: mirror storage), and reads some of it approximately (kept tokens). On the session's
    servers (stock, and TokenDance with its defaults)."""
    out = tmp_path / "conversation.jsonl"
    bench_never_worse.main(["--shapes", "conversation-cached", "--num-agents", "3", "--num-rounds", "2",
                            "--max-new-tokens", "16", "--repeats", "1", "--no-plot", "--output-file", str(out),
                            "--radix-url", emptied(stock_server_url), "--tokendance-url", emptied(default_server_url)])
    row = next(r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "shape")
    assert row["errors"] == 0
    assert row["last_round_exact_tokens"] + row["last_round_kept_tokens"] >= row["last_round_exact_tokens_radix"] > 0
    assert row["last_round_kept_tokens"] > 0
