"""Zero-copy Master-Mirror storage inside a real server (a tiny random Llama: the model does not
matter; --tokendance-storage mirror, a KV pool far below the working set): live rows read the
Masters' slots in place and own only their recomputed tokens; a pinned Master survives eviction
pressure; aborts mid-prefill and mid-decode and /flush_cache leave no slot behind; an agent's
kept Mirror continues its decode exactly; more positions live than the pool has slots; and, on
a second server under SGLang's retraction test switch, Mirrors retracted mid-decode release
their Masters and re-run to the clean answer (conftest's leak invariant after every test: each
slot counted once, tree and Masters sharing slots)."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import assert_no_leak, forest_stats
from sglang_tokendance.core.segments import DEFAULT_SEPARATOR as SEP
from sglang_tokendance.bench.server_process import ServerProcess
from test_faults_server import BLOCKS, RETRACT_EVERY_30_STEPS, agent_prompt, post, stream
from test_metrics import tokendance_metrics

pytestmark = pytest.mark.slow

POOL = 2048


def cache_every_block(url: str) -> None:
    for author in range(2):  # every block cached, in two authors' contexts
        post(url, SEP.join([f"You are author {author}.", *BLOCKS[author * 4:author * 4 + 4], " Go:"]), 1)


@pytest.fixture(scope="module")
def server(tiny_llama):
    # an optimistic admission (--schedule-conservativeness) lets decodes outgrow the pool;
    # SGLang checks its pool accounting after every step (each slot counted once) and stops on a mismatch;
    # prompts are sent again on purpose, to read Masters again (not to be computed as recurrences)
    with ServerProcess(["--model-path", tiny_llama, "--max-total-tokens", str(POOL), "--context-length", "1024",
                        "--schedule-conservativeness", "0.05", "--tokendance-storage", "mirror",
                        "--tokendance-check-layer", "2", "--enable-metrics", "--no-tokendance-exact-recurrence",
                        "--tokendance-round-min-shared", "0",  # readers sent together are not a round
                        # a named round of known size is released once complete: under load its
                        # threads' requests can reach the scheduler more than the default 50 ms apart
                        "--tokendance-round-window-ms", "2000",
                        # eviction by predicted next read (not the default): its ranks under the same
                        # pressure and strict pool accounting
                        "--tokendance-eviction", "next-use"],
                       env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}) as proc:
        cache_every_block(proc.url)
        assert forest_stats(proc.url)["segment_nodes"] == len(BLOCKS)
        yield proc.url


class Reader:
    """A streamed reusing request, its first chunk read (prefill done, decoding) and its
    stream held open (dropping the chunk iterator closes the connection: SGLang aborts)."""

    def __init__(self, url: str, agent: int, blocks: int = 2, tokens: int = 400):
        body = {"text": agent_prompt(agent, blocks),
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        self.response, self.chunks = stream(url, body)
        self.info = next(self.chunks)["meta_info"]["tokendance"]

    def close(self) -> None:
        """The client goes away mid-decode."""
        self.response.close()


def test_live_mirrors_read_masters_in_place_and_own_only_their_diff(server):
    before = forest_stats(server)
    first, second = Reader(server, 0), Reader(server, 1)  # both read block 1, at different offsets
    a, b = first.info, second.info
    try:
        stats = forest_stats(server)
        assert a["segment_hits"] == b["segment_hits"] == 2 and a["recomputed_tokens"] > 0
        assert stats["row_references"] == a["reused_tokens"] + b["reused_tokens"]
        assert stats["mirror_diff_tokens"] == a["recomputed_tokens"] + b["recomputed_tokens"]
        assert stats["pinned_segments"] == 3 and stats["master_tokens"] == before["master_tokens"]
        gauges = tokendance_metrics(server)  # --enable-metrics: the same counts
        assert gauges["sglang:tokendance_row_references"] == stats["row_references"]
        assert gauges["sglang:tokendance_mirror_diff_tokens"] == stats["mirror_diff_tokens"]
        assert gauges["sglang:tokendance_master_tokens"] == stats["master_tokens"]
        for info in (a, b):
            assert info["mirror_diff_tokens"] == info["recomputed_tokens"]
            assert info["mirror_compression"] == pytest.approx(
                (info["reused_tokens"] + info["recomputed_tokens"]) / info["recomputed_tokens"])
            assert info["mirror_compression"] > 2
    finally:
        first.close(), second.close()


def test_a_pinned_master_survives_eviction_pressure(server):
    cache_every_block(server)
    before = forest_stats(server)
    live = Reader(server, 4, blocks=3)  # pins blocks 4, 5, 6
    try:
        flood = [f"Private note {i}: " + " ".join(f"word{i}x{k}" for k in range(110)) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda text: post(server, text, 1), flood))
        stats = forest_stats(server)
        assert stats["segments_evicted"] > before["segments_evicted"], "the pool was not under pressure"
        assert stats["next_use_periodic_items"] > 0  # blocks read by more than one request: ranked by period
        assert stats["pinned_segments"] == 3
        again = post(server, agent_prompt(12, 3), 1)["meta_info"]["tokendance"]  # the same blocks as agent 4
        assert again["segment_hits"] == 3
    finally:
        live.close()


def test_aborts_mid_prefill_leave_nothing_behind(server):
    cache_every_block(server)
    for agent in range(4):
        response, _ = stream(server, {"text": agent_prompt(agent, 3), "sampling_params": {"max_new_tokens": 50}})
        response.close()  # gone before the first token
    assert post(server, agent_prompt(5, 2), 4)["meta_info"]["tokendance"]["segment_hits"] > 0


@functools.lru_cache
def tokenizer_of(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Conversation:
    """An agent's prompt (agent_prompt's pieces, the last one as token ids) that it extends
    with what it decoded, naming the agent so its finished rows are kept (`tokendance.agent`)."""

    def __init__(self, url: str, model_path: str, agent: int, name: str):
        tokenizer = tokenizer_of(model_path)
        *self.context, reply = agent_prompt(agent, 3).split(SEP)
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.exact_len = len(tokenizer.encode(self.context[0]))  # the private text before the first block
        self.url, self.name = url, name

    def ask(self, decoded: list[int], tokens: int, name: str | None = None) -> dict:
        body = {"segments": [*self.context, self.reply_ids + decoded], "tokendance": {"agent": name or self.name},
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
        response = requests.post(self.url + "/generate", json=body, timeout=900)
        response.raise_for_status()
        return response.json()


def test_an_agents_kept_mirror_continues_exactly_where_its_decode_left_off(server, tiny_llama):
    """A finished row is kept for its agent (`tokendance.agent`): a next prompt that extends it
    with the first tokens the row decoded matches the whole row as a prefix and decodes the
    very tokens the row decoded next (the same KV, approximate blocks included); another
    agent's identical prompt matches only the exact prefix the shared tree holds."""
    cache_every_block(server)
    talk = Conversation(server, tiny_llama, 3, "agent-3")
    kept_before = forest_stats(server)["agent_rows_kept"]
    first = talk.ask([], 24)
    prompt_len, decoded = first["meta_info"]["prompt_tokens"], first["output_ids"]
    assert first["meta_info"]["tokendance"]["reused_tokens"] > 0  # the row holds approximate KV
    assert forest_stats(server)["agent_rows_kept"] == kept_before + 1
    again = talk.ask(decoded[:8], 16)
    continued = again["meta_info"]
    assert continued["tokendance"]["agent_prefix_tokens"] == prompt_len + 7 == continued["cached_tokens"]
    assert continued["tokendance"]["reused_tokens"] == 0  # nothing left to blend
    assert again["output_ids"] == decoded[8:24]
    other = talk.ask(decoded[:8], 4, name="agent-4")["meta_info"]
    assert other["tokendance"]["agent_prefix_tokens"] == 0
    assert other["cached_tokens"] <= talk.exact_len


def test_many_mirrors_hold_more_kv_positions_than_the_pool_and_all_finish(server):
    """Twelve agents reading three blocks each need about 2.5x the pool as dense copies; read in
    place, more row positions are live at once than the pool has slots, and every request
    finishes. Whether SGLang also retracts some depends on its admission estimate, so it is
    not asserted here (the retracting server below retracts Mirrors deterministically)."""
    cache_every_block(server)
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            stats = forest_stats(server)
            peak[0] = max(peak[0], stats["row_references"] + stats["pool_tokens"] - stats["free_tokens"])
            done.wait(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda a: post(server, agent_prompt(a, 3), 48, ignore_eos=True), range(12)))
    finally:
        done.set()
        watcher.join()
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert sum(o["meta_info"]["tokendance"]["segment_hits"] for o in outs) > 12
    assert peak[0] > POOL, f"at most {peak[0]} KV positions live at once"


def test_readers_are_admitted_as_the_forwards_before_them_free_their_slots(server):
    """SGLang admits a prompt only where all its positions fit (its forward allocates them all),
    and once one does not fit it admits nothing until a request leaves its running batch. A
    reader's forward gives back the slots of its reused positions but for its kept tokens, so
    the readers that did not fit are admitted right after: all six of a wave decode at once,
    though their prompts need more slots than the pool has free or evictable."""
    assert requests.post(server + "/flush_cache", timeout=60).status_code == 200
    post(server, SEP.join(["You are author 0.", *BLOCKS[:3], " Go:"]), 1)
    anchor = Reader(server, 0, blocks=3)  # pins blocks 0-2 (their Masters no longer count as evictable)
    try:
        before, start = forest_stats(server), time.perf_counter()

        def first_and_last_token(agent: int) -> tuple[float, float, int]:
            body = {"text": agent_prompt(agent, 3),
                    "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}
            response, chunks = stream(server, body)
            with response:
                next(chunks)
                first = time.perf_counter() - start
                meta = [chunk["meta_info"] for chunk in chunks][-1]
            assert meta["tokendance"]["segment_hits"] == 3 and meta["tokendance"]["mirror_compression"] > 1
            return first, time.perf_counter() - start, meta["prompt_tokens"]

        with ThreadPoolExecutor(6) as pool:  # agents 8, 16, ...: blocks 0-2, as the anchor
            times = list(pool.map(first_and_last_token, range(8, 56, 8)))
        assert max(first for first, _, _ in times) < min(last for _, last, _ in times), times
        # SGLang could not admit the six at once: their prompts exceed the free and evictable slots
        assert sum(tokens for _, _, tokens in times) > before["free_tokens"] + before["tree_evictable_tokens"]
    finally:
        anchor.close()


def test_a_rounds_readers_are_admitted_together_on_the_slots_they_take(server):
    """SGLang reserves a slot for every extend token it admits; a reader allocates only its fresh
    tokens and one slot per reused token it can keep, and once admitted it is charged only
    that. So a round of six readers whose prompts and decode headroom need more slots than
    are free or evictable is admitted in one prefill batch after its leader, and each reader's
    row owns fewer slots than its reused positions."""
    from test_rounds_server import Sent, record_of

    assert requests.post(server + "/flush_cache", timeout=60).status_code == 200
    post(server, SEP.join(["You are author 0.", *BLOCKS[:3], " Go:"]), 1)
    anchor = Reader(server, 0, blocks=3)  # pins blocks 0-2 (their Masters no longer count as evictable)
    try:
        before = forest_stats(server)
        size, new_tokens = 6, 32
        sent = [Sent(server, agent_prompt(agent, 3), tokendance={"round": "wave", "round_size": size},
                     sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
                for agent in range(8, 8 + 8 * size, 8)]  # agents 8, 16, ...: blocks 0-2, as the anchor
        for s in sent:
            s.join()
            assert s.result.status_code == 200, s.result.text
        metas = [s.result.json()["meta_info"] for s in sent]
        assert record_of(server, "wave")["admitted"] == [1, size - 1]  # the leader, then every reader at once
        readers = [m for m in metas if m["tokendance"]["reused_tokens"] + m["tokendance"]["recomputed_tokens"]]
        assert len(readers) == size - 1 and all(m["tokendance"]["mirror_compression"] > 1 for m in readers)
        # SGLang's charge of whole prompts could not have admitted the leader and then the readers together
        assert sum(m["prompt_tokens"] + new_tokens for m in metas) > before["free_tokens"] + before["evictable_tokens"]
    finally:
        anchor.close()


def test_flush_waits_for_live_mirrors_then_frees_every_slot(server):
    cache_every_block(server)
    live = Reader(server, 2)
    assert requests.post(server + "/flush_cache", timeout=60).status_code != 200  # a Mirror is alive
    assert forest_stats(server)["pinned_segments"] == 2
    live.close()
    assert_no_leak(server)
    assert requests.post(server + "/flush_cache", timeout=60).status_code == 200
    stats = forest_stats(server)
    assert stats["free_tokens"] == stats["pool_tokens"] and stats["segment_nodes"] == 0 == stats["master_tokens"]
    cache_every_block(server)


@pytest.fixture(scope="module")
def retracting_server(tiny_llama):
    """Mirror storage at the default recompute ratio (rows read Masters in place) under SGLang's
    retraction test switch; the pool holds every block, so a re-run reads the same Masters (and a
    prompt sent again reads them again: no recurrence computed exactly, no unnamed row kept, no
    inferred round: a batch reads the Masters its requests read alone)."""
    with ServerProcess(["--model-path", tiny_llama, "--max-total-tokens", "8192", "--context-length", "1024",
                        "--tokendance-storage", "mirror", "--tokendance-check-layer", "2",
                        "--no-tokendance-exact-recurrence", "--no-tokendance-keep-rows",
                        "--tokendance-round-min-shared", "0"],
                       env={**RETRACT_EVERY_30_STEPS, "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}) as proc:
        cache_every_block(proc.url)
        yield proc.url


def test_retracted_mirrors_release_their_masters_and_rerun_to_the_clean_answer(retracting_server):
    url = retracting_server
    # 40 decode steps each: SGLang's switch retracts at every 30th step, so the batch below is hit
    clean = [post(url, agent_prompt(agent, 2), 40, ignore_eos=True) for agent in range(4)]  # alone: never retracted
    assert all(out["meta_info"]["num_retractions"] == 0 for out in clean)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda a: post(url, agent_prompt(a, 2), 40, ignore_eos=True), range(4)))
    assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0, "no request was retracted"
    for agent, (out, alone) in enumerate(zip(outs, clean)):
        info = out["meta_info"]["tokendance"]
        assert info["segment_hits"] == 2 and 0 < info["mirror_diff_tokens"] < info["reused_tokens"], info
        assert out["output_ids"] == alone["output_ids"], agent
    assert forest_stats(url)["segments_evicted"] == 0


def test_retracted_continuations_of_kept_mirrors_rerun_from_the_same_kv(retracting_server, tiny_llama):
    """Agents continuing their kept rows, retracted mid-decode (the kept rows locked, then
    released, then matched again): each decodes what its kept row decoded next."""
    talks = [Conversation(retracting_server, tiny_llama, agent, f"retracted-{agent}") for agent in range(4)]
    first = [talk.ask([], 48) for talk in talks]  # one at a time: never retracted
    with ThreadPoolExecutor(len(talks)) as pool:
        again = list(pool.map(lambda pair: pair[0].ask(pair[1]["output_ids"][:8], 40), zip(talks, first)))
    assert sum(out["meta_info"]["num_retractions"] for out in again) > 0, "no request was retracted"
    for out, before in zip(again, first):
        assert out["meta_info"]["tokendance"]["agent_prefix_tokens"] >= before["meta_info"]["prompt_tokens"] + 7
        assert out["output_ids"] == before["output_ids"][8:48]
