"""Shared fixtures. Slow tests start real SGLang servers on SmolLM2: one per module, or one per
session for the flags several modules share (`default_server_url`, `full_ratio_server_url`,
`stock_server_url`; each module empties it first). Every server is forked from one process
that imported SGLang once (`server_process.preloaded`), which also keeps them alive across
test_engine.py: SGLang's `Engine.shutdown` kills every descendant of the test process."""

from __future__ import annotations

import json
import pytest
import requests

from sglang_tokendance.model_store import prepared_default_model
from sglang_tokendance.bench.server_process import ServerProcess, flush_cache, preloaded

FULL_RATIO_CHUNK = 64  # --chunked-prefill-size of the shared ratio-1 server


@pytest.fixture(scope="session", autouse=True)
def preloaded_servers():
    """A server start without SGLang's import in its main process (a third of it saved)."""
    with preloaded():
        yield


@pytest.fixture(scope="session")
def smollm2_path():
    return prepared_default_model()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_path) -> str:
    """A random-weight Llama (SmolLM2's tokenizer) two layers deeper than TokenDance's default
    check layer: for server tests where the model does not matter (mechanics, faults, CLIs),
    whose servers start and answer in a fraction of SmolLM2's time."""
    from sglang_tokendance.bench.tiny_models import write_tiny_model
    from sglang_tokendance.server_args import TokenDanceArgs

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama",
                                num_layers=TokenDanceArgs().check_layer + 2))


@pytest.fixture(scope="session")
def default_server_url(smollm2_path):
    """One TokenDance server with its default flags for every module that needs no other (a
    server start costs about a minute of CI's 2 cores); each module's fixture empties it first."""
    with ServerProcess([]) as proc:
        yield proc.url


@pytest.fixture(scope="session")
def full_ratio_server_url(smollm2_path):
    """One TokenDance server recomputing every reused token (ratio 1: a full prefill's outputs),
    in chunks of FULL_RATIO_CHUNK tokens: the modules comparing ratio 1 with SGLang's own
    prefill, one prompt, in one chunk or several, share it."""
    with ServerProcess(["--chunked-prefill-size", str(FULL_RATIO_CHUNK), "--tokendance-recompute-ratio", "1.0",
                        "--tokendance-check-layer", "2", "--no-tokendance-cost-check"]) as proc:
        yield proc.url


SMALL_POOL = 1200  # --max-total-tokens of the shared small-pool server: a few prompts overflow it


@pytest.fixture(scope="session")
def small_pool_server_url(smollm2_path):
    """One TokenDance server with a KV pool of SMALL_POOL tokens (contexts of 1024) and
    Prometheus metrics on: the modules that make it evict share it."""
    with ServerProcess(["--enable-metrics", "--max-total-tokens", str(SMALL_POOL), "--context-length", "1024"]) as proc:
        yield proc.url


@pytest.fixture(scope="session")
def stock_server_url(smollm2_path):
    """One stock `sglang.launch_server` with its default flags, shared the same way."""
    with ServerProcess([], stock=True) as proc:
        yield proc.url


def emptied(url: str) -> str:
    """`url` once its caches are flushed (after its last request ends): a module starts as on a
    fresh server."""
    flush_cache(url)
    return url


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' model and tokenizer on the same fp32 weights SGLang serves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


def hf_greedy(hf_model_and_tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """HF greedy continuation ids, cut after the first EOS as SGLang stops there."""
    import torch

    model, tokenizer = hf_model_and_tokenizer
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    new = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    for i, tok in enumerate(new):
        if tok in eos:
            return new[: i + 1]
    return new


def generate(url: str, text, max_new_tokens: int = 16, sampling: dict | None = None, **extra) -> dict:
    """A greedy /generate; `sampling` adds sampling params, `extra` top-level fields (rid, cache_salt)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, **(sampling or {})}
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": params, **extra}, timeout=900)
    r.raise_for_status()
    return r.json()


def stream_chunks(response):
    """The JSON chunks of a streamed /generate response, [DONE] left out."""
    for line in response.iter_lines():
        if line.startswith(b"data:") and line != b"data: [DONE]":
            yield json.loads(line[5:])


def forest_stats(url: str) -> dict | None:
    """The segment forest's counters in /server_info (None on a server without it)."""
    info = requests.get(url + "/server_info", timeout=60).json()
    return info["internal_states"][0].get("tokendance_forest")


def assert_no_leak(url: str, timeout: float = 20.0) -> None:
    """At quiescence, before any flush: every used KV slot belongs to the radix tree or to a
    segment (Master), each slot counted once (under mirror storage a Master can hold the
    tree's own slots), the tree holds no lock but clients' pins, no Master is pinned by a row, and no
    per-request state is left behind (so no live own slots). The scheduler releases a request
    just after answering it, so this waits a little for quiescence."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = forest_stats(url)
        if stats is None:
            return
        used = stats["pool_tokens"] - stats["free_tokens"]
        owned = stats["tree_tokens"] + stats["segment_only_tokens"]
        quiet = stats["tree_protected_tokens"] == stats["hint_pinned_tokens"] and stats["live_requests"] == 0 \
            and stats["pinned_segments"] == 0
        if (quiet and used == owned) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert quiet and stats["row_references"] == 0 == stats["mirror_diff_tokens"], stats
    assert stats["segment_only_tokens"] <= stats["master_tokens"] <= stats["segment_tokens"], stats
    assert used == owned, f"{used} KV slots in use, {owned} held by the tree and segments: {stats}"


def server_urls(value) -> list[str]:
    """The server URLs a fixture's value holds: itself, or those inside a tuple, list or dict."""
    if isinstance(value, str):
        return [value] if value.startswith("http://") else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [url for item in value for url in server_urls(item)]
    return []


@pytest.fixture(autouse=True)
def no_kv_leak_after_server_tests(request, monkeypatch):
    """After every slow test: the leak invariant at quiescence on every TokenDance server any of
    its fixtures handed it (a URL, or URLs in a tuple, list or dict; stock servers have no forest),
    and on every server the test started itself (a benchmark's included) as it leaves its `with`
    block normally, still serving."""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    stop = ServerProcess.__exit__

    def checked_exit(proc: ServerProcess, kind, error, trace) -> None:
        try:
            if kind is None and proc.proc.poll() is None:
                assert_no_leak(proc.url)
        finally:
            stop(proc, kind, error, trace)

    monkeypatch.setattr(ServerProcess, "__exit__", checked_exit)
    yield
    urls = {url for name in request.fixturenames if name in request.node.funcargs
            for url in server_urls(request.node.funcargs[name])}
    for url in sorted(urls):
        assert_no_leak(url)
