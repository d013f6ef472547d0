"""The blended prefill inside a real server (SmolLM2): recompute ratio 1 is a full prefill,
the default ratio recomputes its share, and recomputed tokens are reported."""

from __future__ import annotations

import pytest
import requests

from conftest import FULL_RATIO_CHUNK, emptied, generate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP

pytestmark = pytest.mark.slow

BLOCKS = [
    "Tom: The river flooded the old mill last night, so the north road is closed until Friday.",
    "Ada: The council will vote on the new market hall tomorrow at noon in the town square.",
]
AUTHOR = SEP.join(["You are Mira, the baker of Oakvale. Yesterday you sold rye bread to the mayor.",
                   *BLOCKS, " Mira says:"])
READER = SEP.join(["You are Oskar, the carpenter.", BLOCKS[1], BLOCKS[0], " Oskar says:"])


def with_logprobs(url: str, text: str, salt: str, max_new_tokens: int = 12) -> dict:
    return generate(url, text, max_new_tokens, cache_salt=salt, return_logprob=True)


def output_logprobs(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def full_ratio_server(full_ratio_server_url):
    return emptied(full_ratio_server_url)


def test_ratio_one_equals_a_full_prefill(full_ratio_server):
    url = full_ratio_server  # emptied by its fixture
    reference = with_logprobs(url, READER, "reference")  # its own namespace, nothing cached: SGLang's prefill
    with_logprobs(url, AUTHOR, "round", 2)  # caches both blocks in Mira's context
    blended = with_logprobs(url, READER, "round")  # same namespace: segments hit, no radix prefix past "You are"
    info = blended["meta_info"]["tokendance"]
    assert blended["meta_info"]["prompt_tokens"] <= FULL_RATIO_CHUNK  # one chunk (test_chunked_server: several)
    assert info["segment_hits"] == 2 and info["reused_tokens"] == 0 and info["recomputed_tokens"] > 0
    assert blended["output_ids"] == reference["output_ids"]
    assert output_logprobs(blended) == pytest.approx(output_logprobs(reference), abs=2e-3)


def test_default_ratio_recomputes_its_share_and_serves_batches(default_server_url):
    url = emptied(default_server_url)
    generate(url, AUTHOR, 2)
    out = generate(url, READER, 8)
    info = out["meta_info"]["tokendance"]
    seg_tokens = sum(s["end"] - s["start"] for s in info["segments"])
    assert info["segment_hits"] == 2
    assert info["recomputed_tokens"] == round(0.3 * seg_tokens)  # default --tokendance-recompute-ratio
    assert info["reused_tokens"] + info["recomputed_tokens"] == seg_tokens
    meta = out["meta_info"]
    assert info["computed_tokens"] == meta["prompt_tokens"] - meta["cached_tokens"] - info["reused_tokens"]
    plain = "The capital of France is"
    alone = generate(url, plain, 8)["output_ids"]
    batch = generate(url, [READER.replace("Oskar", "Ilse"), plain], 8)
    assert batch[0]["meta_info"]["tokendance"]["recomputed_tokens"] > 0
    assert batch[1]["output_ids"] == alone


def test_a_requests_fidelity_budget_bounds_its_approximate_tokens(default_server_url):
    """`tokendance.max_approximate_tokens`: at most that many reused tokens keep their cached
    KV (more recomputed than the ratio's share, or the chunk computed on SGLang's path where
    that no longer pays); a budget above the ratio's leaves the default."""
    url = emptied(default_server_url)
    generate(url, AUTHOR, 2)
    counts = {}
    for budget in (None, 1000, 6, 0):
        options = {} if budget is None else {"tokendance": {"max_approximate_tokens": budget}}
        info = generate(url, READER.replace("Oskar", f"Oskar{budget}"), 2, **options)["meta_info"]["tokendance"]
        seg_tokens = sum(s["end"] - s["start"] for s in info["segments"])
        assert info["segment_hits"] == 2
        assert info["reused_tokens"] + info["recomputed_tokens"] + info["cost_fallback_tokens"] == seg_tokens
        counts[budget] = info["reused_tokens"]
    assert counts[1000] == counts[None] == seg_tokens - round(0.3 * seg_tokens) > 6
    assert counts[6] <= 6 and counts[0] == 0


def test_input_logprob_requests_take_sglangs_path(default_server_url):
    url = default_server_url
    generate(url, AUTHOR, 2)
    body = {"text": READER.replace("Oskar", "Pia"), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    out = requests.post(url + "/generate", json=body, timeout=300).json()
    assert "reused_tokens" not in out["meta_info"]["tokendance"]
    without = generate(url, READER.replace("Oskar", "Quinn"), 2)["meta_info"]["tokendance"]
    assert without["segment_hits"] == 2  # the same prompt reuses when it asks for no input logprobs
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]
