"""The blended prefill on every supported family's SGLang decoder (tiny random weights):
Mistral (LlamaModel), Qwen2 (Qwen2Model) and Qwen3 (Qwen3Model, per-head q/k norm).
At recompute ratio 1 a request whose blocks hit the forest gets SGLang's own full-prefill
answer."""

from __future__ import annotations

import pytest

from conftest import assert_no_leak
from sglang_tokendance.bench.server_process import ServerProcess
from sglang_tokendance.bench.tiny_models import write_tiny_model
from test_blend_server import AUTHOR, READER, output_logprobs, with_logprobs

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_blended_prefill_on_each_family(tmp_path, smollm2_path, arch):
    path = write_tiny_model(tmp_path / arch, arch)
    with ServerProcess(["--model-path", str(path), "--tokendance-recompute-ratio", "1.0",
                        "--tokendance-check-layer", "2", "--no-tokendance-cost-check"]) as server:
        reference = with_logprobs(server.url, READER, "reference")
        with_logprobs(server.url, AUTHOR, "round", 2)
        blended = with_logprobs(server.url, READER, "round")
        assert_no_leak(server.url)
    info = blended["meta_info"]["tokendance"]
    assert info["segment_hits"] == 2 and info["recomputed_tokens"] > 0 and info["reused_tokens"] == 0
    assert blended["output_ids"] == reference["output_ids"]
    assert output_logprobs(blended) == pytest.approx(output_logprobs(reference), abs=2e-3)
