"""The segment-hash forest (radix-cache backend "tokendance") inside a real server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import generate
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.server_process import ServerProcess

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


def forest_stats(url: str) -> dict:
    info = requests.get(url + "/server_info", timeout=60).json()
    return info["internal_states"][0]["tokendance_forest"]


def used_tokens(url: str) -> int:
    return requests.get(url + "/v1/loads?include=core", timeout=60).json()["loads"][0]["num_used_tokens"]


def run_prefix_prompts(url: str) -> list[tuple[list[int], int]]:
    outs = []
    for prompt in PREFIX_PROMPTS:
        out = generate(url, prompt, 8)
        outs.append((out["output_ids"], out["meta_info"]["cached_tokens"]))
    return outs


@pytest.fixture(scope="module")
def stock_prefix_results(smollm2_path):
    with ServerProcess([], stock=True) as stock:
        return run_prefix_prompts(stock.url)


@pytest.fixture(scope="module")
def server(smollm2_path):
    with ServerProcess([]) as proc:
        yield proc.url


def test_forest_is_the_default_radix_cache(server):
    info = requests.get(server + "/server_info", timeout=60).json()
    assert info["radix_cache_backend"] == "tokendance"


def test_private_prefixes_hit_like_stock_sglang(server, stock_prefix_results):
    assert run_prefix_prompts(server) == stock_prefix_results


def test_segments_are_cached_once_per_content(server):
    requests.post(server + "/flush_cache", timeout=60)
    for history in HISTORIES:
        generate(server, SEP.join([history, *BLOCKS, " Reply:"]), 2)
    stats = forest_stats(server)
    assert stats["segment_nodes"] == 3 and stats["segments_inserted"] == 3
    assert stats["segment_duplicates"] == 3  # the second agent's copies are only counted
    out = generate(server, SEP.join(["Short.", BLOCKS[2], BLOCKS[0], " Reply:"]), 2)
    hashes = {s["hash"] for s in out["meta_info"]["tokendance"]["segments"]}
    assert len(hashes) == 2 and forest_stats(server)["segment_nodes"] == 3


def test_flush_frees_every_slot(server):
    requests.post(server + "/flush_cache", timeout=60)
    start = used_tokens(server)
    for i, history in enumerate(HISTORIES * 2):
        generate(server, SEP.join([f"{history} Day {i}.", *BLOCKS[i % 2:], " Reply:"]), 4)
    assert forest_stats(server)["segment_tokens"] > 0
    assert requests.post(server + "/flush_cache", timeout=60).status_code == 200
    assert forest_stats(server)["segment_nodes"] == 0
    assert used_tokens(server) == start


def test_small_kv_budget_evicts_and_every_request_finishes(smollm2_path):
    words = "harvest mill river bakery market council bridge square lantern orchard".split()
    def prompt(i: int) -> str:
        blocks = [" ".join(words[(i + j + k) % len(words)] for k in range(60)) + f" ({i}.{j})" for j in range(3)]
        return SEP.join([f"Agent {i} history.", *blocks, " Reply:"])

    with ServerProcess(["--max-total-tokens", "1200", "--context-length", "1024"]) as small:
        for wave in range(2):  # a wave of concurrent requests well past the budget, twice
            with ThreadPoolExecutor(6) as pool:
                outs = list(pool.map(lambda i: generate(small.url, prompt(i), 16), range(wave * 6, wave * 6 + 6)))
            assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs)
            assert all(len(o["output_ids"]) >= 1 for o in outs)
        stats = forest_stats(small.url)
        assert stats["segments_evicted"] > 0
        assert stats["segment_tokens"] + stats["tree_evictable_tokens"] <= 1200


def test_segment_copy_stores_unrotated_k_and_same_v():
    from types import SimpleNamespace

    import torch

    from sglang_tokendance.core.rope import RopeSpec, rotate
    from sglang_tokendance.srt.forest import SegmentForest

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
    fake = SimpleNamespace(rope=spec, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))
    dst = torch.tensor([12, 13, 14, 15, 16])
    SegmentForest._copy_unrotated(fake, src, dst, start=11)
    for layer in range(2):
        assert torch.allclose(k_buffers[layer][dst], raw_k[layer], atol=1e-5)
        assert torch.equal(v_buffers[layer][dst], values[layer])
