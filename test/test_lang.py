"""The frontend-language extension against a fake server: the /generate bodies it sends, and
(on a real local HTTP server) the router's routing-key header."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import sglang as sgl
import sglang_tokendance.lang  # noqa: F401  (adds sgl.separator, sgl.gen(register_output=..., round=...))
from sglang.lang.backend import runtime_endpoint
from sglang_tokendance.lang import round as agent_round
from sglang_tokendance.lang import simulation
from sglang_tokendance.lang.routing import ROUTING_FIELD

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


def options_of(body: dict) -> dict | None:
    """The TokenDance options a /generate body carries (JSON text in `custom_labels`)."""
    text = (body.get("custom_labels") or {}).get("tokendance")
    return json.loads(text) if text is not None else None


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
    assert "custom_labels" not in plain
    assert options_of(registered) == {"register_output": True}
    del registered["custom_labels"]
    assert registered.keys() == plain.keys()  # nothing else changes
    assert registered["sampling_params"] == plain["sampling_params"]


def test_register_output_is_not_sent_to_a_server_without_tokendance(monkeypatch):
    bodies = run(monkeypatch, two_gens, {"version": "0.5.23"})
    assert len(bodies) == 2 and all("custom_labels" not in b for b in bodies)


def test_register_output_with_choices_is_an_error():
    with pytest.raises(ValueError, match="register_output"):
        sgl.gen("pick", choices=["yes", "no"], register_output=True)


def test_round_keyword_and_block_reach_the_generate_bodies(monkeypatch):
    fake = fake_server(monkeypatch, TOKENDANCE_INFO)
    backend = sgl.RuntimeEndpoint("http://fake")
    agent.run(0, backend=backend).sync()
    assert options_of(fake.bodies[0]) is None and options_of(fake.bodies[1]) == {"round": "own"}
    fake.bodies.clear()
    with agent_round("r1", 3):
        agent.run_batch([{"i": i} for i in range(3)], backend=backend, num_threads=3)  # worker threads
        agent.run(3, backend=backend).sync()
    rounds = sorted(json.dumps(options_of(b)) for b in fake.bodies)
    assert rounds == [json.dumps({"round": "own"})] * 4 + [json.dumps({"round": "r1", "round_size": 3})] * 4
    fake.bodies.clear()
    agent.run_batch([{"i": 0}], backend=backend)  # after the block: untagged again
    assert options_of(fake.bodies[0]) is None


def test_round_is_not_sent_to_a_server_without_tokendance(monkeypatch):
    fake = fake_server(monkeypatch, {"version": "0.5.23"})
    with agent_round("r1", 2):
        agent.run(0, backend=sgl.RuntimeEndpoint("http://fake")).sync()
    assert len(fake.bodies) == 2 and all("custom_labels" not in b for b in fake.bodies)


def test_round_with_choices_is_an_error():
    with pytest.raises(ValueError, match="round"):
        sgl.gen("pick", choices=["yes", "no"], round="r1")


# --- behind SGLang's router: a real local HTTP server standing in for router and worker ---------


class RecordingHandler(BaseHTTPRequestHandler):
    """A router in front of one TokenDance worker, both on this port: the router's /server_info
    is a 404 (as sglang-router's), its /workers lists the worker, whose /server_info is under
    /worker; /generate records each request's headers and body."""

    requests: list[tuple[dict, dict]] = []

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, value) -> None:
        payload = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        host = f"http://127.0.0.1:{self.server.server_port}"
        answers = {"/get_model_info": {"model_path": "fake-model"},
                   "/workers": {"workers": [{"url": "http://127.0.0.1:1", "is_healthy": False},
                                            {"url": f"{host}/worker@0", "is_healthy": True}]},
                   "/worker/server_info": TOKENDANCE_INFO}
        self._answer(200, answers[self.path]) if self.path in answers else self._answer(404, {"error": "no"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        RecordingHandler.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self._answer(200, {"text": " fine", "meta_info": {}})


@pytest.fixture
def router_url():
    RecordingHandler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_simulation_block_routes_every_gen_by_its_key_through_a_router(router_url):
    backend = sgl.RuntimeEndpoint(router_url)
    with agent_round("r1", 2, simulation="sim-7"):
        agent.run_batch([{"i": i} for i in range(2)], backend=backend, num_threads=2)  # worker threads
    with simulation("sim-7"):
        marked.run(backend=backend).sync()
    marked.run(backend=backend).sync()  # outside the block: no key
    sent = RecordingHandler.requests
    assert len(sent) == 6
    assert [h.get("x-smg-routing-key") for h, _ in sent[:5]] == ["sim-7"] * 5
    assert "x-smg-routing-key" not in sent[5][0]
    assert all(ROUTING_FIELD not in body for _, body in sent)  # the key never rides in a body
    # the worker behind the router said it serves TokenDance: markers and options are sent
    assert sent[4][1]["text"] == "History.<|tokendance_sep|> Block.<|tokendance_sep|> Reply:"
    assert sorted(json.dumps(options_of(b)) for _, b in sent[:4]) == (
        [json.dumps({"round": "own"})] * 2 + [json.dumps({"round": "r1", "round_size": 2})] * 2)


def test_simulation_key_must_be_a_non_empty_string():
    with pytest.raises(ValueError, match="routing key"):
        with simulation(""):
            pass
