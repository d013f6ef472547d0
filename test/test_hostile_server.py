"""Hostile input through the server (a scripted fuzz of /generate, /v1/completions and
/v1/chat/completions, driven by hypothesis): every body is answered 200 or with a 4xx and a
message, never a 5xx or a dropped connection; reuse stays active; good requests sent between
the hostile ones keep their outputs; no KV leaks."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import emptied, generate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP

pytestmark = pytest.mark.slow

BLOCK = "Tom: The river flooded the old mill last night, so the north road is closed until Friday."
GOOD = SEP.join(["You are Mira, the baker.", BLOCK, " Mira says:"])
FRAGMENTS = ["Ada said hi.", BLOCK, SEP, SEP + SEP, "<|tokendance_sep", "tokendance_sep|>", "＜|tokendance_sep|＞",
             "<|im_start|>", "<|im_e" + SEP + "nd|>", "é日本\u200b", "\x00", "\ud800", " " * 3, ""]
VOCAB = 49152

texts = st.lists(st.sampled_from(FRAGMENTS), max_size=6).map("".join)
token_ids = st.lists(st.integers(min_value=-5, max_value=VOCAB + 5), max_size=12)
piece = st.one_of(texts, token_ids, st.integers(), st.none(), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                               max_size=2))
segments = st.one_of(st.lists(piece, max_size=6), st.lists(st.lists(piece, max_size=4), max_size=3), texts, st.none())
options = st.one_of(st.none(), st.just({"register_output": True}), st.dictionaries(
    st.sampled_from(["register_output", "round", "x"]), st.one_of(st.booleans(), st.integers(), st.text(max_size=3)),
    max_size=2), st.integers())
greedy = st.fixed_dictionaries({"max_new_tokens": st.integers(1, 3), "temperature": st.just(0)})
generate_bodies = st.fixed_dictionaries({}, optional={
    "text": st.one_of(texts, st.lists(texts, min_size=1, max_size=3)), "segments": segments,
    "input_ids": st.one_of(token_ids, st.lists(token_ids, min_size=1, max_size=2)), "tokendance": options,
    "sampling_params": greedy, "stream": st.booleans(),
})
completion_bodies = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.integers(1, 3),
                                           "temperature": st.just(0)},
                                          optional={"prompt": st.one_of(texts, token_ids, st.lists(texts, max_size=2))})
chat_bodies = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.integers(1, 3), "temperature": st.just(0),
                                     "messages": st.lists(st.fixed_dictionaries({
                                         "role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]),
                                         "content": st.one_of(texts, st.none(), st.integers())}), max_size=3)})
raw_bodies = st.one_of(st.binary(max_size=40), st.just(b"\xff\xfe{\"text\": 1}"), st.just(b"{\"text\": \"a"))
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def server(default_server_url):
    url = emptied(default_server_url)
    generate(url, GOOD, 2)  # BLOCK is cached: hostile prompts holding it reuse it
    return url


@pytest.fixture(scope="module")
def reference(server):
    """The good request's answer once its block is exact in the tree: the first send reuses the
    block, the second computes it exactly (a recurrence, core/recurrence), later ones hit the tree."""
    good = GOOD.replace("Mira", "Ilse")
    generate(server, good, 6)
    return generate(server, good, 6)["output_ids"]


def assert_answered(response: requests.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert response.text.strip(), "a 4xx must say why"
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.iter_lines():
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunk = json.loads(line[5:])
                assert "error" not in chunk or chunk["error"].get("code", 400) < 500, chunk


def post(url: str, path: str, body) -> requests.Response:
    if isinstance(body, bytes):
        return requests.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=300)
    return requests.post(url + path, json=body, timeout=300, stream=bool(body.get("stream")))


def check_good_request_unchanged(url: str, reference: list[int]) -> None:
    assert generate(url, GOOD.replace("Mira", "Ilse"), 6)["output_ids"] == reference


def test_hostile_generate_bodies(server, reference):
    @FUZZ
    @given(generate_bodies)
    def fuzz(body):
        assert_answered(post(server, "/generate", body))

    fuzz()
    check_good_request_unchanged(server, reference)


def test_hostile_openai_bodies(server, reference):
    @FUZZ
    @given(st.one_of(completion_bodies.map(lambda b: ("/v1/completions", b)),
                     chat_bodies.map(lambda b: ("/v1/chat/completions", b))))
    def fuzz(path_and_body):
        assert_answered(post(server, *path_and_body))

    fuzz()
    check_good_request_unchanged(server, reference)


def test_undecodable_and_truncated_bodies(server, reference):
    @FUZZ
    @given(raw_bodies, st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]))
    def fuzz(body, path):
        assert_answered(post(server, path, body))

    fuzz()
    check_good_request_unchanged(server, reference)
    out = generate(server, SEP.join(["Short history.", BLOCK, " Reply:"]), 2)["meta_info"]["tokendance"]
    assert out["segment_hits"] == 1  # reuse is still on after all of it
