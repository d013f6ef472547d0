"""The frontend-language extension against a fake server: the /generate bodies it sends."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import sglang as sgl
import sglang_tokendance.lang  # noqa: F401  (adds sgl.separator, sgl.gen(register_output=..., round=...))
from sglang.lang.backend import runtime_endpoint
from sglang_tokendance.lang import round as agent_round

TOKENDANCE_INFO = {"tokendance": {"separator": "<|tokendance_sep|>"}}


class FakeServer:
    """Answers RuntimeEndpoint's HTTP calls and records every /generate body."""

    def __init__(self, server_info: dict):
        self.server_info = server_info
        self.bodies: list[dict] = []

    def __call__(self, url: str, json: dict | None = None, stream: bool = False, **unused) -> SimpleNamespace:
        path = url.rsplit("/", 1)[-1]
        answer = {"get_model_info": {"model_path": "fake-model"}, "server_info": self.server_info}.get(path)
        if path == "generate":
            self.bodies.append(json)
            answer = {"text": " fine", "meta_info": {}}
        lines = [b"data: " + _json_bytes(answer), b"data: [DONE]"]
        return SimpleNamespace(status_code=200, json=lambda: answer, iter_lines=lambda **kw: iter(lines))


def _json_bytes(value) -> bytes:
    return json.dumps(value).encode()


@sgl.function
def two_gens(s):
    s += "Private notes." + sgl.gen("notes", max_tokens=4)
    s += " Now say it to everyone:" + sgl.gen("answer", max_tokens=4, register_output=True)


@sgl.function
def marked(s):
    s += "History." + sgl.separator() + " Block." + sgl.separator() + " Reply:" + sgl.gen("answer", max_tokens=4)


@sgl.function
def agent(s, i):
    s += f"Agent {i}." + sgl.gen("answer", max_tokens=4)
    s += " Again:" + sgl.gen("again", max_tokens=4, round="own")


def fake_server(monkeypatch, server_info: dict) -> FakeServer:
    fake = FakeServer(server_info)
    monkeypatch.setattr(runtime_endpoint, "http_request", fake)
    return fake


def run(monkeypatch, program, server_info: dict, stream: bool = False) -> list[dict]:
    """Run `program` on a RuntimeEndpoint to a fake server; the /generate bodies it sent."""
    fake = fake_server(monkeypatch, server_info)
    state = program.run(backend=sgl.RuntimeEndpoint("http://fake"), stream=stream)
    if stream:
        "".join(state.text_iter())
    assert state["answer"] == " fine"
    return fake.bodies


@pytest.mark.parametrize("server_info, marker", [(TOKENDANCE_INFO, "<|tokendance_sep|>"), ({}, "")])
def test_separator_sends_the_servers_marker_or_nothing(monkeypatch, server_info, marker):
    (body,) = run(monkeypatch, marked, server_info)
    assert body["text"] == f"History.{marker} Block.{marker} Reply:"


@pytest.mark.parametrize("stream", [False, True])
def test_register_output_reaches_only_its_own_generate_body(monkeypatch, stream):
    plain, registered = run(monkeypatch, two_gens, TOKENDANCE_INFO, stream)
    assert "tokendance" not in plain
    assert registered.pop("tokendance") == {"register_output": True}
    assert registered.keys() == plain.keys()  # nothing else changes
    assert registered["sampling_params"] == plain["sampling_params"]


def test_register_output_is_not_sent_to_a_server_without_tokendance(monkeypatch):
    bodies = run(monkeypatch, two_gens, {"version": "0.5.23"})
    assert len(bodies) == 2 and all("tokendance" not in b for b in bodies)


def test_register_output_with_choices_is_an_error():
    with pytest.raises(ValueError, match="register_output"):
        sgl.gen("pick", choices=["yes", "no"], register_output=True)


def test_round_keyword_and_block_reach_the_generate_bodies(monkeypatch):
    fake = fake_server(monkeypatch, TOKENDANCE_INFO)
    backend = sgl.RuntimeEndpoint("http://fake")
    agent.run(0, backend=backend).sync()
    assert "tokendance" not in fake.bodies[0] and fake.bodies[1]["tokendance"] == {"round": "own"}
    fake.bodies.clear()
    with agent_round("r1", 3):
        agent.run_batch([{"i": i} for i in range(3)], backend=backend, num_threads=3)  # worker threads
        agent.run(3, backend=backend).sync()
    rounds = sorted(json.dumps(b["tokendance"]) for b in fake.bodies)
    assert rounds == [json.dumps({"round": "own"})] * 4 + [json.dumps({"round": "r1", "round_size": 3})] * 4
    fake.bodies.clear()
    agent.run_batch([{"i": 0}], backend=backend)  # after the block: untagged again
    assert "tokendance" not in fake.bodies[0]


def test_round_is_not_sent_to_a_server_without_tokendance(monkeypatch):
    fake = fake_server(monkeypatch, {"version": "0.5.23"})
    with agent_round("r1", 2):
        agent.run(0, backend=sgl.RuntimeEndpoint("http://fake")).sync()
    assert len(fake.bodies) == 2 and all("tokendance" not in b for b in fake.bodies)


def test_round_with_choices_is_an_error():
    with pytest.raises(ValueError, match="round"):
        sgl.gen("pick", choices=["yes", "no"], round="r1")
