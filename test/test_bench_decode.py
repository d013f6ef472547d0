"""bench_decode: its three layouts hold the same keys (every path answers as SGLang's decode),
and its CLI writes what the README promises (fast: a tiny shape)."""

from __future__ import annotations

import json

import torch

from sglang_tokendance import bench_decode
from sglang_tokendance.core.rope import RopeSpec


def test_rows_read_each_master_at_a_shift_of_their_own_and_own_the_rest():
    shape = bench_decode.Shape(heads=4, kv_heads=2, head_dim=8, layers=1, batch=3, runs=2, shared=0.5, tile=4)
    layouts = bench_decode.Layouts(shape, 40, RopeSpec(8, 8, 10000.0), seed=1)
    table = layouts.mirror_table
    shared = [set(table[b].tolist()) & set(table[c].tolist()) for b, c in ((0, 1), (1, 2))]
    assert all(len(s) == 20 for s in shared)  # the Masters' slots, read by every row
    assert len(set(table.flatten().tolist())) == 3 * 20 + 20  # each row's own slots are its alone
    shifts = layouts.frames.shifts(table)
    assert layouts.distinct_shifts == len(shifts.unique()) >= 4  # 0 for own text, a shift per row for the Masters
    assert all(len(set(shifts[b][shifts[b] != 0].tolist())) == 1 for b in range(3))
    assert len({int(shifts[b][shifts[b] != 0][0]) for b in range(3)}) == 3


def test_cli_times_the_three_paths_and_they_answer_alike(tmp_path):
    out = tmp_path / "decode.jsonl"
    bench_decode.main(["--lengths", "48,96", "--batch", "3", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16", "--tile", "8", "--repeats", "2", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in records if r["type"] == "summary"]
    assert {(r["path"], r["length"]) for r in rows} == {(p, n) for p in ("sglang", "rotate-all", "frames")
                                                        for n in (48, 96)}
    assert all(r["max_abs_diff"] < 1e-4 for r in rows)
    assert all(r["over_sglang"] == 1.0 for r in rows if r["path"] == "sglang")
    assert all(r["plan_ms"] > 0 for r in rows if r["path"] == "frames")
    assert records[0]["command"].startswith("python -m sglang_tokendance.bench_decode")
    assert out.with_suffix(".md").read_text().count("| frames |") == 2 and out.with_suffix(".png").stat().st_size
    assert torch.get_num_threads() == records[0]["threads"]
