"""core/cost inside a real server (tiny random-weight Llama): at recompute ratio 1 blending
never pays, so a request whose blocks hit the forest is computed on SGLang's own path: the
same answer as with nothing cached, its matched tokens counted as fallen back in meta_info and
on /metrics; with --no-tokendance-cost-check the same hits are blended (recomputed)."""

from __future__ import annotations

import pytest

from sglang_tokendance.bench.server_process import ServerProcess
from test_blend_server import AUTHOR, READER, output_logprobs, with_logprobs
from test_metrics import tokendance_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cost_check", [True, False])
def test_ratio_one_falls_back_to_sglangs_path_unless_told_to_blend(tiny_llama, cost_check):
    flags = [] if cost_check else ["--no-tokendance-cost-check"]
    with ServerProcess(["--model-path", tiny_llama, "--tokendance-recompute-ratio", "1.0", "--tokendance-check-layer",
                        "2", "--enable-metrics", *flags]) as server:
        reference = with_logprobs(server.url, READER, "reference")  # nothing cached: SGLang's prefill
        with_logprobs(server.url, AUTHOR, "round", 2)  # caches both blocks
        hit = with_logprobs(server.url, READER, "round")
        info, metrics = hit["meta_info"]["tokendance"], tokendance_metrics(server.url)
    matched = sum(span["end"] - span["start"] for span in info["segments"])
    assert info["segment_hits"] == 2 and info["reused_tokens"] == 0
    if cost_check:
        assert info["cost_fallback_tokens"] == matched and info["recomputed_tokens"] == 0
        assert metrics["sglang:tokendance_cost_fallbacks_total"] == 1
        assert metrics["sglang:tokendance_cost_fallback_tokens_total"] == matched
    else:
        assert info["cost_fallback_tokens"] == 0 and info["recomputed_tokens"] == matched
        assert metrics["sglang:tokendance_cost_fallbacks_total"] == 0
    assert hit["output_ids"] == reference["output_ids"]
    assert output_logprobs(hit) == pytest.approx(output_logprobs(reference), abs=2e-3)
