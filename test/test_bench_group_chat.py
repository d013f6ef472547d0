"""bench_group_chat: unmodified clients (an OpenAI chat group chat, a plain-text simulation) against stock
radix, beside the plain-text client with markers and named rounds."""

from __future__ import annotations

import json

import pytest

from sglang_tokendance import bench_group_chat


def test_cli_refuses_unknown_settings_and_groups_of_one():
    for argv in (["--settings", "default,magic"], ["--clients", "chat,voice"], ["--num-agents", "1"],
                 ["--num-agents", "4,x"], ["--top-logprobs", "0"]):
        with pytest.raises(SystemExit):
            bench_group_chat.parse_args(argv)


@pytest.mark.slow
def test_clients_without_markers_or_names_reuse_the_conversation(tmp_path, tiny_llama):
    """The agents' prompts hold the same turns after other notes: by default each chat turn is a
    segment, and a plain-text prompt's (or one long chat message's) content-defined chunks are;
    round 0, with nothing cached, already reads them at a shift, whatever the arrival: requests
    reaching the scheduler in one pass form an inferred round with a leader, and a later one
    waits for the prefill computing its turns. The marked client's named round is led the same way."""
    out = tmp_path / "chat.jsonl"
    bench_group_chat.main(["--model-path", tiny_llama, "--num-agents", "3", "--num-rounds", "2",
                           "--max-new-tokens", "4", "--settings", "default", "--repeats", "2",
                           "--output-file", str(out)])
    every = [r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "round"]
    rows = {(r["client"], r["round"]): r for r in every if r["repeat"] == 0}
    assert set(rows) == {(c, r) for c in ("chat", "transcript", "text", "marked") for r in (0, 1)}
    again = {(r["client"], r["round"]): r for r in every if r["repeat"] == 1}  # both servers timed again, in turn
    assert set(again) == set(rows) and len(every) == 16
    assert all(again[k]["seconds_radix"] != rows[k]["seconds_radix"] and again[k]["prompt_tokens"]
               == rows[k]["prompt_tokens"] for k in rows)
    assert all(row["setting"] == "default" for row in rows.values())
    assert rows["chat", 0]["segments"] >= 3 * 4  # each agent: its system message and the three seed turns
    assert rows["text", 0]["segments"] >= 3 * 4  # each seed turn is several chunks
    assert rows["transcript", 0]["segments"] >= 3 * 4  # the one user message holding the turns: its chunks
    assert rows["marked", 0]["segments"] == 3 * 3  # each seed turn is one segment; the notes are private
    assert rows["marked", 0]["segment_hits"] >= 2 * 3  # two readers of the leader's three turns
    for client in ("chat", "transcript", "text", "marked"):
        assert rows[client, 0]["reused_tokens"] > 0 and rows[client, 0]["segment_hits"] > 0
    assert all(row["first_kl"] >= 0 and row["seconds"] > 0 and row["identical"] <= 3 for row in rows.values())
    # live KV: at most the round's own tokens and the rows its agents kept from the last round
    assert all(0 <= row["peak_kv_tokens"] <= 2 * row["prompt_tokens"] for row in rows.values())
    assert out.with_suffix(".md").read_text().count("| default |") == 16 + 8  # each round, then each spread
    assert out.with_suffix(".png").stat().st_size > 1000
