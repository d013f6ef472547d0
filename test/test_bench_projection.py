"""The on-paper projection of a round's KV onto one GPU, from a capacity fit run."""

from __future__ import annotations

import json

import pytest

from sglang_tokendance.bench_projection import Device, RoundShape, main


def probe(mode, n, fits, prompt, reused, new=100, compression=float("nan")):
    return {"type": "fit_probe", "mode": mode, "num_agents": n, "fits": fits, "prompt_tokens_per_agent": prompt,
            "reused_positions_per_agent": reused, "completion_tokens_per_agent": new,
            "mirror_compression": compression}


def write_run(path, rows, probes):
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "meta"}, *probes,
                                                          *({"type": "capacity_fit", **r} for r in rows)]))


def test_the_projection_reads_the_rounds_shape_and_scales_it_to_the_gpus_pool(tmp_path):
    run = tmp_path / "fit.jsonl"
    # mirror fitted 8 agents, each prompt 1000 tokens of which 800 reused (8 blocks of 100)
    write_run(run, [{"mode": "radix", "max_agents": 5, "peak_kv_tokens_per_agent": 800.0,
                     "mirror_compression": float("nan")},
                    {"mode": "tokendance-mirror", "max_agents": 8, "peak_kv_tokens_per_agent": 700.0,
                     "mirror_compression": 4.0}],
              [probe("radix", 5, True, 700, 0), probe("tokendance-mirror", 7, True, 900, 700),
               probe("tokendance-mirror", 8, True, 1000, 800), probe("tokendance-mirror", 9, False, 1100, 900)])
    out = tmp_path / "proj.jsonl"
    main(["--input-file", str(run), "--num-agents", "10,40", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    meta = records[0]
    assert meta["shape"] == {"private": 200.0, "block": 100.0, "new": 100.0}
    device = Device(**meta["device"])
    assert meta["bytes_per_token"] == 2 * 28 * 4 * 128 * 2 and meta["pool_tokens"] == device.pool_tokens
    rows = {(r["mode"], r["num_agents"]): r for r in records if r["type"] == "projection"}
    assert rows["radix", 10]["kv_tokens_per_agent"] == 200 + 10 * 100 + 100
    assert rows["tokendance-mirror", 10]["kv_tokens_per_agent"] == 200 + 10 * 100 / 4 + 100 + 100
    for n in (10, 40):
        assert rows["tokendance-mirror", n]["rounds_vs_radix"] > 1
        assert rows["radix", n]["rounds_at_once"] == device.pool_tokens // (n * rows["radix", n]["kv_tokens_per_agent"])
    shape = RoundShape(200.0, 100.0, 100.0)
    for mode, c in (("radix", 1.0), ("tokendance-mirror", 4.0)):
        largest = rows[mode, 10]["largest_round"]
        assert shape.kv_tokens(largest, c) <= device.pool_tokens < shape.kv_tokens(largest + 1, c)
    # the model against what the run measured at the most agents it fitted
    assert rows["tokendance-mirror", 10]["model_vs_measured"] == pytest.approx(shape.kv_tokens(8, 4.0) / 8 / 700)
    assert out.with_suffix(".png").stat().st_size > 1000 and "rounds_at_once" in out.with_suffix(".md").read_text()


def test_a_run_without_fitted_rows_or_a_pool_is_refused(tmp_path):
    run = tmp_path / "fit.jsonl"
    write_run(run, [], [])
    with pytest.raises(ValueError, match="capacity_fit"):
        main(["--input-file", str(run), "--no-plot", "--output-file", str(tmp_path / "p.jsonl")])
    with pytest.raises(ValueError, match="no KV pool"):
        _ = Device(28, 4, 128, 2, gpu_gb=16, mem_fraction_static=0.9, weights_gb=15.23).pool_tokens
