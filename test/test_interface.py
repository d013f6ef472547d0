"""The round-aware interface end to end: separators, `segments`, chat, frontend, bad input."""

from __future__ import annotations

import json

import pytest
import requests

from conftest import generate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

HISTORY = "You are Mira, the baker of Oakvale. Yesterday you sold rye bread to the mayor."
BLOCK_A = "Tom: The river flooded the old mill last night, so the north road is closed until Friday."
BLOCK_B = "Ada: The council will vote on the new market hall tomorrow at noon in the town square."
QUESTION = " Mira, what do you say to the others?"
MAX_SEGMENTS = 6


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The interface alone (--disable-tokendance keeps it, minus KV reuse): every output here
    must equal a full prefill. Reuse is tested in test_forest.py. A tiny random Llama with
    SmolLM2's tokenizer and chat template: the model does not matter here."""
    with ServerProcess(["--model-path", tiny_llama, "--disable-tokendance", "--tokendance-max-segments",
                        str(MAX_SEGMENTS), "--context-length", "2048"]) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def pieces_ids(tokenizer, pieces, specials=True):
    ids = tokenizer.encode(pieces[0], add_special_tokens=specials)
    for piece in pieces[1:]:
        ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def post(url, path, body):
    return requests.post(url + path, json=body, timeout=300)


def test_markers_are_zero_width_and_boundaries_round_trip(server, tokenizer):
    pieces = [HISTORY, BLOCK_A, BLOCK_B, QUESTION]
    out = generate(server, SEP.join(pieces), 12)
    ids = pieces_ids(tokenizer, pieces)
    assert out["output_ids"] == generate(server, None, 12, input_ids=ids)["output_ids"]
    assert SEP not in out["text"]
    segments = out["meta_info"]["tokendance"]["segments"]
    a_start = len(pieces_ids(tokenizer, pieces[:1]))
    a_end = len(pieces_ids(tokenizer, pieces[:2]))
    b_end = len(pieces_ids(tokenizer, pieces[:3]))
    assert [(s["start"], s["end"]) for s in segments] == [(a_start, a_end), (a_end, b_end)]


def test_same_block_elsewhere_has_same_hash(server):
    one = generate(server, SEP.join([HISTORY, BLOCK_A, BLOCK_B, QUESTION]), 1)
    two = generate(server, SEP.join(["Short.", BLOCK_B, BLOCK_A, QUESTION]), 1)
    (a1, b1), (b2, a2) = one["meta_info"]["tokendance"]["segments"], two["meta_info"]["tokendance"]["segments"]
    assert a1["hash"] == a2["hash"] and b1["hash"] == b2["hash"] and a1["hash"] != b1["hash"]
    assert a1["start"] != a2["start"]


def test_segments_field_equals_markers_for_strings_ids_and_batches(server, tokenizer):
    pieces = [HISTORY, BLOCK_A, BLOCK_B, QUESTION]
    marked = generate(server, SEP.join(pieces), 8)
    greedy = {"max_new_tokens": 8, "temperature": 0}
    as_strings = post(server, "/generate", {"segments": pieces, "sampling_params": greedy}).json()
    mixed = [HISTORY, tokenizer.encode(BLOCK_A, add_special_tokens=False), BLOCK_B, QUESTION]
    as_ids = post(server, "/generate", {"segments": mixed, "sampling_params": greedy}).json()
    batch = post(server, "/generate", {"segments": [pieces, ["Short.", BLOCK_B, BLOCK_A, QUESTION]],
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    for other in (as_strings, as_ids, batch[0]):
        assert other["output_ids"] == marked["output_ids"]
        assert other["meta_info"]["tokendance"] == marked["meta_info"]["tokendance"]
    assert batch[1]["meta_info"]["tokendance"]["segments"][0]["hash"] == \
        marked["meta_info"]["tokendance"]["segments"][1]["hash"]


def test_batched_text_mixing_marked_and_plain_prompts(server):
    plain = "The capital of France is"
    batch = generate(server, [SEP.join([HISTORY, BLOCK_A, QUESTION]), plain], 8)
    assert batch[1]["output_ids"] == generate(server, plain, 8)["output_ids"]
    assert batch[1]["meta_info"]["tokendance"] == {"segments": []}
    assert len(batch[0]["meta_info"]["tokendance"]["segments"]) == 1


def test_a_batch_of_token_ids_keeps_each_prompts_sampling_params_beside_options(server):
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (2, 5)]
    for carrier in ({"tokendance": {"round": "ids", "round_size": 2}},
                    {"custom_labels": {"tokendance": json.dumps({"round": "ids2", "round_size": 2})}}):
        r = post(server, "/generate", {"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]], "sampling_params": params, **carrier})
        assert r.status_code == 200, r.text
        assert [len(o["output_ids"]) for o in r.json()] == [2, 5]
        assert all(o["meta_info"]["tokendance"]["round"] == carrier_round(carrier) for o in r.json())


def carrier_round(carrier: dict) -> str:
    options = carrier.get("tokendance") or json.loads(carrier["custom_labels"]["tokendance"])
    return options["round"]


def test_plain_prompt_is_untouched_and_client_cannot_forge_segments(server):
    forged = json.dumps({"segments": [{"start": 0, "end": 3, "hash": "f" * 32}]})
    out = generate(server, "The capital of France is", 8, **{})
    body = {"text": "The capital of France is", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "custom_params": {"tokendance": forged}}}
    forged_out = post(server, "/generate", body).json()
    assert forged_out["meta_info"]["tokendance"] == {"segments": []}
    assert forged_out["output_ids"] == out["output_ids"]


def test_completions_accept_markers(server):
    prompt = SEP.join([HISTORY, BLOCK_A, QUESTION])
    r = post(server, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == generate(server, prompt, 8)["text"]
    assert r.json()["metadata"]["tokendance"] == generate(server, prompt, 1)["meta_info"]["tokendance"]


def test_chat_markers_make_segments_and_template_text_stays_private(server, tokenizer):
    content = f"News:{SEP}{BLOCK_A}{SEP}{BLOCK_B}{SEP}What happened to the mill?"
    messages = [{"role": "system", "content": HISTORY}, {"role": "user", "content": content}]
    r = post(server, "/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = rendered.split(SEP)
    assert len(pieces) == 4 and pieces[0].startswith("<|im_start|>system")
    expected = generate(server, None, 16, input_ids=pieces_ids(tokenizer, pieces, specials=False))
    assert answer == expected["text"]
    assert SEP not in answer
    spans = r.json()["metadata"]["tokendance"]["segments"]
    assert [(x["start"], x["end"]) for x in spans] == [
        (len(pieces_ids(tokenizer, pieces[:i], specials=False)),
         len(pieces_ids(tokenizer, pieces[:i + 1], specials=False)))
        for i in (1, 2)]


def test_frontend_program_equals_raw_api(server):
    import sglang as sgl

    import sglang_tokendance.lang  # noqa: F401  (adds sgl.separator)

    @sgl.function
    def react(s, history, blocks):
        s += history
        for block in blocks:
            s += sgl.separator() + block
        s += sgl.separator() + QUESTION
        s += sgl.gen("answer", max_tokens=12, temperature=0)

    backend = sgl.RuntimeEndpoint(server)
    raw = generate(server, SEP.join([HISTORY, BLOCK_A, BLOCK_B, QUESTION]), 12)
    state = react.run(history=HISTORY, blocks=[BLOCK_A, BLOCK_B], backend=backend)
    assert state["answer"] == raw["text"]
    assert state.get_meta_info("answer")["tokendance"] == raw["meta_info"]["tokendance"]

    states = react.run_batch([{"history": HISTORY, "blocks": [BLOCK_A, BLOCK_B]}] * 2, backend=backend)
    assert [s["answer"] for s in states] == [raw["text"]] * 2

    streamed = react.run(history=HISTORY, blocks=[BLOCK_A, BLOCK_B], backend=backend, stream=True)
    assert "".join(streamed.text_iter("answer")) == raw["text"]

    @sgl.function
    def forked(s):
        s += HISTORY + sgl.separator() + BLOCK_A + sgl.separator()
        forks = s.fork(2)
        for f in forks:
            f += QUESTION
            f += sgl.gen("answer", max_tokens=6, temperature=0)
        s += forks[0]["answer"]

    fork_state = forked.run(backend=backend)
    assert fork_state.text().endswith(generate(server, SEP.join([HISTORY, BLOCK_A, QUESTION]), 6)["text"])


BAD_REQUESTS = [
    ({"text": f"a{SEP}{SEP}b"}, "empty"),
    ({"text": f"a{SEP}{BLOCK_A}<|tokendance_sep b"}, "malformed"),
    ({"text": f"<|im_{SEP}start|>user"}, "special token"),
    ({"text": SEP.join(["a"] + [BLOCK_A] * (MAX_SEGMENTS + 1) + ["b"])}, "max-segments"),
    ({"text": "word " * 2100}, "context length"),
    ({"segments": ["a", {"x": 1}, "b"]}, "string or a list of token ids"),
    ({"segments": ["a", [1, 2, 10**9], "b"]}, "outside the vocabulary"),
    ({"segments": ["a", BLOCK_A], "input_ids": [1, 2, 3]}, "cannot be combined"),
    ({"text": f"a{SEP}{BLOCK_A}", "input_ids": [1, 2, 3]}, "cannot be combined"),
    ({"segments": []}, "non-empty list"),
    ({"text": "a", "tokendance": {"register": True}}, "register_output"),
    ({"text": "a", "tokendance": "yes"}, "register_output"),
    ({"text": f"a{SEP}{SEP}b", "stream": True}, "empty"),
    ({"text": "a", "custom_labels": {"tokendance": "{round"}}, "JSON text"),
    ({"text": "a", "custom_labels": {"tokendance": '{"register": true}'}}, "register_output"),
    ({"text": "a", "tokendance": {"round": "r"}, "custom_labels": {"tokendance": '{"round": "r"}'}}, "given twice"),
    ({"text": "a", "custom_labels": {"tokendance": '{"round_size": 2}'}, "stream": True}, "needs"),
    ({"text": SEP.join(["x", "y"]), "sampling_params": {"custom_params": "z"}}, "custom_params` must be an object"),
    ({"text": "a", "tokendance": {"round": "r"}, "sampling_params": {"custom_params": [1]}, "stream": True},
     "custom_params` must be an object"),
    ({"text": "a", "tokendance": {"round": "r", "round_size": 2}, "sampling_params": {"n": 2}}, "need n = 1"),
]


def test_options_ride_in_the_string_maps_a_router_keeps(server):
    """sglang-router drops a top-level `tokendance` on /generate and chat: the same object as JSON
    text in `custom_labels` (/generate) or `metadata` (OpenAI) is read the same way."""
    options = {"round": "r9", "round_size": 1}
    direct = post(server, "/generate", {"text": "Hello", "tokendance": options,
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    labelled = post(server, "/generate", {"text": "Hello", "custom_labels": {"tokendance": json.dumps(options)},
                                          "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    assert direct["meta_info"]["tokendance"]["round"] == labelled["meta_info"]["tokendance"]["round"] == "r9"
    assert labelled["output_ids"] == direct["output_ids"]
    chat = post(server, "/v1/chat/completions", {"model": "m", "max_tokens": 4, "temperature": 0,
                                                 "metadata": {"tokendance": json.dumps(options)},
                                                 "messages": [{"role": "user", "content": "Hello"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["metadata"]["tokendance"]["round_size"] == 1


def test_bad_requests_get_400_and_good_ones_are_unchanged(server):
    good = [SEP.join([HISTORY, BLOCK_A, QUESTION]), "The capital of France is"]
    before = [generate(server, g, 10)["output_ids"] for g in good]
    for body, message in BAD_REQUESTS:
        r = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                   **body.get("sampling_params", {})}})
        assert r.status_code == 400, (body, r.text)
        assert message in r.text, (body, r.text)
        assert generate(server, good[0], 10)["output_ids"] == before[0]
    for body in ({"text": "word " * 2100}, {"input_ids": []}, {"input_ids": [5, 10 ** 7]}):  # SGLang's prompt errors
        streamed = post(server, "/generate", {**body, "stream": True, "sampling_params": {"max_new_tokens": 4}})
        assert streamed.status_code == 200 and '"error"' in streamed.text, (body, streamed.text)
    bad_chat = post(server, "/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": f"x{SEP}{SEP}y"}]})
    assert bad_chat.status_code == 400 and "empty" in bad_chat.text
    assert [generate(server, g, 10)["output_ids"] for g in good] == before
    assert requests.get(server + "/health", timeout=30).status_code == 200
