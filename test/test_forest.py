"""The segment-hash forest (radix-cache backend "tokendance") inside a real server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import SMALL_POOL, emptied, forest_stats, generate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow

BLOCKS = [
    "Tom: The river flooded the old mill last night, so the north road is closed until Friday.",
    "Ada: The council will vote on the new market hall tomorrow at noon in the town square.",
    "Lin: My bakery will sell rye bread at half price on Sunday to celebrate the harvest fair.",
]
HISTORIES = ["You are Mira, the baker.", "You are Oskar, the carpenter who lives by the river."]

# Prompts whose private prefixes overlap, to compare radix hits with stock SGLang.
PREFIX_PROMPTS = [
    "The history of the town of Oakvale begins with a mill",
    "The history of the town of Oakvale begins with a bridge",
    "The history of the town of Oakvale",
    "A different story about a sailor",
    "The history of the town of Oakvale begins with a mill and a river",
]


def used_tokens(url: str) -> int:
    return requests.get(url + "/v1/loads?include=core", timeout=60).json()["loads"][0]["num_used_tokens"]


def run_prefix_prompts(url: str) -> list[tuple[list[int], int]]:
    outs = []
    for prompt in PREFIX_PROMPTS:
        out = generate(url, prompt, 8)
        outs.append((out["output_ids"], out["meta_info"]["cached_tokens"]))
    return outs


@pytest.fixture(scope="module")
def stock_prefix_results(stock_server_url):
    return run_prefix_prompts(emptied(stock_server_url))


@pytest.fixture(scope="module")
def server(smollm2_path):
    """Plain reuse (recompute ratio 0): the forest's own path; test_blend_server covers r > 0. No
    inferred rounds: prompts sent together are one batch (test_rounds_server covers rounds)."""
    with ServerProcess(["--tokendance-recompute-ratio", "0", "--tokendance-storage", "dense",
                        "--tokendance-round-min-shared", "0"]) as proc:
        yield proc.url


def test_forest_is_the_default_radix_cache(server):
    info = requests.get(server + "/server_info", timeout=60).json()
    assert info["radix_cache_backend"] == "tokendance"


def test_private_prefixes_hit_like_stock_sglang(server, stock_prefix_results):
    assert run_prefix_prompts(emptied(server)) == stock_prefix_results  # both from an empty cache


def test_segments_are_cached_once_per_content(server):
    requests.post(server + "/flush_cache", timeout=60)
    before = forest_stats(server)  # the counters are cumulative; the nodes are not
    # One batch: both agents compute the blocks in the same prefill, each in its own context.
    generate(server, [SEP.join([history, *BLOCKS, " Reply:"]) for history in HISTORIES], 2)
    stats = forest_stats(server)
    assert stats["segment_nodes"] == 3 and stats["segments_inserted"] - before["segments_inserted"] == 3
    # the second agent's copies are only counted
    assert stats["segment_duplicates"] - before["segment_duplicates"] == 3
    out = generate(server, SEP.join(["Short.", BLOCKS[2], BLOCKS[0], " Reply:"]), 2)
    info = out["meta_info"]["tokendance"]
    assert len({s["hash"] for s in info["segments"]}) == 2 and info["segment_hits"] == 2
    assert forest_stats(server)["segment_nodes"] == 3


def test_flush_frees_every_slot(server):
    requests.post(server + "/flush_cache", timeout=60)
    start = used_tokens(server)
    for i, history in enumerate(HISTORIES * 2):
        generate(server, SEP.join([f"{history} Day {i}.", *BLOCKS[i % 2:], " Reply:"]), 4)
    assert forest_stats(server)["segment_tokens"] > 0
    assert requests.post(server + "/flush_cache", timeout=60).status_code == 200
    assert forest_stats(server)["segment_nodes"] == 0
    assert used_tokens(server) == start


def distinct_blocks_prompt(i: int) -> str:
    """Agent i's prompt: three ~70-token blocks that no other i shares."""
    words = "harvest mill river bakery market council bridge square lantern orchard".split()
    blocks = [" ".join(words[(i + j + k) % len(words)] for k in range(60)) + f" ({i}.{j})" for j in range(3)]
    return SEP.join([f"Agent {i} history.", *blocks, " Reply:"])


def test_small_kv_budget_evicts_and_every_request_finishes(small_pool_server_url):
    small = emptied(small_pool_server_url)
    evicted_before = forest_stats(small)["segments_evicted"]  # a counter over the server's life
    for wave in range(2):  # a wave of concurrent requests well past the budget, twice
        with ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda i: generate(small, distinct_blocks_prompt(i), 16),
                                 range(wave * 6, wave * 6 + 6)))
        assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
        assert all(len(o["output_ids"]) >= 1 for o in outs)
    stats = forest_stats(small)
    assert stats["segments_evicted"] > evicted_before
    assert stats["segment_only_tokens"] + stats["tree_tokens"] <= SMALL_POOL  # each slot once


def test_segment_copy_stores_unrotated_k_and_same_v():
    from types import SimpleNamespace

    import torch

    from sglang_tokendance.core.rope import RopeSpec, rotate
    from sglang_tokendance.srt.kv_copy import PoolKeys, copy_kv

    spec = RopeSpec(head_dim=8, rotary_dim=8, base=10000.0)
    raw_k = torch.randn(2, 5, 3, 8)  # layers, tokens, heads, dim
    values = torch.randn(2, 5, 3, 8)
    k_buffers = [torch.zeros(20, 3, 8) for _ in range(2)]
    v_buffers = [torch.zeros(20, 3, 8) for _ in range(2)]
    src = torch.tensor([3, 4, 5, 6, 7])
    positions = torch.arange(11, 16)  # the segment sat at prompt positions 11..15
    for layer in range(2):
        k_buffers[layer][src] = rotate(raw_k[layer], positions, spec)
        v_buffers[layer][src] = values[layer]
    pool = SimpleNamespace(start_layer=0, layer_num=2, get_key_buffer=k_buffers.__getitem__,
                           get_value_buffer=v_buffers.__getitem__)
    dst = torch.tensor([12, 13, 14, 15, 16])
    copy_kv(pool, src, dst, positions, PoolKeys(spec).unrotated)
    for layer in range(2):
        assert torch.allclose(k_buffers[layer][dst], raw_k[layer], atol=1e-5)
        assert torch.equal(v_buffers[layer][dst], values[layer])


H_MIRA = "You are Mira, the baker of Oakvale. Yesterday you sold rye bread to the mayor."


def generate_salted(url: str, text: str, salt: str, max_new_tokens: int = 16) -> dict:
    body = {"text": text, "cache_salt": salt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def test_segments_never_cross_cache_salts(server):
    """A cache_salt is SGLang's tenant namespace: segments are isolated like its tree."""
    requests.post(server + "/flush_cache", timeout=60)
    generate_salted(server, SEP.join([H_MIRA, BLOCKS[0], BLOCKS[1], " Mira says:"]), "tenant-a", 2)
    reader = SEP.join(["You are Oskar.", BLOCKS[1], BLOCKS[0], " Oskar says:"])
    other = generate_salted(server, reader, "tenant-b", 2)["meta_info"]["tokendance"]
    assert other["segment_hits"] == 0 and other["segment_misses"] == 2 and other["reused_tokens"] == 0
    plain = generate(server, reader.replace("Oskar", "Pia"), 2)["meta_info"]["tokendance"]  # no salt either
    assert plain["segment_hits"] == 0
    same = generate_salted(server, reader.replace("Oskar", "Ilse"), "tenant-a", 2)["meta_info"]["tokendance"]
    assert same["segment_hits"] == 2 and same["reused_tokens"] > 0


def test_reuse_at_another_offset_runs_and_keeps_approximate_kv_out_of_the_tree(server):
    requests.post(server + "/flush_cache", timeout=60)
    generate(server, SEP.join([H_MIRA, BLOCKS[0], BLOCKS[1], " Mira says:"]), 2)
    other = SEP.join(["You are Oskar.", BLOCKS[1], BLOCKS[0], " Oskar says:"])
    out = generate(server, other, 8)
    info = out["meta_info"]["tokendance"]
    assert info["reused_tokens"] > 0 and info["segment_hits"] == 2
    first_reused = info["segments"][0]["start"]
    again = generate(server, other, 8)
    # Only the exact part before the first reused token was published to the radix tree; the
    # blocks, met again after the same tokens, are computed exactly this time (core/recurrence).
    assert again["meta_info"]["cached_tokens"] <= first_reused
    assert again["meta_info"]["tokendance"]["reused_tokens"] == 0
    third = generate(server, other, 8)
    assert third["meta_info"]["cached_tokens"] >= info["segments"][-1]["end"]  # now exact in the tree
    assert third["output_ids"] == again["output_ids"]


def test_blocks_recurring_after_the_same_notes_are_computed_exactly_once_then_hit(server):
    """A static briefing after an agent's own notes, round after round: reused approximately
    the first time, computed exactly the second (then published), served exactly from the tree
    from the third on, as stock SGLang serves it from its second."""
    requests.post(server + "/flush_cache", timeout=60)
    generate(server, SEP.join(["You are Oskar.", BLOCKS[0], BLOCKS[1], " Oskar says:"]), 2)  # caches the blocks
    rounds = [generate(server, SEP.join([H_MIRA, BLOCKS[0], BLOCKS[1], f" Round {r}. Mira says:"]), 4)["meta_info"]
              for r in range(3)]
    first, second, third = (meta["tokendance"] for meta in rounds)
    spans = first["segments"]
    block_tokens = sum(span["end"] - span["start"] for span in spans)
    assert first["reused_tokens"] > 0 and first["exact_recurring_tokens"] == 0
    assert second["exact_recurring_tokens"] == block_tokens and second["reused_tokens"] == 0
    assert rounds[1]["cached_tokens"] <= spans[0]["start"]
    assert rounds[2]["cached_tokens"] >= spans[-1]["end"] and third["exact_recurring_tokens"] == 0


def test_batch_mixing_reuse_and_plain_requests(server):
    requests.post(server + "/flush_cache", timeout=60)
    marked = SEP.join([H_MIRA, BLOCKS[2], BLOCKS[0], " Mira says:"])
    generate(server, marked, 2)
    plain = "The capital of France is"
    alone = generate(server, plain, 8)["output_ids"]
    body = {"text": [SEP.join(["You are Oskar.", BLOCKS[0], BLOCKS[2], " Oskar says:"]), plain],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    batch = requests.post(server + "/generate", json=body, timeout=300).json()
    assert batch[0]["meta_info"]["tokendance"]["reused_tokens"] > 0
    assert batch[1]["output_ids"] == alone


def test_chat_with_markers_reuses_cached_blocks(server):
    requests.post(server + "/flush_cache", timeout=60)
    generate(server, SEP.join([H_MIRA, BLOCKS[0], BLOCKS[1], " Mira says:"]), 2)
    content = f"News:{SEP}{BLOCKS[1]}{SEP}{BLOCKS[0]}{SEP}What happened to the mill?"
    r = requests.post(server + "/v1/chat/completions", json={
        "model": "m", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]},
        timeout=300)
    assert r.status_code == 200, r.text
    info = r.json()["metadata"]["tokendance"]
    assert info["segment_hits"] == 2 and info["reused_tokens"] > 0


def test_unmarked_chat_messages_are_segments_another_agents_chat_reuses(server):
    """No markers: each message of an OpenAI chat is a segment, so a second agent whose chat
    holds the same messages after another system message reads them at a shift; a chat whose
    messages are short is SGLang's alone."""
    requests.post(server + "/flush_cache", timeout=60)

    answers = []

    def chat(system: str, turns: list[str], tokens: int = 4) -> dict:
        messages = [{"role": "system", "content": system}] + [
            {"role": "assistant" if t in answers else "user", "content": t} for t in turns]
        r = requests.post(server + "/v1/chat/completions", json={
            "model": "m", "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "messages": messages},
            timeout=300)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
        return r.json()["metadata"]["tokendance"]

    first = chat("You are Mira.", [BLOCKS[0], BLOCKS[1]], tokens=24)
    assert len(first["segments"]) == 2 and first["reused_tokens"] == 0 and first["register_output"]
    second = chat(H_MIRA, [BLOCKS[1], BLOCKS[0]])
    assert len(second["segments"]) == 3  # the long system message is one too
    assert second["segment_hits"] == 2 and second["reused_tokens"] > 0
    quoting = chat("You are Oskar.", [BLOCKS[2], answers[0]])  # the first answer, registered, is a hit
    assert len(quoting["segments"]) == 2 and quoting["segment_hits"] == 1 and quoting["reused_tokens"] > 0
    assert chat("Be brief.", ["Hi there."])["segments"] == []


def test_registered_output_is_reused_as_next_rounds_block(server):
    requests.post(server + "/flush_cache", timeout=60)
    body = {"text": SEP.join([H_MIRA, BLOCKS[0], " Mira says:"]), "tokendance": {"register_output": True},
            "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    first = requests.post(server + "/generate", json=body, timeout=300).json()
    assert forest_stats(server)["segment_nodes"] == 2  # BLOCKS[0] and the output
    reply = first["text"]
    nxt = generate(server, SEP.join(["You are Oskar.", reply, " Oskar replies:"]), 4)
    info = nxt["meta_info"]["tokendance"]
    (span,) = info["segments"]
    length = span["end"] - span["start"]
    assert info["segment_hits"] == 1
    # The output's last token had no KV yet: it is computed fresh (unless an EOS followed it).
    assert info["reused_tokens"] in (length - 1, length)
    plain = generate(server, "The capital of France is", 4)
    assert "reused_tokens" not in plain["meta_info"]["tokendance"]


def test_frontend_gen_registers_its_output(server):
    import sglang as sgl

    import sglang_tokendance.lang  # noqa: F401  (adds sgl.separator, sgl.gen(register_output=...))

    @sgl.function
    def speak(s, register: bool):
        s += H_MIRA + sgl.separator() + BLOCKS[0] + sgl.separator() + " Mira says:"
        s += sgl.gen("answer", max_tokens=24, temperature=0, register_output=register)

    requests.post(server + "/flush_cache", timeout=60)
    backend = sgl.RuntimeEndpoint(server)
    speak.run(register=False, backend=backend).sync()  # run() returns before the program ends
    assert forest_stats(server)["segment_nodes"] == 1  # BLOCKS[0] only
    reply = speak.run(register=True, backend=backend)["answer"]
    assert forest_stats(server)["segment_nodes"] == 2  # and the output
    nxt = generate(server, SEP.join(["You are Oskar.", reply, " Oskar replies:"]), 4)
    assert nxt["meta_info"]["tokendance"]["segment_hits"] == 1


def test_a_growing_conversation_is_computed_exactly_after_its_first_round(server):
    """Each prompt extends the last one and its answer (registered), then a block: the first
    round reuses, every later one is computed exactly, as its blocks come back in the next
    round's prefix; the tree then serves each previous prompt exactly, as stock SGLang's does."""
    requests.post(server + "/flush_cache", timeout=60)
    generate(server, SEP.join(["You are Oskar.", BLOCKS[0], BLOCKS[1], BLOCKS[2], " Oskar says:"]), 2)
    pieces, metas = [H_MIRA, BLOCKS[0], " Mira says:"], []
    for r in range(3):
        body = {"text": SEP.join(pieces), "tokendance": {"register_output": True},
                "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}
        out = requests.post(server + "/generate", json=body, timeout=300).json()
        metas.append(out["meta_info"])
        pieces = [*pieces, out["text"], BLOCKS[1 + r % 2], f" Round {r + 1}. Mira says:"]
    first, *later = (meta["tokendance"] for meta in metas)
    assert first["reused_tokens"] > 0 and first["exact_recurring_tokens"] == 0
    for info in later:
        assert info["reused_tokens"] == info["recomputed_tokens"] == 0 and info["exact_recurring_tokens"] > 0
    assert metas[2]["cached_tokens"] >= metas[1]["prompt_tokens"]
