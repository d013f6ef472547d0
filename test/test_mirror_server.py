"""--tokendance-storage mirror inside real servers (tiny random-weight Llama): the `tokendance`
attention backend runs SGLang's torch_native attention for rows that read nothing at a shift,
so without reuse it answers exactly as torch_native does -- prefill, radix prefix hits, chunked
prefill, decode; with segment reuse (Masters read in place at a shift) it answers as dense
storage does at the same selection, and as a full prefill at ratio 1."""

from __future__ import annotations

import pytest
import requests

from conftest import assert_no_leak, generate
from sglang_tokendance.bench.server_process import ServerProcess
from test_blend_server import AUTHOR, READER, output_logprobs, with_logprobs

pytestmark = pytest.mark.slow

CHUNK = ["--chunked-prefill-size", "32", "--tokendance-check-layer", "2"]
PLAIN = [  # no separators; the 2nd and 4th hit the 1st's radix prefix; the last is prefilled in chunks
    "The history of the town of Oakvale begins with a mill",
    "The history of the town of Oakvale begins with a bridge",
    "A different story about a sailor",
    "The history of the town of Oakvale",
    " ".join(["The mill ground rye and wheat for every farm along the river, year after year."] * 4),
]


def serve(model: str, *argv: str):
    with ServerProcess(["--model-path", model, *CHUNK, *argv]) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def dense_server(tiny_llama):
    yield from serve(tiny_llama, "--tokendance-storage", "dense")


@pytest.fixture(scope="module")
def mirror_server(tiny_llama):
    yield from serve(tiny_llama, "--tokendance-storage", "mirror")


def plain_answers(url: str) -> list[tuple[list[int], list[float], int]]:
    requests.post(url + "/flush_cache", timeout=60)
    outs = [with_logprobs(url, text, "plain") for text in PLAIN]
    outs += with_logprobs_batch(url, PLAIN[1:3])
    return [(o["output_ids"], output_logprobs(o), o["meta_info"]["cached_tokens"]) for o in outs]


def with_logprobs_batch(url: str, texts: list[str]) -> list[dict]:
    return generate(url, texts, 12, cache_salt=["plain"] * len(texts), return_logprob=True)


def test_mirror_servers_use_the_tokendance_attention_backend(dense_server, mirror_server):
    backend = lambda url: requests.get(url + "/server_info", timeout=60).json()["attention_backend"]  # noqa: E731
    assert (backend(dense_server), backend(mirror_server)) == ("torch_native", "tokendance")


def test_rows_without_a_shift_answer_exactly_as_torch_native(dense_server, mirror_server):
    dense, mirror = plain_answers(dense_server), plain_answers(mirror_server)
    assert [cached for _, _, cached in dense][3] > 0  # a radix hit was exercised
    one_by_one = len(PLAIN)
    assert mirror[:one_by_one] == dense[:one_by_one]  # SGLang's own attention: ids, prefix hits, logprobs bit for bit
    # two requests sent at once may share a forward or not (the scheduler's timing), which moves
    # CPU matmuls' rounding: the same ids and prefix hits, logprobs to float tolerance
    for (ids, logprobs, cached), (want_ids, want_logprobs, want_cached) in zip(mirror[one_by_one:], dense[one_by_one:]):
        assert (ids, cached) == (want_ids, want_cached)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_mirror_reuse_answers_as_dense_reuse(dense_server, mirror_server):
    outs = []
    for url in (dense_server, mirror_server):
        requests.post(url + "/flush_cache", timeout=60)
        with_logprobs(url, AUTHOR, "round", 2)  # caches both blocks in Mira's context
        outs.append(with_logprobs(url, READER, "round"))
        assert_no_leak(url)
    dense, mirror = outs
    info = mirror["meta_info"]["tokendance"]
    assert info["segment_hits"] == 2 and info["reused_tokens"] > 0 and info["recomputed_tokens"] > 0
    assert info["planned_tokens"] == info["reused_tokens"] + info["recomputed_tokens"]  # chosen once, in chunks
    assert {k: info[k] for k in ("reused_tokens", "recomputed_tokens", "planned_tokens")} == \
        {k: dense["meta_info"]["tokendance"][k] for k in ("reused_tokens", "recomputed_tokens", "planned_tokens")}
    assert mirror["output_ids"] == dense["output_ids"]
    assert output_logprobs(mirror) == pytest.approx(output_logprobs(dense), abs=1e-4)
    assert info["within_threshold_tokens"] == 0 and info["mirror_diff_tokens"] == info["recomputed_tokens"]


def test_a_diff_threshold_no_recomputed_token_passes_keeps_no_diff(tiny_llama):
    """--tokendance-diff-threshold large enough for every recomputed token: each reads its
    Master after the forward (no own slot: the Mirror diff is empty), counted as within the
    threshold; the server keeps serving and leaks nothing."""
    with ServerProcess(["--model-path", tiny_llama, *CHUNK, "--tokendance-storage", "mirror",
                        "--tokendance-diff-threshold", "1e9"]) as server:
        with_logprobs(server.url, AUTHOR, "round", 2)
        blended = with_logprobs(server.url, READER, "round")
        assert_no_leak(server.url)
        again = with_logprobs(server.url, READER, "round")  # its finished row is kept: read again as it was
        assert again["meta_info"]["tokendance"]["agent_prefix_tokens"] == again["meta_info"]["prompt_tokens"] - 1
        assert again["output_ids"] == blended["output_ids"]
    info = blended["meta_info"]["tokendance"]
    assert info["segment_hits"] == 2 and info["recomputed_tokens"] > 0
    assert info["within_threshold_tokens"] == info["recomputed_tokens"] and info["mirror_diff_tokens"] == 0


def test_mirror_ratio_one_equals_a_full_prefill(tiny_llama):
    with ServerProcess(["--model-path", tiny_llama, *CHUNK, "--tokendance-storage", "mirror",
                        "--tokendance-recompute-ratio", "1.0", "--no-tokendance-cost-check"]) as server:
        reference = with_logprobs(server.url, READER, "reference")  # nothing cached: the backend's prefill
        with_logprobs(server.url, AUTHOR, "round", 2)
        blended = with_logprobs(server.url, READER, "round")
        assert_no_leak(server.url)
    info = blended["meta_info"]["tokendance"]
    assert info["segment_hits"] == 2 and info["reused_tokens"] == 0 and info["recomputed_tokens"] > 0
    assert blended["output_ids"] == reference["output_ids"]
    assert output_logprobs(blended) == pytest.approx(output_logprobs(reference), abs=2e-3)
