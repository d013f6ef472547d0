"""Our server on the CPU with SmolLM2: the APIs answer, and greedy output equals HF's."""

from __future__ import annotations

import pytest
import requests

from conftest import emptied, generate, hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def server(default_server_url):
    return emptied(default_server_url)


def test_generate_matches_hf_greedy_token_for_token(server, hf_smollm2):
    for prompt in PROMPTS:
        out = generate(server, prompt, max_new_tokens=24)
        assert out["output_ids"] == hf_greedy(hf_smollm2, prompt, 24), prompt


def test_batched_generate_matches_single(server):
    batch = generate(server, PROMPTS[:3], max_new_tokens=12)
    singles = [generate(server, p, max_new_tokens=12)["output_ids"] for p in PROMPTS[:3]]
    assert [o["output_ids"] for o in batch] == singles


def test_openai_completions(server):
    r = requests.post(server + "/v1/completions", json={
        "model": "default", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
    }, timeout=300)
    r.raise_for_status()
    body = r.json()
    assert body["choices"][0]["text"] == generate(server, PROMPTS[0], 8)["text"]
    assert body["usage"]["completion_tokens"] == 8


def test_openai_chat_completions_use_the_chat_template(server, hf_smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = requests.post(server + "/v1/chat/completions", json={
        "model": "default", "messages": messages, "max_tokens": 24, "temperature": 0,
    }, timeout=300)
    r.raise_for_status()
    answer = r.json()["choices"][0]["message"]["content"]
    _, tokenizer = hf_smollm2
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert answer == generate(server, prompt, 24)["text"]
    assert "Paris" in answer


def test_frontend_program_through_runtime_endpoint(server):
    import sglang as sgl

    @sgl.function
    def complete(s, prefix):
        s += prefix
        s += sgl.gen("continuation", max_tokens=12, temperature=0)

    state = complete.run(prefix=PROMPTS[2], backend=sgl.RuntimeEndpoint(server))
    assert state["continuation"] == generate(server, PROMPTS[2], 12)["text"]


def test_server_info_reports_tokendance(server):
    info = requests.get(server + "/server_info", timeout=60).json()
    assert info["tokendance"]["disable_tokendance"] is False
    # auto storage on the CPU: mirror, through the tokendance backend (SGLang's torch_native for the other rows)
    assert info["device"] == "cpu" and info["attention_backend"] == "tokendance"
    assert info["tokendance"]["storage"] == "mirror"
