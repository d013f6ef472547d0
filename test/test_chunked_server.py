"""Reuse under SGLang's chunked prefill (--chunked-prefill-size 64, 600+ token prompts; a tiny
random Llama where the model does not matter, SmolLM2 for ratio 1): every chunk reuses, the
whole prompt's selection is made once (planned selection), counts are summed over chunks, no
approximate token enters the radix tree, ratio 1 equals SGLang's own chunked prefill, and
per-request state survives aborts and reused request ids."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import FULL_RATIO_CHUNK, assert_no_leak, emptied, generate, stream_chunks as stream_lines
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.bench.server_process import ServerProcess
from test_metrics import tokendance_metrics

pytestmark = pytest.mark.slow

CHUNK = ["--chunked-prefill-size", str(FULL_RATIO_CHUNK)]  # the shared ratio-1 server's too
WORDS = ("harvest mill river bakery market council bridge square lantern orchard meadow forge "
         "granary well chapel tavern").split()


def block(i: int, words: int = 140) -> str:
    return f"Agent {i} reports: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + "."


BLOCKS = [block(i) for i in range(4)]
AUTHOR = SEP.join(["You are Mira, the baker of Oakvale. " * 6, *BLOCKS, " Mira says:"])
READER = SEP.join(["You are Oskar, the carpenter, who lives by the river. " * 3, *BLOCKS[::-1], " Oskar says:"])
# the same reader with chunks after its last block that read no Master
LONG_TAIL_READER = SEP.join(["You are Oskar, the carpenter, who lives by the river. " * 3, *BLOCKS[::-1],
                             " Oskar thinks about the orchard, the meadow and the forge before he answers." * 6
                             + " Oskar says:"])


def post(url: str, text: str, salt: str | None = None, max_new_tokens: int = 8, **extra) -> dict:
    return generate(url, text, max_new_tokens, **extra, **({} if salt is None else {"cache_salt": salt}))


@pytest.fixture(scope="module")
def default_server(tiny_llama):
    # the reader is sent again on purpose, to reuse again (not to be computed as a recurrence, nor
    # read from its kept row: --no-tokendance-keep-rows under the CPU's mirror storage); a
    # probe of 3 of the tiny model's layers, where the default's (all but 2 of them) run twice by
    # planned selection would cost more than SGLang's forward (core/cost plan_pays)
    with ServerProcess(["--model-path", tiny_llama, *CHUNK, "--enable-metrics", "--no-tokendance-exact-recurrence",
                        "--no-tokendance-keep-rows", "--tokendance-check-layer", "2"]) as proc:
        yield proc.url


def span_tokens(info: dict) -> int:
    return sum(s["end"] - s["start"] for s in info["segments"])


def test_every_chunk_reuses_and_counts_are_summed(default_server):
    url = default_server
    requests.post(url + "/flush_cache", timeout=60)
    post(url, AUTHOR, max_new_tokens=2)
    before = tokendance_metrics(url)
    out = post(url, READER)
    info, meta = out["meta_info"]["tokendance"], out["meta_info"]
    delta = {k: v - before[k] for k, v in tokendance_metrics(url).items()}
    assert meta["prompt_tokens"] >= 600 and len(info["segments"]) == 4
    assert info["segments"][0]["start"] < 64 and info["segments"][-1]["end"] > 9 * 64  # spans over ~10 chunks
    assert info["segment_hits"] == 4 and info["segment_misses"] == 0  # a straddling span counts once
    assert info["reused_tokens"] + info["recomputed_tokens"] == span_tokens(info)  # every chunk reused
    # planned selection: one choice over the whole prompt at its first chunk (the default ratio of
    # all its reused tokens, exactly), each chunk recomputing its part
    assert info["planned_tokens"] == span_tokens(info)
    assert info["recomputed_tokens"] == round(0.3 * span_tokens(info))
    assert info["computed_tokens"] == meta["prompt_tokens"] - meta["cached_tokens"] - info["reused_tokens"]
    assert delta["sglang:tokendance_segment_hits_total"] == 4
    assert delta["sglang:tokendance_reused_tokens_total"] == info["reused_tokens"]
    assert delta["sglang:tokendance_recomputed_tokens_total"] == info["recomputed_tokens"]


def test_no_approximate_token_enters_the_tree(default_server):
    """A request that reuses nothing (input-token logprobs take SGLang's path) after reusing
    ones hits only exact KV in the tree: its answer is the one it gets on a clean cache."""
    url = default_server
    requests.post(url + "/flush_cache", timeout=60)
    clean = post(url, READER, "round", return_logprob=True, logprob_start_len=0)  # nothing cached yet
    requests.post(url + "/flush_cache", timeout=60)
    post(url, AUTHOR, "round", max_new_tokens=2)
    reused = post(url, READER, "round")["meta_info"]
    assert reused["tokendance"]["reused_tokens"] > 0
    first_reused = reused["tokendance"]["segments"][0]["start"]
    again = post(url, READER, "round")["meta_info"]
    assert again["cached_tokens"] <= first_reused
    plain = post(url, READER, "round", return_logprob=True, logprob_start_len=0)
    assert "reused_tokens" not in plain["meta_info"]["tokendance"]
    assert plain["meta_info"]["cached_tokens"] <= first_reused
    assert plain["output_ids"] == clean["output_ids"]


# SGLang aborts a streamed request's rid 2 s after its stream ends, if the rid is live then
# (TokenizerManager.create_abort_task): a client reusing the rid sooner can see its new
# request aborted by stock SGLang. The test reuses rids only after that.
RID_REUSE_DELAY_S = 3.0


def test_reused_request_ids_and_aborts_leave_no_state_behind(default_server):
    url = default_server
    requests.post(url + "/flush_cache", timeout=60)
    post(url, AUTHOR, max_new_tokens=2)
    body = {"text": READER, "rid": "agent-7", "stream": True,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as first:
        lines = stream_lines(first)
        next(lines)  # the request is running: its prefill is done
        duplicate = requests.post(url + "/generate", json={**body, "stream": False}, timeout=600)
        assert duplicate.status_code == 400 and "Duplicate request ID" in duplicate.text  # SGLang's rule
        *_, last = lines
    assert last["meta_info"]["tokendance"]["segment_hits"] == 4 and len(last["output_ids"]) == 48
    time.sleep(RID_REUSE_DELAY_S)

    # aborted mid-decode, and right after submission (mid-prefill or before it ran)
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as aborted:
        next(stream_lines(aborted))
        requests.post(url + "/abort_request", json={"rid": "agent-7"}, timeout=60)
        list(stream_lines(aborted))
    time.sleep(RID_REUSE_DELAY_S)
    sent = threading.Thread(target=lambda: requests.post(url + "/generate", json={**body, "stream": False},
                                                         timeout=600))
    sent.start()
    requests.post(url + "/abort_request", json={"rid": "agent-7"}, timeout=60)
    sent.join()
    assert_no_leak(url)  # the tokenizer answers an abort before the scheduler lets go: wait for it

    again = post(url, READER, rid="agent-7")["meta_info"]["tokendance"]
    fresh = post(url, READER, rid="agent-8")
    assert again.get("segment_hits") == 4 and again == fresh["meta_info"]["tokendance"], again


@pytest.fixture(scope="module")
def full_ratio_server(full_ratio_server_url):
    return emptied(full_ratio_server_url)


def test_ratio_one_in_chunks_equals_sglangs_own_chunked_prefill(full_ratio_server):
    url = full_ratio_server
    reference = post(url, READER, "reference", max_new_tokens=12, return_logprob=True)  # SGLang's own path
    post(url, AUTHOR, "round", max_new_tokens=2)
    blended = post(url, READER, "round", max_new_tokens=12, return_logprob=True)
    info = blended["meta_info"]["tokendance"]
    assert info["segment_hits"] == 4 and info["reused_tokens"] == 0
    assert info["recomputed_tokens"] == span_tokens(info)
    assert blended["output_ids"] == reference["output_ids"]
    logprobs = lambda out: [e[0] for e in out["meta_info"]["output_token_logprobs"]]  # noqa: E731
    assert logprobs(blended) == pytest.approx(logprobs(reference), abs=2e-3)


@pytest.fixture(scope="module")
def chunked_and_whole(tiny_llama):
    """Two servers that differ only in chunking; blending every matched block (no cost check) so
    both read the same Masters."""
    argv = ["--model-path", tiny_llama, "--no-tokendance-exact-recurrence", "--tokendance-check-layer", "2",
            "--no-tokendance-cost-check"]
    with ServerProcess([*argv, *CHUNK]) as chunked, ServerProcess(argv) as whole:
        yield chunked.url, whole.url


def test_planned_chunks_answer_as_the_unchunked_prefill(chunked_and_whole):
    """The chunks resume the planning probe's states (core/blend RequestRow.resumed): the same
    tokens recomputed and the same answer as one forward of the whole prompt, to float rounding,
    the chunks that read no Master included (SGLang's own forward would compute them again from
    the first layer over the approximate KV)."""
    outs = []
    for url in chunked_and_whole:
        requests.post(url + "/flush_cache", timeout=60)
        post(url, AUTHOR, max_new_tokens=2)
        outs.append(post(url, LONG_TAIL_READER, max_new_tokens=12, return_logprob=True))
    chunked, whole = ({k: out["meta_info"]["tokendance"][k] for k in ("reused_tokens", "recomputed_tokens")}
                      for out in outs)
    assert chunked == whole and whole["reused_tokens"] > 0
    assert outs[0]["meta_info"]["tokendance"]["planned_tokens"] > 0
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    logprobs = lambda out: [e[0] for e in out["meta_info"]["output_token_logprobs"]]  # noqa: E731
    assert logprobs(outs[0]) == pytest.approx(logprobs(outs[1]), abs=1e-3)
